"""Fake run directories with the files aggregate.run_row reads, in the current layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# A run's settings as train_metrics.json records them (TrainConfig plus the job geometry).
BASE_CONFIG: dict[str, Any] = {
    "model": "resnet18",
    "epochs": 8,
    "batch_size": 256,
    "lr": 0.1,
    "momentum": 0.9,
    "weight_decay": 5e-5,
    "label_smoothing": 0.0,
    "warmup_epochs": 0.0,
    "precision": "bf16",
    "crop_size": 224,
    "eval_resize": 256,
    "workers": 7,
    "seed": 0,
    "device": "auto",
    "backend": "auto",
    "channels_last": True,
    "compile": False,
    "deterministic": False,
    "log_interval": 20,
    "timeout_minutes": 60.0,
    "synthetic": False,
    "keep_checkpoints": 2,
    "throughput_warmup_steps": 20,
    "cpus_per_task": 8,
    "extra": {},
}


BREAKDOWN = {"data_wait_ms": 3.0, "compute_ms": 80.0, "step_ms": 84.0, "input_bound_pct": 2.4,
             "mfu_pct": 31.5}  # fmt: skip


def write_run_dir(
    root: Path,
    run: str,
    *,
    nodes: int,
    tasks_per_node: int,
    steady_per_worker: float | None,
    per_worker: float | None = None,
    legacy: bool = False,
    history: list[dict[str, Any]] | None = None,
    cost: dict[str, Any] | None = None,
    holdout_top1: float = 0.6,
    **settings: Any,
) -> Path:
    """results/runs/<run>/ with train_metrics.json, eval.json, job.json and staging/*.json.

    ``per_worker`` is the end-to-end figure (default: 90 % of the steady one); ``legacy``
    writes a train_metrics.json from before the steady-state window (no steady keys, no
    geometry in the config); ``history``: train_metrics.json's epochs (history.csv's rows),
    ``cost``: its cost block (the attempt record's).
    """
    world = nodes * tasks_per_node
    if per_worker is None:
        per_worker = 0.9 * steady_per_worker
    # One GPU per rank unless a test says otherwise.
    config = {**BASE_CONFIG, "gpus_per_node": tasks_per_node, **settings, "run": run}
    config.update(nodes=nodes, tasks_per_node=tasks_per_node)
    metrics: dict[str, Any] = {
        "run": run,
        "config": config,
        "world_size": world,
        "nodes": nodes,
        "ranks": [
            {"rank": r, "host": f"node{r // tasks_per_node}", "device": "cuda:0"}
            for r in range(world)
        ],
        "global_batch": config["batch_size"] * world,
        "mean_epoch_seconds": 1_153_000 / (per_worker * world),
        "images_per_s": per_worker * world,
        "images_per_s_per_worker": per_worker,
        "steady_images_per_s": None if steady_per_worker is None else steady_per_worker * world,
        "steady_images_per_s_per_worker": steady_per_worker,
        "throughput_warmup_steps": config["throughput_warmup_steps"],
        # the step-time breakdown (training.step_timing), medians over epochs
        **BREAKDOWN,
        "epochs": history or [],
        "lr_used": config["lr"] * config["batch_size"] * world / 256,
    }
    if cost is not None:
        metrics["cost"] = cost
    if legacy:
        for key in ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node"):
            config.pop(key)
        config.pop("throughput_warmup_steps")
        config["workers"] = "auto"
        for key in ("steady_images_per_s", "steady_images_per_s_per_worker"):
            metrics.pop(key)
        metrics.pop("throughput_warmup_steps")
        for key in BREAKDOWN:
            metrics.pop(key)
    run_dir = root / "results/runs" / run
    (run_dir / "staging").mkdir(parents=True)
    (run_dir / "train_metrics.json").write_text(json.dumps(metrics))
    (run_dir / "eval.json").write_text(
        json.dumps(
            {"holdout": {"top1": holdout_top1, "top5": 0.8}, "test": {"top1": 0.58, "top5": 0.79}}
        )
    )
    (run_dir / "job.json").write_text(json.dumps({"wall_seconds": 3600.0}))
    (run_dir / "model.pt.provenance.json").write_text(
        json.dumps({"code": {"git_commit": "abc1234"}})
    )
    for node in range(nodes):
        (run_dir / "staging" / f"node{node}.json").write_text(
            json.dumps({"seconds": 120.0, "bytes": 150e9})
        )
    return run_dir


def write_preflight(root: Path, run: str, report: dict[str, Any]) -> Path:
    """results/preflight/<run>/preflight.json, where aggregate.run_row looks for it."""
    path = root / "results/preflight" / run / "preflight.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(report))
    return path
