"""End to end: the demo as a new user runs it (the repository's config.yaml unchanged), then
`snakemake --report` with the figures."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from imagenet_ddp.report.aggregate import COLUMNS, SHORT_COLUMNS
from tests.workflow_helpers import REPO, copy_workflow, planned_jobs, snakemake

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = [
    "results/plots/throughput.png",
    "results/plots/scaling_efficiency.png",
    "results/plots/training_curves.png",
    "results/plots/per_class_test_top1.png",
    "results/plots/cost.png",
    "results/plots/holdout_vs_gpu_hours.png",
]


@pytest.fixture(scope="module")
def reported_run(module_tmp):
    workdir = copy_workflow(module_tmp / "report-e2e", as_shipped=True)
    snakemake(workdir, "--profile", "profiles/local")
    snakemake(workdir, "--report", "report.html")
    return workdir


def test_figures_are_written(reported_run):
    for path in FIGURES:
        data = (reported_run / path).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, path
    assert (reported_run / "logs/plots.log").is_file()


def test_report_holds_figures_table_captions_and_description(reported_run):
    html = (reported_run / "report.html").read_text()
    for category in ("Throughput", "Accuracy", "Training curves", "Tables", "Cost"):
        assert category in html, category
    for name in (
        "throughput.png",
        "scaling_efficiency.png",
        "training_curves.png",
        "per_class_test_top1.png",
        "cost.png",
        "holdout_vs_gpu_hours.png",
        "runs.csv",
    ):
        assert name in html, name
    # One distinctive phrase from each caption and from the workflow description.
    for phrase in (
        "ideal linear scaling",
        "perfect linear scaling",
        "holdout loss measured at the end of the epoch",
        "Spread of top-1 accuracy over classes",
        "All runs in one table",
        "Up and to the left is better",
        "DistributedDataParallel",
    ):
        assert phrase in html, phrase


def test_the_demos_runs_reach_comparable_accuracy(reported_run):
    """The 2-rank run takes half the steps of the 1-rank one: with the demo's warm-up and LR
    scaling both still learn (a gap here reads as "DDP breaks accuracy")."""
    table = pd.read_csv(reported_run / "results/aggregate/runs.csv").set_index("run")
    top1 = table["holdout_top1"]
    assert sorted(table["world_size"]) == [1, 2]
    assert top1.max() - top1.min() <= 0.10 and top1.min() >= 0.5, top1.to_dict()


def test_runs_md_is_the_short_table_and_the_csv_every_figure(reported_run):
    """As a newcomer reads it: the demo's two runs differ in ranks, so in lr_used (linear
    scaling) beside lr; one is marked best; each reached config.yaml's report.target_top1 50 %
    at an epoch, with the allocations' time to it (0 GPU-hours: on CPU)."""
    text = (reported_run / "results/aggregate/runs.md").read_text()
    header, _, *lines = text.splitlines()
    headings = [cell.strip() for cell in header.strip("|").split("|")]
    assert headings == [
        "run", "lr", "lr_used", *(heading for heading, *_ in SHORT_COLUMNS[1:])
    ]  # fmt: skip
    rows = [dict(zip(headings, (c.strip() for c in line.strip("|").split("|")), strict=True))
            for line in lines[:2]]  # fmt: skip
    assert {r["lr_used"] for r in rows} == {"0.025", "0.0125"} and {r["lr"] for r in rows} == {
        "0.2"
    }
    assert sum(r["run"].endswith(" (best)") for r in rows) == 1
    assert not any("at chance" in r["run"] or "holdout loss high" in r["run"] for r in rows)
    assert {r["target top-1"] for r in rows} == {"50.0 % (set)"}
    for r in rows:
        assert re.fullmatch(r"[1-4] ep, 0:\d\d:\d\d, 0 GPU-h", r["to target"]), r
    assert "runs.csv" in lines[-1]
    table = pd.read_csv(reported_run / "results/aggregate/runs.csv")
    assert list(table.columns)[: len(COLUMNS)] == COLUMNS
    assert {"optimizer", "momentum", "lr_scaling", "warmup_epochs"} <= set(table.columns)
    reached = table["target_wall_seconds"]
    assert (table["target_epochs"].between(1, 4)).all() and (reached > 0).all()
    assert (reached <= table["wall_seconds"] + 1).all()  # one allocation each: within its time
    assert (table["target_gpu_hours"] == 0).all() and table["steady_note"].isna().all()


def test_every_caption_file_is_used():
    rules = (REPO / "workflow/rules/report.smk").read_text()
    captions = sorted(p.name for p in (REPO / "workflow/report").glob("*.rst"))
    for name in captions:
        assert f"../report/{name}" in rules, name


def test_figures_are_identical_when_redrawn(reported_run):
    before = {path: (reported_run / path).read_bytes() for path in FIGURES}
    snakemake(
        reported_run, "--profile", "profiles/local", "--forcerun", "plots", "--until", "plots"
    )
    for path in FIGURES:
        assert (reported_run / path).read_bytes() == before[path], path
    assert planned_jobs(reported_run, "--profile", "profiles/local") == {}
