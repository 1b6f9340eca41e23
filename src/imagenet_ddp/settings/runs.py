"""config.yaml to the workflow's runs, the one path (common.smk calls :func:`resolve_runs` once
per parse): the config checked against its schema (:func:`config_problems`), ``sweep:``
blocks expanded beside the hand-written ``runs`` (:func:`expand_runs`), each run resolved
(:func:`resolve_run`: schema defaults, presets, ``train_defaults``, the run) and checked
(:mod:`imagenet_ddp.settings.run_checks`).

A sweep is a name template, shared ``settings``, ``grid`` axes (every combination, in written
order) and ``zip`` axes (equal lists walked together); names are ``str.format`` over the run's
merged settings, so stable; a name produced twice is an error naming both. Torch-free.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
from jsonschema import validators

from imagenet_ddp.settings.kinds import load_schema
from imagenet_ddp.settings.presets import preset
from imagenet_ddp.settings.run_checks import check_runs

__all__ = ["RunsError", "SweepError", "config_problems", "expand_runs", "per_family", "resolve_run",
           "resolve_runs", "run_defaults", "written_settings"]  # fmt: skip


# --------------------------------------------------------------------------- the schema


def _with_defaults(validator_class):
    """Snakemake's validate's extension: each property's default set before it is checked."""
    check_properties = validator_class.VALIDATORS["properties"]

    def properties(validator, props, instance, schema):
        if isinstance(instance, dict):
            for key, sub in props.items():
                if "default" in sub:
                    instance.setdefault(key, sub["default"])
        yield from check_properties(validator, props, instance, schema)

    return validators.extend(validator_class, {"properties": properties})


_Validator = _with_defaults(jsonschema.Draft202012Validator)


def config_problems(
    config: dict[str, Any], schema: str | os.PathLike[str] | Mapping[str, Any]
) -> list[str]:
    """Validate ``config`` in place as ``snakemake.utils.validate`` does (Draft 2020-12, the
    schema's defaults filled in), but one line per problem (``config.yaml: run 'r50': model
    ...; write ...``), not jsonschema's best match. ``schema``: its file or mapping."""
    if not isinstance(schema, Mapping):
        schema = load_schema(schema)
    errors = sorted(_Validator(schema).iter_errors(config), key=lambda e: list(map(str, e.path)))
    return list(dict.fromkeys(describe_error(e, config) for e in errors))


def _where(path: Sequence, config: Mapping) -> tuple[str, list]:
    """("run 'name'" or "sweep[0]" or a section, the keys under it) for an error's path."""
    path = list(path)
    if len(path) < 2 or path[0] not in ("runs", "sweep") or not isinstance(path[1], int):
        return "", path
    entries = config.get(path[0]) or []
    entry = entries[path[1]] if path[1] < len(entries) else None
    name = entry.get("name") if isinstance(entry, Mapping) else None
    named = isinstance(name, str) and name
    if path[0] == "runs":
        return (f"run {name!r}" if named else f"runs[{path[1]}] (unnamed)"), path[2:]
    return f"sweep[{path[1]}]" + (f" (name {name!r})" if named else ""), path[2:]


def _fix(error: jsonschema.ValidationError) -> str:
    """What to do, from the failing keyword and the schema's own words."""
    kind, arg, sub = error.validator, error.validator_value, error.schema
    if kind in ("anyOf", "oneOf") and error.context:
        # each form the value may take (`workers: 4` or `workers: auto`), said once
        return " or ".join(dict.fromkeys(_fix(e) for e in error.context if not e.path))
    if kind == "additionalProperties":
        known = sorted(sub.get("properties", {}))
        extra = [k for k in error.instance if k not in known] if known else []
        close = [m for k in extra for m in difflib.get_close_matches(str(k), known, 1)]
        hint = f"did you mean {', '.join(close)}?" if close else "remove it"
        return f"{hint} (the keys here are those in docs/configuration.md)"
    if kind == "enum":
        return f"use one of {', '.join(map(repr, arg))}"
    if kind == "const":
        return f"use {arg!r}"
    if kind == "type":
        return f"write a{'n' if str(arg)[0] in 'aeiou' else ''} {arg}"
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
        return f"use a value {op[kind]} {arg}"
    if kind == "required":
        return f"add {_missing(error)}"
    if kind in ("minItems", "minProperties", "minLength"):
        return f"give at least {arg}"
    if kind == "pattern" and isinstance(error.instance, str):
        lower = error.instance.lower()
        if lower != error.instance and re.search(arg, lower):
            return f"write it in lower case ({lower!r})"
    if sub.get("description"):  # the schema's own words, up to their first clause
        return f"write {sub['description'].split(';')[0]}"
    if kind == "pattern":
        return f"write a value matching {arg}"
    return "see docs/configuration.md"


