"""Where a run's evaluation runs: its geometry and loader settings from config.yaml. Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_BATCH_SIZE = 128
DEFAULT_WORKERS = "auto"  # cpus_per_task - 1, as in training (geometry.loader_workers)


def eval_crop(settings: Mapping[str, Any]) -> int:
    """The evaluation's center crop: ``eval_crop_size``, else (0, or a model.pt from before it
    existed) the training crop."""
    return settings.get("eval_crop_size") or settings["crop_size"]


@dataclass(frozen=True)
class EvalInput:
    """How a model's evaluation reads its center crops: a TrainConfig's fields of the same
    names (training.accuracy.shard_loader takes either)."""

    loader: str
    eval_resize: int
    eval_crop: int
    interpolation: str

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> EvalInput:
        """A model.pt's ``config``; one from before ``loader`` or ``interpolation``: the
        values it trained with (pytorch, bilinear)."""
        return cls(settings.get("loader", "pytorch"), settings["eval_resize"],
                   eval_crop(settings), settings.get("interpolation", "bilinear"))  # fmt: skip


def eval_settings(evaluate: dict[str, Any] | None, run: dict[str, Any]) -> dict[str, Any]:
    """One run's evaluation settings: its ``evaluate`` block over the top-level one, key by key;
    unset keys follow the run (one node, a rank per GPU, its ``cpus_per_task``)."""
    chosen = {**(evaluate or {}), **(run.get("evaluate") or {})}
    gpus = chosen.get("gpus_per_node", run.get("gpus_per_node", 0))
    return {
        "nodes": chosen.get("nodes", 1),
        "tasks_per_node": chosen.get("tasks_per_node", gpus if gpus > 0 else 1),
        "cpus_per_task": chosen.get("cpus_per_task", run.get("cpus_per_task", 1)),
        "gpus_per_node": gpus,
        "batch_size": chosen.get("batch_size", DEFAULT_BATCH_SIZE),
        "workers": chosen.get("workers", DEFAULT_WORKERS),
    }
