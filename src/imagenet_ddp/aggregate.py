"""One table across all runs: throughput, scaling, staging, accuracy, provenance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

COLUMNS = [
    "run",
    "model",
    "nodes",
    "workers",
    "gpus",
    "global_batch",
    "precision",
    "epochs",
    "staging_seconds",
    "staging_gb_per_s",
    "mean_epoch_seconds",
    "images_per_s",
    "images_per_s_per_worker",
    "scaling_efficiency",
    "holdout_top1",
    "holdout_top5",
    "test_top1",
    "test_top5",
    "wall_seconds",
    "git_commit",
]


def run_row(run_dir: Path) -> dict[str, Any]:
    """Collect one run's numbers from the files its train/evaluate rules wrote."""
    train = json.loads((run_dir / "train_metrics.json").read_text())
    evaluation = json.loads((run_dir / "eval.json").read_text())
    job = json.loads((run_dir / "job.json").read_text())
    staging = [json.loads(p.read_text()) for p in sorted((run_dir / "staging").glob("*.json"))]
    cfg = train["config"]
    gpus = sum(1 for r in train["ranks"] if r["device"].startswith("cuda"))
    stage_seconds = max((s["seconds"] for s in staging), default=float("nan"))
    stage_bytes = max((s["bytes"] for s in staging), default=0)
    return {
        "run": train["run"],
        "model": cfg["model"],
        "nodes": train["nodes"],
        "workers": train["world_size"],
        "gpus": gpus,
        "global_batch": train["global_batch"],
        "precision": cfg["precision"],
        "epochs": cfg["epochs"],
        "staging_seconds": stage_seconds,
        "staging_gb_per_s": stage_bytes / stage_seconds / 1e9 if stage_seconds else float("nan"),
        "mean_epoch_seconds": train["mean_epoch_seconds"],
        "images_per_s": train["images_per_s"],
        "images_per_s_per_worker": train["images_per_s_per_worker"],
        "holdout_top1": evaluation["holdout"]["top1"],
        "holdout_top5": evaluation["holdout"]["top5"],
        "test_top1": evaluation["test"]["top1"],
        "test_top5": evaluation["test"]["top5"],
        "wall_seconds": job["wall_seconds"],
        "git_commit": job["provenance"]["code"].get("git_commit", "unknown"),
    }


def aggregate_runs(run_dirs: list[Path]) -> pd.DataFrame:
    table = pd.DataFrame([run_row(d) for d in run_dirs])
    # Scaling efficiency: per-worker throughput relative to the smallest run of the same model.
    baseline = (
        table.sort_values(["model", "workers", "run"])
        .groupby("model")["images_per_s_per_worker"]
        .first()
    )
    table["scaling_efficiency"] = table["images_per_s_per_worker"] / table["model"].map(baseline)
    return table[COLUMNS].sort_values(["model", "workers", "run"]).reset_index(drop=True)


def to_markdown(table: pd.DataFrame) -> str:
    return table.to_markdown(index=False, floatfmt=".4g") + "\n"
