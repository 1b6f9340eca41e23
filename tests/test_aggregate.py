"""The runs table: scaling efficiency only within groups of identical settings, on the
steady-state figure; baselines and lone runs say so instead of claiming 100 %."""

from __future__ import annotations

import json
import math
import os
import re
import time

import pandas as pd
import pytest

from imagenet_ddp.report.aggregate import (
    ACCURACY_NOTE,
    ALONE_NOTE,
    BASELINE_NOTE,
    BEST_NOTE,
    COLUMNS,
    LOSS_SPIKE_NOTE,
    SHORT_COLUMNS,
    STEADY_NOTE,
    aggregate_runs,
    group_labels,
    scaling_key,
    to_markdown,
    write_aggregate,
)
from tests.fake_runs import BASE_CONFIG, write_preflight, write_run_dir


def _table(tmp_path, runs: list[dict]) -> pd.DataFrame:
    dirs = [write_run_dir(tmp_path, **run) for run in runs]
    return aggregate_runs(dirs).set_index("run")


def test_different_precision_and_size_are_not_compared(tmp_path):
    """The issue's case: fp32 on 1 GPU against bf16 on 8 used to report > 100 %."""
    table = _table(
        tmp_path,
        [
            {"run": "r50-fp32-1x1", "nodes": 1, "tasks_per_node": 1, "steady_per_worker": 400.0,
             "model": "resnet50", "precision": "fp32"},
            {"run": "r50-bf16-1x8", "nodes": 1, "tasks_per_node": 8, "steady_per_worker": 1100.0,
             "model": "resnet50", "precision": "bf16"},
        ],
    )  # fmt: skip
    fp32, bf16 = table.loc["r50-fp32-1x1"], table.loc["r50-bf16-1x8"]
    assert fp32["scaling_group"] != bf16["scaling_group"]
    assert fp32["scaling_group"] == "resnet50 (precision=fp32)"
    assert bf16["scaling_group"] == "resnet50 (precision=bf16)"
    for row in (fp32, bf16):
        assert math.isnan(row["scaling_efficiency"])
        assert row["scaling_note"] == ALONE_NOTE
        assert pd.isna(row["scaling_baseline"])  # its own baseline: named by no other run


def test_group_efficiency_is_relative_to_smallest_run_on_steady_figure(tmp_path):
    # End-to-end figures deliberately tell another story (loader start-up in a short epoch).
    table = _table(
        tmp_path,
        [
            {"run": "r18-2x2", "nodes": 2, "tasks_per_node": 2, "steady_per_worker": 800.0,
             "per_worker": 300.0},
            {"run": "r18-1x1", "nodes": 1, "tasks_per_node": 1, "steady_per_worker": 1000.0,
             "per_worker": 600.0},
            {"run": "r18-1x2", "nodes": 1, "tasks_per_node": 2, "steady_per_worker": 950.0,
             "per_worker": 500.0},
        ],
    )  # fmt: skip
    assert table["scaling_group"].nunique() == 1
    assert table.loc["r18-1x1", "scaling_group"] == "resnet18"
    assert pd.isna(table.loc["r18-1x1", "scaling_baseline"])  # not itself
    assert (table["scaling_baseline"].drop("r18-1x1") == "r18-1x1").all()
    assert math.isnan(table.loc["r18-1x1", "scaling_efficiency"])
    assert table.loc["r18-1x1", "scaling_note"] == BASELINE_NOTE
    assert table.loc["r18-1x2", "scaling_efficiency"] == pytest.approx(0.95)
    assert table.loc["r18-2x2", "scaling_efficiency"] == pytest.approx(0.8)
    assert table.loc["r18-2x2", "scaling_note"] == "relative to r18-1x1"
    # Both figures are in the table, each under its own name.
    assert table.loc["r18-2x2", "steady_images_per_s"] == pytest.approx(3200.0)
    assert table.loc["r18-2x2", "images_per_s_per_rank"] == pytest.approx(300.0)
    assert table.loc["r18-2x2", "throughput_warmup_steps"] == 20


def test_table_columns_and_order(tmp_path):
    dirs = [
        write_run_dir(tmp_path, "b-1x2", nodes=1, tasks_per_node=2, steady_per_worker=90.0),
        write_run_dir(tmp_path, "a-1x1", nodes=1, tasks_per_node=1, steady_per_worker=100.0),
        write_run_dir(tmp_path, "c-1x1", nodes=1, tasks_per_node=1, steady_per_worker=50.0, lr=0.2),
    ]
    table = aggregate_runs(dirs)
    # COLUMNS, then every setting of the runs not among them, by name (runs.csv: all of them)
    settings = sorted(k for k in {**BASE_CONFIG, "nodes": 1, "tasks_per_node": 1,
                                  "gpus_per_node": 1} if k not in COLUMNS)  # fmt: skip
    assert list(table.columns) == COLUMNS + settings
    assert {"momentum", "weight_decay", "seed", "workers"} <= set(settings)
    assert list(table["lr"]) == [0.1, 0.1, 0.2]
    assert list(table["run"]) == ["a-1x1", "b-1x2", "c-1x1"]  # by group, then world size
    assert list(table["scaling_group"]) == ["resnet18 (lr=0.1)"] * 2 + ["resnet18 (lr=0.2)"]


