"""A run longer than its time limit, through `snakemake --profile profiles/slurm` on the real
local SLURM cluster: one invocation resubmits it until done (imagenet_ddp.attempts), and its
cost counts every allocation.

The train job's time limit is 1 minute (the shortest `sbatch -t` takes); slurmctld ends it
within its 30 s check, SIGTERM to every process, SIGKILL KillWait (5 s) later. Each job
checkpoints at the signal, the next resumes, and the final weights are bitwise identical to an
uninterrupted run (deterministic mode, CPU, gloo, one thread per rank), trained meanwhile at
the lowest CPU priority: it takes the cores while the SLURM run waits between allocations.

Meanwhile a second invocation in the same directory trains a run whose ranks fail at start on
every node (it asks for a GPU; the nodes' fake GPUs have no CUDA behind them, as a node with a
broken driver): it is retried once with its GPUs, and its next retry, which refuses, is
submitted as one task without GPUs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from imagenet_ddp import attempts
from tests.test_resume import CONFIG, assert_bitwise_equal, torchrun, weights
from tests.test_slurm_e2e import TEST_PROFILE
from tests.workflow_helpers import copy_workflow, read_config, shown_specs, snakemake

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


# Fails at start on every node: a GPU run where CUDA is unusable (a broken driver); its
# invocation's only run, so the rule's retries are max_allocations - 1 = 2. Two loader workers:
# fewer on a GPU run is refused at the dry-run (run_checks.MIN_GPU_LOADER_WORKERS).
CRASH = {**LONG, "name": "crash", "epochs": 1, "gpus_per_node": 1, "max_allocations": 3,
         "workers": 2}  # fmt: skip
SLURM = ["--profile", "profiles/slurm", "--workflow-profile", str(TEST_PROFILE)]


def reference_run(prepared, workdir, out, settings) -> subprocess.CompletedProcess:
    """The run uninterrupted, at nice 19 (it trains while the SLURM run waits)."""
    proc = torchrun(prepared, workdir / "results/split", out / "out", out / "ckpt",
                    config=settings, popen=True)  # fmt: skip
    os.setpriority(os.PRIO_PROCESS, proc.pid, 19)  # before it starts its ranks (inherited)
    stdout, _ = proc.communicate(timeout=1500)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")


def crash_invocation(workdir) -> subprocess.CompletedProcess:
    """The run that fails at start, in its own invocation (beside the other: --nolock; the
    outputs differ) with a config of its own: its runs alone. A --set-resources on the command
    line replaces the profile's set-resources whole, so mem_mb is restated (without it the job
    asks default-resources' 500 MB, which the dry-run's memory check refuses)."""
    (workdir / "crash.yaml").write_text(json.dumps({"runs": [CRASH]}))  # YAML
    return snakemake(
        workdir, "results/runs/crash/model.pt", *SLURM, "--nolock", "--configfile", "crash.yaml",
        "--set-resources", "train:runtime=5", "train:mem_mb=4000", check=False, timeout=1500,
    )  # fmt: skip


def assert_crash_retried_once_then_refused_without_gpus(cluster, workdir, crashing) -> None:
    """Two jobs with its GPUs, then one task without GPUs that refuses with their error; no
    more (its retries end there)."""
    crash_log = crashing.stdout + crashing.stderr
    assert crashing.returncode != 0, crash_log[-4000:]
    jobs = sacct_jobs(cluster, crash_log, "JobID,State,NNodes,ReqTRES,Comment")
    shapes = [(state, nnodes, "gres/gpu=2" in tres) for _, state, nnodes, tres, _ in jobs]
    assert shapes == [("FAILED", "2", True)] * 2 + [("FAILED", "1", False)], jobs
    record = attempts.load(workdir / "results/checkpoints/crash")
    assert [a["outcome"] for a in record] == ["failed", "failed", "refused"], record
    assert "CUDA is unusable" in record[0]["error"], record[0]
    assert record[2]["error"].startswith("not retrying") and "CUDA is unusable" in crash_log


def sacct_jobs(cluster, log: str, fields: str) -> list[list[str]]:
    """The train jobs of the invocation whose output is ``log``: ``fields`` of each."""
    run_uuid = re.search(r"SLURM run ID: (\S+)", log).group(1)
    # -S: without it (and without -j) sacct lists only jobs since today's midnight.
    out = cluster.run(
        "sacct", "-X", "-n", "-P", "-S", "2000-01-01", "--name", run_uuid, "-o", fields
    ).stdout
    return [line.split("|") for line in out.splitlines() if "rule_train" in line]


def test_a_run_longer_than_its_time_limit_finishes_in_one_invocation(slurm_cluster, tmp_path):
    workdir = copy_workflow(tmp_path / "wf", runs=[LONG], stage=slurm_cluster.node_scratch_config())
    config = read_config(workdir)
    target = f"{config['prepare'].get('dir', 'results/prepared')}/train"
    prepared = workdir / target
    # The data steps here (they are not what is tested).
    snakemake(workdir, "--profile", "profiles/local", target, "results/split/train.csv")
    shown = snakemake(workdir, "-n", "-p", "results/runs/long/model.pt").stdout
    settings = shown_specs(shown, "train")[0]["run"]

    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(reference_run, prepared, workdir, tmp_path / "ref", settings)
        crashing = pool.submit(crash_invocation, workdir)
        result = snakemake(
            workdir, "results/runs/long/accounting.json", *SLURM,
            "--set-resources", "train:runtime=1", "train:mem_mb=4000", timeout=1500,
        )  # fmt: skip
        reference, crashing = reference.result(), crashing.result()
    log = result.stdout + result.stderr
    train = [fields[:2] for fields in sacct_jobs(slurm_cluster, log, "JobID,State,Comment")]
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
    # Every job's log kept (logs/train/<run>/), the run's log linking to the last.
    job_of = {int(re.match(r"job-(\d+)-", p.name).group(1)): p
              for p in (workdir / "logs/train/long").glob("job-*.log")}  # fmt: skip
    assert sorted(job_of) == [int(j) for j, _ in train], sorted(job_of)
    logs = [job_of[int(j)] for j, _ in train]
    assert (workdir / "logs/train/long.log").resolve() == logs[-1].resolve()
    assert "resuming from" in logs[1].read_text(), logs[1].read_text()[-2000:]

    # The run as the workflow resolved it (train_defaults, schema defaults): the same settings.
    assert json.loads((run_dir / "job_spec.json").read_text())["run"] == settings
    assert reference.returncode == 0, reference.stdout[-3000:]
    assert_bitwise_equal(weights(run_dir), weights(tmp_path / "ref" / "out"))
    assert (
        torch.load(run_dir / "model.pt", weights_only=False)["config"]["epochs"] == LONG["epochs"]
    )

    assert_crash_retried_once_then_refused_without_gpus(slurm_cluster, workdir, crashing)
