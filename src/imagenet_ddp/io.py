"""Atomic file writing (nothing half-written ever carries a final name), a stop raised where
that cleanup can run, locks, heartbeats."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from imagenet_ddp.mounts import flock_is_node_local


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str], *, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path (a rename in one directory is atomic), renamed onto
    ``final`` only if the block succeeds; else removed, ``final`` untouched."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = _temporary_prefix(final)
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


def _temporary_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def temporaries(final: str | os.PathLike[str]) -> list[Path]:
    """The temporaries :func:`atomic_path` made for ``final`` that are still there: a live
    writer's, or one SIGKILLed before its cleanup ran (no ``finally`` runs then)."""
    final = Path(final)
    return sorted(final.parent.glob(f"{glob.escape(_temporary_prefix(final))}*"))


def remove_path(path: Path) -> int:
    """Remove a file or tree; the bytes it held (0 if it was gone)."""
    try:
        if not path.is_dir() or path.is_symlink():
            size = path.lstat().st_size
            path.unlink()
            return size
    except FileNotFoundError:
        return 0
    size = sum(p.lstat().st_size for p in path.rglob("*") if p.is_file())
    shutil.rmtree(path, ignore_errors=True)
    return size


def remove_stale_temporaries(directory: Path, pattern: str, older_than: float) -> list[Path]:
    """Remove the :func:`atomic_path` temporaries of the files ``pattern`` names in
    ``directory`` that nobody has written for ``older_than`` seconds (their writer was
    SIGKILLed: a live one's mtime moves while it writes). The removed paths."""
    cutoff, removed = time.time() - older_than, []
    for tmp in sorted(Path(directory).glob(f".{pattern}.tmp-*")):
        with contextlib.suppress(OSError):
            if tmp.lstat().st_mtime < cutoff:
                remove_path(tmp)
                removed.append(tmp)
    return removed


# A data command's Ctrl-C or SIGTERM while it runs a pool. Python raises a SIGINT's
# KeyboardInterrupt between any two bytecodes; inside a pool's own calls it can leave their locks
# held (seen: concurrent.futures' idle semaphore, and `index` waited for ever at the pool's
# shutdown). Job processes handle their stops themselves (jobs.signals).
_noted: list[int] = []  # one record: a use inside another finds no default to replace

# Exit codes, their one home: bad input (an InputError's one line, as argparse's own usage
# errors), a planned stop after the checkpoint (EX_TEMPFAIL: rerun to resume), killed by a
# signal (:func:`exit_by_signal`).
EXIT_INPUT = 2
EXIT_REQUEUE = 75
# What stops a command: Ctrl-C (SIGINT) and kill/scancel (SIGTERM); a rank also stops on the
# time limit's warning (jobs.early_signals.STOP_SIGNALS adds SIGUSR1).
STOPS = (signal.SIGINT, signal.SIGTERM)


def exit_by_signal(sig: int) -> int:
    """The exit code of a process ended by signal ``sig``, as a shell says it: 128 + N."""
    return 128 + int(sig)


def _raise_noted() -> None:
    """The first stop noted, as its default would end the command but with cleanups run
    (atomic_path): KeyboardInterrupt for SIGINT, else SystemExit(128 + n)."""
    if _noted and threading.current_thread() is threading.main_thread():
        sig = _noted[0]
        _noted.clear()
        raise KeyboardInterrupt if sig == signal.SIGINT else SystemExit(exit_by_signal(sig))


@contextlib.contextmanager
def stops_noted() -> Iterator[Callable[[], None]]:
    """Inside, SIGINT and SIGTERM at their defaults are only noted (one ignored or handled stays
    so); yields the check that raises one, for the caller to call between a pool's calls. On
    leaving, the defaults come back and a stop noted after the last check is raised. Off the
    main thread, where no signal is handled, nothing changes."""
    main = threading.current_thread() is threading.main_thread()
    defaults = (signal.default_int_handler, signal.SIG_DFL)
    replaced = {
        sig: signal.signal(sig, lambda signum, _: _noted.append(signum))
        for sig in STOPS
        if main and signal.getsignal(sig) in defaults
    }
    try:
        yield _raise_noted
    finally:
        for sig, handler in replaced.items():
            signal.signal(sig, handler)
        _raise_noted()


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
# Liveness, one home: a holder's sign of life (:class:`Heartbeat`) every HEARTBEAT_S, read by
# :func:`last_beat`; how long a silence means what, in beats (deliberately different numbers):
HEARTBEAT_S = 30.0
LATE_S = HEARTBEAT_S + 5.0  # a beat missed: no longer beating (attempts._settle waits no more)
SILENT_S = 3 * HEARTBEAT_S  # three missed: a job taken for dead where squeue cannot say (holders)
# 20 missed: a directory lock taken over (data.stage), generous against clocks that differ
# between nodes, since another node's beat is compared with this node's clock.
STALE_S = 20 * HEARTBEAT_S
POLL_S = 2.0


