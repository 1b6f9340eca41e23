"""Sweep expansion (imagenet_ddp.settings.runs): grid and zip, names, collisions, schema, and the
workflow's dry-run of an expanded sweep (its rerun behaviour: tests/test_workflow_local.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from imagenet_ddp.settings.runs import SweepError, expand_runs, run_schema

SCHEMA = run_schema(
    yaml.safe_load((Path(__file__).parents[1] / "workflow/schemas/config.schema.yaml").read_text())
)
DEFAULTS = {"model": "resnet50", "nodes": 1, "precision": "fp32", "lr": 0.1}


def names(config):
    return [run["name"] for run in expand_runs(config, SCHEMA)]


def test_grid_is_the_product_in_written_order():
    config = {
        "train_defaults": DEFAULTS,
        "sweep": [
            {
                "name": "{model}-n{nodes}-{precision}",
                "grid": {"nodes": [1, 2, 4, 8], "precision": ["fp32", "bf16"]},
            }
        ],
    }
    runs = expand_runs(config, SCHEMA)
    assert [r["name"] for r in runs] == [
        f"resnet50-n{n}-{p}" for n in (1, 2, 4, 8) for p in ("fp32", "bf16")
    ]
    assert runs[5] == {"name": "resnet50-n4-bf16", "nodes": 4, "precision": "bf16"}


def test_zip_walks_lists_together_and_combines_with_grid_and_settings():
    config = {
        "train_defaults": DEFAULTS,
        "sweep": [
            {
                "name": "lr{lr}-b{batch_size}-{precision}",
                "settings": {"epochs": 90, "model": "resnet18"},
                "zip": {"lr": [0.1, 0.2, 0.4], "batch_size": [256, 512, 1024]},
                "grid": {"precision": ["bf16"]},
            }
        ],
    }
    runs = expand_runs(config, SCHEMA)
    assert [r["name"] for r in runs] == ["lr0.1-b256-bf16", "lr0.2-b512-bf16", "lr0.4-b1024-bf16"]
    assert runs[2] == {
        "name": "lr0.4-b1024-bf16",
        "epochs": 90,
        "model": "resnet18",
        "precision": "bf16",
        "lr": 0.4,
        "batch_size": 1024,
    }


def test_names_are_stable_when_an_axis_grows_or_is_reordered():
    base = {"name": "{model}-n{nodes}", "grid": {"nodes": [1, 2]}}
    grown = {"name": "{model}-n{nodes}", "grid": {"nodes": [8, 2, 1, 4]}}
    before = names({"train_defaults": DEFAULTS, "sweep": [base]})
    after = names({"train_defaults": DEFAULTS, "sweep": [grown]})
    assert set(before) <= set(after)
    assert expand_runs({"train_defaults": DEFAULTS, "sweep": [base]}, SCHEMA)[1] == next(
        r
        for r in expand_runs({"train_defaults": DEFAULTS, "sweep": [grown]}, SCHEMA)
        if r["name"] == "resnet50-n2"
    )


def test_values_are_spelled_as_in_yaml():
    config = {
        "train_defaults": DEFAULTS,
        "sweep": [{"name": "cl-{channels_last}-wd{weight_decay}", "grid": {
            "channels_last": [True, False], "weight_decay": [1.0, 5.0e-5]}}],
    }  # fmt: skip
    assert names(config) == ["cl-true-wd1", "cl-true-wd5e-05", "cl-false-wd1", "cl-false-wd5e-05"]


def test_sweeps_mix_with_hand_written_runs():
    config = {
        "train_defaults": DEFAULTS,
        "runs": [{"name": "baseline", "lr": 0.05}],
        "sweep": [{"name": "r50-n{nodes}", "grid": {"nodes": [1, 2]}}],
    }
    assert names(config) == ["baseline", "r50-n1", "r50-n2"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (  # an axis missing from the template
            {"sweep": [{"name": "{model}", "grid": {"precision": ["fp32", "bf16"]}}]},
            "run name 'resnet50' is produced twice: by sweep[0] (precision=fp32) and by "
            "sweep[0] (precision=bf16)",
        ),
        (  # a sweep and a hand-written run
            {
                "runs": [{"name": "resnet50-n2"}],
                "sweep": [{"name": "{model}-n{nodes}", "grid": {"nodes": [1, 2]}}],
            },
            "run name 'resnet50-n2' is produced twice: by runs (hand-written) and by "
            "sweep[0] (nodes=2)",
        ),
        (  # two sweeps
            {
                "sweep": [
                    {"name": "a-n{nodes}", "grid": {"nodes": [1]}},
                    {"name": "a-n{nodes}", "zip": {"nodes": [1]}},
                ]
            },
            "'a-n1' is produced twice: by sweep[0] (nodes=1) and by sweep[1] (nodes=1)",
        ),
    ],
)
def test_collisions_are_a_clear_error(config, message):
    with pytest.raises(SweepError, match="every run needs a unique name") as error:
        expand_runs({"train_defaults": DEFAULTS, **config}, SCHEMA)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        (
            {"name": "x {nodes}", "grid": {"nodes": [1]}},
            "sweep[0] (name 'x {nodes}'): run 'x 1' (nodes=1): name 'x 1': does not match",
        ),
        (
            {"name": "r-{lrr}", "grid": {"lr": [0.1]}},
            "name template uses {lrr}, which is not a setting of the run",
        ),
        (
            {"name": "r-{lr}", "grid": {"lrr": [0.1]}},
            "run 'r-0.1' (lrr=0.1): unknown key(s) ('lrr' was unexpected); did you mean lr?",
        ),
        (
            {"name": "r-{nodes}", "grid": {"nodes": [0]}},
            "run 'r-0' (nodes=0): nodes 0: is less than the minimum of 1; use a value >= 1",
        ),
        (
            {"name": "r-{lr}-{seed}", "zip": {"lr": [0.1, 0.2], "seed": [0]}},
            "zip lists must have equal lengths, got lr=2, seed=1",
        ),
        (
            {"name": "r-{lr}", "grid": {"lr": [0.1]}, "zip": {"lr": [0.2]}},
            "lr under both grid and zip",
        ),
    ],
)
def test_expanded_runs_are_validated_like_hand_written_ones(sweep, message):
    with pytest.raises(SweepError) as error:
        expand_runs({"train_defaults": DEFAULTS, "sweep": [sweep]}, SCHEMA)
    assert str(error.value).startswith("config.yaml: ")
    assert message in str(error.value)


def test_dry_run_lists_every_expanded_run_with_its_resources(tmp_path):
    from tests.workflow_helpers import copy_workflow, read_config, snakemake, write_config

    workdir = copy_workflow(tmp_path / "w")
    config = read_config(workdir)
    config["runs"] = [{"name": "hand", "tasks_per_node": 1}]
    config["sweep"] = [
        {"name": "{model}-n{nodes}x{tasks_per_node}", "grid": {"nodes": [1, 2],
         "tasks_per_node": [1, 2]}},
        # The GPU type is an axis like any other: gres gpu:<type>:<n> of train and evaluate.
        # (A GPU run needs loader workers: run_checks._loader_workers_problem.)
        {"name": "{model}-{gpu_type}",
         "settings": {"gpus_per_node": 2, "tasks_per_node": 2, "workers": 2},
         "grid": {"gpu_type": ["a100", "h100"]}},
    ]  # fmt: skip
    write_config(workdir, config)
    text = snakemake(workdir, "-n", "--profile", "profiles/local").stdout
    blocks = text.split("\n\n")
    for name, nodes, per_node in [("resnet18-n1x1", 1, 1), ("resnet18-n2x2", 2, 2), ("hand", 1, 1)]:
        [block] = [b for b in blocks if "rule train:" in b and f"wildcards: run={name}\n" in b]
        assert f"nodes={nodes}" in block and "cpus_per_task=1" in block, block
        assert "gres=" not in block, block  # no GPUs
        if nodes * per_node > 1:
            assert "mpi=srun" in block, block
    for gpu_type in ("a100", "h100"):
        blocks = [b.split("\n\n", 1)[0] for b in text.split(f"run=resnet18-{gpu_type}\n")[1:]]
        gpu = [b for b in blocks if "gres=" in b]  # train, evaluate; not its check, accounting
        assert len(blocks) == 4 and len(gpu) == 2, blocks
        assert all(f"gres=gpu:{gpu_type}:2," in b for b in gpu), blocks
    assert text.count("rule train:") == 7

    config["sweep"][0]["name"] = "{model}-n{nodes}"  # tasks_per_node missing: collision
    write_config(workdir, config)
    result = snakemake(workdir, "-n", "--profile", "profiles/local", check=False)
    assert result.returncode != 0
    assert "run name 'resnet18-n1' is produced twice" in result.stdout + result.stderr


# Runs argv under a subreaper (PR_SET_CHILD_SUBREAPER) that reaps only argv's process: the
# orphans of a Snakemake killed with its jobs stay zombies, as under an init that never reaps.
KEEP_ZOMBIES = (
    "import ctypes, subprocess, sys, time; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "
    "subprocess.Popen(sys.argv[1:], start_new_session=True).wait(); time.sleep(3600)"
)


def open_second_rung_entries(results: Path) -> list[dict]:
    """The attempt entries that train a run on from epoch 1 and are not closed."""
    import json

    found = []
    for record in results.glob("checkpoints/*/attempts.json"):
        with contextlib.suppress(ValueError):  # written by rename: whole, or not yet there
            entries = json.loads(record.read_text())["attempts"]
            found += [e for e in entries if e["ended"] is None and e["start"]["epoch"] >= 1]
    return found


def _status(pid: int) -> str:
    """psutil's status; "gone" where it reads none: also, for a moment, a dying process's (its
    /proc files go before it is a zombie, psutil issue 2418: seen here once, a pid that only the
    keeper, which reaps none, could have reaped)."""
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


@pytest.mark.e2e
def test_pruned_sweep_trains_by_rungs_and_its_survivor_equals_the_run_alone(tmp_path):
    """4 runs, eta 2, min_epochs 1, epochs 3 (the tiny demo): 4 train to epoch 1, 2 to epoch
    2, 1 to the end; the table marks the pruned; the survivor's model is bitwise the one the
    same settings train alone; then nothing is planned."""
    import json

    import torch

    from tests.workflow_helpers import (
        SNAKEMAKE,
        copy_workflow,
        planned_jobs,
        read_config,
        snakemake,
        write_config,
    )

    workdir = copy_workflow(tmp_path / "w")
    config = read_config(workdir)
    del config["runs"]
    config["sweep"] = [{"name": "r{lr}", "settings": {"tasks_per_node": 1},
                        "zip": {"lr": [0.05, 0.1, 0.2, 0.4], "weight_decay": [1e-4] * 4},
                        "prune": {"eta": 2, "min_epochs": 1}}]  # fmt: skip
    write_config(workdir, config)
    dry = snakemake(workdir, "-n", "--profile", "profiles/local")
    assert "4 to epoch 1, 2 to epoch 2, 1 to epoch 3" in dry.stderr
    assert "7 run-epochs planned, 12 unpruned" in dry.stderr
    w = workdir / "results"
    # Snakemake killed (SIGKILL to its group, jobs included: a dying login node) once a
    # second-rung job has opened its attempt entry, then unlocked and started again: it
    # finishes at once, and no finished first-rung stage trains again. The killed job's entry
    # stays open, its heartbeat fresh, and its pid a zombie under an init that reaps no orphans
    # (CI's): Snakemake runs under a subreaper that never reaps them (KEEP_ZOMBIES).
    with open(tmp_path / "first.log", "w") as out:
        keeper = subprocess.Popen([sys.executable, "-c", KEEP_ZOMBIES, *SNAKEMAKE, "--profile",
                                   "profiles/local"], cwd=workdir, stdout=out,
                                  stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while not (first_run := psutil.Process(keeper.pid).children()):
            assert keeper.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        [first_run] = first_run
        while not (held := open_second_rung_entries(w)):
            log = (tmp_path / "first.log").read_text()
            assert first_run.is_running() and time.monotonic() < deadline, log[-4000:]
            time.sleep(0.5)
        os.killpg(first_run.pid, signal.SIGKILL)
        first_run.wait()
        stamps = {p: p.stat().st_mtime_ns for p in w.glob("runs/*/rungs/1/model.pt")}
        assert len(stamps) == 4 and (w / "sweeps/0/rung-1.json").is_file()
        pids = [int(entry["beat"].rsplit("-", 1)[1]) for entry in open_second_rung_entries(w)]
        assert pids and len(pids) >= len(held)
        settle = time.monotonic() + 60  # dying: a moment
        while not all(_status(pid) == psutil.STATUS_ZOMBIE for pid in pids):
            assert time.monotonic() < settle, f"SIGKILLed, not a zombie: {list(map(_status, pids))}"
            time.sleep(0.1)
        snakemake(workdir, "--unlock")
        snakemake(workdir, "--profile", "profiles/local")
    finally:
        keeper.kill()  # its zombies go to init
        keeper.wait()
    assert {p: p.stat().st_mtime_ns for p in w.glob("runs/*/rungs/1/model.pt")} == stamps
    first = json.loads((w / "sweeps/0/rung-1.json").read_text())
    second = json.loads((w / "sweeps/0/rung-2.json").read_text())
    assert len(first["survivors"]) == 2 and len(second["survivors"]) == 1
    assert set(second["survivors"]) <= set(first["survivors"])
    [survivor] = second["survivors"]
    trained = {p.parent.parent.name: p.name for p in w.glob("runs/*/rungs/*")}
    assert sorted(p.name for p in w.glob(f"runs/{survivor}/rungs/*")) == ["1", "2", "3"]
    assert sum(1 for _ in w.glob("runs/*/rungs/2")) == 2 and len(trained) == 4
    table = (w / "aggregate/runs.md").read_text()
    rows = {line.split()[1]: line for line in table.splitlines() if line.startswith("| r")}
    for epoch, decision in ((1, first), (2, second)):
        for name in decision["pruned"]:
            assert f"(pruned at epoch {epoch})" in rows[name], table
    assert "(pruned" not in rows[survivor]
    # The survivor's settings trained alone, to the end: the same model, bitwise.
    lr = float(survivor[1:])
    config["runs"] = [{"name": "alone", "tasks_per_node": 1, "lr": lr, "weight_decay": 1e-4}]
    write_config(workdir, config)
    snakemake(workdir, "--profile", "profiles/local", "results/runs/alone/model.pt")
    swept = torch.load(w / f"runs/{survivor}/model.pt", weights_only=True)["model"]
    alone = torch.load(w / "runs/alone/model.pt", weights_only=True)["model"]
    assert swept.keys() == alone.keys()
    assert all(torch.equal(swept[k], alone[k]) for k in swept)
    del config["runs"]
    write_config(workdir, config)
    assert planned_jobs(workdir, "--profile", "profiles/local") == {}

    # One run's setting changed (a zip value outside the name): that run's stages train again
    # from its first rung, the decisions are made again, and no stage of another run that
    # existed trains again.
    def stages():
        return {p: p.stat().st_mtime_ns for p in w.glob("runs/*/rungs/*/model.pt")}

    before, decided = stages(), (w / "sweeps/0/rung-1.json").stat().st_mtime_ns
    changed = first["pruned"][0]
    config["sweep"][0]["zip"]["weight_decay"][[f"r{x}" for x in config["sweep"][0]["zip"]["lr"]]
                                              .index(changed)] = 2e-4  # fmt: skip
    write_config(workdir, config)
    snakemake(workdir, "--profile", "profiles/local")
    after = stages()
    assert (
        after[w / f"runs/{changed}/rungs/1/model.pt"]
        != before[w / f"runs/{changed}/rungs/1/model.pt"]
    )
    assert (w / "sweeps/0/rung-1.json").stat().st_mtime_ns != decided
    others = {p: t for p, t in before.items() if p.parts[-4] != changed}
    assert {p: after[p] for p in others} == others
    assert planned_jobs(workdir, "--profile", "profiles/local") == {}
