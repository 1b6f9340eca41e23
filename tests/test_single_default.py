"""Each setting has one default, in the workflow's schema (workflow/schemas/config.schema.yaml).

The rules, the CLI, config.yaml and the training worker's config dataclass do not repeat it,
and docs/configuration.md documents every key with the schema's default. Fast: reads
files and builds the argument parser; no workflow runs.
"""

from __future__ import annotations

import dataclasses
import re

import yaml

from imagenet_ddp.settings.geometry import GEOMETRY_KEYS
from tests.workflow_helpers import REPO, SCHEMA

# TrainConfig's geometry is None when not given: "as the ranks started" for a worker started by
# hand (torchrun); the workflow always passes the schema's geometry.
FROM_THE_RANKS = set(GEOMETRY_KEYS)
NOT_SETTINGS = {"extra"}  # unknown keys kept


def train_config_class():
    """The training worker's config dataclass (one place to repoint when it moves)."""
    from imagenet_ddp.settings.kinds import TrainConfig

    return TrainConfig


def schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


def run_defaults() -> dict:
    properties = schema()["definitions"]["run_settings"]["properties"]
    return {key: spec["default"] for key, spec in properties.items() if "default" in spec}


def section_defaults() -> dict[str, dict]:
    """section -> {key: default} for the top-level sections' keys."""
    out = {}
    for section, spec in schema()["properties"].items():
        properties = spec.get("properties", {})
        out[section] = {k: v["default"] for k, v in properties.items() if "default" in v}
    return out


def test_train_config_states_no_default_and_refuses_a_run_that_lacks_a_setting():
    import pytest

    from imagenet_ddp.settings.kinds import declarations
    from tests.workflow_helpers import run_settings

    fields = {f.name: f for f in dataclasses.fields(train_config_class())}
    settings = set(fields) - NOT_SETTINGS
    # Every setting the worker reads is declared, and every run key it gets is read (the
    # declared kinds say which the rule passes: imagenet_ddp.settings.kinds).
    assert settings == set(declarations(SCHEMA).rank_fields())
    assert set(run_defaults()) >= settings - {"run"}, "every run setting needs its schema default"
    for name in settings - FROM_THE_RANKS:
        assert fields[name].default is fields[name].default_factory is dataclasses.MISSING, name
    for name in FROM_THE_RANKS:
        assert fields[name].default is None, name
    lacking = {key: value for key, value in run_settings().items() if key != "lr"}
    with pytest.raises(ValueError, match="lack lr; the workflow passes every setting"):
        train_config_class().from_dict(lacking)
    # "auto" is the workflow's to resolve at parse (settings.runs.per_family); the rank
    # never guesses it, so a hand-written spec that leaves it is refused in one line.
    unresolved = {**run_settings(), "normalization": "auto"}
    with pytest.raises(ValueError, match=r"lack normalization \(auto\); the workflow passes"):
        train_config_class().from_dict(unresolved)


def test_rules_read_settings_without_a_fallback_default():
    """`config.get(key, default)` would be a second default: the schema fills every key
    (keyword calls, Snakemake's `checkpoints.<rule>.get(wildcard=...)`, are no default)."""
    for path in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"\.get\([^()=]*,", line), f"{path.name}:{number}: {line.strip()}"


# CLI options that carry a schema setting: the rule passes each, so none has its own default.
CLI_SETTINGS = {
    "demo-data": {
        "num_classes": "demo.num_classes",
        "train_per_class": "demo.train_per_class",
        "val_per_class": "demo.val_per_class",
        "image_size": "demo.image_size",
        "seed": "demo.seed",
    },
    "verify": {"check_md5": "data.check_md5"},
    "prepare": {
        "short_side": "prepare.short_side",
        "quality": "prepare.jpeg_quality",
        "workers": "prepare.workers",
        "on_corrupt": "prepare.on_corrupt",
    },
}
# Job spec fields that carry a schema setting (imagenet_ddp.jobs.spec): the rule passes each
# (workflow/rules/common.smk job_spec), so none has a default of its own.
SPEC_SETTINGS = {
    "Execution": {"launcher": "execution.launcher", "srun_extra": "execution.srun_extra"},
    "Stage": {
        "scratch_dir": "stage.scratch_dir",
        "verify": "stage.verify",
        "cleanup": "stage.cleanup",
    },
}


