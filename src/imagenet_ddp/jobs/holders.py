"""Which SLURM job holds a run: one train job of a run at a time, whoever submitted it.

The controlling Snakemake may die while a train job runs (a login node rebooted, a lost ssh
session, a CPU-time limit); the job keeps running. The same command again (after
`snakemake --unlock`) would submit a second train job of the run at once (`rerun-incomplete`),
which resumes from the first one's checkpoint and trains beside it into the same checkpoint
folder. Two guards, both torch-free:

- the submitting Snakemake asks squeue for the run's live train jobs (:func:`holders_ahead`:
  the executor's comment ``rule_train_wildcards_<run>`` and the workflow's directory, and the
  attempt record's open entries) and submits the new job with ``--dependency=afterany:<id>``
  (:func:`dependency_flag`): it pends for free and starts once that job has ended, resuming
  from its newest checkpoint (or re-writing the finished run's outputs from its final one);
- the job itself, before it records its attempt (:func:`wait_for_holders`), waits while an
  open entry of another job of the run is live (squeue; where squeue cannot answer: a
  heartbeat newer than :data:`STALE_SECONDS`), with one log line; the last check and the
  record are made under one lock (:func:`begin_when_free`), so two jobs that start at once
  cannot both find the run free.

Where squeue is missing or fails, the first guard submits without a dependency (one warning
line) and the second still holds.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from imagenet_ddp.io import exclusive_lock, lock_path_for
from imagenet_ddp.jobs.attempts import HEARTBEAT_SECONDS, RECORD, load, of_run, settings_key

T = TypeVar("T")

# States of a job that has ended (squeue shows them for MinJobAge); any other is live.
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}  # fmt: skip
# An open entry whose heartbeat is older than this is taken as dead where squeue cannot say.
STALE_SECONDS = 3 * HEARTBEAT_SECONDS
SQUEUE_SECONDS = 30  # a hung slurmctld must not hang the controller or the job
WAIT_SECONDS = 30.0  # how often a waiting job asks again


def _squeue(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["squeue", *args], capture_output=True, text=True,
                              timeout=SQUEUE_SECONDS)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None


def live_jobs() -> dict[str, dict[str, str]] | None:
    """This user's live SLURM jobs: {job id: {state, comment, workdir}}; None where squeue
    cannot answer (not installed, slurmctld down, a timeout)."""
    result = _squeue("--me", "-h", "-o", "%i|%T|%k|%Z")
    if result is None or result.returncode != 0:
        return None
    jobs = {}
    for line in result.stdout.splitlines():
        parts = line.split("|", 3)
        if len(parts) == 4 and parts[1] not in ENDED:
            jobs[parts[0]] = {"state": parts[1], "comment": parts[2], "workdir": parts[3]}
    return jobs


def job_state(job_id: str) -> str | None:
    """The job's state; "" when SLURM no longer knows it (ended); None: squeue cannot say."""
    result = _squeue("-h", "-j", str(job_id), "-o", "%T")
    if result is None:
        return None
    if result.returncode == 0:
        state = result.stdout.strip()
        return "" if state in ENDED else state
    return "" if "Invalid job id" in result.stderr else None  # purged: long gone


def _same_dir(a: str, b: str | os.PathLike[str]) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def open_entries(checkpoint_root, run: dict[str, Any], own_job: str | None) -> list[dict]:
    """The run's attempt entries that no launcher closed, of jobs other than ``own_job``."""
    return [
        a
        for a in of_run(load(checkpoint_root), settings_key(run))
        if a.get("ended") is None and (own_job is None or a.get("slurm_job_id") != own_job)
    ]


def executor_comment(rule: str, wildcards) -> str:
    """The comment the SLURM executor gives a job of ``rule`` with these wildcard values
    (plugin 2.8.0: ``rule_<rule>_wildcards_<values joined by _, / as _>``)."""
    joined = "_".join(str(w) for w in wildcards).replace("/", "_")
    return f"rule_{rule}_wildcards_{joined}" if joined else f"rule_{rule}"


