"""One train job of a run at a time, whoever submitted it (a restarted Snakemake submits the
run again): the job looks for another live job's open attempt entry (:func:`begin_unless_held`,
under one lock with its own entry) and, where one holds the run, gives its allocation back at
once (:func:`give_back`), never waiting while holding GPUs. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from imagenet_ddp.io import (
    SILENT_S,
    STALE_S,
    Heartbeat,
    exclusive_lock,
    last_beat,
    lock_path_for,
)
from imagenet_ddp.jobs.attempts import (
    ALIVE_DIR,
    EXIT_REQUEUE,
    RECORD,
    last_sign,
    load,
    local_beat_name,
    of_run,
    run_keys,
)
from imagenet_ddp.jobs.launchers import slurm

# States of a job that has ended (squeue shows them for MinJobAge); any other is live. A job an
# admin holds in the queue is not running and holds nothing: only a started job holds a run.
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}  # fmt: skip


def job_state(job_id: str) -> str | None:
    """The job's state; "" when SLURM no longer knows it (ended); None: squeue cannot say."""
    result = slurm("squeue", "-h", "-j", str(job_id), "-o", "%T")
    if result is None:
        return None
    if result.returncode == 0:
        state = result.stdout.strip()
        return "" if state in ENDED else state
    return "" if "Invalid job id" in result.stderr else None  # purged: long gone


def beat_owner_ended(beat: str | os.PathLike) -> bool:
    """Whether the job that a heartbeat file names (attempts.beat_path: its SLURM job id, or
    ``local-<host>-<pid>``) has ended, as squeue or this host knows: a SIGKILLed job's file
    stays fresh for STALE_S. False where neither can say (the heartbeat decides then)."""
    name = Path(beat).name
    if name.isdigit():
        return name != os.environ.get("SLURM_JOB_ID") and job_state(name) == ""
    local = f"local-{socket.gethostname()}-"
    pid = name[len(local) :]
    return name.startswith(local) and pid.isdigit() and not _pid_runs(int(pid))