class Heartbeat:
    """The one liveness mechanism: while active, a daemon thread calls :meth:`beat` every
    ``seconds``, touching ``path``, whose mtime (:func:`last_beat`) is then the holder's last
    sign of life; it is removed when the holder is done. (jobs.attempts.RankProgress beats
    only when its rank stepped: its main thread stops that when it hangs.)"""

    def __init__(self, path, seconds: float = HEARTBEAT_S) -> None:
        self.path, self.seconds = Path(path), seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def beat(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            with contextlib.suppress(OSError):  # a full disk: the holder's own errors say more
                self.beat()

    def __enter__(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):  # its holder is done: silence, at once
            self.path.unlink()


def last_beat(path) -> float | None:
    """When ``path``'s :class:`Heartbeat` last beat (Unix seconds); None: it never did."""
    try:
        return os.stat(path).st_mtime
    except (OSError, TypeError):
        return None


@contextlib.contextmanager
def exclusive_lock(lock_file: str | os.PathLike[str], *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on ``lock_file`` (created if needed), released on exit: flock,
    which the kernel releases if the holder dies; where the filesystem has none
    (:data:`NO_FLOCK_ERRNOS`) or one that locks within a node only (Lustre's ``localflock``),
    a lock directory beside it (:func:`directory_lock`). Yields True; with ``wait=False``
    False at once where another holds it (then nothing is held)."""
    lock_file = Path(lock_file)
    fallback = directory_lock(lock_file.with_name(lock_file.name + ".d"), wait=wait)
    while True:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        if flock_is_node_local(lock_file.parent):
            with fallback as held:
                yield held
            return
        with open(lock_file, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:  # only without wait: another process holds it
                yield False
                return
            except OSError as error:
                if error.errno not in NO_FLOCK_ERRNOS:
                    raise
                with fallback as held:
                    yield held
                return
            if not _still_named(handle, lock_file):
                # its holder removed the file (stage.cleanup_staged) while this one waited on
                # it: a newcomer may hold the file now there, so lock that one instead
                continue
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
            return


def _still_named(handle, path: Path) -> bool:
    try:
        return os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def directory_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """A lock that needs no flock: ``mkdir(path)`` succeeds for one process on any node, whose
    :class:`Heartbeat` keeps it fresh; one silent for :data:`STALE_S` (its holder SIGKILLed or
    its node lost) is renamed away (one waiter wins the rename) and taken. ``path/owner``
    names the holder. Yields True; with ``wait=False`` False where a live holder has it.

    Not filelock's: its SoftFileLock breaks a dead holder's marker on the same host only, and
    its SoftFileLease (filelock 3.30) takes one over across hosts by renameat2's
    RENAME_EXCHANGE, which NFS, older Lustre and FUSE answer with EINVAL: there a dead
    holder's lease is never taken (tried with filelock 4.3.1). A plain rename works on all."""
    while True:
        try:
            os.mkdir(path)
            break
        except FileExistsError:
            silent = time.time() - (last_beat(path) or time.time())
            if silent > STALE_S:
                stale = path.with_name(f"{path.name}.stale-{socket.gethostname()}-{os.getpid()}")
                with contextlib.suppress(FileNotFoundError):  # another waiter renamed it first
                    os.rename(path, stale)
                    shutil.rmtree(stale, ignore_errors=True)
                continue
            if not wait:
                yield False
                return
            time.sleep(POLL_S)
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    (path / "owner").write_text(json.dumps(owner) + "\n")
    try:
        with Heartbeat(path, HEARTBEAT_S):
            yield True
    finally:
        shutil.rmtree(path, ignore_errors=True)


def file_digest(path: str | os.PathLike[str], algorithm: str) -> str:
    """Hex digest of a file, streamed (hashlib.file_digest); md5 is for integrity, not security."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, lambda: hashlib.new(algorithm, usedforsecurity=False))
    return digest.hexdigest()