def test_equal_workers_tie_breaks_by_run_name(tmp_path):
    table = _table(
        tmp_path,
        [
            {"run": "r18-2x1", "nodes": 2, "tasks_per_node": 1, "steady_per_worker": 700.0},
            {"run": "r18-1x2", "nodes": 1, "tasks_per_node": 2, "steady_per_worker": 1000.0},
        ],
    )
    assert table["scaling_baseline"].fillna("itself").to_dict() == {
        "r18-1x2": "itself",
        "r18-2x1": "r18-1x2",
    }
    assert table.loc["r18-1x2", "scaling_note"] == BASELINE_NOTE
    assert table.loc["r18-2x1", "scaling_efficiency"] == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("setting", "value", "same_group"),
    [
        ("log_interval", 100, True),
        ("timeout_minutes", 5.0, True),
        ("keep_checkpoints", 1, True),
        ("extra", {"note": "rerun"}, True),
        ("warmup_epochs", 0, True),  # 0 and 0.0 are the same setting
        ("lr", 0.2, False),
        ("seed", 1, False),
        ("epochs", 9, False),
        ("batch_size", 128, False),
        ("workers", 3, False),
        ("cpus_per_task", 4, False),
        ("gpus_per_node", 8, False),  # 2 GPUs per rank instead of 1
        ("gpu_type", "h100", False),  # an A100 run is never the baseline of an H100 run
        ("gpu_type", "", True),  # unset (files from before) is "": any type
        ("synthetic", True, False),
        ("channels_last", False, False),
        ("compile", True, False),
        ("crop_size", 160, False),
        ("throughput_warmup_steps", 50, False),
    ],
)
def test_which_settings_split_groups(tmp_path, setting, value, same_group):
    table = _table(
        tmp_path,
        [
            {"run": "small", "nodes": 1, "tasks_per_node": 1, "steady_per_worker": 100.0},
            {"run": "large", "nodes": 2, "tasks_per_node": 4, "steady_per_worker": 90.0,
             setting: value},
        ],
    )  # fmt: skip
    assert (table.loc["small", "scaling_group"] == table.loc["large", "scaling_group"]) is (
        same_group
    )
    if same_group:
        assert table.loc["large", "scaling_efficiency"] == pytest.approx(0.9)
    else:  # the label names what differs; GPUs are counted per rank
        label = table.loc["large", "scaling_group"]
        assert setting.replace("gpus_per_node", "gpus_per_rank") in label
        assert table["scaling_efficiency"].isna().all()
        assert (table["scaling_note"] == ALONE_NOTE).all()


def test_each_gpu_type_scales_against_its_own_baseline(tmp_path):
    table = _table(
        tmp_path,
        [
            {"run": f"{t}-{n}x{k}", "nodes": n, "tasks_per_node": k, "gpu_type": t,
             "steady_per_worker": speed * (1.0 if n == 1 else 0.9)}
            for t, speed in (("a100", 100.0), ("h100", 250.0)) for n, k in ((1, 1), (2, 4))
        ],
    )  # fmt: skip
    assert list(table["gpu_type"]) == ["a100", "a100", "h100", "h100"]
    assert table.loc["a100-2x4", "scaling_baseline"] == "a100-1x1"
    assert table.loc["h100-2x4", "scaling_baseline"] == "h100-1x1"
    assert table.loc["h100-2x4", "scaling_group"] == "resnet18 (gpu_type=h100)"
    assert table.loc[["a100-2x4", "h100-2x4"], "scaling_efficiency"].tolist() == pytest.approx(
        [0.9, 0.9]
    )


def test_older_metrics_without_steady_figure_read_as_nan(tmp_path):
    table = _table(
        tmp_path,
        [
            {"run": "old-1x1", "nodes": 1, "tasks_per_node": 1, "steady_per_worker": 100.0,
             "legacy": True},
            {"run": "old-1x2", "nodes": 1, "tasks_per_node": 2, "steady_per_worker": 90.0,
             "legacy": True},
            {"run": "new-1x1", "nodes": 1, "tasks_per_node": 1, "steady_per_worker": 100.0},
        ],
    )  # fmt: skip
    old = table.loc["old-1x2"]
    assert math.isnan(old["steady_images_per_s"]) and pd.isna(old["throughput_warmup_steps"])
    assert old[["data_wait_ms", "input_bound_pct", "mfu_pct"]].isna().all()  # no breakdown yet
    assert table.loc["new-1x1", "mfu_pct"] == pytest.approx(31.5)
    assert old["images_per_s_per_rank"] == pytest.approx(81.0)
    # Never silently replaced by the end-to-end figure.
    assert math.isnan(old["scaling_efficiency"])
    assert (
        old["scaling_note"] == "relative to old-1x1; no steady-state throughput in old-1x2, old-1x1"
    )
    assert old["scaling_group"] == table.loc["old-1x1", "scaling_group"]
    # Settings recorded differently (no geometry, no warm-up steps): not the same group.
    assert table.loc["new-1x1", "scaling_group"] != old["scaling_group"]
    assert table.loc["new-1x1", "scaling_note"] == ALONE_NOTE


