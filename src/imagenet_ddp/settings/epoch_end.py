"""What an epoch's end costs: which epochs evaluate the holdout (``eval_interval``), and the
projection of a run's evaluation and checkpoint time from measured rates. Torch-free.
"""

from __future__ import annotations

import math
from typing import Any

# eval_interval auto: a holdout curve of about this many points. An evaluation of the v2 recipe
# at 2 x 8 H100 costs ~a tenth of its epoch (benchmarks/bench_epoch_end.py): ~20 of 600 epochs
# keep it well under 1 % of training time.
EVALUATIONS_PER_RUN = 20


def eval_every(epochs: int, interval: int | str) -> int:
    """The epochs between holdout evaluations: ``interval``, or for ``auto`` one in
    ceil(epochs / EVALUATIONS_PER_RUN)."""
    if interval == "auto":
        return max(1, math.ceil(epochs / EVALUATIONS_PER_RUN))
    return int(interval)


def evaluates(epoch: int, epochs: int, interval: int | str) -> bool:
    """Whether the holdout is evaluated after ``epoch`` (0-based): every ``interval`` epochs
    and always after the last."""
    return (epoch + 1) % eval_every(epochs, interval) == 0 or epoch + 1 >= epochs


def evaluations(epochs: int, interval: int | str) -> int:
    return sum(evaluates(epoch, epochs, interval) for epoch in range(epochs))


def projection(
    *,
    epochs: int,
    eval_interval: int | str,
    ema: bool,
    holdout_images: int,
    world: int,
    eval_images_per_s: float,
    epoch_seconds: float,
    checkpoint_hold_seconds: float,
    checkpoint_write_seconds: float,
) -> dict[str, Any]:
    """A run's epoch-end time from per-rank rates: ``eval_images_per_s`` one rank's holdout rate,
    ``checkpoint_hold_seconds`` how long a save holds rank 0, ``checkpoint_write_seconds`` the
    background write, which holds the next save only where it outlasts an epoch."""
    passes = 2 if ema else 1
    per_evaluation = passes * holdout_images / world / eval_images_per_s
    count = evaluations(epochs, eval_interval)
    hold = checkpoint_hold_seconds + max(0.0, checkpoint_write_seconds - epoch_seconds)
    eval_seconds, checkpoint_seconds = count * per_evaluation, epochs * hold
    return {
        "evaluations": count,
        "passes_per_evaluation": passes,
        "seconds_per_evaluation": per_evaluation,
        "eval_seconds": eval_seconds,
        "checkpoint_seconds_per_epoch": hold,
        "checkpoint_seconds": checkpoint_seconds,
        "epoch_end_seconds": eval_seconds + checkpoint_seconds,
        "epoch_end_share": (eval_seconds + checkpoint_seconds) / (epochs * epoch_seconds),
    }
