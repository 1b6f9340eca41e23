"""TensorBoard event files of a run, written by rank 0 only (``torch.utils.tensorboard``).

Layout: ``results/runs/<run>/tensorboard/``. All scalars share one x axis, the global step
(``epoch x steps_per_epoch + step``), so a resumed run continues its curves: a resumed job
appends a new event file beside the earlier ones; a fresh start removes them (they belong to
a training that no longer exists). Tags:

- ``train/loss``, ``train/images_per_s``, ``train/lr`` every ``log_interval`` steps, and rank
  0's step-time breakdown over the interval: ``train/data_wait_ms``, ``train/compute_ms``,
  ``train/step_ms``, ``train/input_bound_pct`` (training.step_timing);
- ``epoch/train_loss``, ``epoch/train_top1``, ``epoch/holdout_top1``, ``epoch/holdout_top5``,
  ``epoch/holdout_loss``, ``epoch/images_per_s``, ``epoch/steady_images_per_s``, ``epoch/lr``
  and the epoch's breakdown over all ranks (``epoch/data_wait_ms``, ``epoch/compute_ms``,
  ``epoch/step_ms``, ``epoch/input_bound_pct``, ``epoch/mfu_pct``) at the end of every epoch;
- the profiler window's traces (``profile``, training.profile_window), ``*.pt.trace.json``;
- ``gpu/utilization_percent``, ``gpu/memory_used_gb``, ``gpu/power_watts`` (rank 0's node,
  summed over its GPUs except utilization, the mean) when NVML telemetry is sampled.

Events are flushed every ``FLUSH_SECONDS``, so ``tensorboard --logdir results/runs`` on a
login node shows a running job with at most that delay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FLUSH_SECONDS = 30
EPOCH_TAGS = (
    "train_loss",
    "train_top1",
    "holdout_top1",
    "holdout_top5",
    "holdout_loss",
    "images_per_s",
    "steady_images_per_s",
    # the step-time breakdown (training.step_timing.BREAKDOWN_NOTE)
    "data_wait_ms",
    "compute_ms",
    "step_ms",
    "input_bound_pct",
    "mfu_pct",
)


class TensorBoardLog:
    """Thin wrapper over ``SummaryWriter``: fixed tags, absent values skipped, never fatal."""

    def __init__(self, log_dir: Path, *, fresh: bool):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: rank 0 only

        log_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = SummaryWriter(str(log_dir), flush_secs=FLUSH_SECONDS)

    def scalars(self, prefix: str, values: dict[str, Any], step: int) -> None:
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(f"{prefix}/{name}", float(value), step)

    def epoch(self, record: dict[str, Any], step: int) -> None:
        values = {tag: record.get(tag) for tag in EPOCH_TAGS}
        values["lr"] = record.get("lr_end")
        self.scalars("epoch", values, step)

    def close(self) -> None:
        self.writer.close()