def test_group_labels_are_unique_and_name_what_differs():
    keys = [
        scaling_key({**BASE_CONFIG, "precision": "fp32"}),
        scaling_key({**BASE_CONFIG, "precision": "bf16", "batch_size": 128}),
        scaling_key({**BASE_CONFIG, "model": "resnet50"}),
        scaling_key({**BASE_CONFIG, "seed": "1"}),
        scaling_key({**BASE_CONFIG, "seed": 1}),
    ]
    labels = group_labels(keys)
    assert len(set(labels.values())) == len(keys)
    assert labels[keys[0]] == "resnet18 (batch_size=256, precision=fp32, seed=0)"
    assert labels[keys[2]] == "resnet50"  # the only resnet50 group needs no qualifier
    assert labels[keys[3]].startswith("resnet18 (batch_size=256, precision=bf16, seed=1) #")


def test_geometry_and_bookkeeping_do_not_enter_the_key():
    key = json.loads(
        scaling_key(
            {**BASE_CONFIG, "run": "x", "nodes": 2, "tasks_per_node": 8, "gpus_per_node": 8}
        )
    )
    for name in ("run", "nodes", "tasks_per_node", "log_interval", "timeout_minutes", "extra"):
        assert name not in key
    assert key["cpus_per_task"] == 8 and key["gpus_per_rank"] == 1 and key["workers"] == 7
    assert "gpus_per_node" not in key


def test_a_run_recorded_before_a_setting_existed_joins_the_same_runs_group():
    """A newer version records settings an earlier one did not (model_kwargs, accumulation,
    warmup_steps, ...): at their x-earlier value the two runs are one scaling group; at another
    value they are not."""
    old = dict(BASE_CONFIG)
    for key in ("model_kwargs", "optimizer_kwargs", "accumulation", "warmup_steps"):
        old.pop(key, None)
    new = {**old, "model_kwargs": {}, "optimizer_kwargs": {}, "accumulation": 1, "warmup_steps": 0}
    assert scaling_key(old) == scaling_key(new)
    assert scaling_key({**new, "model_kwargs": {"drop_path_rate": 0.1}}) != scaling_key(old)


def test_one_gpu_and_one_full_node_of_gpus_are_one_group():
    one = scaling_key({**BASE_CONFIG, "nodes": 1, "tasks_per_node": 1, "gpus_per_node": 1})
    node = scaling_key({**BASE_CONFIG, "nodes": 1, "tasks_per_node": 8, "gpus_per_node": 8})
    two = scaling_key({**BASE_CONFIG, "nodes": 2, "tasks_per_node": 8, "gpus_per_node": 8})
    shared = scaling_key({**BASE_CONFIG, "nodes": 1, "tasks_per_node": 8, "gpus_per_node": 4})
    assert one == node == two != shared


def test_markdown_leaves_missing_figures_empty(tmp_path):
    dirs = [
        write_run_dir(tmp_path, "a-1x1", nodes=1, tasks_per_node=1, steady_per_worker=100.0),
        write_run_dir(tmp_path, "a-1x2", nodes=1, tasks_per_node=2, steady_per_worker=95.0),
    ]
    text = to_markdown(aggregate_runs(dirs))
    assert "nan" not in text.lower()
    assert re.search(r"\|\s+baseline \|", text)
    assert re.search(r"\|\s+95\.0 % \|", text)


