"""A run's settings (:class:`TrainConfig`) and the geometry of the job that trains it.

Every field of :class:`TrainConfig` is a run setting of ``train_defaults``/``runs`` in
config.yaml, derived from its declaration in the schema (workflow/schemas/config.schema.yaml,
:mod:`imagenet_ddp.settings.kinds`): a setting added there reaches the rank without a line here. Its
default has one home, the schema: the workflow resolves every run over it and passes every key,
so the class states none (tests/test_single_default.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from typing import Any

import torch

from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.settings.epoch_end import evaluates
from imagenet_ddp.settings.geometry import GEOMETRY_KEYS, Geometry, loader_workers
from imagenet_ddp.settings.kinds import EXTRA, declarations, digest, weight_settings

# "auto" made the model family's value by the workflow (settings.presets.per_family), at parse.
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
        return self.eval_crop_size or self.crop_size

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
TrainConfig.__module__ = __name__  # pickled by name, like a class written here
TrainConfig.__doc__ = _TrainConfig.__doc__


def resolve_geometry(cfg: TrainConfig, info: D.DistInfo, device: torch.device) -> Geometry:
    """The configured geometry, checked against the ranks that actually started."""
    tasks = cfg.tasks_per_node or info.local_world_size
    nodes = cfg.nodes or max(1, info.world_size // tasks)
    if nodes * tasks != info.world_size:
        raise RuntimeError(
            f"run {cfg.run!r}: configured {nodes} node(s) x {tasks} task(s) per node, but "
            f"{info.world_size} ranks started; check the launcher's geometry"
        )
    cpus = cfg.cpus_per_task or int(
        os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("OMP_NUM_THREADS") or 1
    )
    gpus = cfg.gpus_per_node
    if gpus is None:
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return Geometry(nodes, tasks, cpus, gpus, loader_workers(cfg.workers, cpus))
