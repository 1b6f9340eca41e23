"""What each run setting is, from its one declaration: the config schema's ``run_settings``,
where every setting states its default and its kind (``x-kind``, :data:`KINDS`). Everything
that treats settings differently derives from the kind: the checkpoint key, what reruns
`train`, the dry-run's line, the scaling groups, what the rank gets (TrainConfig's fields).

The schema ships inside the package (``config.schema.yaml``, a link to
workflow/schemas/config.schema.yaml): a rank keys its checkpoints by it where the workflow is
absent (the container image). Torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from imagenet_ddp.optimizers import scaled_lr
from imagenet_ddp.settings.epoch_end import evaluates
from imagenet_ddp.settings.evaluation import eval_crop
from imagenet_ddp.settings.geometry import GEOMETRY_KEYS, global_batch

SCHEMA = Path(__file__).parents[1] / "config.schema.yaml"  # the package's: package-data


@dataclass(frozen=True)
class Kind:
    """What a change of a setting of this kind does."""

    fingerprint: bool  # hashed into the checkpoint key: a change trains afresh
    # In train's params: the checkpoint key's settings and the geometry's: a rerun that would
    # only resume a finished run's final checkpoint changes nothing (a loader change does so).
    rerun: bool
    shown: bool  # on the dry-run's `hyperparameters:` line
    compared: bool  # must be equal between the runs of a scaling group
    rank: bool = True  # passed to the rank (a TrainConfig field)


# docs/configuration.md "Reruns" says the same in a table (tests/test_settings.py checks it).
KINDS = {
    # What is learned: a change retrains from scratch.
    "weights": Kind(fingerprint=True, rerun=True, shown=True, compared=True),
    # How it computes (device, backend): CPU and GPU checkpoints never mix.
    "numerics": Kind(fingerprint=True, rerun=True, shown=False, compared=True),
    # A preset's name (`recipe`): its values are other settings; shown beside them.
    "preset": Kind(fingerprint=False, rerun=False, shown=True, compared=True),
    # Where the figures are measured. The global batch, CPU or GPU (and the rank count under
    # sync_bn) are the checkpoint key's other part (settings.geometry.checkpoint_tag); the
    # loader's settings are not (a run resumes under them) but still rerun a finished train:
    # its params keep the text every earlier version gave them.
    "geometry": Kind(fingerprint=False, rerun=True, shown=False, compared=True),
    # How the figures are taken, and where a run trains (gpu_type): a run in progress resumes
    # under the new value; a finished run keeps its figures and the value they were taken at.
    "speed": Kind(fingerprint=False, rerun=False, shown=False, compared=True),
    "site": Kind(fingerprint=False, rerun=False, shown=False, compared=True),
    # How a run is logged, bounded or checked: its next job gets the new value.
    "bookkeeping": Kind(fingerprint=False, rerun=False, shown=False, compared=False),
    # What the workflow does around training (`evaluate`, `preflight`): no rank reads them.
    "workflow": Kind(fingerprint=False, rerun=False, shown=False, compared=False, rank=False),
    # The run's name (the rank's `run`): the wildcard; two runs never share checkpoints.
    "identity": Kind(fingerprint=True, rerun=False, shown=False, compared=False),
}

# The declared `name` is the rank's `run` (TrainConfig.run, the fingerprint's key).
RANK_NAMES = {"name": "run"}
EXTRA = "extra"  # TrainConfig's field for keys the declarations do not know


class DeclarationError(ValueError):
    """A run setting declared without a kind, with an unknown one, or twice."""


@dataclass(frozen=True)
class Declarations:
    """The run settings' declarations (schema properties), by the name the rank uses."""

    properties: Mapping[str, Mapping[str, Any]]

    @classmethod
    def of_schema(cls, schema: Mapping[str, Any], where: str = "the config schema") -> Declarations:
        properties = schema["definitions"]["run_settings"]["properties"]
        problems = [
            f"{where}: run setting {key!r} has x-kind {spec.get('x-kind')!r}; declare one of "
            f"{', '.join(KINDS)}"
            for key, spec in properties.items()
            if spec.get("x-kind") not in KINDS
        ]
        if problems:
            raise DeclarationError("\n".join(problems))
        return cls({RANK_NAMES.get(k, k): v for k, v in properties.items()})

    def kind(self, key: str) -> Kind | None:
        """The kind of ``key`` (a rank's name: ``run``); None for an undeclared key."""
        spec = self.properties.get(RANK_NAMES.get(key, key))
        return None if spec is None else KINDS[spec["x-kind"]]

    def keys(self, kind: str) -> tuple[str, ...]:
        return tuple(k for k, v in self.properties.items() if v["x-kind"] == kind)

    def _select(self, settings: Mapping[str, Any], flag: str) -> dict[str, Any]:
        """The settings whose kind has ``flag``; undeclared keys never."""
        return {
            k: v
            for k, v in settings.items()
            if (kind := self.kind(k)) is not None and getattr(kind, flag)
        }

    def without_earlier_values(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """``settings`` less those at their ``x-earlier`` value (what every run had before the
        setting existed): an earlier run's keys and params stay the same."""
        return {
            k: v
            for k, v in settings.items()
            if "x-earlier" not in (spec := self.properties.get(RANK_NAMES.get(k, k), {}))
            or v != spec["x-earlier"]  # Python's ==: 1 and 1.0, [0.08, 1] and [0.08, 1.0]
        }

    def earlier_values(self) -> dict[str, Any]:
        """Each ``x-earlier`` setting's value where a key leaves it out (without_earlier_values)."""
        return {k: v["x-earlier"] for k, v in self.properties.items() if "x-earlier" in v}

    def weight_settings(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """What the checkpoint fingerprint hashes of ``settings``: those that change the weights."""
        return self.without_earlier_values(self._select(settings, "fingerprint"))

    def rerun_settings(self, run: Mapping[str, Any]) -> dict[str, Any]:
        """What reruns train when it changes (the rule's params), of a resolved run."""
        return self.without_earlier_values(self._select(run, "rerun"))

    def shown_settings(self, run: Mapping[str, Any]) -> dict[str, Any]:
        return self._select(run, "shown")

    def changed_from_default(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The ``settings`` not at their declared default (the dry-run's compact line)."""
        return {
            k: v
            for k, v in settings.items()
            if "default" not in (spec := self.properties.get(RANK_NAMES.get(k, k), {}))
            or v != spec["default"]
        }

    def rank_settings(self, run: Mapping[str, Any]) -> dict[str, Any]:
        """A resolved run as the rank gets it: ``name`` as ``run``, no workflow settings."""
        renamed = {RANK_NAMES.get(k, k): v for k, v in run.items()}
        return self._select(renamed, "rank")

    def rank_defaults(self) -> dict[str, Any]:
        """Every rank setting's declared default (a job spec leaves them out)."""
        return {k: v["default"] for k, v in self.properties.items()
                if "default" in v and KINDS[v["x-kind"]].rank}  # fmt: skip

    def rank_fields(self) -> tuple[str, ...]:
        """TrainConfig's fields, in declaration order."""
        return tuple(k for k in self.properties if KINDS[self.properties[k]["x-kind"]].rank)

    def not_compared(self) -> frozenset[str]:
        """Settings that may differ between the runs of a scaling group (rank names), and
        TrainConfig's `extra` (keys a rank does not know, e.g. from a newer version)."""
        return frozenset({EXTRA, *(k for k in self.properties if not self.kind(k).compared)})


# libyaml's loader where PyYAML has it (its wheels do): every parse, each job's own included,
# reads this 30 KB file, 0.16 s with the pure-Python loader and 0.02 s with libyaml.
class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """YAML that refuses a key given twice in one mapping (plain YAML keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise DeclarationError(
                    f"{mark.name}:{mark.line + 1}: {key!r} is given twice in one mapping; "
                    "declare it once"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_schema(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The schema at ``path``; a key given twice in one mapping raises DeclarationError."""
    with open(path) as f:
        return yaml.load(f, Loader=_UniqueKeyLoader)  # a SafeLoader


def declarations(schema_path: str | os.PathLike[str] | None = None) -> Declarations:
    """The declarations of the schema at ``schema_path`` (default: the package's)."""
    return _declarations(os.path.realpath(schema_path or SCHEMA))


@functools.cache
def _declarations(path: str) -> Declarations:
    return Declarations.of_schema(load_schema(path), path)


# Two forms of a run's settings, each for what reads it: :func:`digest` names things (the
# checkpoint directory, the attempt record's key: a short hash); :func:`rerun_line` is train's
# param, which Snakemake compares as text and shows in its reason (`lr=0.1` -> `lr=0.2`).
def digest(settings: dict[str, Any]) -> str:
    """A short, stable hash of settings: the checkpoint fingerprint, the attempt record's key."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def rerun_line(settings: Mapping[str, Any]) -> str:
    """``settings`` as ``key=<JSON value>`` sorted by key, space-separated. A frozen format
    (train's params): a change of it would rerun every finished training."""
    return " ".join(
        f"{k}={json.dumps(v, sort_keys=True, separators=(',', ':'))}"
        for k, v in sorted(settings.items())
    )


def hyperparameter_line(run: Mapping[str, Any], settings: Declarations, compact=False) -> str:
    """The run's hyperparameters on one line with its global batch and ``lr_used``: every shown
    setting (those whose kind is ``shown``), sorted, for the attempt log's header; with
    ``compact``, the dry-run's (model, epochs, batch size, lr, lr_scaling, then the settings not
    at the schema's default, a preset's values included): reviewed before spending GPU hours."""
    shown = settings.shown_settings(run)
    values, changed = dict(sorted(shown.items())), {}
    if compact:
        always = ("model", "epochs", "batch_size", "lr", "lr_scaling")
        values = {k: shown[k] for k in always if k in shown}
        changed = dict(sorted(settings.changed_from_default(shown).items()))
    values["global_batch"] = batch = global_batch(run)  # as a published recipe states it
    values["lr_used"] = round(scaled_lr(run, batch), 8)  # after lr_scaling
    values.update(changed)
    return " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in values.items())


def weight_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """:meth:`Declarations.weight_settings` of the package's declarations."""
    return declarations().weight_settings(settings)


# --------------------------------------------------------------------------- the rank's settings
# TrainConfig: a field per declared setting that reaches the rank, so a setting added to the
# schema reaches the rank without a line here. Its default has one home, the schema: the
# workflow resolves every run over it and passes every key, so the class states none
# (tests/test_single_default.py).

# "auto" made the model family's value by the workflow (settings.runs.per_family), at parse.
FAMILY_AUTO = ("weight_decay_groups", "normalization")


class _TrainConfig:
    """One run's settings as a rank reads them: a field per setting that reaches the rank,
    taken from its declaration (:func:`_fields`); these are its methods."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> _TrainConfig:
        """The run of ``data`` (a job spec's ``run``: every setting, resolved, as the workflow
        passes them); unknown keys are kept in ``extra``."""
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        lacking = [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in data
        ] + [f"{k} (auto)" for k in FAMILY_AUTO if data.get(k) == "auto"]
        if lacking:
            raise ValueError(
                f"run {data.get('run')!r}: the run settings lack {', '.join(lacking)}; the "
                "workflow passes every setting resolved (schema defaults and the model family's "
                "values filled in), and a job spec written by hand must too"
            )
        extra = {k: v for k, v in data.items() if k not in known}
        cfg = cls(**{k: v for k, v in data.items() if k in known})
        cfg.extra.update(extra)
        return cfg

    def fingerprint(self) -> str:
        """Hash of everything that changes the trained weights (not logging or geometry: the
        geometry is the checkpoint key's second part)."""
        return digest(weight_settings(dataclasses.asdict(self)))

    def evaluates(self, epoch: int) -> bool:
        """Whether the holdout is evaluated after ``epoch`` (0-based;
        imagenet_ddp.settings.epoch_end)."""
        return evaluates(epoch, self.epochs, self.eval_interval)

    @property
    def eval_crop(self) -> int:
        return eval_crop(vars(self))

    def crop_for_epoch(self, epoch: int) -> int:
        """Training crop of ``epoch``: progressive resizing as FFCV's ResNet recipes do it
        (the minimum until the start epoch, linear to crop_size at the end epoch, in between
        rounded to a multiple of ``progressive_multiple``)."""
        low, start = self.progressive_min_crop, self.progressive_start_epoch
        end = self.progressive_end_epoch
        if not low or epoch >= end:
            return self.crop_size
        if epoch <= start:
            return low
        size = low + (self.crop_size - low) * (epoch - start) / (end - start)
        return int(round(size / self.progressive_multiple)) * self.progressive_multiple


def _fields() -> list[tuple]:
    """TrainConfig's fields: every declared setting that reaches the rank, in the schema's
    order (typed and checked there), none with a default (the schema's is the one; the
    workflow passes every setting), but the job's geometry: None there means "as the ranks
    started" (a rank started by hand, torchrun); and ``extra``, the keys the declarations do
    not know."""
    names = [n for n in declarations().rank_fields() if n != "run" and n not in GEOMETRY_KEYS]
    geometry = [(name, int | None, field(default=None)) for name in GEOMETRY_KEYS]
    return [
        ("run", str),
        *((n, Any) for n in names),
        *geometry,
        (EXTRA, dict[str, Any], field(default_factory=dict)),
    ]


TrainConfig = dataclasses.make_dataclass("TrainConfig", _fields(), bases=(_TrainConfig,))
TrainConfig.__module__ = __name__  # pickled by name (DataLoader workers), like a class written here
TrainConfig.__doc__ = _TrainConfig.__doc__
