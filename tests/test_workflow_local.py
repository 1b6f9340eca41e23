"""End to end: the real `snakemake --profile profiles/local` on the demo data.

One full run (module fixture), then assertions on every artifact and on Snakemake's rerun
decisions: a no-op rerun, a changed lr, a changed split seed.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from imagenet_ddp.data.prepared_layout import resolve_prepared
from imagenet_ddp.jobs.plan import CHECK_FIRST
from tests.workflow_helpers import (
    REPO,
    SNAKEMAKE,
    planned_jobs,
    read_config,
    shown_specs,
    snakemake,
    write_config,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def local_run(module_tmp):
    from tests.workflow_helpers import copy_workflow

    workdir = copy_workflow(module_tmp / "local-e2e")
    config = read_config(workdir)
    config["train_defaults"]["preflight"] = True  # every run trains after its preflight
    write_config(workdir, config)
    snakemake(workdir, "--profile", "profiles/local")
    return workdir


def test_every_stage_artifact_exists_with_provenance(local_run):
    w = local_run
    for path in [
        "resources/demo/ILSVRC2012/ILSVRC2012_img_train.tar",
        "results/verify/report.json",
        "results/verify/report.json.provenance.json",
        "results/index/classes.csv",
        "results/index/train.csv",
        "results/index/val.csv",
        "results/index/provenance.json",
        "results/split/train.csv",
        "results/split/holdout.csv",
        "results/split/provenance.json",
        "results/prepared/train.json",  # manifests naming the copies in prepare.dir
        "results/prepared/val.json",
        "results/aggregate/runs.csv",
        "results/aggregate/runs.md",
        "results/aggregate/runs.csv.provenance.json",
    ]:
        assert (w / path).is_file(), path
    for which in ("train", "val"):  # each manifest names a complete copy in prepare.dir
        copy = resolve_prepared(w / f"results/prepared/{which}.json")
        assert copy.parent == w / "results/prepared" and copy.name.startswith(f"{which}-")
        assert (copy / "prepared.json").is_file()
    provenance = json.loads((w / "results/split/provenance.json").read_text())
    assert provenance["seeds"] == {"split": 0}
    assert provenance["libraries"]["torch"].startswith("2.")
    assert "git_commit" in provenance["code"]
    for run in ("resnet18-1x2", "resnet18-1x1"):
        for name in (
            "model.pt",
            "train_metrics.json",
            "history.csv",
            "job.json",
            "eval.json",
            "per_class.csv",
            "eval.json.provenance.json",
            "accounting.json",
        ):
            assert (w / "results/runs" / run / name).is_file(), (run, name)
        # Cost and TensorBoard (rank 0 only; CPU run: no NVML, no SLURM, each says why).
        events = list((w / "results/runs" / run / "tensorboard").glob("events.out.tfevents.*"))
        assert len(events) == 1, events
        accounting = json.loads((w / "results/runs" / run / "accounting.json").read_text())
        assert accounting == {"available": False, "reason": "not trained in a SLURM job"}
    assert (w / "results/plots/cost.png").is_file()
    # The runs so far, from one command beside the finished workflow: rank 0's last epoch of
    # each run (progress.json) and the finished runs' table.
    for run in ("resnet18-1x2", "resnet18-1x1"):
        last = json.loads((w / "results/runs" / run / "progress.json").read_text())
        assert last["epoch"] == 2 and last["images_per_s"] > 0, last
    shown = snakemake(w, "progress", "--nolock", "--cores", "1").stdout
    progress = pd.read_csv(w / "results/progress/runs.csv")
    assert sorted(progress["run"]) == ["resnet18-1x1", "resnet18-1x2"]
    assert set(progress["state"]) == {"finished"}, progress
    assert "Finished: 2 of 2." in shown and "resnet18-1x2" in shown
    table = pd.read_csv(w / "results/aggregate/runs.csv").set_index("run")
    assert (table["gpu_hours"] == 0).all() and (table["core_hours"] > 0).all(), table
    assert table[["energy_kwh", "slurm_state", "gpu_utilization_percent"]].isna().all().all()


def test_accuracy_well_above_chance_on_holdout_and_test(local_run):
    table = pd.read_csv(local_run / "results/aggregate/runs.csv")
    chance = 1 / 6
    assert len(table) == 2
    # 2x chance: BatchNorm running statistics over ~20 steps make a tiny run's eval noisy.
    assert (table["holdout_top1"] > 2 * chance).all(), table
    assert (table["test_top1"] > 2 * chance).all(), table
    evaluation = json.loads((local_run / "results/runs/resnet18-1x2/eval.json").read_text())
    assert evaluation["test"]["samples"] == 6 * 10  # every val image exactly once
    holdout = pd.read_csv(local_run / "results/split/holdout.csv")
    assert evaluation["holdout"]["samples"] == len(holdout)
    geometry = evaluation["evaluation"]  # default: one node, one CPU rank (gpus_per_node 0)
    assert (geometry["nodes"], geometry["world_size"], geometry["device"]) == (1, 1, "cpu")
    assert geometry["images"] == 60 + len(holdout) and geometry["images_per_s"] > 0


def test_training_used_the_configured_ranks_and_recorded_throughput(local_run):
    metrics = json.loads((local_run / "results/runs/resnet18-1x2/train_metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert sorted(r["rank"] for r in metrics["ranks"]) == [0, 1]
    assert len(metrics["epochs"]) == 3
    for epoch in metrics["epochs"]:
        assert epoch["images_per_s"] > 0
        assert len(epoch["images_per_s_per_rank"]) == 2
    staging = list((local_run / "results/runs/resnet18-1x2/staging").glob("*.json"))
    assert len(staging) == 1
    report = json.loads(staging[0].read_text())
    assert report["bytes"] > 0 and report["cleaned"] is True
    if report.get("in_place"):  # scratch (/tmp here) on the disk of the data: no copy
        assert report["dest"] == report["src"] and "lease" not in report, report
        assert (local_run / report["src"] / "prepared.json").is_file(), "the data must stay"
    else:
        assert not Path(report["dest"]).exists(), "staged copy was not cleaned up"


# The demo's projection against the training that followed it, on a 2-core machine that other
# jobs share; measured 2.2x (the preflight's step ran alone, training's shares its rank's core
# with its loader and metrics). On a GPU node the step dominates and the factor is smaller.
PROJECTION_FACTOR = 4


def test_preflight_ran_first_and_its_figures_follow_their_definitions(local_run):
    report = json.loads((local_run / "results/preflight/resnet18-1x2/preflight.json").read_text())
    assert report["problems"] == [] and report["world_size"] == 2
    assert report["loader"]["name"] == "pytorch"
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    allreduce = report["allreduce"]
    assert allreduce["busbw_gbps"] == pytest.approx(allreduce["algbw_gbps"] * 2 * 1 / 2)
    assert allreduce["bytes"] == allreduce["gradient_bytes"] > 0
    rates = report["loader"]["images_per_s"] / report["model"]["images_per_s"]
    assert report["loader_over_model"] == pytest.approx(rates)
    projection = report["projection"]
    assert projection["allocations"] == 1 and projection["train_runtime_minutes"] is None
    trained = json.loads((local_run / "results/runs/resnet18-1x2/train_metrics.json").read_text())
    # its step timed at training's intra-op threads (training.worker.rank_threads)
    threads = {r["rank"]: r["intra_op_threads"] for r in trained["ranks"]}
    assert {r["rank"]: r["intra_op_threads"] for r in report["ranks"]} == threads
    ratio = trained["mean_epoch_seconds"] / projection["epoch_seconds"]
    assert 1 / PROJECTION_FACTOR < ratio < PROJECTION_FACTOR, ratio
    assert "problems: none" in (local_run / "logs/preflight/resnet18-1x2.log").read_text()
    table = pd.read_csv(local_run / "results/aggregate/runs.csv").set_index("run")
    assert table.loc["resnet18-1x2", "preflight_epoch_seconds"] == pytest.approx(
        projection["epoch_seconds"]
    )
    # workers 0: the training process loads between steps, so the projected breakdown adds
    # the loader's time (preflight.report.step_breakdown), beside the measured share
    step = projection["step_breakdown"]
    assert step["basis"].startswith("no overlap") and step["data_wait_ms"] > 0
    assert table.loc["resnet18-1x2", "preflight_input_bound_pct"] == pytest.approx(
        step["input_bound_pct"]
    )
    # The epoch ends, measured by the preflight and by training (its checkpoint root: the run's)
    end = projection["epoch_end"]
    assert end["basis"].startswith("measured") and end["epoch_end_seconds"] > 0
    main = report["ranks"][0]
    assert main["checkpoint_write_mb_per_s"] > 0 and main["eval_images_per_s"] > 0
    assert not list((local_run / "results/checkpoints").glob("*/.preflight-write-rate-*"))
    assert trained["epoch_end_share"] == pytest.approx(table.loc["resnet18-1x2", "epoch_end_share"])
    assert trained["epoch_end_share"] > 0


def test_preflight_fails_with_one_line_per_problem(local_run, tmp_path):
    """Two ranks forced onto one GPU (CUDA_VISIBLE_DEVICES=0 for both; CPU compute) and a run
    that needs more allocations than allowed: one `imagenet-ddp preflight`, exit 1."""
    from imagenet_ddp.jobs.spec import to_dict
    from tests.workflow_helpers import make_job

    run = json.loads((local_run / "results/preflight/resnet18-1x2/preflight_spec.json").read_text())
    settings = {**run["run"], "device": "cpu", "gpus_per_node": 1, "epochs": 5000}
    settings["max_allocations"] = 2
    job = make_job(
        "preflight",
        settings,
        prepared_train="results/prepared/train.json",  # the manifest, resolved by the job
        split_dir="results/split",
        out=tmp_path / "preflight.json",
        checkpoint_root=tmp_path,
        train_runtime_minutes=1.0,
        scratch_dir=str(tmp_path / "scratch"),
    )
    result = subprocess.run(
        [sys.executable, "-m", "imagenet_ddp.cli", "preflight", "--job", json.dumps(to_dict(job))],
        cwd=local_run, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("preflight of run")]
    assert len(lines) == 2, result.stderr
    assert "placement: ranks 0, 1 on" in lines[0] and "would all use GPU 0" in lines[0]
    assert "allocations:" in lines[1] and "max_allocations is 2" in lines[1]
    assert not (tmp_path / "preflight.json").exists()  # nothing that looks like a pass
    failed = json.loads((tmp_path / "preflight.failed.json").read_text())
    assert [r["gpu"] for r in failed["ranks"]] == ["0", "0"]


def test_split_is_stratified(local_run):
    counts = pd.read_csv(local_run / "results/split/class_counts.csv")
    totals = counts["train"] + counts["holdout"]
    expected = totals * 0.1
    assert ((counts["holdout"] - expected).abs() <= 1).all(), counts


def _state(workdir: Path, home: Path) -> dict[str, tuple[str, int]]:
    """Every file of results/, of Snakemake's records and of the user's home: sha256, mtime."""
    import hashlib

    roots = [workdir / "results", workdir / ".snakemake/metadata", home]
    return {
        str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for root in roots
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".cache/snakemake" not in str(p)  # Snakemake's own source cache
    }


def test_nothing_to_do_on_rerun_under_any_trigger_and_a_dry_run_writes_nothing(
    local_run, tmp_path, monkeypatch
):
    """Issue 41: on the finished workflow a dry-run plans nothing with the profile and with
    Snakemake's own defaults (plain `snakemake -c2`: every rerun trigger), and writes nothing:
    not results/, not Snakemake's records, not the user's home. A reinstall of the package (its
    files' times, as pip leaves them; the parse reads the workflow's src/ first) plans nothing,
    and neither does a real plain invocation, nor the one after it."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    before = _state(local_run, home)
    assert planned_jobs(local_run, "--profile", "profiles/local") == {}
    assert planned_jobs(local_run, "-c2") == {}
    assert not (local_run / ".snakemake/job_specs").exists()
    assert _state(local_run, home) == before
    shutil.copytree(REPO / "src", local_run / "src", ignore=shutil.ignore_patterns("__pycache__"))
    try:
        for path in (local_run / "src").rglob("*.py"):
            os.utime(path)
        assert planned_jobs(local_run, "-c2") == {}
        assert (
            "Nothing to be done"
            in snakemake(local_run, "-c2").stdout + snakemake(local_run, "-c2").stderr
        )
        assert planned_jobs(local_run, "-c2") == {}
    finally:
        shutil.rmtree(local_run / "src")


