"""An upgrade from the last landed version (1e9350b) resubmits no finished train or preflight_run
job: their Snakemake records are carried over to today's param format where the run's settings
did not change (imagenet_ddp.settings.rerun_migration), and a real change still reruns."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from imagenet_ddp.settings.rerun_migration import (
    earlier_rerun_param,
    locked,
    migrate_rerun_params,
    record_path,
    recorded,
    rerun_param,
)
from tests.workflow_helpers import REPO, TINY_CONFIG_OVERRIDES, planned_jobs, snakemake

EARLIER = "1e9350b"  # the last landed version with the one-JSON-param format
RERUN = {"lr": 0.1, "nodes": 1, "model": "resnet18", "mixup_alpha": 0.0}
OUTPUTS = ["results/runs/r/model.pt", "results/runs/r/history.csv"]


def _persistence():
    """The installed Snakemake's file backend, its path and param functions only."""
    from snakemake.persistence.file import FilePersistence

    persistence = FilePersistence.__new__(FilePersistence)
    persistence._max_len = None
    return persistence


def _write_records(snakemake_dir, params, version=6, outputs=OUTPUTS):
    """Records as Snakemake's file backend writes them (its own FilePersistence._record_path)."""
    metadata = snakemake_dir / "metadata"
    metadata.mkdir(parents=True, exist_ok=True)
    paths = []
    for output in outputs:
        path = _persistence()._record_path(str(metadata), output)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        record = {"rule": "train", "params": params, "record_format_version": version, "code": "x"}
        with open(path, "w") as handle:
            json.dump(record, handle)
        os.chmod(path, 0o660)
        paths.append(path)
    return paths


def test_record_path_and_serialization_are_snakemakes(tmp_path):
    """The path and the params as the installed Snakemake computes them (a long path split
    into `@` folders too)."""
    persistence = _persistence()
    long = "results/runs/" + "x" * 400 + "/model.pt"
    for output in ("results/runs/r/model.pt", long):
        assert record_path(str(tmp_path), output) == persistence._record_path(str(tmp_path), output)
    params = [rerun_param(k, v) for k, v in RERUN.items()]
    assert recorded(params) == sorted(persistence._serialize_param_builtin(p) for p in params)
    assert rerun_param("lr", 0.1) == "lr=0.1"
    assert rerun_param("model", "resnet18") == 'model="resnet18"'


def test_earlier_format_records_of_unchanged_settings_are_carried_over(tmp_path):
    paths = _write_records(tmp_path, recorded([earlier_rerun_param(RERUN)]))
    assert migrate_rerun_params(str(tmp_path), OUTPUTS, RERUN) == OUTPUTS
    for path in paths:
        record = json.loads(Path(path).read_text())
        assert record["params"] == recorded(rerun_param(k, v) for k, v in RERUN.items())
        assert record["code"] == "x" and record["rule"] == "train"  # the rest as it was
        assert os.stat(path).st_mode & 0o777 == 0o660
    assert not [n for n in os.listdir(os.path.dirname(paths[0])) if n.startswith(".migrate-")]
    assert migrate_rerun_params(str(tmp_path), OUTPUTS, RERUN) == []  # done once


@pytest.mark.parametrize(
    "params, version",
    [
        (recorded([earlier_rerun_param({**RERUN, "lr": 0.2})]), 6),  # a changed setting
        (recorded([earlier_rerun_param(RERUN), "'other'"]), 6),  # another param beside it
        (recorded(["lr=0.2"]), 6),  # today's format, another value
        (recorded([earlier_rerun_param(RERUN)]), 5),  # another record version
    ],
)
def test_any_other_record_is_left_untouched(tmp_path, params, version):
    paths = _write_records(tmp_path, params, version)
    before = [Path(p).read_text() for p in paths]
    assert migrate_rerun_params(str(tmp_path), OUTPUTS, RERUN) == []
    assert [Path(p).read_text() for p in paths] == before


def test_nothing_is_rewritten_while_a_snakemake_holds_the_directory(tmp_path):
    paths = _write_records(tmp_path, recorded([earlier_rerun_param(RERUN)]))
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / "0.output.lock").write_text("results/runs/r/model.pt\n")
    assert locked(str(tmp_path))
    before = [Path(p).read_text() for p in paths]
    assert migrate_rerun_params(str(tmp_path), OUTPUTS, RERUN) == []
    assert [Path(p).read_text() for p in paths] == before
    assert migrate_rerun_params(str(tmp_path / "absent"), OUTPUTS, RERUN) == []


