"""The workflow's runs as the rules use them: config.yaml's runs and sweeps resolved, then checked.

:func:`resolve_runs` is the one path from config.yaml to the runs: the hand-written ``runs`` and
every sweep's expanded runs (:mod:`imagenet_ddp.settings.sweeps`), each resolved over the schema's
defaults, ``train_defaults`` and its preset (:mod:`imagenet_ddp.settings.presets`: who wins),
then refused at the dry-run if it could only fail on the GPU node
(:mod:`imagenet_ddp.settings.run_checks`). ``workflow/rules/common.smk`` calls it once per parse.

Torch-free (the standard library, PyYAML and jsonschema, which Snakemake brings): it runs while
Snakemake parses the rules, also in a login node's bare Snakemake environment.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import yaml

from imagenet_ddp.settings.init_weights import fill_digests
from imagenet_ddp.settings.presets import resolve_run
from imagenet_ddp.settings.run_checks import check_runs
from imagenet_ddp.settings.sweeps import SweepError, expand_runs, run_schema

__all__ = ["RunsError", "resolve_runs", "run_defaults", "written_settings"]


class RunsError(ValueError):
    """Runs that cannot be trained: one line per problem, each naming config.yaml and the fix."""


def written_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """``train_defaults``, ``runs`` and ``sweep`` as written, copied before Snakemake's
    ``validate`` fills the schema's defaults into them: filled in, every run's (and sweep's)
    defaults would override ``train_defaults`` and presets. Runs resolve from these."""
    return copy.deepcopy(
        {
            "train_defaults": config.get("train_defaults") or {},
            "runs": config.get("runs") or [],
            "sweep": config.get("sweep") or [],
        }
    )


def run_defaults(config_schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema's default of every run key that has one."""
    keys = config_schema["definitions"]["run_settings"]["properties"]
    return {k: v["default"] for k, v in keys.items() if "default" in v}


def resolve_runs(
    config: Mapping[str, Any],
    written: Mapping[str, Any],
    schema_path: str | os.PathLike[str],
    *,
    workdir: str | os.PathLike[str] | None = ".",
    models: frozenset[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every run by name, in order (hand-written runs, then each sweep's), resolved and checked.

    ``config``: validated (the schema's defaults filled in); ``written``: its
    :func:`written_settings` from before validation; ``schema_path``: the config schema, whose
    ``runs`` item every expanded run is held to. ``workdir``, ``models``, ``cache_dir``: as
    :func:`imagenet_ddp.settings.run_checks.check_runs` takes them. Raises :class:`RunsError` with
    every problem, one line each.
    """
    with open(schema_path) as f:
        config_schema = yaml.safe_load(f)
    try:
        entries = expand_runs(
            {**config, "runs": written["runs"], "sweep": written["sweep"]},
            run_schema(config_schema),
        )
    except SweepError as error:
        raise RunsError(str(error)) from None
    defaults = run_defaults(config_schema)
    runs = {
        entry["name"]: resolve_run(defaults, written["train_defaults"], entry) for entry in entries
    }
    # the init_weights file's digest, a weights setting: filled before the checks and keys
    problems = fill_digests(runs, check=workdir is not None, cache_dir=cache_dir)
    problems += check_runs(runs, config, workdir=workdir, models=models, cache_dir=cache_dir)
    if problems:
        raise RunsError("\n".join(problems))
    return runs
