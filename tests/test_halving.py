"""Successive halving's rung schedule and decisions (imagenet_ddp.settings.halving)."""

from __future__ import annotations

import json
import random

import pytest

from imagenet_ddp.settings.halving import Halving, decide, halvings, plan_lines, rungs


def test_rungs_are_min_epochs_times_powers_of_eta_below_epochs():
    assert rungs(1, 2, 4) == (1, 2)
    assert rungs(5, 3, 90) == (5, 15, 45)
    assert rungs(4, 2, 4) == ()


def test_plan_keeps_floor_n_over_eta_and_counts_epochs():
    halving = Halving(0, tuple(f"r{i}" for i in range(9)), 3, (1, 3), 9)
    assert halving.plan() == [(1, 9), (3, 3), (9, 1)]
    assert halving.planned_epochs() == 9 * 1 + 3 * 2 + 1 * 6  # against 81 unpruned
    assert Halving(0, ("a", "b"), 3, (1,), 4).plan() == [(1, 2), (4, 1)]  # at least one


def test_the_dry_runs_plan_line_counts_run_and_gpu_epochs_against_the_grid():
    names = tuple(f"r{i}" for i in range(9))
    halving = Halving(0, names, 3, (1, 3), 9)
    on_gpus = {n: {"nodes": 2, "gpus_per_node": 8} for n in names}
    [line] = plan_lines({0: halving}, on_gpus)
    assert line == (
        "sweep[0] prune (eta 3): 9 to epoch 1, 3 to epoch 3, 1 to epoch 9; 21 run-epochs "
        "planned, 81 unpruned (26%); 16 GPUs a run: 336 GPU-epochs against 1296"
    )
    mixed = {**on_gpus, "r0": {"nodes": 1, "gpus_per_node": 8}}  # no one GPU count: run-epochs
    assert plan_lines({0: halving}, mixed)[0].endswith("81 unpruned (26%)")


def _metrics(tmp_path, figures):
    paths = {}
    for name, top1 in figures.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"epochs": [{"holdout_top1": 0.0}, {"holdout_top1": top1}]}))
        paths[name] = path
    return paths


def test_decision_ranks_high_first_ties_by_name_whatever_the_order(tmp_path):
    figures = {"d": 0.5, "b": 0.7, "a": 0.5, "c": float("nan")}
    halving = Halving(0, tuple(figures), 2, (1, 2), 4)
    paths = _metrics(tmp_path, figures)
    first = decide(halving, 1, paths)
    assert [r["run"] for r in first["ranking"]] == ["b", "a", "d", "c"]  # no figure last
    assert first["survivors"] == ["a", "b"] and first["pruned"] == ["c", "d"]
    items = list(paths.items())
    for seed in range(5):
        random.Random(seed).shuffle(items)
        assert decide(halving, 1, dict(items)) == first


def test_a_pruned_sweep_needs_one_epochs_and_a_rung_below_it():
    prune = {"eta": 2, "min_epochs": 1, "metric": "holdout_top1"}
    config = {"sweep": [{"name": "r{epochs}", "grid": {"epochs": [2, 4]}, "prune": prune}]}
    written = {"sweep": config["sweep"], "train_defaults": {}}
    runs = {"r2": {"epochs": 2}, "r4": {"epochs": 4}}
    found, problems = halvings(config, written, runs)
    assert found == {} and problems[0].startswith("config.yaml: sweep[0].prune: ")
    config["sweep"][0]["grid"] = {"lr": [0.1, 0.2]}
    config["sweep"][0]["name"] = "r{lr}"
    config["sweep"][0]["prune"]["min_epochs"] = 4
    found, problems = halvings(config, written, {"r0.1": {"epochs": 4}, "r0.2": {"epochs": 4}})
    assert "min_epochs 4 is not below the runs' epochs 4" in problems[0]
    config["sweep"][0]["prune"]["min_epochs"] = 1
    found, problems = halvings(config, written, {"r0.1": {"epochs": 4}, "r0.2": {"epochs": 4}})
    assert problems == [] and found[0].stages == (1, 2, 4) and found[0].runs == ("r0.1", "r0.2")


@pytest.mark.parametrize("epoch", [1, 3])
def test_start_afresh_resumes_an_earlier_rungs_delivery(tmp_path, epoch):
    from imagenet_ddp.jobs.launch import DELIVERED, start_afresh_if_delivered

    root = tmp_path / "ckpt" / "run"
    root.mkdir(parents=True)
    (root / DELIVERED).write_text(json.dumps({"delivered_at": 1.0, "epoch": 2}))
    moved = start_afresh_if_delivered(root, {"IMAGENET_DDP_INVOCATION_STARTED": "5"}, epoch)
    assert (moved is None) == (epoch > 2)


def test_every_job_whose_inputs_a_decision_chose_lists_that_decision(tmp_path, monkeypatch):
    """jobs.plan.SweepStages: prune's runs at a later rung are the survivors of the rung before,
    rung_final's stage is where its run was pruned (else the end), and each lists the decisions
    it read (ancient): Snakemake re-evaluates a checkpoint's dependents when it is made again
    in the same invocation only through such an input (tests/test_sweeps.py, end to end)."""
    from types import SimpleNamespace

    from snakemake.io import is_flagged

    from imagenet_ddp.jobs.plan import SweepStages

    monkeypatch.chdir(tmp_path)
    halving = Halving(0, ("a", "b", "c", "d"), 2, (1, 2), 3)
    kept = {1: ["a", "b"], 2: ["b"]}
    for epoch, survivors in kept.items():
        path = tmp_path / f"results/sweeps/0/rung-{epoch}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"survivors": survivors}))
    prune = SimpleNamespace(get=lambda sweep, epoch: SimpleNamespace(
        output=[f"results/sweeps/{sweep}/rung-{epoch}.json"]))  # fmt: skip
    stages = SweepStages(SimpleNamespace(prune=prune), {0: halving})
    assert stages.decisions == ["results/sweeps/0/rung-1.json", "results/sweeps/0/rung-2.json"]
    first, second = SimpleNamespace(sweep="0", epoch="1"), SimpleNamespace(sweep="0", epoch="2")
    assert stages.runs(first) == ["a", "b", "c", "d"] and stages.decided(first) == []
    assert stages.runs(second) == ["a", "b"]
    assert stages.metrics(second) == [f"results/runs/{n}/rungs/2/train_metrics.json" for n in "ab"]
    (decided,) = stages.decided(second)
    assert decided == "results/sweeps/0/rung-1.json" and is_flagged(decided, "ancient")
    for run, stage, read in (("c", 1, 1), ("a", 2, 2), ("b", 3, 2)):
        inputs = stages.final_input(SimpleNamespace(run=run))
        assert inputs["stage"][0] == f"results/runs/{run}/rungs/{stage}/model.pt", run
        assert inputs["decided"] == stages.decisions[:read], run
        assert all(is_flagged(d, "ancient") for d in inputs["decided"])
    with pytest.raises(Exception, match="5 is none of its rungs"):
        stages.previous(SimpleNamespace(run="a", epoch="5"))
    assert stages.previous(SimpleNamespace(run="a", epoch="1")) == []
    assert stages.previous(SimpleNamespace(run="a", epoch="3")).endswith(
        "rungs/2/train_metrics.json"
    )
