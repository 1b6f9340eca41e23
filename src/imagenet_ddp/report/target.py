"""Time and GPU-hours to a target top-1 (``report.target_top1``): the first evaluated epoch
whose holdout top-1 reaches it, and the allocations' wall time and GPU-hours up to that epoch's
end, over every allocation of the run.

No timestamp per epoch is recorded; what is: each epoch's times (history.csv's
``epoch_seconds``, ``eval_seconds``, ``checkpoint_seconds``) and each allocation's wall time,
GPUs, last checkpoint and lost time (the attempt record, train_metrics.json's ``cost``). An
epoch's figure is every allocation before the one that finished it, in full (staging, queue
not included, lost work included), plus that one's wall time less its epochs after it and its
lost work: it includes that allocation's tail after its last epoch (writing model.pt, seconds).
"""

from __future__ import annotations

import math
from typing import Any


def _seconds(row: dict[str, Any], key: str) -> float:
    value = row.get(key)
    return 0.0 if value is None or (isinstance(value, float) and math.isnan(value)) else value


def epoch_work_seconds(row: dict[str, Any]) -> float:
    """One epoch's training, holdout evaluation and checkpoint hold (history.csv)."""
    return sum(_seconds(row, k) for k in ("epoch_seconds", "eval_seconds", "checkpoint_seconds"))


def cost_by_epoch(
    history: list[dict[str, Any]], attempts: list[dict[str, Any]]
) -> list[tuple[float, float]] | None:
    """(wall seconds, GPU-hours) over every allocation up to the end of each epoch of
    ``history``; None without an attempt record (a run from before it was kept)."""
    if not attempts or not history:
        return None
    done = [(a.get("last_checkpoint") or {}).get("epoch") or 0 for a in attempts]
    out = []
    for index, row in enumerate(history):
        finished = int(row["epoch"]) + 1  # a checkpoint after epoch e records epoch e + 1
        k = next((i for i, d in enumerate(done) if d >= finished), len(attempts) - 1)
        before = attempts[:k]
        mine = attempts[k]
        later = sum(
            epoch_work_seconds(h) for h in history[index + 1 :] if int(h["epoch"]) < done[k]
        )
        wall = mine.get("wall_seconds") or 0.0
        within = max(0.0, wall - later - (mine.get("lost_seconds") or 0.0))
        gpus = (mine.get("gpu_hours") or 0.0) * 3600 / wall if wall else 0.0
        out.append(
            (
                sum(a.get("wall_seconds") or 0.0 for a in before) + within,
                sum(a.get("gpu_hours") or 0.0 for a in before) + gpus * within / 3600,
            )
        )
    return out


def time_to_target(
    history: list[dict[str, Any]], attempts: list[dict[str, Any]], target: float | None
) -> dict[str, Any]:
    """``target_epochs`` (epochs trained when the holdout first reached ``target``, a
    fraction), ``target_wall_seconds``, ``target_gpu_hours`` and ``target_note``: why a cell
    is empty."""
    empty = {"target_epochs": None, "target_wall_seconds": math.nan, "target_gpu_hours": math.nan}
    if target is None:
        return {**empty, "target_note": "no target (report.target_top1)"}
    evaluated = [
        (i, h) for i, h in enumerate(history) if not math.isnan(_float(h.get("holdout_top1")))
    ]
    reached = next((i for i, h in evaluated if _float(h["holdout_top1"]) >= target), None)
    if reached is None:
        best = max((_float(h["holdout_top1"]) for _, h in evaluated), default=math.nan)
        shown = "no holdout evaluated" if math.isnan(best) else f"best {100 * best:.1f} %"
        return {**empty, "target_note": f"not reached in {len(history)} epochs ({shown})"}
    costs = cost_by_epoch(history, attempts)
    row = {**empty, "target_epochs": int(history[reached]["epoch"]) + 1, "target_note": ""}
    if costs is None:
        return {**row, "target_note": "no attempt record: time and GPU-hours unknown"}
    row["target_wall_seconds"], row["target_gpu_hours"] = costs[reached]
    return row


def _float(value: Any) -> float:
    try:
        return math.nan if value is None else float(value)
    except (TypeError, ValueError):
        return math.nan
