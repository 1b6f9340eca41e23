"""The opt-in profiler window (``profile: {epoch, steps, ranks}``): a ``torch.profiler`` trace
of a few training steps in the run's TensorBoard folder (``tensorboard_trace_handler``; open
it in TensorBoard's profile plugin or ``chrome://tracing``).

The window opens at the first step of epoch ``epoch`` that this job trains (the profiler's
warm-up), records the next ``steps``, then writes the trace (an epoch shorter than the window
at its end); rank 0 records, with ``ranks: per_node`` the first rank of every node. The
profiler only observes: the weights are bitwise those of the run without it
(tests/test_step_timing.py); the profiled steps are slower, which history.csv's
``profiled_steps`` says. A bookkeeping setting: changing it reruns nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from imagenet_ddp.jobs import distributed as D


class ProfileWindow:
    """The ``profile`` setting of a rank: :meth:`open` gives the epoch's profiler or None."""

    def __init__(self, setting: dict[str, Any] | None, info: D.DistInfo, trace_dir: Path):
        self.setting, self.info, self.trace_dir = setting or {}, info, trace_dir
        per_node = self.setting.get("ranks") == "per_node"
        self.records = bool(self.setting) and (
            info.rank == 0 or (per_node and info.local_rank == 0)
        )

    def window(self, epoch: int) -> int:
        """Steps of ``epoch`` in the window on the recording ranks (warm-up included; 0: none)."""
        return 1 + self.setting["steps"] if self.setting.get("epoch") == epoch else 0

    def steps(self, epoch: int) -> int:
        """Steps of ``epoch`` this rank records (0: none)."""
        return self.setting["steps"] if self.records and self.window(epoch) else 0

    def open(self, epoch: int, device: torch.device):
        """The started profiler of ``epoch`` (call ``.step()`` after every step and ``.stop()``
        at the epoch's end), or None when this rank records nothing in it."""
        steps = self.steps(epoch)
        if not steps:
            return None
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        name = f"{self.info.host}-rank{self.info.rank}"
        profiler = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(self.trace_dir), worker_name=name),
        )
        profiler.start()
        return profiler
