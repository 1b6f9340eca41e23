"""Top-1/top-5 and per-class accuracy, each sample counted exactly once across ranks.

Unlike ``DistributedSampler`` (which pads the last shard with duplicates), rank r evaluates
indices ``r, r + W, r + 2W, ...`` and the counts are summed, so results do not depend on the
number of ranks. Used by training (the holdout, every ``eval_interval`` epochs) and by the
evaluation stage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from imagenet_ddp.data.dataset import normalize_batch
from imagenet_ddp.jobs.distributed import all_reduce_sum
from imagenet_ddp.jobs.signals import stop_signals_blocked
from imagenet_ddp.models import IMAGENET_MEAN_STD
from imagenet_ddp.precision import autocast
from imagenet_ddp.training.data import train_loader


def shard_loader(
    dataset: Dataset,
    *,
    device: torch.device,
    batch_size: int,
    workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
    persistent: bool = False,
    cfg=None,
) -> DataLoader:
    """This rank's share of ``dataset`` (indices rank, rank + W, ...), in order, the last batch
    partial. ``persistent``: a loader made once serves every evaluation of a training run (no
    fork and warm-up per pass); its own generator (data.train_loader) keeps the training's
    random streams independent of how often the holdout is evaluated. ``cfg`` (a TrainConfig,
    or settings.evaluation.EvalInput) with ``loader: dali``: DALI decodes and crops
    (data.train_loader chooses; ``dataset`` is then read through its ``read_bytes``)."""
    shard = Subset(dataset, range(rank, len(dataset), world_size))
    pin = device.type == "cuda"
    return train_loader(shard, None, batch_size, workers, pin, persistent, cfg=cfg, device=device)


def evaluate_dataset(
    model: torch.nn.Module,
    dataset: Dataset,
    *,
    device: torch.device,
    batch_size: int,
    workers: int = 0,
    rank: int = 0,
    world_size: int = 1,
    cfg=None,
    **options,
) -> dict[str, Any]:
    """Evaluate ``dataset`` split across ranks; every rank returns the global result.
    ``cfg``: :func:`shard_loader`'s; ``options``: :func:`evaluate_loader`'s (num_classes,
    precision, ...)."""
    loader = shard_loader(
        dataset,
        device=device,
        batch_size=batch_size,
        workers=workers,
        rank=rank,
        world_size=world_size,
        cfg=cfg,
    )
    return evaluate_loader(model, loader, device=device, **options)


@torch.no_grad()
def evaluate_loader(
    model: torch.nn.Module,
    loader: DataLoader,
    *,
    num_classes: int,
    device: torch.device,
    precision: str = "fp32",
    channels_last: bool = False,
    mean_std: tuple = IMAGENET_MEAN_STD,
) -> dict[str, Any]:
    """Evaluate this rank's :func:`shard_loader`; every rank returns the global result.
    ``mean_std``: the run's input normalization (models.input_normalization)."""
    was_training = model.training
    model.eval()
    # Counted on the device and read once per pass (_summarize): no host sync per batch.
    # scatter_add_ into fixed-size counters, not bincount (which reads the max on the host).
    correct1 = torch.zeros(num_classes, dtype=torch.int64, device=device)
    per_class_total = torch.zeros(num_classes, dtype=torch.int64, device=device)
    correct5 = torch.zeros((), dtype=torch.int64, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    k = min(5, num_classes)
    with stop_signals_blocked():  # workers are forked here; see imagenet_ddp.jobs.signals
        batches = iter(loader)
    for images, targets in batches:
        images = images.to(device, non_blocking=True)
        if images.dtype == torch.uint8:  # eval_transform(normalize=False): normalize here
            images = normalize_batch(images, *mean_std)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        targets = targets.to(device, non_blocking=True)
        with autocast(device, precision):
            logits = model(images)
        logits = logits.float()
        loss_sum += criterion(logits, targets).double()
        topk = logits.topk(k, dim=1).indices
        hit1 = topk[:, 0] == targets
        correct1.scatter_add_(0, targets, hit1.long())
        per_class_total.scatter_add_(0, targets, torch.ones_like(targets))
        correct5 += (topk == targets[:, None]).any(dim=1).sum()
    model.train(was_training)
    return _summarize(correct1, per_class_total, correct5, loss_sum)


def _summarize(correct1, per_class_total, correct5, loss_sum) -> dict[str, Any]:
    """Sum the counters over all ranks (on their device: NCCL reduces CUDA tensors only);
    accuracies of the whole set. The one read from the device of the pass."""
    num_classes = len(correct1)
    # One reduction for all counters keeps the collectives in lock-step across ranks; float64
    # holds counts exactly up to 2^53.
    packed = torch.cat(
        [correct1.double(), per_class_total.double(), correct5.double()[None], loss_sum[None]]
    )
    packed = all_reduce_sum(packed).cpu()
    correct1, per_class_total = packed[:num_classes], packed[num_classes : 2 * num_classes]
    correct5, loss_sum = packed[-2], packed[-1]
    total = per_class_total.sum().item()
    with np.errstate(invalid="ignore", divide="ignore"):
        per_class = (correct1 / per_class_total).numpy()
    return {
        "samples": int(total),
        "top1": correct1.sum().item() / total if total else float("nan"),
        "top5": correct5.item() / total if total else float("nan"),
        "loss": loss_sum.item() / total if total else float("nan"),
        "per_class_correct": correct1.long().tolist(),
        "per_class_total": per_class_total.long().tolist(),
        "per_class_top1": [None if np.isnan(v) else float(v) for v in per_class],
    }