def _by_id(ids) -> list[str]:
    return sorted(ids, key=lambda j: [int(p) for p in j.split("_") if p.isdigit()])


def same_jobs(live: dict[str, dict[str, str]], comment: str, workdir) -> list[str]:
    """The live jobs the SLURM executor submitted from ``workdir`` with ``comment``."""
    return _by_id(j for j, job in live.items()
                  if job["comment"] == comment and _same_dir(job["workdir"], workdir))  # fmt: skip


def holders_ahead(
    checkpoint_root, run: dict[str, Any], name: str, workdir, live: dict[str, dict[str, str]]
) -> list[str]:
    """The live train jobs of run ``name`` in the workflow at ``workdir`` (``live``:
    :func:`live_jobs`), oldest first: those the SLURM executor submitted from there, and those
    with an open entry in the run's attempt record."""
    ids = set(same_jobs(live, executor_comment("train", [name]), workdir))
    own = os.environ.get("SLURM_JOB_ID")
    entries = open_entries(checkpoint_root, run, own)
    ids |= {a["slurm_job_id"] for a in entries if a.get("slurm_job_id") in live}
    ids.discard(own)
    return _by_id(ids)


def dependency_flag(ids: list[str]) -> str:
    """The sbatch flag that starts a job once all of ``ids`` have ended, however they ended."""
    return "--dependency=afterany:" + ":".join(ids)


def _live_holders(entries: list[dict], now: float) -> list[dict]:
    holding = []
    for entry in entries:
        state = job_state(entry["slurm_job_id"]) if entry.get("slurm_job_id") else None
        if state is None:  # squeue cannot say (or no SLURM): its heartbeat does
            if now - float(entry.get("alive") or entry["started"]) < STALE_SECONDS:
                holding.append({**entry, "state": "heartbeat"})
        elif state:
            holding.append({**entry, "state": state})
    return holding


def wait_for_holders(
    checkpoint_root,
    run: dict[str, Any],
    *,
    log: Callable[[str], None] = print,
    seconds: float = WAIT_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Wait while another job holds the run (an open entry of a live job): the seconds waited.
    Called before this job records its attempt (which would close the other's entry)."""
    own = os.environ.get("SLURM_JOB_ID")
    waited, said = 0.0, False
    while True:
        holding = _live_holders(open_entries(checkpoint_root, run, own), time.time())
        if not holding:
            if said:
                log(f"run {run.get('run')!r}: the other job has ended after {waited:.0f} s; "
                    "this job resumes from its newest checkpoint")  # fmt: skip
            return waited
        if not said:
            h = holding[0]
            log(f"run {run.get('run')!r}: job {h.get('slurm_job_id') or 'local'} (attempt "
                f"{h['attempt']} on {h.get('host')}, {h['state']}) still trains it into "
                f"{Path(checkpoint_root)}; this job waits for it to end before it trains (two "
                "jobs must not write one run; docs/reliability.md)")  # fmt: skip
            said = True
        sleep(seconds)
        waited += seconds


def begin_when_free(
    checkpoint_root,
    run: dict[str, Any],
    begin: Callable[[], T],
    *,
    log: Callable[[str], None] = print,
    seconds: float = WAIT_SECONDS,
) -> T:
    """``begin()`` (this job's attempt entry: :func:`imagenet_ddp.jobs.attempts.begin`) once no
    other live job holds the run, the check and the record under one lock on the attempt
    record: of two jobs of a run that start within seconds (no dependency between them), the
    second sees the first's open entry and waits for it. Across nodes where the checkpoint
    folder's filesystem locks across nodes (flock, or the lock directory of
    :func:`imagenet_ddp.io.exclusive_lock`). The lock is held while this job waits."""
    with exclusive_lock(lock_path_for(Path(checkpoint_root) / RECORD)):
        wait_for_holders(checkpoint_root, run, log=log, seconds=seconds)
        return begin()
