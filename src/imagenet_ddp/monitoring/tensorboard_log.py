"""TensorBoard event files of a run, written by rank 0 only (``torch.utils.tensorboard``).

Layout: ``results/runs/<run>/tensorboard/``. Every scalar's x axis is the global step
(``epoch x steps_per_epoch + step``), so a resumed run continues its curves: a resumed job
appends an event file beside the earlier ones; a fresh start removes them (they belong to a
training that no longer exists). Tags (imagenet_ddp.monitoring.monitor): ``train/*`` every
``log_interval`` steps (loss, images_per_s, lr, rank 0's step-time breakdown), ``epoch/*`` at
each epoch's end (monitor.EPOCH_TAGS, lr), ``gpu/*`` (NVML, rank 0's node); the profiler
window's traces (``*.pt.trace.json``, training.profile_window). Events are flushed every
``FLUSH_SECONDS``: ``tensorboard --logdir results/runs`` shows a running job that late at most.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FLUSH_SECONDS = 30


class TensorBoardLog:
    """Thin wrapper over ``SummaryWriter``: fixed tags, absent values skipped."""

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

    def close(self, *, finished: bool = False) -> None:
        self.writer.close()
