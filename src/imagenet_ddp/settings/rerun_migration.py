"""Snakemake's recorded params of finished train and preflight_run jobs, carried over from the
earlier format (one JSON param) to today's (one `key=value` param per rerun setting), so that
an upgrade resubmits no finished job whose settings did not change.

Snakemake (9.20.0 to 9.27.1, snakemake/persistence) records, per output file, a JSON file under
.snakemake/metadata named by the urlsafe base64 of the output's path (split into folders of
NAME_MAX - 1 characters, each but the last prefixed `@`), whose "params" is the sorted
`repr()` of each of the rule's params (a value it cannot represent left out), and compares the
recorded set with today's (`params` rerun trigger). A record is rewritten only when its params
are exactly those the earlier format gives for the run's current settings: any other record
(a changed setting, an unknown format, another version of the record) is left as it is, so a
real change still reruns.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from collections.abc import Iterable

# Snakemake's record format whose params this module knows (persistence RECORD_FORMAT_VERSION).
RECORD_FORMAT_VERSION = 6


def rerun_param(key: str, value) -> str:
    """Today's param of one rerun setting (workflow/rules/common.smk rerun_params)."""
    return f"{key}={json.dumps(value, separators=(',', ':'))}"


def earlier_rerun_param(rerun: dict) -> str:
    """The earlier format (up to commit 1e9350b, common.smk run_rerun_key): the run's rerun
    settings as one JSON value. Kept only to recognise records written by that version."""
    return json.dumps(rerun, sort_keys=True, separators=(",", ":"))


def recorded(params: Iterable[str]) -> list[str]:
    """``params`` as Snakemake records them (sorted repr of each string param)."""
    return sorted(repr(p) for p in params)


def record_path(metadata_dir: str, output: str, name_max: int | None = None) -> str:
    """Where Snakemake's file backend keeps ``output``'s record (FilePersistence._record_path)."""
    if name_max is None:
        name_max = os.pathconf(metadata_dir, "PC_NAME_MAX") if os.name == "posix" else 255
    name_max = name_max or 255
    b64 = base64.urlsafe_b64encode(output.encode()).decode()
    parts = [b64[i : i + name_max - 1] for i in range(0, len(b64), name_max - 1)]
    return os.path.join(metadata_dir, *(["@" + p for p in parts[:-1]] + [parts[-1]]))


def _rewrite(path: str, record: dict) -> None:
    """Replace the record at ``path`` atomically (a reader sees the old or the new one),
    keeping its permissions."""
    mode = os.stat(path).st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".migrate-")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def locked(snakemake_dir: str) -> bool:
    """Whether a Snakemake holds the working directory (its lock files: another one running,
    or one that crashed, which Snakemake itself refuses to run beside until --unlock)."""
    locks = os.path.join(snakemake_dir, "locks")
    return os.path.isdir(locks) and any(n.endswith(".lock") for n in os.listdir(locks))


def migrate_rerun_params(snakemake_dir: str, outputs: Iterable[str], rerun: dict) -> list[str]:
    """Rewrite the params of the records of ``outputs`` (one job's output paths, as Snakemake
    names them) from the earlier format of ``rerun`` (the run's current rerun settings) to
    today's; the outputs whose record was rewritten. Records holding anything else are left
    untouched, and all of them while a Snakemake holds ``snakemake_dir`` (.snakemake)."""
    metadata_dir = os.path.join(snakemake_dir, "metadata")
    if not os.path.isdir(metadata_dir) or locked(snakemake_dir):
        return []
    earlier = recorded([earlier_rerun_param(rerun)])
    now = recorded(rerun_param(k, v) for k, v in rerun.items())
    migrated = []
    for output in outputs:
        path = record_path(metadata_dir, output)
        try:
            with open(path) as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            continue  # no record, or one being written: Snakemake's own rules apply
        if (
            not isinstance(record, dict)
            or record.get("record_format_version") != RECORD_FORMAT_VERSION
            or record.get("params") != earlier
        ):
            continue
        _rewrite(path, {**record, "params": now})
        migrated.append(output)
    return migrated
