"""Expand config.yaml's ``sweep:`` block into runs, beside the hand-written ``runs``.

A sweep is a name template, shared ``settings`` and two kinds of axes over any run setting:

- ``grid``: every combination (Cartesian product) of its lists, in the order written;
- ``zip``: lists of equal length walked together (row i takes the i-th value of each).

With both, every grid combination is taken with every zip row. Each expanded run is
``{name, **settings, **axis values}`` and is then handled exactly like a hand-written run
(``train_defaults`` merged in, the same schema and dry-run checks). Names come from the
template, ``str.format`` over the run's merged settings (``"{model}-n{nodes}-{precision}"``):
readable, and stable because they depend only on the run's own values, not on the order or
size of the sweep. A name used twice, by two expanded runs or by a sweep and a hand-written
run, is an error naming both origins: silently dropping one would train one run fewer.

No Snakemake or torch here: the workflow (``imagenet_ddp.settings.runs``) and the tests call it
directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import jsonschema

from imagenet_ddp.settings.schema import describe_error

__all__ = ["SweepError", "expand_runs", "expand_sweep", "format_value", "run_schema"]


class SweepError(ValueError):
    """A sweep that cannot expand; the message names config.yaml, the sweep and the fix."""


def run_schema(config_schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema of one ``runs`` item, taken from the config schema (its definitions kept), so
    expanded runs are held to exactly the rules of hand-written ones."""
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
    """One sweep's runs as (run entry, axis values), in expansion order. ``run_schema``: the
    schema a hand-written ``runs`` item must satisfy; every expanded run is checked with it."""
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
    """The hand-written ``runs`` followed by every sweep's runs: a list of run entries (name
    plus the settings that override ``train_defaults``). Raises :class:`SweepError` on a name
    used twice, naming where each came from and the settings that differ."""
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