def test_markdown_is_the_short_table_and_the_csv_keeps_every_figure(tmp_path):
    """runs.md: the figures compared first, then one line saying where the rest is; runs.csv
    (which the HTML report embeds, workflow/rules/report.smk) keeps every column."""
    dirs = [
        write_run_dir(tmp_path, "a-1x1", nodes=1, tasks_per_node=1, steady_per_worker=100.0),
        write_run_dir(tmp_path, "a-2x2", nodes=2, tasks_per_node=2, steady_per_worker=90.0),
    ]
    metrics = json.loads((dirs[1] / "train_metrics.json").read_text())
    metrics["cost"] = {"allocations": 3, "gpu_hours": 2.5}  # resumed twice
    (dirs[1] / "train_metrics.json").write_text(json.dumps(metrics))
    csv, markdown = tmp_path / "runs.csv", tmp_path / "runs.md"
    write_aggregate(dirs, csv, markdown)
    text = markdown.read_text()
    table_text, best, columns, legend, note = text.split("\n\n")
    header, rule, *rows = table_text.splitlines()
    # lr_used differs (0.1 x 256 / 256 on 1 rank, x 4 on 4: lr_scaling), so lr stands beside it
    assert [cell.strip() for cell in header.strip("|").split("|")] == [
        "run", "lr", "lr_used", "model", "nodes x ranks", "GPUs", "global batch", "precision",
        "epochs",
        "img/s (steady)", "scaling eff.", "input-bound", "holdout top-1", "test top-1",
        "target top-1", "to target", "GPU-h", "wall h:mm:ss",
    ]  # fmt: skip
    # equal holdout top-1: the first by name is the best
    assert best == BEST_NOTE + "a-1x1" and rows[0].split("|")[1].strip() == "a-1x1 (best)"
    assert rows[0].split("|")[16].strip() == "no target (report.target_top1)"  # a ResNet-18
    lrs = [[c.strip() for c in row.split("|")[2:4]] for row in rows]
    assert lrs == [["0.1", "0.1"], ["0.1", "0.4"]]
    assert [row.split("|")[5].strip() for row in rows] == ["1 x 1", "2 x 2"]
    assert [row.split("|")[12].strip() for row in rows] == ["2 %", "2 %"]  # input-bound
    assert "runs.csv" in note and "report" in note
    # a line under the table for every column: what it is, includes, and why empty or 0
    assert columns == "Columns:" and [line.split(": ")[0] for line in legend.splitlines()] == [
        "- run",
        "- settings that differ",
        *(f"- {heading}" for heading, *_ in SHORT_COLUMNS[1:]),
    ]
    for words in (
        "0: on CPU",
        "empty for a group's only run",
        "a few % means the loader keeps",
        "warm-up, holdout evaluation, checkpoints and lost work included",
        "0: no GPU allocated (a CPU run)",
        "each epoch's first throughput_warmup_steps",
    ):
        assert words in legend, words  # fmt: skip
    written = pd.read_csv(csv)
    assert list(written.columns)[: len(COLUMNS)] == COLUMNS and "momentum" in written.columns
    # counts as integers, and no run named as its own baseline
    cells = pd.read_csv(csv, dtype=str, keep_default_na=False)  # as written
    assert cells["allocations"].tolist() == ["", "3"] and cells["gpus"].tolist() == ["1", "4"]
    assert written["scaling_baseline"].tolist()[0] != "a-1x1"
    assert (
        pd.isna(written.loc[0, "scaling_baseline"])
        and written.loc[1, "scaling_baseline"] == "a-1x1"
    )


def test_ema_accuracy_and_the_published_figure_it_compares_with(tmp_path):
    """A v2-recipe run's published top-1 is its EMA model's: the table names test_top1_ema
    as the column to compare; a run without a preset or EMA leaves all of it empty."""
    v2 = write_run_dir(tmp_path, "v2", nodes=2, tasks_per_node=8, steady_per_worker=2000.0,
                       recipe="torchvision-resnet50-v2")  # fmt: skip
    v1 = write_run_dir(tmp_path, "v1", nodes=1, tasks_per_node=8, steady_per_worker=2000.0,
                       recipe="torchvision-resnet50-v1")  # fmt: skip
    plain = write_run_dir(tmp_path, "plain", nodes=1, tasks_per_node=1, steady_per_worker=9.0)
    evaluation = json.loads((v2 / "eval.json").read_text())
    evaluation["ema"] = {
        "holdout": {"top1": 0.7, "top5": 0.9},
        "test": {"top1": 0.69, "top5": 0.88},
    }
    (v2 / "eval.json").write_text(json.dumps(evaluation))
    table = aggregate_runs([v2, v1, plain]).set_index("run")
    row = table.loc["v2"]
    assert (row["test_top1_ema"], row["holdout_top5_ema"]) == (0.69, 0.9)
    assert row["published_top1"] == pytest.approx(0.80858)
    assert row["published_compare_with"] == "test_top1_ema"
    assert table.loc["v1", "published_compare_with"] == "test_top1"
    assert table.loc["v1", "published_top1"] == pytest.approx(0.7613)
    assert math.isnan(table.loc["v1", "test_top1_ema"])
    assert pd.isna(table.loc["plain", "published_compare_with"])
    assert math.isnan(table.loc["plain", "published_top1"])
    assert "test_top1_ema" in COLUMNS and "published_top1" in COLUMNS  # runs.csv, the report


