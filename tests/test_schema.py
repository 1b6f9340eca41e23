"""config.yaml against its schema (imagenet_ddp.settings.runs.config_problems): the defaults
filled in as Snakemake's validate fills them, and every problem one line naming the run (or
section) and the key, with no jsonschema dump."""

from __future__ import annotations

import copy

import pytest
import yaml

from imagenet_ddp.settings.runs import RunsError, config_problems, resolve_runs, written_settings
from tests.workflow_helpers import REPO, SCHEMA


def repo_config(**changes) -> dict:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config.update(copy.deepcopy(changes))
    return config


def test_defaults_are_filled_as_snakemakes_validate_fills_them():
    from snakemake.utils import validate

    config = repo_config(sweep=[{"name": "{lr}", "grid": {"lr": [0.1]}}], evaluate={"nodes": 1})
    ours, theirs = copy.deepcopy(config), copy.deepcopy(config)
    assert config_problems(ours, SCHEMA) == []
    validate(theirs, str(SCHEMA))
    assert ours == theirs and ours != config  # filled, and filled alike


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        # a run by its name, the key and its value, and what to write instead
        (
            {"runs": [{"name": "a"}, {"name": "b"}, {"name": "c", "model": "ResNet50"}]},
            ["config.yaml: run 'c': model 'ResNet50': does not match",
             "write it in lower case ('resnet50')"],
        ),
        # an unnamed run by its index; a misspelt key with the key it likely meant
        (
            {"runs": [{"lrr": 0.1}]},
            ["config.yaml: runs[0] (unnamed): unknown key(s) ('lrr' was unexpected); "
             "did you mean lr?"],
        ),
        # outside runs: section.key
        (
            {"train_defaults": {"lr": "fast"}},
            ["config.yaml: train_defaults.lr 'fast': is not of type 'number'; write a number"],
        ),
        # an anyOf: every form the value may take
        (
            {"evaluate": {"workers": -1}},
            ["config.yaml: evaluate.workers -1: ", "use a value >= 0 or use 'auto'"],
        ),
        (
            {"runs": [{"name": "x", "precision": "fp8"}]},
            ["config.yaml: run 'x': precision 'fp8': ", "use one of 'fp32', 'bf16', 'fp16'"],
        ),
    ],
)  # fmt: skip
def test_each_problem_is_one_line_naming_the_run_and_key(changes, expected):
    problems = config_problems(repo_config(**changes), SCHEMA)
    line = next(p for p in problems if expected[0] in p)
    assert all(part in line for part in expected), line
    for problem in problems:
        assert "\n" not in problem and "instance[" not in problem and "schema" not in problem


def test_every_problem_is_reported_not_only_the_first():
    config = repo_config(runs=[{"name": "x", "nodes": 0, "tasks_per_node": "two"}])
    problems = config_problems(config, SCHEMA)
    assert len(problems) == 2
    assert problems[0].startswith("config.yaml: run 'x': nodes 0: ")
    assert problems[1].startswith("config.yaml: run 'x': tasks_per_node 'two': ")


def test_empty_runs_beside_a_sweep_resolve_and_no_runs_at_all_is_one_line(tmp_path):
    sweep = [{"name": "r-{lr}", "grid": {"lr": [0.1, 0.2]}}]
    config = repo_config(runs=[], sweep=sweep)
    written = written_settings(config)
    assert config_problems(config, SCHEMA) == []
    runs = resolve_runs(config, written, SCHEMA)
    assert list(runs) == ["r-0.1", "r-0.2"]

    config = repo_config(runs=[], sweep=[])
    written = written_settings(config)
    assert config_problems(config, SCHEMA) == []
    with pytest.raises(RunsError, match=r"^config.yaml: no runs: add an entry under runs or a"):
        resolve_runs(config, written, SCHEMA)
