"""Where a training step's time goes (data wait, compute, the rest), model FLOPs and MFU.

No host sync per step. The loop marks each step at ``fetch`` (before the loader's next()),
``ready`` (the batch on the device, normalized, mixed) and ``done`` (the optimizer step
queued). ``data_wait``: fetch to ready on the host. ``compute``: ready to done; on a GPU
between two CUDA events, read once complete (queried every ``log_interval`` steps), never
waited for. ``step``: CPU: fetch to fetch; GPU: done event to done event. ``input_bound``: CPU:
the data wait; GPU: the device's idle gap before ``ready``, at most the host's data wait.
Exposed communication lies inside ``compute`` (the profiler window shows it apart). Model
FLOPs are counted once per crop size on the meta device (:func:`flops_per_image`); MFU
compares them at the epoch's steady throughput with the device's dense peak.
"""

from __future__ import annotations

import functools
import json
import math
import time
from typing import Any

import torch

from imagenet_ddp.jobs import distributed as D

# Dense (no sparsity) peak tensor-core TFLOP/s per GPU from NVIDIA's data sheets, by precision:
# fp32 runs use TF32 tensor cores for convolutions (torch.backends.cudnn.allow_tf32 is on by
# default), so "fp32" is the TF32 peak where there is one. Matched against the device name in
# this order; a MIG slice or an unlisted GPU gets no MFU (None), never a guess.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 418.0}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),  # SXM5 ("H100 80GB HBM3")
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),  # SXM4 and PCIe alike
    ("L40S", {"bf16": 362.05, "fp16": 362.05, "fp32": 183.0}),
    ("V100-SXM2", {"fp16": 125.0, "fp32": 15.7}),  # no bf16, no TF32: fp32 is the FMA peak
    ("V100-PCIE", {"fp16": 112.0, "fp32": 14.0}),
)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak FLOP/s at ``precision``; None on CPU or an unknown GPU."""
    if device.type != "cuda" or "MIG" in (name := torch.cuda.get_device_name(device)):
        return None  # a MIG slice: its share of the peak is not in the name
    peaks = next((p for pattern, p in PEAK_TFLOPS if pattern.lower() in name.lower()), {})
    return peaks[precision] * 1e12 if precision in peaks else None


@functools.cache
def flops_per_image(model_name: str, num_classes: int, crop: int, model_kwargs: str = "{}") -> int:
    """Model FLOPs of one training step per image (forward and backward). Counted on a batch
    of 2 (BatchNorm in training mode refuses one value per channel, as a tiny crop gives).
    ``model_kwargs``: as JSON (hashable, for the cache)."""
    from imagenet_ddp.models import build_model, on_meta

    model = on_meta(lambda: build_model(model_name, num_classes, json.loads(model_kwargs)))
    images = torch.empty(2, 3, crop, crop, device="meta")
    return count_flops(model, images) // 2


def count_flops(model: torch.nn.Module, images: torch.Tensor) -> int:
    """FLOPs of one forward and backward of ``model`` on ``images`` (not divided by batch)."""
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    backward = {torch.ops.aten.convolution_backward: _conv_backward_flops}
    with FlopCounterMode(display=False, custom_mapping=backward) as counter:
        model(images).sum().backward()
    return int(counter.get_total_flops())


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, *args, out_shape=None, **kwargs):
    """A convolution's backward: each multiply-add of its forward is one of the input's
    gradient and one of the weight's. torch's own formula (flop_counter.conv_backward_flop)
    counts the weight's gradient as if the convolution were dense, ``groups`` times too many
    for a grouped or depthwise one (RegNet, ResNeXt, EfficientNet, ConvNeXt, ...)."""
    from torch.utils.flop_counter import conv_flop_count

    transposed, output_mask = args[4], args[7]
    forward = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def mfu_percent(flops_image: float | None, images_per_s: float | None, ranks: int, peak):
    """Model FLOPs utilization in percent: achieved model FLOP/s over the ranks' peak."""
    if not flops_image or not images_per_s or not peak:
        return None
    return 100.0 * flops_image * images_per_s / (ranks * peak)


