"""An upgrade from the last landed version (c3f0997, 0.1.0) resubmits no finished training, with
Snakemake's own commands only (docs/configuration.md "Code changes"): the workflow reads or
writes none of Snakemake's records."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.workflow_helpers import REPO, TINY_CONFIG_OVERRIDES, planned_jobs, snakemake

EARLIER = "c3f0997"  # the last landed version: one param per rerun setting, code digests


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


def _swap(work, tree):
    for name in ("Snakefile", "workflow", "profiles"):
        if (work / name).exists():
            shutil.rmtree(work / name) if (work / name).is_dir() else (work / name).unlink()
        (shutil.copytree if (tree / name).is_dir() else shutil.copy)(tree / name, work / name)


@pytest.mark.e2e
def test_upgrade_from_the_earlier_version_resubmits_no_finished_training(tmp_path):
    """Real: the workflow trained by the code of EARLIER, then today's in the same working
    directory. Its dry-run shows the finished train and preflight (their params' format
    changed); the documented steps (--touch of the earlier stages, the new local records,
    --touch of the GPU jobs) run none of them and leave nothing to do but the tables; a
    changed lr then plans them, the reason naming lr alone."""
    old = _earlier_tree(tmp_path / "old")
    work = tmp_path / "work"
    work.mkdir()
    _swap(work, old)
    config = _tiny_config(old)
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(old / "src")}
    args = [sys.executable, "-m", "snakemake", "--profile", "profiles/local", "--until", "train"]
    done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    model = work / "results/runs/r/model.pt"
    trained = model.stat().st_mtime_ns

    _swap(work, REPO)  # today's workflow, the config as it was
    profile = ("--profile", "profiles/local")
    plan = planned_jobs(work, *profile, "--until", "train")
    assert plan.get("train") == 1 and plan.get("preflight_run") == 1, plan
    data = ("verify", "index", "split", "prepare", "prepare_chunk")
    snakemake(work, *profile, "--touch", "--allowed-rules", *data)
    snakemake(work, *profile, "keys")  # the records, then the keys (their paths are the records')
    snakemake(work, *profile, "--touch", "--allowed-rules", "train", "preflight_run", "evaluate")
    assert model.stat().st_mtime_ns >= trained and "rule train:" not in done.stdout
    plan = planned_jobs(work, *profile)  # evaluate: never run by the earlier invocation
    assert set(plan) <= {"evaluate", "accounting", "aggregate", "plots", "all"}, plan
    ran = snakemake(work, *profile)
    assert "rule train:" not in ran.stdout + ran.stderr
    assert planned_jobs(work, *profile) == {}

    config["runs"][0]["lr"] = 0.02
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    result = snakemake(work, "-n", *profile)
    text = result.stdout + result.stderr
    assert re.search(r"^train\s+1$", text, re.M) and re.search(r"^preflight_run\s+1$", text, re.M)
    assert "run 'r': lr 0.05 -> 0.02" in result.stderr.splitlines(), text[-3000:]
