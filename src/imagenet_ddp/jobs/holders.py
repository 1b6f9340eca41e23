"""One train job of a run at a time, whoever submitted it (a restarted Snakemake submits the
run again): the job looks for another live job's open attempt entry (:func:`begin_unless_held`,
under one lock with its own entry) and, where one holds the run, gives its allocation back at
once (:func:`give_back`), never waiting while holding GPUs. Torch-free.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from imagenet_ddp.io import SILENT_S, exclusive_lock, lock_path_for
from imagenet_ddp.jobs.attempts import (
    ALIVE_DIR,
    EXIT_REQUEUE,
    RECORD,
    last_sign,
    load,
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
