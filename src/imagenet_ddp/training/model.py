"""The ``model.pt`` file format, and the model built from it (imagenet_ddp.models builds).

``model.pt`` has exactly one writer (:func:`save_model`) and one reader (:func:`read_model_file`;
:func:`load_model` and :func:`model_from_state` build the model from it).
It is a ``torch.save`` dict::

    format_version  MODEL_FORMAT_VERSION
    arch            the model setting (imagenet_ddp.models: "resnet50", "timm/vit_tiny_...")
    num_classes     output classes
    model           state_dict of the trained model (no DDP prefix)
    config          the run's settings and geometry (TrainConfig + geometry.Geometry fields;
                    its model_kwargs rebuild the model)
    ema             runs with ``ema_decay`` > 0 only: state_dict of the averaged model (the
                    same torchvision model, weights and BatchNorm buffers averaged)
    diverged        runs the divergence guard stopped only (training.guard): where and why;
                    ``model`` then holds the weights of the last good checkpoint

Tensors and plain data only: read with ``weights_only=True`` (a file that needs more is
refused, checkpoint.load_tensors). Loading it into torchvision or timm without this package:
docs/results.md "Loading a trained model".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from imagenet_ddp.io import atomic_path
from imagenet_ddp.models import build_model  # the one factory (torchvision's and timm's)
from imagenet_ddp.training.checkpoint import load_tensors

MODEL_FORMAT_VERSION = 1


def save_model(
    path: Path,
    model: torch.nn.Module,
    *,
    arch: str,
    num_classes: int,
    config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``model.pt`` atomically (a reader never sees a half-written file)."""
    state = {
        "format_version": MODEL_FORMAT_VERSION,
        "arch": arch,
        "num_classes": num_classes,
        "model": model.state_dict(),
        "config": config,
        **(extra or {}),
    }
    with atomic_path(Path(path)) as tmp:
        torch.save(state, tmp)


def read_model_file(path: Path) -> dict[str, Any]:
    """The raw contents of ``model.pt``, checked: a clear error for a foreign or newer file."""
    state = load_tensors(path)  # tensors and plain data only: nothing in it runs
    if not isinstance(state, dict) or "model" not in state or "arch" not in state:
        raise ValueError(f"{path}: not a model file written by imagenet-ddp train")
    version = state.get("format_version", 1)  # files before the field existed are version 1
    if version > MODEL_FORMAT_VERSION:
        raise ValueError(
            f"{path}: model file format {version} is newer than this version of imagenet-ddp "
            f"reads ({MODEL_FORMAT_VERSION}); update the package"
        )
    return state


def load_model(
    path: Path, device: torch.device | str = "cpu", *, weights: str = "model"
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The trained model on ``device`` (channels_last if the run trained so) and the file's
    contents. ``weights``: ``"model"``, or ``"ema"`` for the averaged weights when present."""
    state = read_model_file(path)
    return model_from_state(state, device, weights=weights, path=path), state


def model_from_state(
    state: dict[str, Any], device: torch.device | str = "cpu", *, weights: str = "model", path=""
) -> torch.nn.Module:
    """The model of ``state`` (:func:`read_model_file`'s) with its ``weights`` on ``device``."""
    if weights not in state or state[weights] is None:
        raise ValueError(f"{path}: has no {weights!r} weights (the run did not keep them)")
    model = build_model(state["arch"], state["num_classes"], state["config"].get("model_kwargs"))
    model.load_state_dict(state[weights])
    model.to(device)
    if state["config"].get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    return model
