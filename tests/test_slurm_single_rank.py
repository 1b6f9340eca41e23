"""A one-rank training job run through Snakemake on the local SLURM cluster, ended by a plain
`scancel` (SIGTERM to every process of every step).

A world-size-1 job has no `mpi` resource, so the rule's shell runs inside the executor's own
`srun -n1` step, next to Snakemake: the signal reaches Snakemake, the rule's shell and the
launcher as well as the rank and its loader worker. The rank must still checkpoint, the job
must not look complete, and the next `snakemake` must resume.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.workflow_helpers import SNAKEMAKE, copy_workflow, snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

TEST_PROFILE = Path(__file__).parent / "slurm_cluster" / "profile"
RUN = {
    "name": "single",
    "nodes": 1,
    "tasks_per_node": 1,
    "cpus_per_task": 2,  # workers: auto -> one loader worker
    "workers": "auto",
    "epochs": 6,  # still training when scancel lands after "epoch 1 step"
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
    workdir = copy_workflow(tmp_path / "wf", runs=[RUN])
    profile = ["--profile", "profiles/slurm", "--workflow-profile", str(TEST_PROFILE)]
    first = subprocess.Popen(
        [*SNAKEMAKE, *profile], cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    log = workdir / "logs/train/single.log"
    try:
        wait_for(log, "epoch 1 step", timeout=600, proc=first)
        job = train_job_id(slurm_cluster)
        slurm_cluster.run("scancel", str(job))
        assert slurm_cluster.wait_job(job, timeout=120).startswith("CANCELLED")
        text = wait_for(log, "rerun to resume", timeout=60)
        # The executor plugin (2.8.0) matches sacct's state exactly, and a scancel'd job reads
        # "CANCELLED by <uid>": the controlling Snakemake would wait for it forever
        # (docs/slurm-notes.md). A user stops it with Ctrl-C, as done here, and reruns.
        time.sleep(5)
        assert first.poll() is None, "the executor noticed the cancelled job: update the notes"
        first.send_signal(signal.SIGINT)
        output = first.communicate(timeout=180)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, output[-3000:]
    assert "interrupted" in text and "killed by signal" not in text, text[-3000:]
    assert "--overlap" in text  # the rank ran in its own step beside the executor's
    assert not (workdir / "results/runs/single/train_metrics.json").exists()
    assert list((workdir / "results/checkpoints/single").rglob("checkpoint-*.pt"))

    snakemake(workdir, *profile, "results/runs/single/train_metrics.json", timeout=900)
    text = log.read_text(errors="replace")
    assert "resuming from" in text, text[-3000:]
    assert (workdir / "results/runs/single/train_metrics.json").is_file()
