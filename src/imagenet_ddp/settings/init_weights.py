"""A run's ``init_weights`` file: what the config shows of it, and its content's digest. The
local `check` rule hashes the file (:func:`weights_digest`) and train takes the digest as a
param: another content retrains the run, a moved file does not; the rank refuses bytes with
another digest. A file that is gone stops only a run that would read it. Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from imagenet_ddp.io import file_digest


def static_weights_problems(run: Mapping) -> list[str]:
    """What the config alone shows (no run prefix): an exclusion or a digest without a file."""
    if run.get("init_weights"):
        return []
    problems = []
    if run.get("init_weights_exclude"):
        problems.append(
            f"init_weights_exclude {run['init_weights_exclude']} without init_weights: nothing "
            "is loaded, so it excludes nothing; remove it or set init_weights"
        )
    if run.get("init_weights_sha256"):
        problems.append("init_weights_sha256 without init_weights; remove it or set init_weights")
    return problems


def recorded_digest(run_dir: str | os.PathLike[str]) -> str | None:
    """The digest the run last started from: its last job's spec (written when the job
    started, checkpoints or not), else its model's provenance; None where neither says."""
    for name, keys in (("job_spec.json", ("run",)), ("model.pt.provenance.json", ("config",))):
        try:
            record = json.loads((Path(run_dir) / name).read_text())
            for key in keys:
                record = record[key]
            if record.get("init_weights_sha256"):
                return record["init_weights_sha256"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def weights_digest(run: Mapping, run_dir: str | os.PathLike[str]) -> tuple[str, str | None]:
    """(train's param, a problem or None) of the run's init_weights: '' without a file; the file's
    digest (a pinned one must equal it); where it is gone, the pinned or last used digest."""
    path, pinned = run.get("init_weights") or "", run.get("init_weights_sha256") or ""
    if not path:
        return "", None
    where = f"init_weights {path!r}"
    try:
        digest = file_digest(path, "sha256")
    except OSError as error:
        kept = pinned or recorded_digest(run_dir)
        if kept:
            return kept, None
        return "", (
            f"{where} cannot be read ({error.strerror or error}) and the run has no model to "
            "keep; put the file back, pin its init_weights_sha256 to resume a run that has "
            "checkpoints, or remove init_weights to train from random weights"
        )
    if pinned and pinned != digest:
        return digest, (
            f"{where}: its SHA-256 is {digest}, init_weights_sha256 pins {pinned}; put back "
            "the pinned file, or update or remove init_weights_sha256"
        )
    return digest, None
