"""The opt-in profiler window (``profile: {epoch, steps, ranks}``): a ``torch.profiler`` trace
of a few training steps, written into the run's TensorBoard folder.

The window opens at the first step of epoch ``epoch`` (0-based) that this job trains; that
step is the profiler's warm-up (its first step carries the profiler's own start-up), the next
``steps`` are recorded, then the trace is written (``tensorboard_trace_handler``:
``<run dir>/tensorboard/<host>-rank<r>.<time>.pt.trace.json``, which TensorBoard's profile
plugin and ``chrome://tracing`` open). Rank 0 records; with ``ranks: per_node``, the first rank
of every node. An epoch shorter than the window writes what it recorded at its end.

The profiler only observes: the weights are bitwise those of the same run without it
(tests/test_step_timing.py). The recorded steps run slower (the profiler's overhead), so the
profiled epoch's throughput and step times include it: history.csv's ``profiled_steps`` says
how many steps of an epoch were profiled. A bookkeeping setting: changing it reruns nothing
and keeps the checkpoints (imagenet_ddp.settings.kinds).
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
