"""Whether a run's loader feeds its GPU: measured per-worker loader rates per augmentation, GPU
step rates where we know them, and one figure for both the dry-run's estimate and the
preflight's measurement, the share of GPU time spent waiting for data. Torch-free."""

from __future__ import annotations

import math
from collections.abc import Mapping

# img/s one DataLoader worker delivers on an idle core, by the run's auto_augment policy:
# training's loader (preflight.rank.loader_rate: the recipe's dataset with the crop-first
# decode, its transform and augmentations, random erasing included, uint8 crops, the seeded
# sampler), 1 worker, batch 32, crop 224 from short side 256, 512 synthetic ImageNet-size JPEGs
# (~110 KB originals), the median of 3 loaders each timed 25 s after its prefetch queues filled:
#   benchmarks/bench_gpu.py --workers 1 --batch 32 --crop 224 --short-side 256 --images 512 \
#       --seconds 25 --repeats 3 --recipe <the recipe> [--auto-augment <the policy>]
# 2026-12-05 on an otherwise idle 2-core AMD EPYC VM (no SMT); an interleaved run the day
# before, another VM, read 1.07-1.11x these. Not shown: a server core's rate, and whether the
# rates add up over 8-16 workers sharing a node's memory bandwidth.
IDLE_CORE_RATES = {
    "none": 981.0,  # --recipe none: v1's RandomResizedCrop and flip
    "trivialaugment": 552.0,  # --recipe torchvision-resnet50-v2 (erasing 0.1)
    "randaugment": 398.0,  # torchvision's: --recipe none --auto-augment randaugment
    "autoaugment": 583.0,  # torchvision's ImageNet policy: --recipe none --auto-augment autoaugment
    "timm rand-*": 360.0,  # --recipe deit-small: rand-m9-mstd0.5-inc1, erasing 0.25
}
# DeiT's was measured before its crop reached timm's ops through recipe.pil_image (2026-12-07),
# which bench_loader.py reads 1.07-1.14x faster a core: low by that much, the warning's safe side.
# The share of such a core that one SLURM CPU of a GPU node is taken to give a worker: where a
# site's CPUs are hardware threads (a DGX H100's 224 on 112 cores, docs/cluster.md#cpus-per-gpu),
# two busy workers share each core, about 0.6 of it each (two SMT threads do ~1.1-1.3x one;
# assumed, not measured: this VM has no SMT). The safe side for a warning: more warnings where
# CPUs are cores, never fewer. (The 2026-12-02 figures, this VM loaded by 3 other jobs, read
# 0.55-0.68x these.)
CPU_SHARE = 0.6
MEASURED_SHORT_SIDE, MEASURED_CROP = 256, 224

# img/s of one GPU stepping the model alone (eager, compiled), bf16 autocast, channels_last,
# batch 256, crop 224. h200: ours, benchmarks/gpu_check.sh on one H200, 2026-11-27
# (docs/proven.md); a100: NVIDIA DeepLearningExamples ResNet-50 v1.5, AMP, batch 256 (eager
# only: its compiled figure is taken as the eager one). Other models: not known, no estimate.
GPU_STEP_RATES = {
    ("resnet50", "h200"): (4689.0, 6809.0),
    ("resnet50", "a100"): (2470.0, 2470.0),
}

WAYS_OUT = (
    "loader: dali (GPU decoding and augmentation), more cpus_per_task, "
    "or a smaller prepare.short_side"
)


def gpu_time_lost(loader: float, gpu: float) -> float:
    """The share of a GPU's time it waits for a loader of ``loader`` img/s feeding a step of
    ``gpu`` img/s, loading overlapping compute: 1 - loader / gpu when the loader is slower."""
    return max(0.0, 1.0 - loader / gpu) if gpu > 0 else 0.0


def cpus_for_loader(per_worker: float, gpu: float) -> int:
    """cpus_per_task whose loader workers (cpus - 1: ``workers: auto``) feed ``gpu`` img/s at
    ``per_worker`` img/s each, the loader's rate taken to grow with its workers."""
    return math.ceil(gpu / per_worker) + 1 if per_worker > 0 else 0


def policy(auto_augment: str) -> str:
    """The IDLE_CORE_RATES entry of an auto_augment setting (any timm rand-* spec as DeiT's)."""
    return "timm rand-*" if auto_augment.startswith("rand-") else auto_augment


def per_worker_rate(run: Mapping, short_side: int) -> float:
    """A worker's img/s for ``run`` at ``short_side`` on one SLURM CPU: the measured figure at
    CPU_SHARE, its decode taken to cost as the prepared image's pixels (an approximation; the
    preflight measures)."""
    rate = IDLE_CORE_RATES[policy(run.get("auto_augment", "none"))] * CPU_SHARE
    return rate * (MEASURED_SHORT_SIDE / short_side) ** 2


def gpu_step_rate(run: Mapping) -> tuple[float, str] | None:
    """(img/s, where it comes from) of one of ``run``'s GPUs stepping its model, scaled from
    crop 224 by pixels; an unset or unlisted gpu_type: the slowest listed GPU's, a lower
    bound; None: the model's rate is not known."""
    model, gpu_type = run["model"], (run.get("gpu_type") or "").lower()
    known = {gpu: rates for (name, gpu), rates in GPU_STEP_RATES.items() if name == model}
    if not known:
        return None
    listed = [gpu for gpu in known if gpu_type.startswith(gpu)] if gpu_type else []
    gpu = listed[0] if listed else min(known, key=lambda g: known[g][0])
    rate = known[gpu][1 if run.get("compile") else 0]
    compiled = " compiled" if run.get("compile") else ""
    source = f"{model} on {gpu}{compiled}" + ("" if listed else f" (gpu_type {gpu_type or 'any'}"
                                              ": the slowest GPU listed)")  # fmt: skip
    return rate * (MEASURED_CROP / run["crop_size"]) ** 2, source