def test_an_earlier_prepared_copy_is_adopted_by_a_manifest_at_the_epoch(tmp_path):
    from imagenet_ddp.data.prepared_layout import (
        PREPARED_JSON,
        adopt_earlier_copy,
        resolve_prepared,
    )

    manifest, root = tmp_path / "results" / "prepared" / "train.json", tmp_path / "shared"
    assert not adopt_earlier_copy(manifest, root, "train")  # no copy: prepare decides
    (root / "train").mkdir(parents=True)
    (root / "train" / PREPARED_JSON).write_text("{}")
    assert not adopt_earlier_copy(manifest, root, "train")  # no provenance: not a known copy
    made_from = {"which": "train", "short_side": 40, "index_sha256": "ab"}
    (root / "train.provenance.json").write_text(json.dumps({"config": made_from}))
    assert adopt_earlier_copy(manifest, root, "train")
    assert resolve_prepared(manifest) == root / "train" and manifest.stat().st_mtime == 0
    assert json.loads(manifest.read_text())["identity"] == made_from
    manifest.write_text("today's")
    assert not adopt_earlier_copy(manifest, root, "train")  # an existing one stays
    assert manifest.read_text() == "today's"


def _earlier_tree(dest):
    """The repository at EARLIER (git archive), or a skip where the clone lacks it."""
    have = subprocess.run(["git", "cat-file", "-e", f"{EARLIER}^{{commit}}"], cwd=REPO)
    if have.returncode != 0:
        pytest.skip(f"commit {EARLIER} is not in this clone (a shallow one): fetch its history")
    dest.mkdir()
    archive = subprocess.run(["git", "archive", EARLIER], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def _tiny_config(old):
    config = yaml.safe_load((old / "config.yaml").read_text())
    config["demo"] = dict(TINY_CONFIG_OVERRIDES["demo"])
    config["prepare"] = dict(TINY_CONFIG_OVERRIDES["prepare"])
    config["train_defaults"].update(TINY_CONFIG_OVERRIDES["train_defaults_update"])
    config["train_defaults"]["epochs"] = 1
    config["runs"] = [{"name": "r", "nodes": 1, "tasks_per_node": 1, "preflight": True}]
    return config


@pytest.mark.e2e
def test_upgrade_from_the_earlier_version_resubmits_no_finished_training(tmp_path):
    """Real: the workflow trained by the code of EARLIER, then today's in the same working
    directory: neither its dry-run nor its run plans train or preflight_run (the records
    carried over, the earlier prepared copy adopted); a changed lr then plans them, the reason
    naming lr alone."""
    old = _earlier_tree(tmp_path / "old")
    work = tmp_path / "work"
    work.mkdir()
    for name in ("Snakefile", "workflow", "profiles"):
        (shutil.copytree if (old / name).is_dir() else shutil.copy)(old / name, work / name)
    config = _tiny_config(old)
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(old / "src")}
    args = [sys.executable, "-m", "snakemake", "--profile", "profiles/local", "--until", "train"]
    done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]

    # Today's workflow in the same directory (the config as it was).
    for name in ("Snakefile", "workflow", "profiles"):
        shutil.rmtree(work / name) if (work / name).is_dir() else (work / name).unlink()
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, work / name)
    metadata = str(work / ".snakemake" / "metadata")
    records = [
        record_path(metadata, f"results/{path}")
        for path in ("runs/r/model.pt", "runs/r/history.csv", "preflight/r/preflight.json")
    ]
    for path in records:
        assert len(json.loads(Path(path).read_text())["params"]) == 1  # the earlier format
    # Its first dry-run plans the data stages (1e9350b had no code digests) but neither job,
    # and carries the records over; so does the run, which then runs the data stages alone.
    until = ("--profile", "profiles/local", "--until", "train")
    plan = planned_jobs(work, *until)
    assert "train" not in plan and "preflight_run" not in plan and "prepare" in plan, plan
    for path in records:
        params = json.loads(Path(path).read_text())["params"]
        assert "'lr=0.05'" in params and len(params) > 1, params  # today's format
    ran = snakemake(work, *until)
    assert "rule train:" not in ran.stdout + ran.stderr
    assert "rule preflight_run:" not in ran.stdout + ran.stderr
    assert planned_jobs(work, *until) == {}  # now Snakemake checks train's params too

    config["runs"][0]["lr"] = 0.02
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    result = snakemake(work, "-n", *until)
    text = result.stdout + result.stderr
    assert re.search(r"^train\s+1$", text, re.M) and re.search(r"^preflight_run\s+1$", text, re.M)
    changes = re.findall(r"before: (.+?) now: (.+?)\s*$", text, re.M)
    assert changes and set(changes) == {("'lr=0.05'", "'lr=0.02'")}, text[-4000:]
