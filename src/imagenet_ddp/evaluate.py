"""Top-1/top-5 and per-class accuracy, each sample counted exactly once across ranks.

Unlike ``DistributedSampler`` (which pads the last shard with duplicates), rank r evaluates
indices ``r, r + W, r + 2W, ...`` and the counts are summed, so results do not depend on the
number of ranks.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from imagenet_ddp.distributed import all_reduce_sum
from imagenet_ddp.signals import ignore_stop_signals, stop_signals_blocked

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate_dataset(
    model: torch.nn.Module,
    dataset: Dataset,
    *,
    num_classes: int,
    device: torch.device,
    batch_size: int,
    workers: int = 0,
    precision: str = "fp32",
    channels_last: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """Evaluate ``dataset`` split across ranks; every rank returns the global result."""
    was_training = model.training
    model.eval()
    shard = Subset(dataset, range(rank, len(dataset), world_size))
    loader = DataLoader(
        shard,
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=ignore_stop_signals,  # a stop signal is the rank's to handle
    )
    correct1 = torch.zeros(num_classes, dtype=torch.float64)
    correct5 = torch.zeros((), dtype=torch.float64)
    per_class_total = torch.zeros(num_classes, dtype=torch.float64)
    loss_sum = torch.zeros((), dtype=torch.float64)
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    k = min(5, num_classes)
    with stop_signals_blocked():  # workers are forked here; see imagenet_ddp.signals
        batches = iter(loader)
    for images, targets in batches:
        images = images.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        targets = targets.to(device, non_blocking=True)
        with autocast(device, precision):
            logits = model(images)
        logits = logits.float()
        loss_sum += criterion(logits, targets).double().cpu()
        topk = logits.topk(k, dim=1).indices
        hit1 = (topk[:, 0] == targets).cpu()
        hitk = (topk == targets[:, None]).any(dim=1).cpu()
        t = targets.cpu()
        correct1 += torch.bincount(t[hit1], minlength=num_classes).double()
        per_class_total += torch.bincount(t, minlength=num_classes).double()
        correct5 += hitk.sum().double()
    # One reduction for all counters keeps the collectives in lock-step across ranks.
    packed = torch.cat([correct1, per_class_total, correct5[None], loss_sum[None]])
    packed = all_reduce_sum(packed.to(device)).cpu()  # NCCL reduces CUDA tensors only
    correct1, per_class_total = packed[:num_classes], packed[num_classes : 2 * num_classes]
    correct5, loss_sum = packed[-2], packed[-1]
    total = per_class_total.sum().item()
    model.train(was_training)
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


def evaluate_run(
    *,
    model_path,
    prepared_train,
    prepared_val,
    holdout_ids_csv,
    batch_size: int = 128,
    workers: int = 0,
    device: str = "auto",
) -> dict[str, Any]:
    """Evaluate a trained model on the holdout split and on the test set (official val).

    Runs as one process, or as several when started by torchrun/srun (counts are summed).
    """
    from pathlib import Path

    import pandas as pd

    from imagenet_ddp import distributed as D
    from imagenet_ddp.prepared import PreparedImageDataset, eval_transform
    from imagenet_ddp.train import build_model

    info = D.dist_info_from_env()
    dev = D.select_device(device, info.local_rank)
    D.init_process_group(info, dev, "auto", timeout_minutes=30)
    try:
        checkpoint = torch.load(model_path, map_location="cpu", weights_only=False)
        cfg = checkpoint["config"]
        model = build_model(checkpoint["arch"], checkpoint["num_classes"])
        model.load_state_dict(checkpoint["model"])
        model.to(dev)
        if cfg.get("channels_last"):
            model = model.to(memory_format=torch.channels_last)
        transform = eval_transform(cfg["eval_resize"], cfg["crop_size"])
        holdout_ids = pd.read_csv(holdout_ids_csv, usecols=["sample_id"])["sample_id"].tolist()
        sets = {
            "holdout": PreparedImageDataset(Path(prepared_train), holdout_ids, transform),
            "test": PreparedImageDataset(Path(prepared_val), None, transform),
        }
        results = {
            name: evaluate_dataset(
                model,
                ds,
                num_classes=checkpoint["num_classes"],
                device=dev,
                batch_size=batch_size,
                workers=workers,
                precision=cfg.get("precision", "fp32"),
                channels_last=bool(cfg.get("channels_last")),
                rank=info.rank,
                world_size=info.world_size,
            )
            for name, ds in sets.items()
        }
        return {"run": cfg.get("run"), "eval_world_size": info.world_size, **results}
    finally:
        D.destroy_process_group()