@pytest.mark.parametrize(("key", "value"), [("lr", 0.02), ("nodes", 2), ("loader", "dali")])
def test_changing_one_runs_weights_or_geometry_reruns_only_that_run(local_run, key, value):
    """A weights setting (`lr`) and a geometry one (`nodes`): that run's train and what reads
    it, nothing of the other run (docs/configuration.md "Reruns"). A setting its check judges
    (`loader`: DALI's import and pipeline): that run's check, a checkpoint after which its
    train is judged, and the reason line naming the setting."""
    config = read_config(local_run)
    original = copy.deepcopy(config)
    config["runs"][1][key] = value
    write_config(local_run, config)
    try:
        result = snakemake(local_run, "-n", "--profile", "profiles/local")
        plan = planned_jobs(local_run, "--profile", "profiles/local")
        # What a reviewer reads before submitting: the cluster profile's dry-run.
        shown = snakemake(local_run, "-n", "-p", "--profile", "profiles/slurm").stdout
    finally:
        write_config(local_run, original)
    assert "wildcards: run=resnet18-1x1" in result.stdout
    assert "wildcards: run=resnet18-1x2" not in result.stdout
    # The reason, one line per run: the one setting that changed (issue 50)
    old = {"lr": config["train_defaults"].get(key, 1), "loader": "pytorch"}.get(key, 1)
    then = f" ({CHECK_FIRST})" if key == "loader" else ""  # a setting its check judges
    assert f"run 'resnet18-1x1': {key} {old} -> {value}{then}" in result.stderr.splitlines()
    if key == "loader":
        assert plan == {"check": 1}, plan
        return
    assert plan == {
        "key": 1, "preflight_run": 1, "train": 1, "evaluate": 1, "accounting": 1,
        "aggregate": 1, "plots": 1, "all": 1,
    }, plan  # fmt: skip
    # Each train job in a few lines: its SLURM shape, a compact hyperparameter line, a spec
    # file's path (not the spec twice), and a reason that names the one setting that changed.
    blocks = shown.split("\n\n")
    (block,) = [b for b in blocks if "rule train:" in b]
    assert len(block.encode()) < 2800, block  # its whole spec, twice (resources, command)
    assert "nodes=" in block and "hyperparameters=model=" in block, block
    # These runs train after a preflight, whose input is train's key: train's reason says
    # that the preflight reran.
    assert "results/preflight/" in block, block