def test_an_elastic_run_lists_its_allocations_shapes_and_each_shapes_throughput(tmp_path):
    """A run resumed on fewer nodes (issue 28): the table says which allocation ran on which
    shape, and its throughput is per shape (the last job's), never an average across them."""
    run_dir = write_run_dir(tmp_path, "e", nodes=1, tasks_per_node=2, steady_per_worker=50.0)
    metrics = json.loads((run_dir / "train_metrics.json").read_text())
    metrics["shape"] = "1x2"
    metrics["throughput_by_shape"] = {
        "2x2": {"epochs": 3, "images_per_s": 380.0, "steady_images_per_s": 400.0},
        "1x2": {"epochs": 2, "images_per_s": 90.0, "steady_images_per_s": 100.0},
    }
    metrics["cost"] = {
        "attempts": [
            {"attempt": 1, "shape": "2x2"},
            {"attempt": 2, "shape": "1x2"},
            {"attempt": 3, "shape": "1x2"},
        ]  # fmt: skip
    }
    (run_dir / "train_metrics.json").write_text(json.dumps(metrics))
    table = aggregate_runs([run_dir])
    row = table.iloc[0]
    assert row["shape"] == "1x2" and row["allocation_shapes"] == "2x2: 1; 1x2: 2, 3"
    assert row["throughput_by_shape"] == (
        "2x2: 400 img/s steady, 380 end to end (3 epochs); "
        "1x2: 100 img/s steady, 90 end to end (2 epochs)"
    )
    assert row["steady_images_per_s"] == 100.0  # the last job's shape's (write_run_dir: 50 x 2)
    assert "| 1 x 2 (+ 2 x 2) |" in to_markdown(table)


def test_the_preflights_projected_breakdown_stands_beside_the_measured_one(tmp_path):
    """preflight_compute_ms and preflight_input_bound_pct beside the measured figures; a
    preflight.json from before the projected breakdown still aggregates (those two empty)."""
    from tests.test_preflight import ranks, report

    runs = ("new", "old", "none")
    dirs = [write_run_dir(tmp_path, f"{r}-1x1", nodes=1, tasks_per_node=1, steady_per_worker=100.0)
            for r in runs]  # fmt: skip
    projected = report(ranks(r2={"loader_images_per_s": 80.0}))  # 80 of 400 ms waits for data
    write_preflight(tmp_path, "new-1x1", projected)
    earlier = json.loads(json.dumps(projected))
    del earlier["projection"]["step_breakdown"]
    write_preflight(tmp_path, "old-1x1", earlier)
    table = aggregate_runs(dirs).set_index("run")
    new, old, none = (table.loc[f"{r}-1x1"] for r in runs)
    assert new["preflight_compute_ms"] == pytest.approx(320.0)  # 32 images at 100 img/s
    assert new["preflight_input_bound_pct"] == pytest.approx(20.0)
    assert (new["compute_ms"], new["input_bound_pct"]) == (80.0, 2.4)  # measured, beside it
    assert old["preflight_epoch_seconds"] == pytest.approx(400.0)  # the rest of it reads
    assert old[["preflight_compute_ms", "preflight_input_bound_pct"]].isna().all()
    assert none[[c for c in COLUMNS if "preflight" in c]].isna().all()
    at = COLUMNS.index("preflight_loader_over_model")
    assert COLUMNS[at + 1 : at + 3] == ["preflight_compute_ms", "preflight_input_bound_pct"]
    rows = to_markdown(aggregate_runs(dirs)).splitlines()[2:5]
    cells = {row.split("|")[1].strip().removesuffix(" (best)"): row.split("|")[10].strip()
             for row in rows}  # fmt: skip
    assert cells == {"new-1x1": "2 % (preflight 20 %)", "old-1x1": "2 %", "none-1x1": "2 %"}


def test_a_model_trained_by_another_package_version_is_flagged(tmp_path):
    """No code change reruns a finished training (issue 35): the table flags a run whose
    provenance records another package version than this one's; one that records none is
    unknown, never flagged."""
    from imagenet_ddp import __version__

    dirs = {
        name: write_run_dir(tmp_path, name, nodes=1, tasks_per_node=1, steady_per_worker=9.0)
        for name in ("same", "other", "older")
    }
    for name, version in (("same", __version__), ("other", "0.0.1"), ("older", None)):
        path = dirs[name] / "model.pt.provenance.json"
        provenance = json.loads(path.read_text())
        provenance["code"] = {} if version is None else {"package_version": version}
        path.write_text(json.dumps(provenance))
    csv, markdown = tmp_path / "runs.csv", tmp_path / "runs.md"
    write_aggregate(list(dirs.values()), csv, markdown)
    flags = pd.read_csv(csv).set_index("run")["trained_by_other_code"]
    assert flags["other"] == True and flags["same"] == False  # noqa: E712
    assert pd.isna(flags["older"])
    text = markdown.read_text()
    assert "| other †" in text and "| same " in text and "same †" not in text
    assert "† trained by another imagenet-ddp version than this one" in text
    assert ": other\n" in text


