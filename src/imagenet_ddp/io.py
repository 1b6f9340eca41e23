"""Atomic file writing: nothing half-written ever carries a final name."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from imagenet_ddp.mounts import MOUNTINFO, flock_is_node_local


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


# flock(2) errors that mean "this filesystem has no flock", not "someone holds it": Lustre
# mounted without `flock` (the default before 2.13) answers ENOSYS; some NFS/FUSE mounts
# EOPNOTSUPP or ENOLCK.
NO_FLOCK_ERRNOS = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK})
# The fallback lock (a directory made with mkdir, atomic on every shared filesystem): its
# holder touches it every HEARTBEAT_S; a waiter takes it over once it is older than STALE_S
# (a holder killed with SIGKILL or on a lost node), generous against clocks that differ
# between nodes.
HEARTBEAT_S = 30.0
STALE_S = 600.0
POLL_S = 2.0


@contextlib.contextmanager
def exclusive_lock(
    lock_file: str | os.PathLike[str], *, mountinfo: Path = MOUNTINFO
) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if needed), released on exit.

    flock works across processes and, on most shared file systems (NFS v4, Lustre mounted
    with ``flock``, GPFS), across nodes; it is released by the kernel if the holder dies.
    Where the filesystem has no flock (:data:`NO_FLOCK_ERRNOS`) or one that locks within a
    node only (Lustre's ``localflock``), a lock directory beside it (:func:`directory_lock`)
    holds across nodes instead.
    """
    lock_file = Path(lock_file)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    if flock_is_node_local(lock_file.parent, mountinfo):
        with directory_lock(lock_file.with_name(lock_file.name + ".d")):
            yield
        return
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in NO_FLOCK_ERRNOS:
                raise
            with directory_lock(lock_file.with_name(lock_file.name + ".d")):
                yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def directory_lock(path: Path) -> Iterator[None]:
    """An exclusive lock that needs no flock: ``mkdir(path)`` succeeds for one process on any
    node; ``path/owner`` names the holder (host, pid), whose thread touches it every
    :data:`HEARTBEAT_S`. A lock untouched for :data:`STALE_S` is renamed away (one waiter
    wins the rename) and taken."""
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    while True:
        try:
            os.mkdir(path)
            break
        except FileExistsError:
            _break_if_stale(path)
            time.sleep(POLL_S)
    (path / "owner").write_text(json.dumps(owner) + "\n")
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, stop), daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        shutil.rmtree(path, ignore_errors=True)


def _heartbeat(path: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):
            os.utime(path)


def _break_if_stale(path: Path) -> None:
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return  # released meanwhile
    if age < STALE_S:
        return
    stale = path.with_name(f"{path.name}.stale-{socket.gethostname()}-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):  # another waiter renamed it first
        os.rename(path, stale)
        shutil.rmtree(stale, ignore_errors=True)


def file_digest(path: str | os.PathLike[str], algorithm: str) -> str:
    """Hex digest of a file, streamed (hashlib.file_digest); md5 is for integrity, not security."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, lambda: hashlib.new(algorithm, usedforsecurity=False))
    return digest.hexdigest()