def _changed(spec: dict):
    """Another valid value of a setting, from its declaration (type, default)."""
    default = spec["default"]
    if default is None:  # an opt-in block, off by default (profile): its smallest valid value
        (block,) = [s for s in spec["anyOf"] if s.get("type") == "object"]
        return {k: block["properties"][k].get("minimum", 0) for k in block["required"]}
    if "enum" in spec:
        return next(value for value in spec["enum"] if value != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 1
    return f"{default}changed"


def _artifacts(workdir) -> dict[str, tuple[str, int]]:
    """Every file under results/: its sha256 and mtime (a rewrite with the same bytes shows)."""
    import hashlib

    return {
        str(p.relative_to(workdir)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted((workdir / "results").rglob("*"))
        if p.is_file()
    }


NEW_SETTING = """      new_knob: {x-kind: weights, type: number, default: 0.25%s}
"""


def _add_setting(workdir, declaration: str) -> None:
    """A newer version's schema: one run setting more, at its default."""
    path = workdir / "workflow/schemas/config.schema.yaml"
    anchor = "      name: {x-kind: identity, type: string}\n"
    text = path.read_text()
    assert anchor in text
    path.write_text(text.replace(anchor, anchor + declaration))


def test_bookkeeping_changes_and_a_new_setting_at_its_default_rerun_nothing(local_run):
    """Each bookkeeping setting changed in turn, then all at once with a setting that a newer
    version adds at its default (x-earlier): the dry-run plans no job, a real run rewrites no
    artifact and adds no allocation. A train job that does start gets the new values."""
    from imagenet_ddp.settings.kinds import declarations

    schema_path = local_run / "workflow/schemas/config.schema.yaml"
    settings = declarations(schema_path)
    # fallback_nodes has no valid value on these 1-node runs (a count below nodes); its kind
    # keeps it out of the rerun key as it does the others' (tests/test_settings.py).
    # init_weights must name a file, whose digest (a weights setting) decides: a moved file
    # reruns nothing (tests/test_init_weights.py).
    unchangeable = ("fallback_nodes", "init_weights")
    bookkeeping = [key for key in settings.keys("bookkeeping") if key not in unchangeable]
    assert {"log_interval", "max_allocations", "mlflow_uri"} <= set(bookkeeping)
    config = read_config(local_run)
    original, schema = copy.deepcopy(config), schema_path.read_text()
    before = _artifacts(local_run)
    allocations = pd.read_csv(local_run / "results/aggregate/runs.csv")["allocations"].tolist()
    try:
        for key in bookkeeping:
            config = copy.deepcopy(original)
            config["train_defaults"][key] = _changed(settings.properties[key])
            write_config(local_run, config)
            assert planned_jobs(local_run, "--profile", "profiles/local") == {}, key
        for key in bookkeeping:  # all at once, and a newer version's setting
            config["train_defaults"][key] = _changed(settings.properties[key])
        write_config(local_run, config)
        _add_setting(local_run, NEW_SETTING % ", x-earlier: 0.25")
        assert planned_jobs(local_run, "--profile", "profiles/local") == {}
        shown = snakemake(
            local_run, "-n", "-p", "--profile", "profiles/local", "--forcerun", "train"
        )
        snakemake(local_run, "--profile", "profiles/local")
        after = _artifacts(local_run)
        # Without x-earlier the same setting would rerun every run (what the key guards).
        schema_path.write_text(schema)
        _add_setting(local_run, NEW_SETTING % "")
        unmarked = planned_jobs(local_run, "--profile", "profiles/local")
    finally:
        write_config(local_run, original)
        schema_path.write_text(schema)
    assert after == before
    assert pd.read_csv(local_run / "results/aggregate/runs.csv")["allocations"].tolist() == (
        allocations
    )
    sent = [spec["run"] for spec in shown_specs(shown.stdout, "train", local_run)]
    assert len(sent) == 2, shown.stdout[-3000:]
    for run in sent:  # the next job of a run gets the changed bookkeeping; the new setting at
        # its default travels as the default (a job fills it in from its package's schema,
        # which here, the workflow's schema edited alone, does not know it)
        assert run["log_interval"] == config["train_defaults"]["log_interval"]
        assert run.get("new_knob", 0.25) == 0.25
    assert unmarked["train"] == 2, unmarked


def test_sweep_of_the_same_runs_is_up_to_date_and_one_axis_value_reruns_only_its_run(local_run):
    """A sweep that expands to the trained runs' names and settings trains nothing; changing
    one zip value plans exactly that run (train, evaluate) and the tables after it."""
    config = read_config(local_run)
    original = copy.deepcopy(config)
    lr = config["train_defaults"]["lr"]
    config["runs"] = [original["runs"][0]]  # resnet18-1x2 stays hand-written
    sweep = {"name": "resnet18-1x{tasks_per_node}", "zip": {"tasks_per_node": [1], "lr": [lr]}}
    config["sweep"] = [sweep]
    write_config(local_run, config)
    try:
        unchanged = planned_jobs(local_run, "--profile", "profiles/local")
        sweep["zip"] = {"tasks_per_node": [2, 1], "lr": [lr, lr / 2]}
        del config["runs"]  # now both runs come from the sweep
        write_config(local_run, config)
        result = snakemake(local_run, "-n", "--profile", "profiles/local")
        changed = planned_jobs(local_run, "--profile", "profiles/local")
    finally:
        write_config(local_run, original)
    # No training: only the tables redo, whose first columns are now the sweep's axes
    # (aggregate's report settings, issue 53)
    assert unchanged == {"aggregate": 1, "plots": 1, "all": 1}, unchanged
    assert changed == {
        "key": 1, "preflight_run": 1, "train": 1, "evaluate": 1, "accounting": 1,
        "aggregate": 1, "plots": 1, "all": 1,
    }, changed  # fmt: skip
    assert "wildcards: run=resnet18-1x1" in result.stdout
    assert "wildcards: run=resnet18-1x2" not in result.stdout


def test_changing_split_seed_reruns_split_and_downstream_only(local_run):
    config = read_config(local_run)
    original = copy.deepcopy(config)
    config["split"]["seed"] = 1
    write_config(local_run, config)
    try:
        plan = planned_jobs(local_run, "--profile", "profiles/local")
    finally:
        write_config(local_run, original)
    # Every training waits for the data's new content digest (data_content, a checkpoint),
    # which decides it once it has run: another split is other data, so they will retrain
    # (tests of a data change that runs: test_rerun_matrix_under_each_trigger_set).
    assert plan == {"split": 1, "data_content": 1}, plan


def test_prepare_split_into_jobs_shows_them_in_the_dry_run(local_run):
    """prepare.jobs: 3 plans 3 chunk jobs per prepared set and a join (tests/test_prepare_jobs.py
    proves the join equals the one-job copy byte for byte)."""
    config = read_config(local_run)
    original = copy.deepcopy(config)
    config["prepare"]["jobs"] = 3
    write_config(local_run, config)
    try:
        result = snakemake(local_run, "-n", "--profile", "profiles/local", "--until", "prepare")
    finally:
        write_config(local_run, original)
    text = result.stdout + result.stderr
    for which in ("train", "val"):
        for chunk in range(3):
            assert f"results/prepare_chunks/{which}/{chunk}-of-3" in text, text[-3000:]
    plan = planned_jobs(local_run, "--profile", "profiles/local", "--until", "prepare")
    assert plan == {}, "a dry-run changes nothing: the one-job copy is still up to date"


def test_flipping_check_md5_on_a_finished_workflow_plans_only_verify(local_run):
    """verify reruns alone (issue 35): index reads the archives beside it, and what trains
    waits for its report without its time being a reason (data_content: ancient)."""
    config = read_config(local_run)
    original = copy.deepcopy(config)
    config["data"]["check_md5"] = not config["data"].get("check_md5", True)
    write_config(local_run, config)
    try:
        plan = planned_jobs(local_run, "--profile", "profiles/local")
    finally:
        write_config(local_run, original)
    assert plan == {"verify": 1, "all": 1}, plan


def _bump_stage_version(workdir: Path, stage: str) -> None:
    """The workflow's own source tree (common.smk puts <workflow>/src first on the path) with
    ``stage``'s output version bumped: a release whose stage writes something new."""
    shutil.copytree(REPO / "src", workdir / "src", ignore=shutil.ignore_patterns("__pycache__"))
    path = workdir / "src/imagenet_ddp/jobs/stage_versions.py"
    text = path.read_text()
    line = re.search(rf'^    "{stage}": (\w+),$', text, re.M)
    path.write_text(text.replace(line.group(0), f'    "{stage}": {line.group(1)} + 1,'))


def _mtimes(workdir: Path, *paths: str) -> dict[str, int]:
    return {p: (workdir / p).stat().st_mtime_ns for p in paths}


def test_a_stage_version_and_an_lr_change_in_one_invocation(local_run):
    """Issue 41: a new split version reruns split; its same bytes rerun no training and no
    evaluation, while an lr changed in the same invocation retrains that run (and evaluates
    it) then and there. A comment in the source changes nothing."""
    config = read_config(local_run)
    original = copy.deepcopy(config)
    one, two = (f"results/runs/{r['name']}/model.pt" for r in config["runs"])
    evals = [p.replace("model.pt", "eval.json") for p in (one, two)]
    before = _mtimes(local_run, one, two, *evals, "results/split/train.csv")
    try:
        _bump_stage_version(local_run, "split")
        config["runs"][1]["lr"] = config["train_defaults"]["lr"] / 2
        write_config(local_run, config)
        plan = planned_jobs(local_run, "--profile", "profiles/local")
        snakemake(local_run, "--profile", "profiles/local")
        after = _mtimes(local_run, one, two, *evals, "results/split/train.csv")
        rerun = planned_jobs(local_run, "--profile", "profiles/local")
    finally:
        shutil.rmtree(local_run / "src", ignore_errors=True)
        write_config(local_run, original)
        snakemake(local_run, "--profile", "profiles/local")  # back: retrains that run again
    # train is decided once data_content has run (the lr's run then, the other not)
    assert plan == {"split": 1, "data_content": 1}, plan
    assert after["results/split/train.csv"] != before["results/split/train.csv"]  # rerun
    changed = {p for p in before if after[p] != before[p]}
    assert changed == {"results/split/train.csv", two, evals[1]}, changed
    assert rerun == {}, rerun


def _tree(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``root``: sha256, inode and mtime (a rewrite or a new file shows)."""
    import hashlib

    return {
        str(p.relative_to(root)): (
            hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_ino, p.stat().st_mtime_ns
        )
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }  # fmt: skip


def test_a_second_workflow_sharing_prepare_dir_never_touches_the_first_ones_copy(
    local_run, tmp_path
):
    """Issue 35: a second working directory sharing prepare.dir, its index files newer than
    the first's copy, runs its own verify, index and prepare: it reuses the first's copy (its
    manifest names it) instead of deleting it, and with another prepared setting builds a copy
    of its own beside it. The first's copy, one of its files held open as a reader holds it,
    is the same bytes, inodes and mtimes throughout."""
    from tests.workflow_helpers import copy_workflow

    first = resolve_prepared(local_run / "results/prepared/val.json")
    before = _tree(first)
    second = copy_workflow(tmp_path / "second")
    config = read_config(second)
    config["demo"]["enabled"] = False
    config["data"]["dir"] = str(local_run / "resources/demo/ILSVRC2012")
    config["prepare"]["dir"] = str(local_run / "results/prepared")
    write_config(second, config)
    target = "results/prepared/val.json"
    with open(first / "samples.csv", "rb") as reader:
        snakemake(second, "--profile", "profiles/local", target)
        reused = resolve_prepared(second / target)
        config["prepare"]["shard_samples"] = 7  # another copy: another name
        write_config(second, config)
        planned = planned_jobs(second, "--profile", "profiles/local", target)
        snakemake(second, "--profile", "profiles/local", target)
        assert os.fstat(reader.fileno()).st_nlink == 1  # what a reader holds was not unlinked
    own = resolve_prepared(second / target)
    assert (second / "results/index/val.csv").stat().st_mtime > first.stat().st_mtime
    assert reused == first
    assert planned == {"prepare": 1}, planned  # the manifest, never the shared copy
    assert own != first and own.parent == first.parent and (own / "prepared.json").is_file()
    assert _tree(first) == before
    assert resolve_prepared(local_run / target) == first  # the first still names its copy


def test_split_is_identical_when_rerun(local_run, tmp_path):
    before = (local_run / "results/split/holdout.csv").read_bytes()
    shutil.copytree(local_run / "results/split", tmp_path / "split-before")
    snakemake(local_run, "--profile", "profiles/local", "--forcerun", "split", "--until", "split")
    assert (local_run / "results/split/holdout.csv").read_bytes() == before
    assert (local_run / "results/split/train.csv").read_bytes() == (
        tmp_path / "split-before/train.csv"
    ).read_bytes()


# Demo-sized overrides for the published recipes (their crops, batches and epochs are
# ImageNet's); everything else comes from the preset.
SHORT = {
    "model": "resnet18",
    "epochs": 1,
    "batch_size": 32,
    "tasks_per_node": 1,
    "crop_size": 16,
    "eval_resize": 20,
    "eval_crop_size": 16,
}
RECIPE_RUNS = [
    {"name": "recipe-tv-v1", "recipe": "torchvision-resnet50-v1", **SHORT},
    {  # and the GPU path's numerics, run by the CPU (issue 18): 2 ranks, evaluated too
        "name": "recipe-tv-v2",
        "recipe": "torchvision-resnet50-v2",
        **SHORT,
        "tasks_per_node": 2,
        "precision": "bf16",
        "channels_last": True,
        "compile": True,
        # PyTorch 2.14.1's CPU (oneDNN) bf16 channels_last convolution backward now and then
        # writes NaN into a weight's gradient (512 elements of layer4.0.conv1, about 1 backward
        # in 6 here; the divergence guard caught it): this run shows the path, not the guard
        "divergence_guard": False,
    },
    {
        "name": "recipe-ffcv",
        "recipe": "ffcv-resnet50",
        **SHORT,
        "progressive_min_crop": 8,
        "progressive_start_epoch": 0,
        "progressive_end_epoch": 1,
        "progressive_multiple": 8,
    },
    {  # DeiT's recipe on 2 ranks at its augmentation's full strength: each image takes two
        # of its RandAugment ops at magnitude 10, probability 1 (posterize to 0 bits in ~1 of
        # 8: a crash in the first step before issue 51), the smallest crop, flip and erasing
        "name": "recipe-deit",
        "recipe": "deit-small",
        **SHORT,
        "model_kwargs": {},
        "tasks_per_node": 2,
        "auto_augment": "rand-m10-mstd0-inc1-p1",
        "crop_scale": [0.08, 0.08],
        "hflip": 1.0,
        "random_erasing": 1.0,
    },
    {  # the same at full strength through loader: dali (DALI's CPU backend) under Snakemake:
        # its check job's DALI cases, its preflight's DALI loader and evaluation rates, its
        # training and holdout, and its evaluate stage
        "name": "recipe-dali",
        "recipe": "deit-small",
        **SHORT,
        "model_kwargs": {},
        "tasks_per_node": 2,
        "loader": "dali",
        "auto_augment": "rand-m10-mstd0-inc1-p1",
        "crop_scale": [0.08, 0.08],
        "hflip": 1.0,
        "random_erasing": 1.0,
    },
    {  # ResNet strikes back's (timm's LAMB, BCE, repeated augmentation) on 2 ranks
        "name": "recipe-rsb",
        "recipe": "timm-resnet50-a1",
        **SHORT,
        "model_kwargs": {},
        "tasks_per_node": 2,
    },
    {  # every component at once (sync_bn aside: torch syncs BatchNorm on GPUs only)
        "name": "recipe-all",
        **SHORT,
        "epochs": 2,  # the crop rises
        "optimizer": "adamw",
        "lr": 0.002,
        "lr_scaling": "linear",
        "lr_schedule": "step",
        "lr_step_epochs": [1],
        "warmup_epochs": 0.5,
        "warmup_start_factor": 0.1,
        "norm_weight_decay": 0.0,
        "bias_weight_decay": 0.0,
        "grad_clip_norm": 2.0,
        "label_smoothing": 0.1,
        "auto_augment": "randaugment",
        "random_erasing": 0.25,
        "mixup_alpha": 0.2,
        "cutmix_alpha": 1.0,
        "ema_decay": 0.999,
        "ema_steps": 4,
        "zero_init_residual": True,
        "progressive_min_crop": 8,
        "progressive_start_epoch": 0,
        "progressive_end_epoch": 1,
        "progressive_multiple": 8,
        "eval_resize": 24,
        "eval_crop_size": 20,
    },
]


# Models beyond the presets (issue 34) on 2 ranks, each with its own options and optimizer; their
# bitwise resume is tests/test_resume.py's (the same models and recipe components).
MODEL_RUNS = [
    {"name": "timm-resnet", "model": "timm/resnet18.a1_in1k", "optimizer": "timm/lamb",
     "model_kwargs": {"drop_path_rate": 0.05}, "lr": 0.01},
    {"name": "timm-vit", "model": "timm/vit_tiny_patch16_224", "optimizer": "adamw", "lr": 0.001,
     "model_kwargs": {"img_size": 16, "patch_size": 8}, "optimizer_kwargs": {"betas": [0.9, 0.95]}},
    {"name": "tv-mobilenet", "model": "mobilenet_v3_small", "model_kwargs": {"dropout": 0.2}},
]  # fmt: skip
MODEL_RUNS = [{**SHORT, "tasks_per_node": 2, "preflight": False, **run} for run in MODEL_RUNS]


def test_each_recipe_preset_and_all_components_train(local_run):
    """One snakemake invocation trains a one-epoch run of every preset and a two-epoch run with
    every recipe component on (each evaluated on the holdout at every epoch's end, at its
    eval_resize/eval_crop_size); the dry-run first shows each run's resolved hyperparameters."""
    config = read_config(local_run)
    original = copy.deepcopy(config)
    config["runs"] = RECIPE_RUNS + MODEL_RUNS
    write_config(local_run, config)
    targets = [f"results/runs/{run['name']}/model.pt" for run in RECIPE_RUNS]
    targets += ["results/runs/recipe-tv-v2/eval.json", "results/runs/recipe-dali/eval.json"]
    targets += [f"results/runs/{run['name']}/eval.json" for run in MODEL_RUNS]
    try:
        dry = snakemake(local_run, "--profile", "profiles/local", "-n", *targets)
        shown = dry.stdout + dry.stderr
        # Train jobs run side by side and share the node's staged copy: each holds a lease,
        # and only the last to finish removes it (imagenet_ddp.data.stage).
        snakemake(local_run, "--profile", "profiles/local", *targets)
    finally:
        write_config(local_run, original)
    # The v1 preset's step schedule and the linear scaling rule, before any job runs.
    line = next(x for x in shown.splitlines() if "recipe=" in x and "torchvision-resnet50-v1" in x)
    assert "lr_schedule=step" in line.replace('"', "") and "lr_step_epochs=[30,60]" in line
    assert "lr_used=0.0125" in line  # 0.1 per 256 images x batch 32 x 1 rank / 256
    runs = local_run / "results/runs"
    for run in RECIPE_RUNS:
        metrics = json.loads((runs / run["name"] / "train_metrics.json").read_text())
        assert len(metrics["epochs"]) == run["epochs"], run["name"]
        link = local_run / "logs/train" / f"{run['name']}.log"  # to the job's own log
        assert link.resolve().parent == (local_run / "logs/train" / run["name"]).resolve()
        log = link.read_text()
        header, hyperparameters = log.splitlines()[:2]  # each job: a header, its settings
        assert header.startswith("== job local, Snakemake attempt 1, started "), header
        assert hyperparameters.startswith("hyperparameters: "), log[:200]
    deit = json.loads((runs / "recipe-deit/train_metrics.json").read_text())
    assert deit["config"]["auto_augment"] == "rand-m10-mstd0-inc1-p1" and deit["world_size"] == 2
    assert json.loads((runs / "recipe-rsb/train_metrics.json").read_text())["world_size"] == 2
    _assert_trained_and_evaluated_through_dali(local_run)
    v2 = json.loads((runs / "recipe-tv-v2/train_metrics.json").read_text())
    assert v2["config"]["recipe"] == "torchvision-resnet50-v2"
    assert (v2["config"]["mixup_alpha"], v2["config"]["auto_augment"]) == (0.2, "trivialaugment")
    assert v2["lr_used"] == pytest.approx(0.125 * 32 * 2 / 256)  # 2 ranks
    assert all("holdout_ema_top1" in epoch for epoch in v2["epochs"])
    # bf16 autocast, channels_last, torch.compile (inductor, the machine's C compiler) and EMA
    # on 2 gloo ranks: trained (device discipline checked by every rank) and evaluated.
    assert (v2["config"]["precision"], v2["config"]["channels_last"]) == ("bf16", True)
    assert v2["config"]["compile"] is True and v2["world_size"] == 2
    evaluation = json.loads((runs / "recipe-tv-v2/eval.json").read_text())
    assert evaluation["evaluation"]["precision"] == "bf16" and evaluation["test"]["samples"] > 0
    # The v2 recipe's published figure is its EMA model's: evaluated beside the raw weights.
    assert evaluation["reported_model"] == "ema" and evaluation["evaluation"]["models"] == [
        "model",
        "ema",
    ]
    assert evaluation["ema"]["test"]["samples"] == evaluation["test"]["samples"]
    everything = json.loads((runs / "recipe-all/train_metrics.json").read_text())
    assert [e["crop_size"] for e in everything["epochs"]] == [8, 16]
    assert everything["epochs"][1]["lr_end"] == pytest.approx(0.002 * 32 / 256 * 0.1)
    assert all(0 <= e["holdout_ema_top1"] <= 1 for e in everything["epochs"])
    import torchvision

    from imagenet_ddp.training.model import read_model_file

    state = read_model_file(runs / "recipe-all/model.pt")
    plain = torchvision.models.get_model(state["arch"], num_classes=state["num_classes"])
    plain.load_state_dict(state["ema"])  # the EMA loads into plain torchvision too

    _assert_models_beyond_the_presets(runs)


def _assert_trained_and_evaluated_through_dali(workdir: Path) -> None:
    """recipe-dali's check ran DALI's cases, its preflight timed DALI's loaders, and it trained
    on 2 ranks and was evaluated through DALI."""
    runs = workdir / "results/runs"
    trained = json.loads((runs / "recipe-dali/train_metrics.json").read_text())
    assert trained["config"]["loader"] == "dali" and trained["world_size"] == 2
    assert all(0 <= e["holdout_top1"] <= 1 for e in trained["epochs"])
    evaluation = json.loads((runs / "recipe-dali/eval.json").read_text())
    assert evaluation["evaluation"]["loader"] == "dali" and evaluation["test"]["samples"] > 0
    assert (workdir / "results/checks/recipe-dali.json").is_file()
    report = json.loads((workdir / "results/preflight/recipe-dali/preflight.json").read_text())
    assert report["problems"] == [] and report["loader"]["images_per_s"] > 0
    assert report["loader"]["name"] == "dali"  # the figure is DALI's pipeline's
    log = (workdir / "logs/preflight/recipe-dali.log").read_text()
    assert re.search(r"; loader \(dali\) [\d.]+ img/s per rank", log), log[-2000:]
    assert all(rank["eval_images_per_s"] > 0 for rank in report["ranks"][:1])


def _assert_models_beyond_the_presets(runs: Path) -> None:
    """timm's ResNet and ViT and a torchvision model outside the presets trained on 2 ranks and
    evaluated, and are rows of the runs table (report.aggregate, the aggregate rule's code)
    with their FLOPs; the model.pt of each rebuilds through the factory, model_kwargs and all."""
    import torch

    from imagenet_ddp.report.aggregate import aggregate_runs
    from imagenet_ddp.training.model import load_model

    table = aggregate_runs([runs / run["name"] for run in MODEL_RUNS]).set_index("run")
    for run in MODEL_RUNS:
        row = table.loc[run["name"]]
        assert row["model"] == run["model"] and row["world_size"] == 2
        assert row["flops_per_image"] > 0 and 0 <= row["test_top1"] <= 1
        metrics = json.loads((runs / run["name"] / "train_metrics.json").read_text())
        assert metrics["config"]["model_kwargs"] == run["model_kwargs"]
        assert metrics["config"]["optimizer"] == run.get("optimizer", "sgd")
        model, state = load_model(runs / run["name"] / "model.pt")
        assert state["arch"] == run["model"]
        assert model.eval()(torch.zeros(1, 3, 16, 16)).shape == (1, state["num_classes"])
    # each model's own count (the ViT's at its img_size 16: 4 patches and the class token)
    assert table["flops_per_image"].nunique() == len(MODEL_RUNS)


TRIGGERS = {
    "default": (),
    "mtime": ("--rerun-triggers", "mtime"),
    "mtime params": ("--rerun-triggers", "mtime", "params"),
}
DATA_STAGES = {"verify": 1, "index": 1, "split": 1, "prepare": 2, "data_content": 1, "all": 1}


def test_rerun_matrix_under_each_trigger_set(local_run):
    """Issue 50: on the finished demo, Snakemake's default triggers, `--rerun-triggers mtime`
    and `mtime params` (plain `snakemake -c2`, no profile), each with a no-op, an lr change, a
    touch of the train archive and a data change (another demo seed). A rerun key is an input
    path named by its content (jobs.rerun_keys), so mtime alone retrains for an lr; a touch
    reruns the data stages and nothing downstream, not even the tables; going back to an
    earlier lr retrains under mtime (the delivered job removed the older key); a trigger set
    without mtime is refused in one line. Real runs: one lr retrain, the touch, the data change
    (it leaves the workflow trained on demo seed 1, one run at the doubled lr)."""
    config = read_config(local_run)
    original = copy.deepcopy(config)
    run = config["runs"][1]["name"]
    lr = config["train_defaults"]["lr"]
    outputs = ("model.pt", "eval.json", "accounting.json")
    files = [f"results/runs/{r['name']}/{f}" for r in config["runs"] for f in outputs]
    files.append("results/aggregate/runs.csv")
    for name, triggers in TRIGGERS.items():
        assert planned_jobs(local_run, "-c2", *triggers) == {}, name
    refused = snakemake(local_run, "-n", "-c2", "--rerun-triggers", "code", check=False)
    assert refused.returncode != 0 and "--rerun-triggers without mtime:" in refused.stderr
    assert "Traceback" not in refused.stderr

    retrain = {"key": 1, "preflight_run": 1, "train": 1, "evaluate": 1, "accounting": 1,
               "aggregate": 1, "plots": 1, "all": 1}  # fmt: skip
    config["runs"][1]["lr"] = lr * 2
    write_config(local_run, config)
    for name, triggers in TRIGGERS.items():
        assert planned_jobs(local_run, "-c2", *triggers) == retrain, name
    shown = snakemake(local_run, "-n", "-c2")
    # the reason, one line: the parse compares with what the last delivered training recorded
    assert [x for x in shown.stderr.splitlines() if x.startswith("run ")] == [
        f"run {run!r}: lr {lr} -> {lr * 2}"
    ], shown.stderr[-3000:]
    snakemake(local_run, "-c2", *TRIGGERS["mtime"])
    assert len(list((local_run / f"results/keys/train/{run}").iterdir())) == 1  # the old one gone
    write_config(local_run, original)  # back to the earlier lr: retrains under mtime too
    for name, triggers in TRIGGERS.items():
        assert planned_jobs(local_run, "-c2", *triggers) == retrain, name

    write_config(local_run, config)  # the lr trained last: its key is there
    for name, triggers in TRIGGERS.items():
        assert planned_jobs(local_run, "-c2", *triggers) == {}, name

    before = _mtimes(local_run, *files)
    os.utime(local_run / "resources/demo/ILSVRC2012/ILSVRC2012_img_train.tar")  # same bytes
    for name, triggers in TRIGGERS.items():  # train and evaluate: decided after data_content
        assert planned_jobs(local_run, "-c2", *triggers) == DATA_STAGES, name
    snakemake(local_run, "-c2", *TRIGGERS["mtime"])
    assert _mtimes(local_run, *files) == before  # no train, evaluate, accounting or table
    for name, triggers in TRIGGERS.items():
        assert planned_jobs(local_run, "-c2", *triggers) == {}, name

    config["demo"]["seed"] = 1  # other images: decided once data_content has run
    write_config(local_run, config)
    data = {**DATA_STAGES, "demo_data": 1}
    assert planned_jobs(local_run, "-c2") == data
    assert planned_jobs(local_run, "-c2", *TRIGGERS["mtime params"]) == data
    assert planned_jobs(local_run, "-c2", *TRIGGERS["mtime"]) == {}  # a param: mtime ignores it
    forced = (*TRIGGERS["mtime"], "--forcerun", "demo_data")
    assert planned_jobs(local_run, "-c2", *forced) == data
    ran = snakemake(local_run, "-c2", *forced)
    text = ran.stdout + ran.stderr
    for rule, count in (("train", 2), ("evaluate", 2), ("accounting", 2), ("aggregate", 1)):
        assert len(re.findall(rf"^(local)?rule {rule}:", text, re.M)) == count, (rule, text[-3000:])
    after = _mtimes(local_run, *files)
    assert all(after[f] != before[f] for f in files), (before, after)
    for name, triggers in TRIGGERS.items():
        assert planned_jobs(local_run, "-c2", *triggers) == {}, name


def _trained_while_no_snakemake_watched(workdir: Path, root: Path, run: str, *args: str):
    """`snakemake --profile profiles/local *args`, SIGKILLed alone (a login node that dies: no
    cleanup) once the run's train job has started; the job trains on, unwatched, to its end."""
    from imagenet_ddp.jobs import attempts

    log, began = workdir / f"logs/train/{run}.log", time.time()
    output = workdir.parent / "killed-snakemake.log"
    with open(output, "w") as out:
        proc = subprocess.Popen([*SNAKEMAKE, "--profile", "profiles/local", *args], cwd=workdir,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = began + 600
    try:
        while not (log.is_file() and log.stat().st_mtime >= began and "epoch 0 step" in
                   log.read_text(errors="replace")):  # fmt: skip
            assert proc.poll() is None and time.time() < deadline, output.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    while not (attempts.load(root) and attempts.load(root)[-1].get("ended") is not None):
        assert time.time() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    time.sleep(1)  # the launcher's last lines, after its attempt entry


def _weights(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def test_a_forced_or_cleaned_run_trains_again_from_scratch(local_run):
    """Issue 50: `--forcerun` of a finished run's model trains it from step 0 (never its final
    checkpoint resumed into the same model), its earlier checkpoints and attempt record moved to
    `<root>.previous`, the log saying so in one line; `--delete-all-output` then a run does the
    same (docs/configuration.md "Reruns" lists what the cleanup leaves). The forced run's
    Snakemake is SIGKILLed while it trains (a login node that dies): its job trains to the end
    but delivers nothing, so the next invocation's rerun of it (`rerun-incomplete`) is no run
    asked for again: it resumes the final checkpoint and writes the outputs without training,
    the same weights. Last in this file: it leaves the run retrained."""
    import torch

    from imagenet_ddp.jobs import attempts

    run = "resnet18-1x1"
    target = f"results/runs/{run}/model.pt"
    root = local_run / "results/checkpoints" / run
    log = local_run / f"logs/train/{run}.log"
    before = len(attempts.load(root))
    epochs = json.loads((local_run / f"results/runs/{run}/train_metrics.json").read_text())
    trained = []
    for cleanup in ("--forcerun", "--delete-all-output"):
        if cleanup == "--forcerun":
            _trained_while_no_snakemake_watched(local_run, root, run, cleanup, target, target)
            text = log.read_text()
            assert "is trained, but the Snakemake that submitted this job has ended" in text
            assert not (root / "delivered.json").exists(), text[-2000:]
            weights = _weights(local_run / target)  # the ranks wrote it: nothing recorded
        else:  # the cleanup of the run's model and what it is made of
            snakemake(local_run, "--profile", "profiles/local", "--delete-all-output", target)
            assert not (local_run / target).exists() and (root / "delivered.json").is_file()
            snakemake(local_run, "--profile", "profiles/local", target)
            text = log.read_text()
        afresh = attempts.load(root)
        assert len(afresh) == 1 and afresh[0]["outcome"] == "completed", afresh
        assert (afresh[0]["start"]["epoch"], afresh[0]["start"]["step"]) == (0, 0), afresh[0]
        assert f"{root.name} held a delivered run; training from scratch" in text, text[-2000:]
        if cleanup == "--forcerun":  # the next invocation: the same command again
            snakemake(local_run, "--unlock")
            assert planned_jobs(local_run, "--profile", "profiles/local", target) == {"train": 1}
            snakemake(local_run, "--profile", "profiles/local", target)
            resumed = attempts.load(root)
            assert [a["outcome"] for a in resumed] == ["completed"] * 2, resumed
            final = epochs["epochs"][-1]["epoch"] + 1
            assert (resumed[1]["start"]["epoch"], resumed[1]["start"]["step"]) == (final, 0)
            again = _weights(local_run / target)
            assert again.keys() == weights.keys()
            assert all(torch.equal(again[k], weights[k]) for k in weights)
            assert "training from scratch" not in log.read_text()
            assert (root / "delivered.json").is_file()
            assert planned_jobs(local_run, "--profile", "profiles/local", target) == {}
        trained.append(
            json.loads((local_run / f"results/runs/{run}/train_metrics.json").read_text())
        )
    assert len(attempts.load(root.with_name(f"{run}.previous"))) == 2  # the forced run's
    assert before >= 1
    for retrained in trained:
        runs = [[e["epoch"] for e in m["epochs"]] for m in (epochs, retrained)]
        assert runs[0] == runs[1] and runs[1][0] == 0, runs  # every epoch again