class StepTimer:
    """One rank's step-time breakdown for one epoch (this job's part of it)."""

    def __init__(self, device: torch.device, drain_every: int, profiled: int = 0):
        self.profiled = profiled  # steps in the profiler window (its warm-up step included)
        self.cuda = device.type == "cuda"
        self.device, self.drain_every = device, max(1, drain_every)
        self.totals = dict.fromkeys(("data", "compute", "step", "input"), 0.0)
        self.steps = 0  # steps whose figures are in totals
        self.marked = 0  # steps marked
        self.interval = dict(self.totals, steps=0)  # since the monitor last read
        self.fetch_at = self.ready_at = self.step_from = 0.0
        self.host_wait: list[float] = []  # GPU: host data wait of steps not yet drained
        self.events: list[tuple[Any, Any]] = []  # GPU: (ready, done) of steps not yet drained
        self.last_done = None  # GPU: the previous drained step's done event

    def fetch(self) -> None:
        self.fetch_at = time.perf_counter()
        if self.marked == 0:  # a step runs from the previous step's done to its own
            self.step_from = self.fetch_at

    def ready(self) -> None:
        self.ready_at = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append((event, None))
            self.host_wait.append(self.ready_at - self.fetch_at)

    def done(self) -> None:
        self.marked += 1
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[-1] = (self.events[-1][0], event)
            if self.marked % self.drain_every == 0:
                self._drain(wait=False)
            return
        now = time.perf_counter()
        data = self.ready_at - self.fetch_at
        self._add(data, now - self.ready_at, now - self.step_from, data)
        self.step_from = now  # the loop's bookkeeping after this step joins the next one

    def _add(self, data: float, compute: float, step: float, input_bound: float) -> None:
        for totals in (self.totals, self.interval):
            totals["data"] += data
            totals["compute"] += compute
            totals["step"] += step
            totals["input"] += input_bound
        self.steps += 1
        self.interval["steps"] += 1

    def _drain(self, *, wait: bool) -> None:
        """Fold in the GPU steps whose events are complete (all of them with ``wait``)."""
        if wait and self.events and self.events[-1][1] is not None:
            self.events[-1][1].synchronize()
        while self.events and self.events[0][1] is not None and self.events[0][1].query():
            ready, done = self.events.pop(0)
            host = self.host_wait.pop(0)
            compute = ready.elapsed_time(done) / 1e3
            if self.last_done is None:  # the first step: the device waited for it all along
                gap, step = host, host + compute
            else:
                gap = self.last_done.elapsed_time(ready) / 1e3
                step = self.last_done.elapsed_time(done) / 1e3
            self._add(host, compute, step, min(gap, host))
            self.last_done = done

    def read_interval(self) -> dict[str, float | None]:
        """This rank's figures since the last read (the monitor's, every log_interval)."""
        figures = _figures(self.interval, self.interval["steps"])
        self.interval = dict.fromkeys(self.totals, 0.0) | {"steps": 0}
        return figures

    def reduce(self) -> dict[str, float | None]:
        """The epoch's figures, each the maximum over ranks of the rank's mean per step
        (collective: call on every rank, at the epoch's end)."""
        if self.cuda:
            self._drain(wait=True)
        mine = _figures(self.totals, self.steps)
        keys = list(mine)
        values = [math.nan if mine[k] is None else mine[k] for k in keys]
        # NaN (a rank without a step) would win over any number; -1 stands for "none" instead.
        values = [-1.0 if math.isnan(v) else v for v in values]
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        reduced = D.all_reduce_max(tensor).cpu().tolist()
        return {k: (None if v < 0 else v) for k, v in zip(keys, reduced, strict=True)}


def _figures(totals: dict[str, float], steps: int) -> dict[str, float | None]:
    """Mean milliseconds per step and the input-bound share of the step time."""
    if steps == 0 or totals["step"] <= 0:
        return dict.fromkeys(BREAKDOWN_COLUMNS)
    return {
        "data_wait_ms": 1e3 * totals["data"] / steps,
        "compute_ms": 1e3 * totals["compute"] / steps,
        "step_ms": 1e3 * totals["step"] / steps,
        "input_bound_pct": 100.0 * totals["input"] / totals["step"],
    }


BREAKDOWN_COLUMNS = ("data_wait_ms", "compute_ms", "step_ms", "input_bound_pct")

BREAKDOWN_NOTE = (
    "data_wait_ms, compute_ms, step_ms: mean per step of every step of the epoch (the first, "
    "with the loader's start, included; holdout evaluation and epoch-end checkpoints excluded), "
    "the maximum over ranks of each rank's mean; input_bound_pct: the share of step time the "
    "rank's device waited for its input, the most input-bound rank's; flops_per_image: model "
    "FLOPs of one forward and backward (matrix multiplications and convolutions); mfu_pct: "
    "those at steady_images_per_s over the ranks' dense peak, empty on CPU or an unknown GPU "
    "(imagenet_ddp.training.step_timing)."
)


def breakdown_row(job, epoch: int, timer: StepTimer, steady, num_classes: int) -> dict:
    """The breakdown columns of an epoch's history row (collective: every rank); ``job``: the
    training.state.TrainingState, ``steady``: the epoch's steady_images_per_s (global)."""
    cfg = job.cfg
    flops_image = flops_per_image(
        cfg.model, num_classes, cfg.crop_for_epoch(epoch), json.dumps(cfg.model_kwargs)
    )
    peak = peak_flops(job.device, cfg.precision)
    return {
        **timer.reduce(),
        "profiled_steps": min(timer.profiled, timer.marked),
        "flops_per_image": flops_image,
        "mfu_pct": mfu_percent(flops_image, steady, job.info.world_size, peak),
    }


def timed_steps(batches, timer, profiler=None):
    """``batches`` with the step marks of ``timer`` (:class:`StepTimer`) around each fetch,
    and the step boundary of ``profiler`` (training.profile_window) after each step; the
    profiler is stopped (its trace written) when the epoch's iteration ends, however it ends."""
    iterator = iter(batches)
    try:
        while True:
            timer.fetch()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            timer.ready()
            yield batch
            if profiler is not None:
                profiler.step()
    finally:
        if profiler is not None:
            try:
                profiler.stop()
            except Exception as error:  # a trace is not worth a training
                print(f"profile: no trace: {type(error).__name__}: {error}", flush=True)
