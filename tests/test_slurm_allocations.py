"""A run longer than its time limit, through `snakemake --profile profiles/slurm` on the real
local SLURM cluster: one invocation resubmits it until done (imagenet_ddp.attempts), and its
cost counts every allocation.

The train job's time limit is 1 minute (the shortest `sbatch -t` takes); slurmctld ends it
within its 30 s check, SIGTERM to every process, SIGKILL KillWait (5 s) later. Each job
checkpoints at the signal, the next resumes, and the final weights are bitwise identical to an
uninterrupted run (deterministic mode, CPU, gloo, one thread per rank), trained meanwhile.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.test_resume import CONFIG, assert_bitwise_equal, torchrun, weights
from tests.test_slurm_e2e import TEST_PROFILE
from tests.workflow_helpers import copy_workflow, read_config, snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

# 2 nodes x 1 rank, one loader worker, batch 2, crop 24, fp32: 81 steps, ~11 s per epoch on
# an idle 2-core machine (measured in CI). A 1-minute allocation (ended 60-90 s after its start
# by slurmctld's 30 s check) trains 4-6 epochs after start-up (measured: 6, 4, 5), so 15 epochs
# (~170 s) need three or more. On a loaded machine (load 11 on 2 cores: ~3x slower) it needs
# ~10: max_allocations leaves room for that.
LONG = {key: CONFIG[key] for key in CONFIG if key != "run"} | {
    "name": "long", "nodes": 2, "tasks_per_node": 1, "cpus_per_task": 1, "epochs": 15,
    "max_allocations": 20, "batch_size": 2, "crop_size": 24, "eval_resize": 24, "workers": 1,
    "precision": "fp32",  # deterministic CPU bf16 runs without oneDNN (~25x slower per step)
}  # fmt: skip


def test_a_run_longer_than_its_time_limit_finishes_in_one_invocation(slurm_cluster, tmp_path):
    workdir = copy_workflow(tmp_path / "wf", runs=[LONG])
    config = read_config(workdir)
    target = f"{config['prepare'].get('dir', 'results/prepared')}/train"
    prepared = workdir / target
    # The data steps here (they are not what is tested).
    snakemake(workdir, "--profile", "profiles/local", target, "results/split/train.csv")

    result = snakemake(
        workdir, "results/runs/long/accounting.json", "--profile", "profiles/slurm",
        "--workflow-profile", str(TEST_PROFILE),
        "--set-resources", "train:runtime=1", "train:mem_mb=1000", timeout=1500,
    )  # fmt: skip
    log = result.stdout + result.stderr
    run_uuid = re.search(r"SLURM run ID: (\S+)", log).group(1)
    out = slurm_cluster.run(
        "sacct", "-X", "-n", "-P", "--name", run_uuid, "-o", "JobID,State,Comment"
    ).stdout
    train = [line.split("|")[:2] for line in out.splitlines() if "rule_train" in line]
    states = [state for _, state in train]
    assert len(train) >= 3 and states[-1] == "COMPLETED", (states, log[-4000:])
    assert set(states[:-1]) == {"TIMEOUT"}, states

    run_dir = workdir / "results/runs/long"
    cost = json.loads((run_dir / "train_metrics.json").read_text())["cost"]
    assert cost["allocations"] == len(train)
    assert cost["slurm_job_ids"] == [job_id for job_id, _ in train]
    # Each interrupted job checkpointed at the signal and exited 75 ("stopped"), or was killed
    # KillWait (5 s) after writing it ("failed"); either way the next one resumed from it. Or
    # its ranks had finished and the time limit ended the job while it wrote its outputs
    # ("completed", seen in CI): the next job resumes from the last epoch and only writes them.
    for attempt, after in zip(cost["attempts"][:-1], cost["attempts"][1:], strict=True):
        if attempt["outcome"] == "completed":
            assert after["start"]["epoch"] == LONG["epochs"], cost["attempts"]
        else:
            assert attempt["outcome"] in {"stopped", "failed"}, cost["attempts"]
    starts = [(a["start"]["epoch"], a["start"]["step"]) for a in cost["attempts"]]
    assert starts == sorted(set(starts)) and starts[0] == (0, 0), starts  # each made progress
    assert all(a["last_checkpoint"] for a in cost["attempts"][:-1])
    assert cost["core_hours"] == pytest.approx(sum(a["core_hours"] for a in cost["attempts"]))
    assert cost["core_hours_lost"] >= 0 and cost["this_job"]["core_hours"] < cost["core_hours"]
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["available"] and accounting["allocations"] == len(train)
    assert accounting["job_ids"] == cost["slurm_job_ids"]
    assert accounting["core_hours"] == pytest.approx(
        sum(job["core_hours"] for job in accounting["jobs"])
    )
    assert [job["state"] for job in accounting["jobs"]][:-1] == ["TIMEOUT"] * (len(train) - 1)

    # The run as the workflow resolved it (train_defaults, schema defaults): the same settings.
    spec_run = json.loads((run_dir / "job_spec.json").read_text())["run"]
    reference = torchrun(prepared, workdir / "results/split", tmp_path / "ref" / "out",
                         tmp_path / "ref" / "ckpt", config=spec_run)  # fmt: skip
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    assert_bitwise_equal(weights(run_dir), weights(tmp_path / "ref" / "out"))
    assert (
        torch.load(run_dir / "model.pt", weights_only=False)["config"]["epochs"] == LONG["epochs"]
    )
