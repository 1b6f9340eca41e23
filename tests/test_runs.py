"""Run resolution (imagenet_ddp.settings.runs.resolve_runs), the one path from config.yaml to the
runs
the rules use: hand-written runs then sweeps, schema defaults < presets / train_defaults < the
run, and every problem refused with one line. In-process: no Snakemake run."""

from __future__ import annotations

import copy

import pytest
import yaml

from imagenet_ddp.settings.presets import PRESETS
from imagenet_ddp.settings.runs import RunsError, resolve_runs, run_defaults, written_settings
from tests.workflow_helpers import REPO, SCHEMA


def resolve(config: dict, tmp_path) -> dict[str, dict]:
    """As workflow/rules/common.smk does: the written settings first, then Snakemake's
    validate (which fills the schema's defaults in place), then resolution."""
    from snakemake.utils import validate

    written = written_settings(config)
    validate(config, str(SCHEMA))
    return resolve_runs(config, written, SCHEMA)


def repo_config(**changes) -> dict:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config.update(copy.deepcopy(changes))
    return config


def test_presets_train_defaults_and_sweeps_resolve_in_order(tmp_path):
    v1 = PRESETS["torchvision-resnet50-v1"]
    config = repo_config(
        train_defaults={"recipe": "torchvision-resnet50-v1", "epochs": 2, "crop_size": 32,
                        "eval_resize": 36, "eval_crop_size": 32, "batch_size": 4},
        runs=[{"name": "hand", "recipe": "ffcv-resnet50", "crop_size": 32, "eval_resize": 36,
               "eval_crop_size": 32, "progressive_min_crop": 0, "batch_size": 8}],
        sweep=[{"name": "{model}-n{nodes}", "settings": {"model": "resnet18"},
                "grid": {"nodes": [1, 2]}}],
    )  # fmt: skip
    runs = resolve(config, tmp_path)
    assert list(runs) == ["hand", "resnet18-n1", "resnet18-n2"]
    # recipe in train_defaults: schema defaults < preset < train_defaults < the run.
    swept = runs["resnet18-n2"]
    assert swept["recipe"] == "torchvision-resnet50-v1" and swept["lr"] == v1["lr"]
    assert swept["epochs"] == 2 and swept["batch_size"] == 4 and swept["model"] == "resnet18"
    assert swept["nodes"] == 2 and swept["name"] == "resnet18-n2"
    # Keys no level sets have the schema's default, not a value filled into an entry.
    defaults = run_defaults(yaml.safe_load(SCHEMA.read_text()))
    assert swept["max_allocations"] == defaults["max_allocations"]
    # recipe in a run: schema defaults < train_defaults < preset < the run.
    hand = runs["hand"]
    assert hand["recipe"] == "ffcv-resnet50" and hand["lr"] == PRESETS["ffcv-resnet50"]["lr"]
    assert hand["epochs"] == PRESETS["ffcv-resnet50"]["epochs"]  # the preset beats train_defaults
    assert hand["batch_size"] == 8 and hand["crop_size"] == 32


def test_the_repo_config_resolves_to_its_two_runs(tmp_path):
    runs = resolve(repo_config(), tmp_path)
    assert list(runs) == ["resnet18-1x2", "resnet18-1x1"]
    assert runs["resnet18-1x1"]["tasks_per_node"] == 1 and runs["resnet18-1x2"]["epochs"] == 4


def test_a_sweep_that_cannot_expand_is_one_error(tmp_path):
    config = repo_config(sweep=[{"name": "{model}", "grid": {"nodes": [1, 2]}}])
    with pytest.raises(RunsError, match="run name 'resnet18' is produced twice"):
        resolve(config, tmp_path)


def test_every_problem_of_every_run_is_one_line(tmp_path):
    config = repo_config(
        runs=[{"name": "a", "model": "resnet9000"}, {"name": "b", "crop_size": 64}]
    )
    with pytest.raises(RunsError) as error:
        resolve(config, tmp_path)
    lines = str(error.value).splitlines()
    assert len(lines) == 3, lines  # a: model; b: crop and the evaluation crop
    assert lines[0].startswith("config.yaml: run 'a': model 'resnet9000' ")
    assert all(line.startswith("config.yaml: run 'b': ") for line in lines[1:])