def _missing(error: jsonschema.ValidationError) -> str:
    """The key a `required` error names ("'dir' is a required property")."""
    return error.message.split("'")[1] if "'" in error.message else "it"


def describe_error(
    error: jsonschema.ValidationError, config: Mapping | None = None, who: str | None = None
) -> str:
    """One line: ``config.yaml: <run 'name' | section>: <key> <value>: <what>; <fix>``.
    ``who``: the run as its caller names it, the error's path then starting in that run."""
    if who is None:
        who, keys = _where(error.absolute_path, config or {})
    else:
        keys = list(error.absolute_path)
    key = ".".join(map(str, keys))
    what = error.message
    if error.validator == "required":
        key, what = ".".join([*map(str, keys), _missing(error)]), "is missing"
    elif error.validator == "additionalProperties":
        what = what.replace("Additional properties are not allowed ", "unknown key(s) ")
    elif error.validator in ("anyOf", "oneOf"):
        what = "is none of the forms allowed here"
    if isinstance(error.instance, (str, int, float, bool)) or error.instance is None:
        # the value is named beside its key; jsonschema's message repeats it first
        value = repr(error.instance)
        what = what[len(value) + 1 :] if what.startswith(value + " ") else what
        key = f"{key} {value}".strip()
    what = what if len(what) <= 120 else what[:117] + "..."
    head = ": ".join(p for p in ("config.yaml", who, key) if p)
    return f"{head}: {what}; {_fix(error)}"


# --------------------------------------------------------------------------- sweeps


class SweepError(ValueError):
    """A sweep that cannot expand; the message names config.yaml, the sweep and the fix."""


