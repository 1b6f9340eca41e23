"""Preemption on the real local SLURM cluster, the way SLURM really ends jobs: a plain SIGTERM to
every process of every step (time limit, `scancel`, preemption), DataLoader workers included.

One 2-node training job (one rank per node, one loader worker per rank) is ended by its time
limit; the resubmitted job is ended by a plain `scancel` mid-epoch; the third finishes. Each
interrupted job checkpoints first, and the final weights are bitwise identical to an
uninterrupted run (deterministic mode, CPU, gloo, the same threads per rank).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_resume import CONFIG, assert_bitwise_equal, torchrun, weights

pytestmark = pytest.mark.slurm

CPUS = 1  # per task: one thread per rank (2 nodes share this machine's 2 cores)
# One loader worker per rank. Batch 2, crop 24: 9 steps of ~0.25 s per epoch, so a scancel sent
# at an epoch's first step lands mid-epoch; 75 epochs outlast the first job's 1-minute limit
# (slurmctld enforces it within 30 s; the first job reached epoch 44 here).
# fp32: the signals are under test here (bf16 resumes are test_resume's; on CPU they run
# without oneDNN, which would make these 75 epochs slower).
LONG = {
    **CONFIG, "epochs": 75, "batch_size": 2, "crop_size": 24, "eval_resize": 24, "workers": 1,
    "precision": "fp32", "channels_last": False,
}  # fmt: skip


def submit(cluster, work: Path, prepared: Path, split: Path, *sbatch: str) -> int:
    geometry = {"nodes": 2, "tasks_per_node": 1, "cpus_per_task": CPUS}
    argv = [
        sys.executable, "-m", "imagenet_ddp.cli", "train", "--launcher", "srun",
        "--run-config-json", json.dumps({**LONG, **geometry}), "--prepared-train", str(prepared),
        "--split-dir", str(split), "--run-dir", str(work / "run"),
        "--checkpoint-root", str(work / "checkpoints"), "--scratch-dir", str(work / "scratch"),
        "--stage-verify", "size", "--cleanup",
    ]  # fmt: skip
    script = work / "train.sh"
    script.write_text(f"#!/bin/bash\nexec {shlex.join(argv)}\n")
    return cluster.sbatch(
        "--nodes=2", "--ntasks-per-node=1", f"--cpus-per-task={CPUS}",
        f"--output={work}/slurm-%j.out", f"--chdir={work}", *sbatch, str(script),
    )  # fmt: skip


def wait_for(path: Path, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    content = ""
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} after {timeout}s:\n{content[-3000:]}")


def assert_checkpointed_and_not_complete(log: Path, work: Path) -> None:
    # sacct shows the job ended at once; its processes have KillWait seconds to finish.
    output = wait_for(log, "rerun to resume", timeout=60)
    assert "interrupted" in output, output[-3000:]
    assert "killed by signal" not in output, output[-3000:]  # loader workers survived
    assert not (work / "run" / "model.pt").exists()  # never looks complete
    assert list((work / "checkpoints").rglob("checkpoint-*.pt"))


def test_time_limit_then_plain_scancel_then_resume_gives_bitwise_identical_weights(
    slurm_cluster, prepared_demo, demo_split, tmp_path
):
    work = tmp_path
    data = (prepared_demo["train"], demo_split)

    # 1. The time limit: SIGTERM to every process of the job, SIGKILL KillWait seconds later.
    first = submit(slurm_cluster, work, *data, "--time=1")
    state = slurm_cluster.wait_job(first, timeout=240)
    log = work / f"slurm-{first}.out"
    assert state.startswith("TIMEOUT"), (state, log.read_text(errors="replace")[-3000:])
    assert_checkpointed_and_not_complete(log, work)

    # 2. Resubmitted, resumed, then a plain scancel (SIGTERM) in the middle of an epoch.
    second = submit(slurm_cluster, work, *data, "--time=10")
    log = work / f"slurm-{second}.out"
    output = wait_for(log, "resuming from", timeout=120)
    resumed_epoch = int(output.split("resuming from")[1].split("(epoch ")[1].split(",")[0])
    wait_for(log, f"epoch {resumed_epoch + 1} step 1/", timeout=120)
    slurm_cluster.run("scancel", str(second))
    state = slurm_cluster.wait_job(second, timeout=120)
    assert state.startswith("CANCELLED"), (state, log.read_text(errors="replace")[-3000:])
    assert_checkpointed_and_not_complete(log, work)
    stopped = log.read_text(errors="replace")
    assert f"interrupted at epoch {resumed_epoch + 1} step" in stopped, stopped[-3000:]  # mid-epoch

    # 3. Resubmitted again: finishes.
    third = submit(slurm_cluster, work, *data, "--time=10")
    state = slurm_cluster.wait_job(third, timeout=400)
    output = (work / f"slurm-{third}.out").read_text(errors="replace")
    assert state == "COMPLETED", output[-3000:]
    assert "resuming from" in output
    metrics = json.loads((work / "run" / "train_metrics.json").read_text())
    assert sorted(r["host"] for r in metrics["ranks"]) == ["node1", "node2"]
    assert metrics["geometry"]["workers"] == 1 and metrics["geometry"]["nodes"] == 2
    # Where the ranks agreed to stop (mid-epoch or at its end) depends on timing; both resume.
    print("epochs resumed mid-epoch:", [e["epoch"] for e in metrics["epochs"] if e["segments"] > 1])

    reference = tmp_path / "reference"
    result = torchrun(
        *data, reference / "out", reference / "ckpt", config=LONG, threads=CPUS
    )  # the same threads per rank: float sums keep their order
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_bitwise_equal(weights(work / "run"), weights(reference / "out"))
    assert torch.load(work / "run" / "model.pt", weights_only=False)["config"]["epochs"] == 75
