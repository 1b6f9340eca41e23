"""End to end on the local SLURM cluster: `snakemake --profile profiles/slurm` on the tiny demo.

The cluster (2 nodes x 2 CPUs, accounting in slurmdbd) comes from the `slurm_cluster` session
fixture; the test-only profile layer tests/slurm_cluster/profile points the real profile at it.
Three runs cover the train rule's three SLURM shapes: 2 nodes x 1 rank (`mpi`, `tasks`),
1 node x 2 ranks (`mpi`, `tasks_per_node`) and 1 x 1 (no `mpi`: inside the executor's step).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from imagenet_ddp.launch import Geometry, srun_argv
from tests.workflow_helpers import TINY_CONFIG_OVERRIDES, copy_workflow, snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

TEST_PROFILE = Path(__file__).parent / "slurm_cluster" / "profile"
RUNS = [
    # Evaluated like it trained: 2 nodes x 1 rank (an `mpi` srun step); the others use the
    # default evaluation geometry (one node, one rank without GPUs).
    # Trains after a passing preflight on its geometry (one more sbatch job, same snakemake).
    {
        "name": "resnet18-2x1",
        "nodes": 2,
        "tasks_per_node": 1,
        "evaluate": {"nodes": 2},
        "preflight": True,
    },
    {"name": "resnet18-1x2", "nodes": 1, "tasks_per_node": 2},
    {"name": "resnet18-1x1", "nodes": 1, "tasks_per_node": 1},
]


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory):
    workdir = copy_workflow(tmp_path_factory.mktemp("slurm-e2e"), runs=RUNS)
    result = snakemake(
        workdir, "--profile", "profiles/slurm", "--workflow-profile", str(TEST_PROFILE),
        timeout=1200,
    )  # fmt: skip
    log = result.stdout + result.stderr
    run_uuid = re.search(r"SLURM run ID: (\S+)", log).group(1)
    # Every SLURM job of this Snakemake run (job name = run ID), with the rule in its comment.
    out = slurm_cluster.run(
        "sacct", "-X", "-n", "-P", "--name", run_uuid, "-o", "JobID,State,NNodes,Comment"
    ).stdout
    jobs = {}
    for line in out.splitlines():
        job_id, state, nnodes, comment = line.split("|")
        jobs[comment] = {"id": int(job_id), "state": state, "nnodes": int(nnodes)}
    return SimpleNamespace(dir=workdir, log=log, jobs=jobs, cluster=slurm_cluster)


def test_every_job_went_through_sbatch_and_completed(slurm_run):
    total = int(re.search(r"(\d+) of \1 steps \(100%\) done", slurm_run.log).group(1))
    assert set(re.findall(r"localrule (\w+):", slurm_run.log)) == {"all"}  # nothing ran here
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+)", slurm_run.log)
    assert len(submitted) == len(slurm_run.jobs) == total - 1, slurm_run.jobs
    assert {j["state"] for j in slurm_run.jobs.values()} == {"COMPLETED"}, slurm_run.jobs
    rules = {re.sub(r"_wildcards_.*", "", c) for c in slurm_run.jobs}
    assert {"rule_train", "rule_evaluate", "rule_prepare", "rule_aggregate"} <= rules, rules
    for run in RUNS:
        assert f"rule_train_wildcards_{run['name']}" in slurm_run.jobs


def test_multi_node_training_had_ranks_on_both_nodes(slurm_run):
    job = slurm_run.jobs["rule_train_wildcards_resnet18-2x1"]
    assert job["nnodes"] == 2
    metrics = json.loads(
        (slurm_run.dir / "results/runs/resnet18-2x1/train_metrics.json").read_text()
    )
    assert metrics["world_size"] == 2 and metrics["nodes"] == 2
    assert sorted((r["rank"], r["host"]) for r in metrics["ranks"]) == [(0, "node1"), (1, "node2")]
    one_node = json.loads(
        (slurm_run.dir / "results/runs/resnet18-1x2/train_metrics.json").read_text()
    )
    assert one_node["world_size"] == 2 and one_node["nodes"] == 1


def test_evaluation_ran_as_ranks_on_both_nodes_and_counted_every_sample_once(slurm_run):
    job = slurm_run.jobs["rule_evaluate_wildcards_resnet18-2x1"]
    assert job["nnodes"] == 2
    runs = slurm_run.dir / "results/runs"
    two = json.loads((runs / "resnet18-2x1/eval.json").read_text())
    one = json.loads((runs / "resnet18-1x1/eval.json").read_text())
    assert two["evaluation"]["world_size"] == 2 and two["evaluation"]["backend"] == "gloo"
    assert two["evaluation"]["hosts"] == ["node1", "node2"]
    assert one["evaluation"]["world_size"] == 1
    for split in ("holdout", "test"):
        assert two[split]["samples"] == one[split]["samples"] > 0


def test_training_used_srun_in_the_allocation(slurm_run):
    for run in RUNS:
        log = (slurm_run.dir / f"logs/train/{run['name']}.log").read_text()
        assert "+ srun " in log, log[-2000:]
        # Only the 1x1 run (no `mpi`) runs inside the executor's step and must overlap it.
        assert ("--overlap" in log) == (run["nodes"] * run["tasks_per_node"] == 1), run


def test_each_node_staged_its_own_copy_into_its_scratch_and_cleaned_it(slurm_run):
    cluster = slurm_run.cluster
    for run in RUNS:
        job_id = slurm_run.jobs[f"rule_train_wildcards_{run['name']}"]["id"]
        job_scratch = cluster.scratch / f"job_{job_id}"
        reports = {
            p.stem: json.loads(p.read_text())
            for p in (slurm_run.dir / f"results/runs/{run['name']}/staging").glob("*.json")
        }
        assert len(reports) == run["nodes"], reports
        for host, report in reports.items():
            assert host in cluster.node_names
            assert report["host"] == host and report["bytes"] > 0 and report["files"] > 0
            assert Path(report["dest"]).is_relative_to(job_scratch), report  # $SLURM_TMPDIR
            assert report["cleaned"] is True
            host_view = cluster.node_scratch(host) / f"job_{job_id}"
            assert host_view.is_dir()  # the prolog made it on this node ...
            assert not [p for p in host_view.rglob("*") if p.is_file()]  # ... and it is empty
    # Nothing was staged into the workflow's fallback scratch dir instead.
    assert not (slurm_run.dir / "scratch").exists() or not any(
        (slurm_run.dir / "scratch").iterdir()
    )


def test_results_are_as_good_as_a_local_run(slurm_run):
    table = pd.read_csv(slurm_run.dir / "results/aggregate/runs.csv")
    chance = 1 / TINY_CONFIG_OVERRIDES["demo"]["num_classes"]
    assert sorted(table["run"]) == sorted(r["name"] for r in RUNS)
    # The thresholds of the local end-to-end test (tests/test_workflow_local.py).
    assert (table["holdout_top1"] > 2 * chance).all(), table
    assert (table["test_top1"] > 2 * chance).all(), table


def test_accounting_of_each_training_job_comes_from_sacct(slurm_run):
    table = pd.read_csv(slurm_run.dir / "results/aggregate/runs.csv").set_index("run")
    for run in RUNS:
        job = slurm_run.jobs[f"rule_train_wildcards_{run['name']}"]
        record = json.loads(
            (slurm_run.dir / f"results/runs/{run['name']}/accounting.json").read_text()
        )
        assert record["available"] is True, record
        assert record["job_id"] == str(job["id"]) and record["state"] == "COMPLETED", record
        assert record["nodes"] == run["nodes"] and record["elapsed_seconds"] > 0, record
        assert int(record["alloc_tres"]["cpu"]) >= run["nodes"] * run["tasks_per_node"], record
        assert table.loc[run["name"], "slurm_state"] == "COMPLETED"
        assert table.loc[run["name"], "slurm_core_hours"] > 0


def test_preflight_ran_on_both_nodes_before_training(slurm_run):
    assert "rule_preflight_run_wildcards_resnet18-2x1" in slurm_run.jobs
    preflight = slurm_run.jobs["rule_preflight_run_wildcards_resnet18-2x1"]
    assert preflight["nnodes"] == 2 and preflight["state"] == "COMPLETED"
    train = slurm_run.jobs["rule_train_wildcards_resnet18-2x1"]
    assert preflight["id"] < train["id"]  # submitted first: train depends on it
    folder = slurm_run.dir / "results/preflight/resnet18-2x1"
    report = json.loads((folder / "preflight.json").read_text())
    assert report["problems"] == [], report["problems"]
    assert sorted(report["nodes"]) == sorted(slurm_run.cluster.node_names)
    assert {r["slurm_job_id"] for r in report["ranks"]} == {str(preflight["id"])}
    allreduce = report["allreduce"]
    assert allreduce["busbw_gbps"] == pytest.approx(allreduce["algbw_gbps"])  # 2(n-1)/n = 1
    assert allreduce["busbw_gbps"] > 0
    for node in report["nodes"].values():  # each node staged into its job's scratch
        assert node["staging"]["bytes"] > 0 and node["staging"]["gb_per_s"] > 0
    # train's time limit (the test profile's 30 min) is what allocations are counted in
    assert report["projection"]["train_runtime_minutes"] == 30
    assert report["projection"]["allocations"] == 1
    table = pd.read_csv(slurm_run.dir / "results/aggregate/runs.csv").set_index("run")
    measured = table.loc["resnet18-2x1", "epoch_seconds_over_preflight"]
    assert 1 / 4 < measured < 4, measured  # the factor README "First run on a new cluster" states


def test_preflight_on_fake_gpus_reports_slurms_binding_per_rank(slurm_run, tmp_path):
    """2 nodes x 2 ranks, --gres=gpu:2 per node (the test cluster's fake GPUs), computing on
    CPU/gloo: every rank reports the CUDA_VISIBLE_DEVICES SLURM gave it and the GPU it would
    use. One sbatch of the CLI: the pipeline refuses gpus_per_node > 0 without CUDA (#18's
    device selection will let the pipeline run's own geometry do this). Two ranks on one GPU
    failing with its line: tests/test_workflow_local.py, tests/test_preflight.py (--gres=gpu:1
    here gave CUDA_VISIBLE_DEVICES=0 to both ranks of a node and failed the same way)."""
    spec = json.loads(
        (slurm_run.dir / "results/preflight/resnet18-2x1/preflight_spec.json").read_text()
    )
    run = {**spec["run"], "tasks_per_node": 2, "gpus_per_node": 2, "device": "cpu"}
    out = tmp_path / "preflight.json"
    argv = [
        sys.executable, "-m", "imagenet_ddp.cli", "preflight",
        "--run-config-json", json.dumps(run),
        "--prepared-train", spec["paths"]["prepared_train"],
        "--split-dir", spec["paths"]["split_dir"], "--out", str(out),
        "--train-runtime-minutes", "30", "--launcher", "srun",
        "--scratch-dir", str(tmp_path / "scratch"), "--stage-verify", "size", "--cleanup",
    ]  # fmt: skip
    job = slurm_run.cluster.sbatch(
        "--nodes=2", "--ntasks-per-node=2", "--gres=gpu:2", "--time=10",
        f"--output={tmp_path}/job.log", "--wrap", shlex.join(argv), cwd=slurm_run.dir,
    )  # fmt: skip
    state = slurm_run.cluster.wait_job(job, timeout=300)
    assert state == "COMPLETED", (tmp_path / "job.log").read_text()
    report = json.loads(out.read_text())
    assert report["problems"] == []
    ranks = report["ranks"]
    assert [r["visible"] for r in ranks] == [["0", "1"]] * 4  # plain srun: a node's GPUs
    assert [(r["host"], r["gpu"]) for r in ranks] == [
        (host, gpu) for host in sorted(slurm_run.cluster.node_names) for gpu in "01"
    ]
    assert {r["slurm_job_id"] for r in ranks} == {str(job)}
    assert "intra_node" in report["allreduce"]["sizes"][0]  # 2 nodes x 2 ranks: both scopes
    assert report["projection"]["gpu_hours"] == pytest.approx(
        report["projection"]["total_seconds"] / 3600 * 2 * 2
    )


def test_srun_overlaps_only_inside_an_existing_step(monkeypatch):
    geometry = Geometry(nodes=1, tasks_per_node=1, cpus_per_task=2)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert "--overlap" not in srun_argv(geometry, per_node=False, extra=[])
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert srun_argv(geometry, per_node=False, extra=["--x"])[-2:] == ["--overlap", "--x"]
