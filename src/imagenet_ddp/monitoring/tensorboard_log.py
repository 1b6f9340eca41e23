"""TensorBoard event files of a run (``<run dir>/tensorboard/``), written by rank 0 only. The x
axis is the global step, so a resumed job appends an event file and continues the curves; a
fresh start removes the old ones (a training that no longer exists). Tags: docs/results.md
"Watching a run". Flushed every ``FLUSH_SECONDS``: a running job shows that late at most."""

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