def run_schema(config_schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema of one ``runs`` item (definitions kept): expanded runs obey the same rules."""
    return {
        "definitions": config_schema.get("definitions", {}),
        **config_schema["properties"]["runs"]["items"],
    }


def format_value(value: Any) -> str:
    """A setting as it appears in a run name: YAML spelling (``true``, ``0.1``, ``bf16``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class _NameValues(dict):
    """Settings for the template; YAML spelling, and a clear error for an unknown key."""

    def __init__(self, settings: Mapping[str, Any], where: str):
        super().__init__({k: format_value(v) for k, v in settings.items()})
        self.where = where

    def __missing__(self, key: str) -> str:
        raise SweepError(
            f"config.yaml: {self.where}: name template uses {{{key}}}, which is not a setting "
            f"of the run; use one of {sorted(self)}"
        )


def _axis_rows(sweep: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """Axis values of every run of one sweep: grid product x zip rows, in written order."""
    grid = dict(sweep.get("grid") or {})
    zipped = dict(sweep.get("zip") or {})
    both = sorted(set(grid) & set(zipped))
    if both:
        raise SweepError(
            f"config.yaml: {where}: {', '.join(both)} under both grid and zip; "
            "give each setting one axis"
        )
    lengths = {key: len(values) for key, values in zipped.items()}
    if len(set(lengths.values())) > 1:
        raise SweepError(
            f"config.yaml: {where}: zip lists must have equal lengths, got "
            f"{', '.join(f'{k}={n}' for k, n in lengths.items())}; use grid for a product"
        )
    grid_rows = [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]
    count = next(iter(lengths.values()), 0)
    zip_rows = [{k: values[i] for k, values in zipped.items()} for i in range(count)] or [{}]
    return [{**g, **z} for g in grid_rows for z in zip_rows]


def expand_sweep(
    sweep: Mapping[str, Any],
    index: int,
    train_defaults: Mapping[str, Any],
    run_schema: Mapping[str, Any] | None = None,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """One sweep's runs as (run entry, axis values), in expansion order, each checked against
    ``run_schema`` (a ``runs`` item's) where given."""
    template = sweep["name"]
    where = f"sweep[{index}] (name {template!r})"
    shared = dict(sweep.get("settings") or {})
    if "name" in shared:
        raise SweepError(f"config.yaml: {where}: settings may not set name; the template does")
    runs = []
    for axes in _axis_rows(sweep, where):
        merged = {**train_defaults, **shared, **axes}
        name = template.format_map(_NameValues(merged, where))
        entry = {"name": name, **shared, **axes}
        if run_schema is not None:
            try:
                jsonschema.validate(entry, run_schema)
            except jsonschema.ValidationError as error:
                who = f"{where}: run {name!r} ({_describe(axes)})"
                raise SweepError(describe_error(error, who=who)) from None
        runs.append((entry, axes))
    return runs


def _describe(axes: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in axes.items()) or "no axes"


def expand_runs(config: Mapping[str, Any], run_schema: Mapping[str, Any] | None = None) -> list:
    """The hand-written ``runs``, then every sweep's: run entries (a name and the settings over
    ``train_defaults``). SweepError on a name used twice, naming where each came from."""
    defaults = config.get("train_defaults") or {}
    origin: dict[str, str] = {}
    entries = []
    for entry in config.get("runs") or []:
        _claim(origin, entry["name"], "runs (hand-written)")
        entries.append(dict(entry))
    for index, sweep in enumerate(config.get("sweep") or []):
        for entry, axes in expand_sweep(sweep, index, defaults, run_schema):
            _claim(origin, entry["name"], f"sweep[{index}] ({_describe(axes)})")
            entries.append(entry)
    if not entries:
        raise SweepError("config.yaml: no runs: add an entry under runs or a sweep")
    return entries


def _claim(origin: dict[str, str], name: str, where: str) -> None:
    if name in origin:
        raise SweepError(
            f"config.yaml: run name {name!r} is produced twice: by {origin[name]} and by "
            f"{where}; every run needs a unique name: put the setting that differs into the "
            "sweep's name template (e.g. {precision}) or rename the hand-written run"
        )
    origin[name] = where


# --------------------------------------------------------------------------- runs


class RunsError(ValueError):
    """Runs that cannot be trained: one line per problem, each naming config.yaml and the fix."""


def written_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """``train_defaults``, ``runs`` and ``sweep`` as written, copied before validation fills the
    schema's defaults into them (filled, they would override ``train_defaults`` and presets)."""
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


def resolve_run(
    defaults: Mapping[str, Any], train_defaults: Mapping[str, Any], run: Mapping[str, Any]
) -> dict[str, Any]:
    """One run's settings: ``defaults`` (the schema's), the preset, ``train_defaults`` and the
    run's own keys, in settings.presets' docstring's order."""
    resolved = dict(defaults)
    if "recipe" in run:
        resolved.update({k: v for k, v in train_defaults.items() if k != "recipe"})
        resolved.update(preset(run["recipe"]))
    else:
        resolved.update(preset(train_defaults.get("recipe", "none")))
        resolved.update(train_defaults)
    resolved.update(run)
    return per_family(resolved)


def per_family(run: dict[str, Any]) -> dict[str, Any]:
    """The settings whose default is the model family's (``auto``) made concrete: timm models take
    timm's weight-decay groups and, fine-tuning, their weights' normalization; torchvision's,
    the reference values they had before these settings existed (so no earlier run reruns)."""
    from imagenet_ddp.models import family

    timm = family(run.get("model", ""))[0] == "timm"
    if run.get("weight_decay_groups") == "auto":
        run["weight_decay_groups"] = "timm" if timm else "torchvision"
    if run.get("normalization") == "auto":
        run["normalization"] = "model" if timm and run.get("init_weights") else "imagenet"
    if run.get("zero_init_residual", False) is None and not timm:
        run["zero_init_residual"] = False  # torchvision's constructors' own default
    return run


def resolve_runs(
    config: Mapping[str, Any],
    written: Mapping[str, Any],
    schema: str | os.PathLike[str] | Mapping[str, Any],
) -> dict[str, dict[str, Any]]:
    """Every run by name, in order (hand-written runs, then each sweep's), resolved and checked.
    ``config``: validated; ``written``: its :func:`written_settings` from before validation;
    ``schema``: the config schema, its file or mapping. Raises :class:`RunsError`, one line
    per problem."""
    config_schema = schema if isinstance(schema, Mapping) else load_schema(schema)
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
    problems = check_runs(runs, config)
    if problems:
        raise RunsError("\n".join(problems))
    return runs
