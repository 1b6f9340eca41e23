"""config.yaml against its schema, each problem one line naming the run (or section) and key.

:func:`config_problems` validates as ``snakemake.utils.validate`` does (Draft 2020-12, the
schema's defaults filled into the config in place by the same ``properties`` extension, from
jsonschema's FAQ) but reports every error, not jsonschema's best match with its dump of the
schema and instance: ``config.yaml: run 'r50': model 'ResNet50': does not match ...; write ...``.

Torch-free: jsonschema and PyYAML come with Snakemake.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
import yaml
from jsonschema import validators

__all__ = ["config_problems", "describe_error"]


def _with_defaults(validator_class):
    """Snakemake's extension (snakemake.utils.validate): each property's default set before
    the property is checked, so the filled config is Snakemake's."""
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
    """Validate ``config`` in place (the schema's defaults filled in as Snakemake's validate
    fills them) and return one line per problem, none when it is valid. ``schema``: the
    schema file or its loaded mapping."""
    if not isinstance(schema, Mapping):
        with open(schema) as f:
            schema = yaml.safe_load(f)
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
