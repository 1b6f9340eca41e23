"""Atomic file writing: nothing half-written ever carries a final name."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str], *, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto ``final`` only if the block succeeds.

    The temporary lives in the same directory so the rename is atomic on POSIX file systems.
    On error the temporary is removed and ``final`` is left untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{final.name}.tmp-"
    tmp = Path(
        tempfile.mkdtemp(prefix=prefix, dir=final.parent)
        if is_dir
        else tempfile.mkstemp(prefix=prefix, dir=final.parent)[1]
    )
    # mkstemp/mkdtemp create private (0600/0700) entries; shared datasets need the umask's mode.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, (0o777 if is_dir else 0o666) & ~umask)
    try:
        yield tmp
        if is_dir and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def write_csv_atomic(path: str | os.PathLike[str], frame: Any) -> None:
    """Write a pandas DataFrame as CSV (deterministic: no index, '\\n' line endings)."""
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False, lineterminator="\n")


def lock_path_for(path: str | os.PathLike[str]) -> Path:
    """The lock file guarding ``path``: a hidden sibling, so it never looks like the artifact."""
    path = Path(path)
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def exclusive_lock(lock_file: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_file`` (created if needed), released on exit.

    flock works across processes and, on most shared file systems (NFS v4, Lustre, GPFS),
    across nodes; it is released by the kernel if the holder dies.
    """
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def file_digest(path: str | os.PathLike[str], algorithm: str) -> str:
    """Hex digest of a file, streamed (hashlib.file_digest); md5 is for integrity, not security."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, lambda: hashlib.new(algorithm, usedforsecurity=False))
    return digest.hexdigest()
