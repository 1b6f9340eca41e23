"""Preemption on the real local SLURM cluster: a 2-node training job is signalled the way SLURM
warns before preemption or the time limit (`scancel --signal=USR1`, which reaches every task of
the job's steps), checkpoints and fails; the resubmitted job resumes and ends with weights
bitwise identical to an uninterrupted run (deterministic mode, CPU, gloo).
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

LONG = {**CONFIG, "epochs": 60}  # long enough to be signalled while training


def submit(cluster, work: Path, prepared: Path, split: Path) -> int:
    argv = [
        sys.executable, "-m", "imagenet_ddp.cli", "train", "--launcher", "srun",
        "--nodes", "2", "--tasks-per-node", "1", "--cpus-per-task", "1",
        "--run-config-json", json.dumps(LONG), "--prepared-train", str(prepared),
        "--split-dir", str(split), "--run-dir", str(work / "run"),
        "--checkpoint-root", str(work / "checkpoints"), "--scratch-dir", str(work / "scratch"),
    ]  # fmt: skip
    script = work / "train.sh"
    script.write_text(f"#!/bin/bash\nexec {shlex.join(argv)}\n")
    return cluster.sbatch(
        "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=10",
        f"--output={work}/slurm-%j.out", f"--chdir={work}", str(script),
    )  # fmt: skip


def wait_for(path: Path, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in {path} after {timeout}s:\n{content[-3000:]}")


def test_signalled_job_checkpoints_and_the_next_job_resumes_bitwise(
    slurm_cluster, prepared_demo, demo_split, tmp_path
):
    work = tmp_path
    first = submit(slurm_cluster, work, prepared_demo["train"], demo_split)
    log = work / f"slurm-{first}.out"
    wait_for(log, "epoch 2 step", timeout=180)
    slurm_cluster.run("scancel", "--signal=USR1", str(first))
    state = slurm_cluster.wait_job(first, timeout=180)
    output = log.read_text(errors="replace")
    assert state.startswith("FAILED"), (state, output[-3000:])  # never looks complete
    assert "interrupted" in output, output[-3000:]
    assert not (work / "run" / "model.pt").exists()
    assert list((work / "checkpoints").rglob("checkpoint-*.pt"))

    second = submit(slurm_cluster, work, prepared_demo["train"], demo_split)
    state = slurm_cluster.wait_job(second, timeout=300)
    output = (work / f"slurm-{second}.out").read_text(errors="replace")
    assert state == "COMPLETED", output[-3000:]
    assert "resuming from" in output
    metrics = json.loads((work / "run" / "train_metrics.json").read_text())
    assert sorted(r["host"] for r in metrics["ranks"]) == ["node1", "node2"]

    reference = tmp_path / "reference"
    result = torchrun(
        prepared_demo["train"], demo_split, reference / "out", reference / "ckpt", config=LONG
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_bitwise_equal(weights(work / "run"), weights(reference / "out"))
    assert torch.load(work / "run" / "model.pt", weights_only=False)["config"]["epochs"] == 60
