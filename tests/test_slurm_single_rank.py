"""A one-rank training job run through Snakemake on the local SLURM cluster, ended by a plain
`scancel` (SIGTERM to every process of every step).

A world-size-1 job has no `mpi` resource, so the rule's shell runs inside the executor's own
`srun -n1` step, next to Snakemake: the signal reaches Snakemake, the rule's shell and the
launcher as well as the rank and its loader worker. The rank must still checkpoint, the job
must not look complete, and the same `snakemake` must notice the cancelled job (the profile
reads states with squeue), resubmit it and resume.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.workflow_helpers import SNAKEMAKE, copy_workflow

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

TEST_PROFILE = Path(__file__).parent / "slurm_cluster" / "profile"
RUN = {
    "name": "single",
    "nodes": 1,
    "tasks_per_node": 1,
    "cpus_per_task": 2,  # workers: auto -> one loader worker
    "workers": "auto",
    "epochs": 4,  # still training when scancel lands after "epoch 1 step"
}


def wait_for(path: Path, text: str, timeout: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    content = ""
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in {path}:\n{content[-3000:]}")


def train_job_id(cluster) -> int:
    out = cluster.run("squeue", "-h", "-o", "%i|%k").stdout
    ids = [int(i) for i, comment in (line.split("|", 1) for line in out.splitlines())
           if comment.startswith("rule_train")]  # fmt: skip
    assert len(ids) == 1, out
    return ids[0]


def test_scancel_of_a_single_rank_job_inside_snakemakes_step_checkpoints_and_resumes(
    slurm_cluster, tmp_path
):
    workdir = copy_workflow(tmp_path / "wf", runs=[RUN], stage=slurm_cluster.node_scratch_config())
    profile = ["--profile", "profiles/slurm", "--workflow-profile", str(TEST_PROFILE)]
    target = "results/runs/single/train_metrics.json"
    run = subprocess.Popen(
        [*SNAKEMAKE, *profile, target], cwd=workdir, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log = workdir / "logs/train/single.log"  # links to the running job's own log
    try:
        wait_for(log, "epoch 1 step", timeout=600, proc=run)
        job = train_job_id(slurm_cluster)
        first_log = log.resolve()
        slurm_cluster.run("scancel", str(job))
        assert slurm_cluster.wait_job(job, timeout=120).startswith("CANCELLED")
        output = run.communicate(timeout=600)[0]
    finally:
        if run.poll() is None:
            run.kill()
    # Noticed (squeue: "CANCELLED"; sacct would say "CANCELLED by <uid>", which the plugin
    # 2.8.0 takes for running: docs/slurm-notes.md), resubmitted, resumed, done.
    assert run.returncode == 0, output[-3000:]
    first = first_log.read_text(errors="replace")
    assert "interrupted" in first and "killed by signal" not in first, first[-3000:]
    assert "--overlap" in first  # the rank ran in its own step beside the executor's
    second = log.read_text(errors="replace")
    assert log.resolve() != first_log and "resuming from" in second, second[-3000:]
    assert (workdir / target).is_file()
    cost = json.loads((workdir / target).read_text())["cost"]
    assert cost["allocations"] == 2 and cost["slurm_job_ids"][0] == str(job), cost
