"""Every way a running training job is told to stop, on the real local SLURM cluster, through
`snakemake --profile profiles/slurm`: each writes a checkpoint, exits for requeue (75) and its
attempt is recorded `stopped`; the next job resumes from it.

One invocation trains a 2-node run (its ranks are an srun step started by the launcher in the
batch step, as every multi-rank job) and the test stops four of its jobs in turn:

1. `kill` (SIGTERM) of the launcher alone: it must not pass SIGTERM to srun, which would
   SIGKILL the step; it passes SIGUSR1, which srun forwards to the ranks unchanged;
2. `scancel <job>`: SIGTERM to every step, the batch step (srun, the launcher) included;
3. `scancel -s TERM --batch <job>`: SIGTERM to the batch shell alone, which dies of it, so the
   job ends and SLURM sends the ranks SIGTERM;
4. the time limit: sbatch `--signal=USR1@30` (as profiles/slurm asks, with a shorter warning
   for a 3-minute limit) sends SIGUSR1 to the ranks' step 30-60 s before the limit.

What SLURM does in each case, read in its source: docs/slurm-notes.md section 7.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from imagenet_ddp import attempts
from tests.test_resume import CONFIG
from tests.test_slurm_e2e import TEST_PROFILE
from tests.workflow_helpers import SNAKEMAKE, copy_workflow, snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

# 2 nodes x 1 rank, ~11 s per epoch on an idle 2-core machine (tests/test_slurm_allocations.py):
# far more epochs than the four stopped jobs train.
RUN = {key: CONFIG[key] for key in CONFIG if key != "run"} | {
    "name": "stops", "nodes": 2, "tasks_per_node": 1, "cpus_per_task": 1, "epochs": 60,
    "max_allocations": 8, "batch_size": 2, "crop_size": 24, "eval_resize": 24, "workers": 1,
    "precision": "fp32", "deterministic": False,
}  # fmt: skip
RUNTIME_MINUTES = 3  # the warning comes 2-2.5 min after the start, the ranks long trained
WARNING_SECONDS = 30  # slurmctld sends it 30-60 s before the limit (its 30 s check)
SLURM = ["--profile", "profiles/slurm", "--workflow-profile", str(TEST_PROFILE)]
PROGRESS = re.compile(r"epoch \d+ step \d+/\d+")


def job_log(workdir: Path, job: int) -> Path | None:
    found = list((workdir / "logs/train/stops").glob(f"job-{job}-*.log"))
    return found[0] if found else None


def running_train_job(cluster, workdir: Path, seen: set[int], proc, timeout: float = 600) -> int:
    """The next train job (not in ``seen``) once its ranks print progress."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = (workdir.parent / "snakemake.out").read_text(errors="replace")[-3000:]
            raise AssertionError(f"snakemake exited {proc.returncode}:\n{said}")
        out = cluster.run("squeue", "-h", "-o", "%i|%k|%T").stdout
        for line in out.splitlines():
            job, comment, state = line.split("|")
            if comment.startswith("rule_train") and state == "RUNNING" and int(job) not in seen:
                log = job_log(workdir, int(job))
                if log is not None and PROGRESS.search(log.read_text(errors="replace")):
                    return int(job)
        time.sleep(1)
    raise AssertionError(f"no new train job trained within {timeout} s:\n{cluster.logs()}")


def launcher_pid(workdir: Path) -> int:
    """The `imagenet-ddp train` process of this workdir (the rule's shell exec'd it)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ours = b"--job" in argv and (proc / "cwd").resolve() == workdir
            if ours and b"train" in argv and any(a.endswith(b"imagenet-ddp") for a in argv):
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError("launcher process not found")


def test_every_way_of_stopping_a_job_checkpoints_and_records_stopped(slurm_cluster, tmp_path):
    stage = slurm_cluster.node_scratch_config()  # the nodes' own tmpfs, as a site user sets it
    workdir = copy_workflow(tmp_path / "wf", runs=[RUN], stage=stage).resolve()
    snakemake(
        workdir, "--profile", "profiles/local", "results/prepared/train", "results/split/train.csv"
    )  # fmt: skip  (the data steps are not what is tested)
    # Its output goes to a file: a pipe nobody reads fills up (64 KB: the shell commands it
    # prints at each resubmission) and blocks Snakemake before it notices a job's end.
    out = (tmp_path / "snakemake.out").open("w")
    run = subprocess.Popen(
        [*SNAKEMAKE, *SLURM, "results/runs/stops/train_metrics.json", "--set-resources",
         f"train:runtime={RUNTIME_MINUTES}", "train:mem_mb=2000",
         f"train:slurm_extra='--signal=USR1@{WARNING_SECONDS}'"],
        cwd=workdir, stdout=out, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    jobs: list[int] = []
    stops = {
        "kill": lambda job: os.kill(launcher_pid(workdir), signal.SIGTERM),
        "scancel": lambda job: slurm_cluster.run("scancel", str(job)),
        "scancel --batch": lambda job: slurm_cluster.run(
            "scancel", "-s", "TERM", "--batch", str(job)
        ),
        "time limit": lambda job: None,  # its --signal warning comes by itself
    }
    states = {}
    try:
        for how, stop in stops.items():
            job = running_train_job(slurm_cluster, workdir, set(jobs), run)
            jobs.append(job)
            stop(job)
            states[how] = slurm_cluster.wait_job(job, timeout=RUNTIME_MINUTES * 60 + 120)
    finally:
        run.send_signal(signal.SIGINT)  # cancels its jobs
        try:
            run.wait(timeout=120)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
        out.close()
        for line in slurm_cluster.run("squeue", "-h", "-o", "%i|%k").stdout.splitlines():
            if line.split("|")[1].startswith("rule_train"):
                slurm_cluster.run("scancel", line.split("|")[0], check=False)

    output = (tmp_path / "snakemake.out").read_text(errors="replace")
    record = attempts.load(workdir / "results/checkpoints/stops")
    mine = [a for a in record if a.get("slurm_job_id") in {str(j) for j in jobs}]
    outcomes = {how: a["outcome"] for how, a in zip(stops, mine, strict=True)}
    assert outcomes == dict.fromkeys(stops, "stopped"), (outcomes, states, output[-4000:])
    assert all(a["exit_code"] == 75 and a["last_checkpoint"] for a in mine), mine
    starts = [(a["start"]["epoch"], a["start"]["step"]) for a in mine]
    assert starts == sorted(set(starts)), starts  # each job resumed from the one before
    logs = {
        how: job_log(workdir, job).read_text(errors="replace")
        for how, job in zip(stops, jobs, strict=True)
    }
    for how, text in logs.items():
        assert "killed by signal" not in text and "task 0: Killed" not in text, (how, text)
        assert re.search(r"interrupted( by SIG\w+)? (at|after) epoch", text), (how, text[-3000:])
    # The launcher passed its SIGTERM on as SIGUSR1; the time limit's warning reached the ranks.
    assert "stop signal SIGTERM: passed on to srun as SIGUSR1" in logs["kill"], logs["kill"]
    assert "interrupted by SIGUSR1" in logs["time limit"], logs["time limit"][-3000:]
    assert states["scancel"].startswith("CANCELLED"), states
    assert states["time limit"] == "FAILED", states  # exit 75 before the limit, not TIMEOUT