def test_a_diverged_run_is_marked_in_both_tables(tmp_path):
    dirs = [
        write_run_dir(tmp_path, "a-1x1", nodes=1, tasks_per_node=1, steady_per_worker=100.0),
        write_run_dir(tmp_path, "a-1x4", nodes=1, tasks_per_node=4, steady_per_worker=90.0),
    ]
    metrics = dirs[1] / "train_metrics.json"
    diverged = {"reason": "gradient norm nan", "epoch": 0, "step": 7, "loss": "nan", "lr": 0.05}
    metrics.write_text(json.dumps({**json.loads(metrics.read_text()), "diverged": diverged}))
    table = aggregate_runs(dirs).set_index("run")
    assert table.loc["a-1x1", "diverged"] == ""
    assert table.loc["a-1x4", "diverged"] == "epoch 0 step 7: gradient norm nan (loss nan, lr 0.05)"
    text = to_markdown(aggregate_runs(dirs))
    assert "| a-1x4 (diverged) " in text and "| a-1x1 " in text
    assert "stopped by the divergence guard" in text and "a-1x4: epoch 0 step 7" in text


def test_progress_shows_the_finished_runs_while_one_failed_and_one_still_trains(tmp_path):
    """`imagenet-ddp progress` (the `progress` rule): the finished runs' table needs no other
    run; a failed run is a row with its error, a run in training its epoch, throughput and
    ETA, a run not started says so."""
    from imagenet_ddp.cli import main
    from imagenet_ddp.jobs import attempts
    from imagenet_ddp.report.progress import PROGRESS
    from tests.workflow_helpers import run_settings

    write_run_dir(tmp_path, "a-1x1", nodes=1, tasks_per_node=1, steady_per_worker=100.0)
    write_run_dir(tmp_path, "b-1x2", nodes=1, tasks_per_node=2, steady_per_worker=90.0)
    runs = ["a-1x1", "b-1x2", "broken", "busy", "queued"]
    run_dirs = [tmp_path / "results/runs" / r for r in runs]
    roots = [tmp_path / "checkpoints" / r for r in runs]
    settings = run_settings(run="broken", nodes=1, tasks_per_node=1, cpus_per_task=1)
    entry, _ = attempts.begin(roots[2], settings, attempt=1, gpus=8, cores=64)
    attempts.record_error(roots[2], 0, "node1", RuntimeError("CUDA error: out of memory"))
    attempts.end(roots[2], entry, 1)
    busy_entry, _ = attempts.begin(roots[3], {**settings, "run": "busy"}, attempt=1, gpus=8,
                                   cores=64)  # fmt: skip
    # Started 3 hours ago, its heartbeat 2 minutes ago: the sign of life is the heartbeat's.
    record = attempts.load(roots[3])
    record[0]["started"] = time.time() - 3 * 3600
    (roots[3] / attempts.RECORD).write_text(json.dumps({"attempts": record}))
    beat = roots[3] / attempts.ALIVE_DIR / busy_entry["beat"]
    beat.parent.mkdir(parents=True, exist_ok=True)
    beat.touch()
    os.utime(beat, (time.time() - 120, time.time() - 120))
    busy = run_dirs[3]
    busy.mkdir(parents=True)
    (busy / "job_spec.json").write_text(json.dumps({"kind": "train", "run": {"epochs": 90}}))
    last = {"epoch": 9, "images_per_s": 21000.0, "epoch_seconds": 60.0, "eval_seconds": 5.0,
            "checkpoint_seconds": 1.0, "loss_spike": "loss spiked to 7.4 at epoch 0"}  # fmt: skip
    (busy / PROGRESS).write_text(json.dumps(last))
    out = tmp_path / "results/progress"
    argv = ["progress", "--runs", *runs, "--run-dirs", *map(str, run_dirs),
            "--checkpoint-roots", *map(str, roots), "--csv", str(out / "runs.csv"),
            "--markdown", str(out / "runs.md")]  # fmt: skip
    assert main(argv) == 0
    table = pd.read_csv(out / "runs.csv").set_index("run")
    assert table["state"].to_dict() == {
        "a-1x1": "finished", "b-1x2": "finished", "broken": "failed", "busy": "training",
        "queued": "not started",
    }  # fmt: skip
    assert table.loc["a-1x1", "test_top1"] == pytest.approx(0.58)
    assert "CUDA error: out of memory" in table.loc["broken", "note"]
    assert table.loc["busy", "epochs_done"] == 10 and table.loc["busy", "epochs"] == 90
    job = busy_entry["slurm_job_id"] or "local"
    assert table.loc["busy", "note"] == (
        f"job {job}, last sign of life 2 min ago; loss spiked to 7.4 at epoch 0"
    )
    assert table.loc["busy", "eta_hours"] == pytest.approx(80 * 66 / 3600)
    text = (out / "runs.md").read_text()
    assert "Finished: 2 of 5." in text and "| broken" in text and "10/90" in text


