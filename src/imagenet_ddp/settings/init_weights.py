"""A run's ``init_weights`` file at the dry-run: its content's digest, filled into the run.

The path says where the file is (kind bookkeeping: moving it retrains nothing); its SHA-256,
``init_weights_sha256`` (kind weights), says what the run starts from: it enters the checkpoint
fingerprint and train's rerun params, so another content trains afresh and the old run's
checkpoints are never resumed under it. The rank reads the file once at a fresh start and
refuses bytes with another digest (imagenet_ddp.models.read_init_weights).

Hashing a 100-300 MB file takes about a second, and Snakemake parses the workflow again in
every job it runs: the digest is cached per user (:func:`file_digest`) by the file's resolved
path, size, inode and mtime in nanoseconds, so a parse whose file is unchanged only stats it.
A file rewritten in place with the same size and mtime to the nanosecond would keep its old
digest; the rank's own digest of the bytes it loads refuses it then.

Torch-free: it runs while Snakemake parses the rules.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from imagenet_ddp.io import file_digest as io_file_digest
from imagenet_ddp.settings.run_checks import _write_cache


def sha256_of(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of the file's bytes (streamed: imagenet_ddp.io.file_digest)."""
    return io_file_digest(path, "sha256")


def file_digest(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None) -> str:
    """The file's SHA-256, from ``cache_dir`` where the file's identity (resolved path, size,
    inode, mtime_ns) is the one hashed before. OSError where it cannot be read."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = json.dumps([real, stat.st_size, stat.st_ino, stat.st_mtime_ns])
    entry = None
    if cache_dir is not None:
        name = hashlib.sha256(key.encode()).hexdigest()[:16]
        entry = Path(cache_dir) / f"init-weights-sha256-{name}.json"
        try:
            stored = json.loads(entry.read_text())
            if stored.get("key") == key and isinstance(stored.get("sha256"), str):
                return stored["sha256"]
        except (OSError, ValueError, AttributeError):
            pass
    digest = sha256_of(real)
    if entry is not None:
        _write_cache(entry, {"key": key, "sha256": digest})
    return digest


def fill_digests(
    runs: Mapping[str, dict],
    *,
    check: bool,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Set each run's ``init_weights_sha256`` from its ``init_weights`` file (in place); the
    problems, one line each, where ``check`` (the Snakemake that submits; a job's own
    Snakemake fills what it can read and judges nothing, so an unreadable file never fails
    another run's job at its parse)."""
    problems = []
    for name, run in runs.items():
        path, exclude = run.get("init_weights") or "", run.get("init_weights_exclude") or []
        where = f"config.yaml: run {name!r}: init_weights {path!r}"
        if not path:
            if check and exclude:
                problems.append(
                    f"config.yaml: run {name!r}: init_weights_exclude {exclude} without "
                    "init_weights: nothing is loaded, so it excludes nothing; remove it or "
                    "set init_weights"
                )
            if check and run.get("init_weights_sha256"):
                problems.append(
                    f"config.yaml: run {name!r}: init_weights_sha256 without init_weights; "
                    "remove it or set init_weights"
                )
            continue
        try:
            digest = file_digest(path, cache_dir)
        except OSError as error:
            if check:
                problems.append(
                    f"{where}: cannot be read ({error.strerror or error}); set init_weights "
                    "to an existing weights file (a path relative to the working directory "
                    "or absolute, on a filesystem the compute nodes see), or remove it"
                )
            continue
        pinned = run.get("init_weights_sha256") or ""
        if pinned and pinned != digest:
            if check:
                problems.append(
                    f"{where}: its SHA-256 is {digest}, init_weights_sha256 pins {pinned}; "
                    "put back the pinned file, or update or remove init_weights_sha256"
                )
            continue
        run["init_weights_sha256"] = digest
    return problems