def _pid_runs(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie has ended. A launcher SIGKILLed with Snakemake is
    orphaned, and where no one reaps orphans (an init that does not wait, as in some containers
    and VMs: CI's) it stays a zombie, its pid taken for a live job's until SILENT_S."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_holder(checkpoint_root, run: dict[str, Any]) -> dict | None:
    """The open entry of another job that still runs the run (squeue; where squeue cannot say,
    its heartbeat within ``io.SILENT_S`` unless its launcher's pid on this host is gone), with
    its ``state``; None if none."""
    now, own = time.time(), os.environ.get("SLURM_JOB_ID")
    for entry in of_run(load(checkpoint_root), run_keys(run)):
        if entry.get("ended") is not None or (own and entry.get("slurm_job_id") == own):
            continue
        state = job_state(entry["slurm_job_id"]) if entry.get("slurm_job_id") else None
        if state is None:
            # a job outside SLURM SIGKILLed with its launcher: its heartbeat stays fresh
            if not entry.get("slurm_job_id") and _local_beat_ended(checkpoint_root, entry):
                continue
            if now - last_sign(checkpoint_root, entry) < SILENT_S:
                return {**entry, "state": "heartbeat"}
        elif state and state != "PENDING":
            return {**entry, "state": state}
    return None


def _local_beat_ended(checkpoint_root, entry: dict[str, Any]) -> bool:
    beat = entry.get("beat")
    return bool(beat) and beat_owner_ended(Path(checkpoint_root) / ALIVE_DIR / beat)


def begin_unless_held(checkpoint_root, run: dict[str, Any], begin: Callable[[], Any]) -> tuple:
    """(``begin()``, None) where no other live job holds the run, else (None, its entry); under
    one lock, so of two jobs that start at once the second sees the first's entry."""
    with exclusive_lock(lock_path_for(Path(checkpoint_root) / RECORD)):
        holder = live_holder(checkpoint_root, run)
        return (None, holder) if holder else (begin(), None)


def give_back(holder: dict, run_name: str, log: Callable[[str], None] = print) -> int:
    """Give this job's allocation back while ``holder`` trains the run: requeued behind it
    where SLURM allows, else ended for Snakemake's retry; the exit code."""
    own = os.environ.get("SLURM_JOB_ID")
    said = (f"run {run_name!r}: job {holder.get('slurm_job_id') or 'local'} (attempt "
            f"{holder['attempt']} on {holder.get('host')}, {holder['state']}) still trains it; "
            "two jobs must not write one run (docs/reliability.md)")  # fmt: skip
    if own and holder.get("slurm_job_id") and _requeue_behind(own, holder["slurm_job_id"]):
        log(f"{said}: this job {own} is requeued behind it and resumes after it")
    else:
        log(f"{said}: this job ends without training; the workflow submits the run again")
    return EXIT_REQUEUE


def _requeue_behind(own: str, holder: str) -> bool:
    """``own`` back in the queue until ``holder`` has ended: held first, so it cannot start
    before the dependency is set; this process ignores SLURM's SIGTERM meanwhile."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for args in (("requeuehold", own),
                 ("update", f"JobId={own}", f"Dependency=afterany:{holder}"),
                 ("release", own)):  # fmt: skip
        result = slurm("scontrol", *args)
        if result is None or result.returncode != 0:
            if args[0] != "requeuehold":  # held without its dependency: let it run again
                slurm("scontrol", "release", own)
            return False
    return True


# The main Snakemake's own heartbeat (the Snakefile's onstart), which its jobs inherit by name:
# whether it still ran when a job finished tells a rerun of that job by `rerun-incomplete`
# (the Snakemake died before it could record the outputs) from one asked for (jobs.launch).
CONTROLLER_BEAT = "IMAGENET_DDP_CONTROLLER_BEAT"  # the file's name, in CONTROLLERS_DIR
CONTROLLERS_DIR = ".controllers"  # in execution.checkpoint_dir, where every node sees it
_watching: list[Heartbeat] = []


def watch_invocation(checkpoint_dir) -> None:
    """Beat for as long as this Snakemake runs (Snakemake's onstart: the main Snakefile's
    only, not under --no-hooks, nor in a workflow that uses this one as a module), named in
    ``$IMAGENET_DDP_CONTROLLER_BEAT`` for the jobs it submits; files of invocations silent for
    STALE_S are removed."""
    folder = Path(checkpoint_dir) / CONTROLLERS_DIR
    for old in folder.glob("*"):
        if time.time() - (last_beat(old) or 0.0) > STALE_S:
            with contextlib.suppress(OSError):  # another invocation removed it first
                old.unlink()
    name = local_beat_name()
    try:
        beat = Heartbeat(folder / name).__enter__()
    except OSError as error:  # its jobs then deliver whatever becomes of this Snakemake
        print(f"warning: {folder}: {error}; train jobs cannot tell whether this Snakemake "
              "still runs when they finish (docs/reliability.md)", file=sys.stderr)  # fmt: skip
        return
    _watching.append(beat)
    os.environ[CONTROLLER_BEAT] = name


def stop_watching() -> None:
    """Snakemake's onsuccess and onerror: this Snakemake ends, its jobs with it."""
    while _watching:
        _watching.pop().__exit__(None, None, None)


def invocation_watched(checkpoint_dir, environ=None) -> bool:
    """Whether the Snakemake that submitted this job still runs, and will record what it
    delivers: False where its heartbeat file names a process gone on this host, is silent for
    STALE_S (another host's: far beyond a shared filesystem's attribute cache and the hosts'
    clock skew, since a live one taken for ended would deliver nothing) or is gone (it ended);
    True where none is named (unknown: a job of a module's consumer, or run by hand) or this
    host sees no heartbeat folder at all (not the filesystem the Snakemake wrote it on)."""
    environ = os.environ if environ is None else environ
    name = environ.get(CONTROLLER_BEAT)
    folder = Path(checkpoint_dir) / CONTROLLERS_DIR
    if not name or not folder.is_dir():
        return True
    path = folder / name
    try:  # opened: NFS revalidates a file's attributes on open (close-to-open)
        with open(path, "rb") as handle:
            beat = os.fstat(handle.fileno()).st_mtime
    except OSError:
        return False
    return time.time() - beat < STALE_S and not beat_owner_ended(path)