def test_a_loss_spike_far_above_chance_is_named_even_when_the_run_recovers(tmp_path):
    """Issue 42: 4 ranks, 10 classes, loss 7.4 after epoch 0 (ln 10 = 2.3), then recovered to
    60 % top-1 without the divergence guard firing: the table names the spike."""
    from imagenet_ddp.training.metrics import loss_spike

    chance = math.log(10)
    losses = [7.4, 3.1, 1.2, 0.9]
    epochs = [{"epoch": e, "train_loss": x, "chance_loss": chance} for e, x in enumerate(losses)]
    spike = "loss spiked to 7.4 at epoch 0 (chance 2.3; last epoch 0.9)"
    assert loss_spike(epochs) == spike
    assert loss_spike(epochs, factor=4.0) == ""  # the run's divergence_loss_factor
    assert loss_spike([{**e, "chance_loss": None} for e in epochs]) == ""  # not recorded
    assert loss_spike([{**e, "train_loss": 1.0} for e in epochs]) == ""  # trained as it should
    spiked = write_run_dir(tmp_path, "r4", nodes=1, tasks_per_node=4, steady_per_worker=90.0)
    metrics = json.loads((spiked / "train_metrics.json").read_text())
    (spiked / "train_metrics.json").write_text(json.dumps({**metrics, "epochs": epochs}))
    calm = write_run_dir(tmp_path, "r1", nodes=1, tasks_per_node=1, steady_per_worker=100.0)
    table = aggregate_runs([calm, spiked]).set_index("run")
    assert table["loss_spike"].to_dict() == {"r1": "", "r4": spike}
    text = to_markdown(table.reset_index())
    assert "| r4 (loss spike)" in text and "| r1 " in text
    assert LOSS_SPIKE_NOTE + f"r4: {spike}" in text


def _epochs(top1: list[float], *, images: int = 160, seconds: float = 100.0, **row) -> list:
    """history rows (train_metrics.json's epochs) of a 10-class run, holdout top-1 per epoch."""
    base = {"train_loss": 1.0, "train_top1": 0.5, "holdout_loss": 1.5, "chance_loss": math.log(10),
            "images": images, "epoch_seconds": seconds, "eval_seconds": 10.0,
            "checkpoint_seconds": 0.0}  # fmt: skip
    return [{**base, "epoch": e, "holdout_top1": t, **row} for e, t in enumerate(top1)]


def test_a_sweep_of_learning_rates_reads_which_run_is_best_and_why(tmp_path):
    """The issue's newcomer: three lr values, runs.md shows lr and lr_used as columns (the
    sweep's axes first), the best run marked, and the run at chance flagged with its cause."""
    dirs = [
        write_run_dir(tmp_path, f"lr{lr}", nodes=1, tasks_per_node=1, steady_per_worker=100.0,
                      lr=lr, holdout_top1=top1, warmup_epochs=float(i), batch_size=16,
                      history=_epochs([top1], train_top1=train, holdout_loss=loss, images=160))
        for i, (lr, top1, train, loss) in enumerate(
            [(0.1, 0.7, 0.8, 1.0), (0.4, 0.7, 0.9, 0.9), (1.6, 0.1, 0.9, 5.05)]
        )
    ]  # fmt: skip
    table = aggregate_runs(dirs).set_index("run")
    # ties by name: lr0.1 and lr0.4 both at 70 %
    assert table["best"].to_dict() == {"lr0.1": True, "lr0.4": False, "lr1.6": False}
    assert table.loc["lr1.6", "accuracy_flag"] == "at chance"
    note = table.loc["lr1.6", "accuracy_note"]
    assert "holdout top-1 10.0 %, chance 10.0 % (10 classes)" in note
    assert "holdout loss 5.05 against chance ln(10) = 2.30" in note
    assert "10 optimizer steps, too few for BatchNorm's running statistics" in note
    assert table.loc[["lr0.1", "lr0.4"], "accuracy_flag"].tolist() == ["", ""]
    assert table["lr_used"].tolist() == pytest.approx([0.1 / 16, 0.4 / 16, 1.6 / 16])
    text = to_markdown(aggregate_runs(dirs), axes=["warmup_epochs", "lr"])
    header, _, *rows = text.split("\n\n")[0].splitlines()
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[:4] == ["run", "warmup_epochs", "lr", "lr_used"]  # axes first, lr_used by lr
    assert cells[4] == "model"  # nothing else differs
    first = [c.strip() for c in rows[0].strip("|").split("|")]
    assert first[:4] == ["lr0.1 (best)", "0", "0.1", "0.00625"]
    assert [c.strip() for c in rows[2].strip("|").split("|")][0] == "lr1.6 (at chance)"
    assert ACCURACY_NOTE + "lr1.6: holdout top-1 10.0 %" in text
    assert BEST_NOTE + "lr0.1" in text


def test_a_high_holdout_loss_beside_a_high_train_accuracy_is_flagged(tmp_path):
    run = write_run_dir(tmp_path, "r", nodes=1, tasks_per_node=1, steady_per_worker=100.0,
                        holdout_top1=0.4, batch_size=16,
                        history=_epochs([0.4] * 8, train_top1=0.95, holdout_loss=5.0))  # fmt: skip
    row = aggregate_runs([run]).iloc[0]
    assert row["accuracy_flag"] == "holdout loss high"
    assert "evaluation unlike training" in row["accuracy_note"]  # 80 steps: enough for BN
    assert not row["best"]  # a table of one run names no best


