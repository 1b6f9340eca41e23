"""Whether a run's loader feeds its GPU: measured per-worker loader rates per augmentation, GPU
step rates where we know them, and one figure for both the dry-run's estimate and the
preflight's measurement, the share of GPU time spent waiting for data. Torch-free."""

from __future__ import annotations

import math
from collections.abc import Mapping

# img/s one DataLoader worker delivers, by the run's auto_augment policy: training's loader
# (preflight.rank.loader_rate through benchmarks/bench_gpu.py's loader_only: the preset's
# dataset with the crop-first decode, its transform and augmentations, random erasing included,
# uint8 crops, the seeded sampler), 1 worker, batch 32, crop 224 from prepare.short_side 256,
# 512 synthetic ImageNet-size JPEGs (~110 KB originals), the median of 3 loaders each timed
# >= 25 s (loaders: 531-548, 283-330, 218-246 img/s). Measured 2026-12-02 on a 2-core AMD
# EPYC VM loaded by 3 other jobs: an under-estimate of an idle server core, the safe side for
# a warning (more warnings, never fewer). Since 2026-12-04 v1's and v2's samples no longer save
# and restore NumPy's RNG (SeededAugmentation.of_run), ~80 us a sample: v1's 1.14-1.17x in
# bench_loader.py (benchmarks/README.md), v2's ~1.05x by that arithmetic (not re-measured).
PER_WORKER_RATES = {
    "none": 540.0,  # torchvision-resnet50-v1 (RandomResizedCrop, flip)
    "trivialaugment": 309.0,  # torchvision-resnet50-v2 (TrivialAugmentWide, erasing 0.1)
    "randaugment": 246.0,  # deit-small (timm rand-m9-mstd0.5-inc1, erasing 0.25)
}
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
    """The PER_WORKER_RATES entry of an auto_augment setting: timm's rand-* specs and
    torchvision's randaugment as RandAugment; autoaugment (not measured) as RandAugment, the
    dearest measured."""
    if auto_augment in ("none", "trivialaugment"):
        return auto_augment
    return "randaugment"


def per_worker_rate(run: Mapping, short_side: int) -> float:
    """A worker's img/s for ``run`` at ``short_side``: the measured figure, its decode taken to
    cost as the prepared image's pixels (an approximation; the preflight measures)."""
    rate = PER_WORKER_RATES[policy(run.get("auto_augment", "none"))]
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