def _subparsers():
    import argparse

    from imagenet_ddp.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_cli_options_for_schema_settings_have_no_default_of_their_own():
    parsers = _subparsers()
    defaults = section_defaults()
    for command, options in CLI_SETTINGS.items():
        actions = {a.dest: a for a in parsers[command]._actions}
        for dest, key in options.items():
            section, name = key.split(".")
            assert name in schema()["properties"][section]["properties"], key
            action = actions[dest]
            assert action.required and action.default is None, (command, dest, defaults)


def test_job_spec_fields_for_schema_settings_have_no_default_of_their_own():
    import dataclasses

    from imagenet_ddp.jobs import spec as job_spec

    for name, options in SPEC_SETTINGS.items():
        fields = {f.name: f for f in dataclasses.fields(getattr(job_spec, name))}
        for field, key in options.items():
            section, setting = key.split(".")
            assert setting in schema()["properties"][section]["properties"], key
            assert fields[field].default is dataclasses.MISSING, (name, field)


def test_the_evaluation_spec_has_no_default_of_eval_settings():
    """Evaluation defaults follow the run, so their home is imagenet_ddp.settings.evaluation: the
    rule passes them (common.smk job_spec), the spec states none."""
    import dataclasses

    from imagenet_ddp.jobs.spec import EvalSettings
    from imagenet_ddp.settings.evaluation import eval_settings

    fields = {f.name: f for f in dataclasses.fields(EvalSettings)}
    for key in set(eval_settings(None, {})) & set(fields):
        assert fields[key].default is dataclasses.MISSING, key


def test_config_yaml_sets_no_key_to_its_default():
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    defaults = section_defaults()
    repeated = [
        f"{section}.{key}"
        for section, values in config.items()
        if isinstance(values, dict) and section != "train_defaults"
        for key, value in values.items()
        if key in defaults.get(section, {}) and defaults[section][key] == value
    ]
    run_default = run_defaults()
    for key, value in config["train_defaults"].items():
        if run_default.get(key) == value:
            repeated.append(f"train_defaults.{key}")
    assert not repeated, f"config.yaml repeats the schema's defaults: {repeated}"


def _readme_settings() -> dict[str, str]:
    """`key` -> default cell of the "All settings" table in docs/configuration.md."""
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text.split("## All settings", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def _schema_keys() -> dict[str, object]:
    """Every settable key as docs/configuration.md names it, with its schema default (or None)."""
    keys: dict[str, object] = {}
    for section, spec in schema()["properties"].items():
        if section in ("train_defaults", "runs"):
            continue
        if spec.get("type") == "array":  # sweep: a list, one row (its keys: "Sweeps")
            keys[section] = None
            continue
        properties = spec.get("properties")
        if properties is None:  # evaluate: a $ref
            properties = schema()["definitions"]["eval_settings"]["properties"]
        for key, value in properties.items():
            keys[f"{section}.{key}"] = value.get("default")
    for key, value in schema()["definitions"]["run_settings"]["properties"].items():
        if key not in ("name", "evaluate"):
            keys[key] = value.get("default")
    return keys


def test_configuration_doc_lists_every_key_with_the_schemas_default():
    from imagenet_ddp.settings.evaluation import eval_settings

    rows = _readme_settings()
    problems = []
    keys = _schema_keys()
    # Evaluation defaults that do not follow the run live in eval_settings, not the schema.
    for key in ("nodes", "batch_size", "workers"):
        keys[f"evaluate.{key}"] = eval_settings(None, {})[key]
    for key, default in keys.items():
        if key not in rows:
            problems.append(f"`{key}` missing")
            continue
        shown = re.match(r"`([^`]*)`", rows[key])
        if default is not None and (not shown or yaml.safe_load(shown.group(1) or '""') != default):
            problems.append(f"`{key}`: the docs say {rows[key]!r}, the schema {default!r}")
    assert not problems, "docs/configuration.md 'All settings': " + "; ".join(problems)


def test_the_schema_is_where_allowed_values_are_checked():
    """prepare/stage do not re-check their settings: a bad value stops the workflow here,
    naming the key (what the prepare and stage modules used to check again)."""
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    base = yaml.safe_load((REPO / "config.yaml").read_text())
    for section, key, value in [
        ("prepare", "on_corrupt", "x"),
        ("prepare", "jpeg_quality", 101),
        ("prepare", "short_side", 4),
        ("stage", "verify", "md5"),
    ]:
        config = {**base, section: {**base.get(section, {}), key: value}}
        try:
            validate(config, str(SCHEMA))
        except WorkflowError as error:
            assert key in str(error) or key in str(error.__cause__ or ""), (key, str(error))
        else:
            raise AssertionError(f"{section}.{key}: {value!r} passed the schema")