def test_an_empty_steady_figure_says_why(tmp_path):
    """5 steps an epoch against throughput_warmup_steps 5: not "trained before it was
    measured" (the issue's demo run); an old file without the window still reads so."""
    short = write_run_dir(tmp_path, "short", nodes=1, tasks_per_node=1, steady_per_worker=None,
                          per_worker=90.0, throughput_warmup_steps=5, batch_size=16,
                          history=_epochs([0.5], images=80))  # fmt: skip
    old = write_run_dir(tmp_path, "old", nodes=1, tasks_per_node=1, steady_per_worker=None,
                        per_worker=90.0, legacy=True)  # fmt: skip
    table = aggregate_runs([short, old]).set_index("run")
    assert table.loc["short", "steady_note"] == "5 steps per epoch <= throughput_warmup_steps 5"
    assert table.loc["old", "steady_note"] == "trained before it was measured"
    text = to_markdown(aggregate_runs([short, old]))
    assert (
        STEADY_NOTE + "short: 5 steps per epoch <= throughput_warmup_steps 5; old: trained" in text
    )
    assert "empty: trained before it was measured" not in text


def test_time_and_gpu_hours_to_the_target_over_every_allocation(tmp_path):
    """Epoch 2 (0-based) reaches 50 %: epochs 0-2 ran in two allocations, the first stopped
    after its checkpoint at epoch 2 with 60 s lost; the second resumed and ran epochs 2-4."""
    history = _epochs([0.2, 0.4, 0.55, 0.6, 0.7], seconds=100.0)  # 110 s an epoch with eval
    attempts = [
        {"attempt": 1, "wall_seconds": 300.0, "gpu_hours": 8 * 300 / 3600, "lost_seconds": 60.0,
         "last_checkpoint": {"epoch": 2, "step": 0}, "start": {"epoch": 0, "step": 0}},
        {"attempt": 2, "wall_seconds": 400.0, "gpu_hours": 4 * 400 / 3600, "lost_seconds": 0.0,
         "last_checkpoint": {"epoch": 5, "step": 0}, "start": {"epoch": 2, "step": 0}},
    ]  # fmt: skip
    run = write_run_dir(tmp_path, "r50", nodes=1, tasks_per_node=1, steady_per_worker=100.0,
                        model="resnet50", history=history,
                        cost={"allocations": 2, "gpu_hours": 8 * 300 / 3600 + 4 * 400 / 3600,
                              "attempts": attempts})  # fmt: skip
    preset = write_run_dir(tmp_path, "a3", nodes=1, tasks_per_node=1, steady_per_worker=100.0,
                           recipe="timm-resnet50-a3", history=history)  # fmt: skip
    row = aggregate_runs([run], {"r50": 50.0}).iloc[0]
    assert (row["target_top1"], row["target_source"], row["target_epochs"]) == (0.5, "set", 3)
    # the first allocation whole, the second less its epochs 3 and 4 (220 s)
    assert row["target_wall_seconds"] == pytest.approx(300 + 180)
    assert row["target_gpu_hours"] == pytest.approx((8 * 300 + 4 * 180) / 3600)
    default = aggregate_runs([run]).iloc[0]  # a ResNet-50 without a target: MLPerf's
    assert (default["target_top1"], default["target_source"]) == (0.759, "MLPerf ResNet-50")
    assert default["target_note"] == "not reached in 5 epochs (best 70.0 %)"
    table = aggregate_runs([run, preset], {"r50": 50.0}).set_index("run")
    assert table.loc["a3", "target_top1"] == pytest.approx(0.781)  # its published figure
    assert table.loc["a3", "target_source"] == "published (timm-resnet50-a3)"
    text = to_markdown(table.reset_index())
    assert re.search(r"\| +50\.0 % \(set\) \| +3 ep, 0:08:00, 0\.867 GPU-h \|", text)
    assert re.search(
        r"\| +78\.1 % \(published\) \| +not reached in 5 epochs \(best 70\.0 %\)", text
    )


def test_write_aggregate_takes_the_report_settings(tmp_path):
    run = write_run_dir(tmp_path, "r", nodes=1, tasks_per_node=1, steady_per_worker=100.0,
                        history=_epochs([0.6]))  # fmt: skip
    csv, markdown = tmp_path / "runs.csv", tmp_path / "runs.md"
    write_aggregate([run], csv, markdown, '{"axes": [], "target_top1": {"r": 55}}')
    written = pd.read_csv(csv)
    assert written.loc[0, "target_epochs"] == 1
    assert "1 ep (no attempt record: time and GPU-hours unknown)" in markdown.read_text()
