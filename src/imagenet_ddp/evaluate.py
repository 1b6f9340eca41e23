"""Top-1/top-5 and per-class accuracy, each sample counted exactly once across ranks.

Unlike ``DistributedSampler`` (which pads the last shard with duplicates), rank r evaluates
indices ``r, r + W, r + 2W, ...`` and the counts are summed, so results do not depend on the
number of ranks.

A run's evaluation (:func:`main`, one process per rank) is started by ``imagenet-ddp
evaluate`` through :func:`imagenet_ddp.launch.launch_ranks`, like the training workers.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from imagenet_ddp.distributed import all_reduce_sum
from imagenet_ddp.eval_settings import DEFAULT_BATCH_SIZE, DEFAULT_WORKERS
from imagenet_ddp.signals import ignore_stop_signals, loader_context, stop_signals_blocked

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
        prefetch_factor=4 if workers > 0 else None,
        worker_init_fn=ignore_stop_signals,  # a stop signal is the rank's to handle
        multiprocessing_context=loader_context() if workers > 0 else None,
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
    model.train(was_training)
    return _summarize(correct1, per_class_total, correct5, loss_sum, device)


def _summarize(correct1, per_class_total, correct5, loss_sum, device) -> dict[str, Any]:
    """Sum the counters over all ranks; accuracies of the whole set."""
    num_classes = len(correct1)
    # One reduction for all counters keeps the collectives in lock-step across ranks.
    packed = torch.cat([correct1, per_class_total, correct5[None], loss_sum[None]])
    packed = all_reduce_sum(packed.to(device)).cpu()  # NCCL reduces CUDA tensors only
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


TIMING_NOTE = (
    "wall_seconds: rank 0's time from all ranks ready (model loaded, process group up) to the "
    "end of the last set's reduction: loader start-up, reading and decoding, forward passes and "
    "reductions of holdout and test; process start-up, imports and model loading excluded "
    "(job_wall_seconds, written by the launcher, includes them)"
)


def _check_world(geometry: dict[str, int], world_size: int) -> None:
    expected = geometry["nodes"] * geometry["tasks_per_node"]
    if expected != world_size:
        raise RuntimeError(
            f"evaluation configured for {geometry['nodes']} node(s) x "
            f"{geometry['tasks_per_node']} task(s) per node, but {world_size} ranks started; "
            "check the launcher's geometry"
        )


def _load_model(model_path, device: torch.device):
    from imagenet_ddp.train import build_model

    checkpoint = torch.load(model_path, map_location="cpu", weights_only=False)
    model = build_model(checkpoint["arch"], checkpoint["num_classes"])
    model.load_state_dict(checkpoint["model"])
    model.to(device)
    if checkpoint["config"].get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    return model, checkpoint["config"], checkpoint["num_classes"]


def evaluate_run(
    *,
    model_path,
    prepared_train,
    prepared_val,
    holdout_ids_csv,
    geometry: dict[str, int],
    batch_size: int = DEFAULT_BATCH_SIZE,
    workers: int | str = DEFAULT_WORKERS,
    device: str = "auto",
) -> dict[str, Any]:
    """Evaluate a trained model on the holdout split and on the test set (official val).

    One rank of ``geometry`` (nodes, tasks_per_node, cpus_per_task, gpus_per_node), started by
    :mod:`imagenet_ddp.launch`; every rank returns the summed counts. Precision and
    channels_last are the run's (from the checkpoint's config).
    """
    from imagenet_ddp import distributed as D
    from imagenet_ddp.train import loader_workers

    info = D.dist_info_from_env()
    _check_world(geometry, info.world_size)
    dev = D.select_device(device, info.local_rank, geometry["gpus_per_node"])
    D.init_process_group(info, dev, "auto", timeout_minutes=30)
    try:
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = True  # one input shape throughout
        model, cfg, num_classes = _load_model(model_path, dev)
        settings = {
            "num_classes": num_classes,
            "device": dev,
            "batch_size": batch_size,
            "workers": loader_workers(workers, geometry["cpus_per_task"]),
            "precision": cfg.get("precision", "fp32"),
            "channels_last": bool(cfg.get("channels_last")),
            "rank": info.rank,
            "world_size": info.world_size,
        }
        sets = _datasets(cfg, prepared_train, prepared_val, holdout_ids_csv)
        D.barrier()
        started = time.perf_counter()
        results = {name: evaluate_dataset(model, ds, **settings) for name, ds in sets.items()}
        seconds = time.perf_counter() - started
        backend = torch.distributed.get_backend() if D.is_distributed() else "none"
        hosts = sorted(set(D.all_gather_objects(info.host)))
    finally:
        D.destroy_process_group()
    evaluation = _evaluation_block(geometry, settings, backend, hosts, results, seconds)
    return {"run": cfg.get("run"), "evaluation": evaluation, **results}


def _datasets(cfg, prepared_train, prepared_val, holdout_ids_csv) -> dict[str, Dataset]:
    # Read from the shared prepared copy directly (no node-local staging): evaluation reads
    # every image exactly once, so staging a copy first would only double the reads.
    import pandas as pd

    from imagenet_ddp.prepared import PreparedImageDataset, eval_transform

    transform = eval_transform(cfg["eval_resize"], cfg["crop_size"])
    holdout_ids = pd.read_csv(holdout_ids_csv, usecols=["sample_id"])["sample_id"].tolist()
    return {
        "holdout": PreparedImageDataset(Path(prepared_train), holdout_ids, transform),
        "test": PreparedImageDataset(Path(prepared_val), None, transform),
    }


def _evaluation_block(geometry, settings, backend, hosts, results, seconds) -> dict[str, Any]:
    images = sum(r["samples"] for r in results.values())
    world = settings["world_size"]
    return {
        "nodes": geometry["nodes"],
        "tasks_per_node": geometry["tasks_per_node"],
        "world_size": world,
        "cpus_per_task": geometry["cpus_per_task"],
        "gpus_per_node": geometry["gpus_per_node"],
        "loader_workers": settings["workers"],
        "device": settings["device"].type,
        "backend": backend,
        "precision": settings["precision"],
        "channels_last": settings["channels_last"],
        "batch_size": settings["batch_size"],
        "hosts": hosts,
        "images": images,
        "wall_seconds": seconds,
        "images_per_s": images / seconds if seconds > 0 else None,
        "images_per_s_per_rank": images / seconds / world if seconds > 0 else None,
        "timing_note": TIMING_NOTE,
    }


def write_outputs(result: dict[str, Any], *, classes, out, per_class_csv, provenance) -> None:
    """eval.json, per_class.csv and the provenance beside eval.json (rank 0 calls this)."""
    import pandas as pd

    from imagenet_ddp.io import write_csv_atomic, write_json_atomic
    from imagenet_ddp.provenance import provenance_path, write_provenance

    table = pd.read_csv(classes, keep_default_na=False)
    per_class = table[["class_index", "wnid", "words"]].copy()
    for name in ("holdout", "test"):
        per_class[f"{name}_top1"] = result[name].pop("per_class_top1")
        per_class[f"{name}_total"] = result[name].pop("per_class_total")
        result[name].pop("per_class_correct")
    write_csv_atomic(per_class_csv, per_class)
    write_json_atomic(out, result)
    write_provenance(provenance_path(out), "evaluate", provenance)


def main(argv: list[str] | None = None) -> int:
    """One evaluation rank (started by ``imagenet-ddp evaluate`` through the launcher); all it
    needs is in the job spec (:mod:`imagenet_ddp.job_spec`)."""
    import argparse

    from imagenet_ddp.distributed import dist_info_from_env
    from imagenet_ddp.job_spec import read_spec

    parser = argparse.ArgumentParser(description="evaluation rank (one per device)")
    parser.add_argument("--spec", type=Path, required=True, help="the job spec file")
    spec = read_spec(parser.parse_args(argv).spec, "evaluate")
    paths, settings = spec["paths"], spec["settings"]
    workers = settings["workers"]
    result = evaluate_run(
        model_path=paths["model"],
        prepared_train=paths["prepared_train"],
        prepared_val=paths["prepared_val"],
        holdout_ids_csv=Path(paths["split_dir"]) / "holdout.csv",
        geometry=spec["geometry"],
        batch_size=settings["batch_size"],
        workers=workers if workers == "auto" else int(workers),
        device=settings["device"],
    )
    if dist_info_from_env().rank == 0:
        write_outputs(
            result,
            classes=paths["classes"],
            out=Path(paths["out"]),
            per_class_csv=paths["per_class"],
            provenance={"model": paths["model"], "batch_size": settings["batch_size"]},
        )
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
