"""One file describes a training or evaluation job; every process of the job reads it.

``imagenet-ddp train`` / ``evaluate`` (called by the rule) write the spec once, atomically, into
the job's folder; the launcher passes only its path to the per-node steps (staging, cleanup)
and to every rank, on this machine or through ``srun``. Nothing downstream re-packs it.

A training spec::

    {"kind": "train",
     "run": {...},          # the run's settings, geometry included (train.TrainConfig)
     "paths": {"prepared_train", "split_dir", "run_dir", "checkpoint_root"},
     "execution": {"launcher", "srun_extra", "scratch_dir", "stage_verify", "cleanup"}}

A preflight spec (:mod:`imagenet_ddp.preflight`) is a training spec of ``"kind": "preflight"``
with ``paths.out`` (preflight.json) and a ``preflight`` block (train_runtime_minutes,
max_allocations); it stages like training.

An evaluation spec has ``"kind": "evaluate"``, ``geometry`` (nodes, tasks_per_node,
cpus_per_task, gpus_per_node), ``settings`` (batch_size, workers, device), ``paths`` (model,
prepared_train, prepared_val, split_dir, classes, out, per_class) and ``execution``.

Torch-free: the launcher process reads it too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from imagenet_ddp.geometry import Geometry
from imagenet_ddp.io import write_json_atomic

TRAIN_SPEC = "job_spec.json"  # in the run folder
EVAL_SPEC = "eval_spec.json"  # beside eval.json
STAGING_DIR = "staging"  # <run folder>/staging/<host>.json: one report per node


def write_spec(path: str | os.PathLike[str], spec: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, spec)
    return path


def read_spec(path: str | os.PathLike[str], kind: str | tuple[str, ...]) -> dict[str, Any]:
    """The spec at ``path``, of kind ``kind`` (or of one of the kinds ``kind`` lists)."""
    spec = json.loads(Path(path).read_text())
    kinds = (kind,) if isinstance(kind, str) else kind
    if spec.get("kind") not in kinds:
        raise ValueError(f"{path}: a {spec.get('kind')!r} job spec, expected {kind!r}")
    return spec


def geometry_of(spec: dict[str, Any]) -> Geometry:
    """The geometry of either kind of spec: what the launcher needs."""
    return Geometry.of(spec["run"] if "run" in spec else spec["geometry"])  # train: the run's


def staging_report_path(run_dir: str | os.PathLike[str], host: str) -> Path:
    return Path(run_dir) / STAGING_DIR / f"{host}.json"


def staged_copy(run_dir: str | os.PathLike[str], host: str) -> Path:
    """The node-local copy of the prepared train set that ``host`` staged for this run."""
    return Path(json.loads(staging_report_path(run_dir, host).read_text())["dest"])
