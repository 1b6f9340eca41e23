"""A training job's host memory per node, estimated at the dry-run against its ``mem_mb``.

SLURM's ``--mem`` is per node; a node runs ``tasks_per_node`` ranks, each with its loader's
processes. Figures are per process, in MiB: MEASURED ones by ``benchmarks/bench_memory.py``
(benchmarks/README.md "Memory"), ESTIMATED ones could not be without a GPU. The measured sum
(ranks, loader fork servers and workers with their in-flight batches, the holdout's loader;
with ``loader: dali`` DALI's rank and its spawned workers)
above ``mem_mb`` is refused; with the estimated part (CUDA, compile workers) a warning
(docs/configuration.md "the dry-run checks"). Sized by the data (:class:`DataSizes`): each
loader worker holds the dataset's per-sample arrays, and a train copy staged on a tmpfs is
charged to the job (a tmpfs the dry-run cannot see is checked on the node:
imagenet_ddp.data.stage.ram_copy_problem). Torch-free.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from imagenet_ddp.settings.evaluation import eval_crop
from imagenet_ddp.settings.geometry import loader_workers
from imagenet_ddp.settings.notices import Notice

MIB = 2**20
# Measured (bench_memory.py): RSS of a rank (torch and torchvision imported, its loader
# started): 547; of its loader's forkserver (torch and torchvision preloaded, pages shared
# with the workers it forks, so charged once): 703; USS of one loader worker: 49.
RANK_MB = 550
FORKSERVER_MB = 700
LOADER_WORKER_MB = 50
# Measured (bench_memory.py --loader dali, DALI's CPU backend, batch 256 at 224): a
# ``loader: dali`` rank, its training and holdout pipelines built (RSS): 1,251-1,402 (v1),
# 1,490 (v2), 1,513-1,630 (DeiT-S); USS of one of its external source's spawned workers (each
# imports torch, torchvision and timm itself: no forkserver to share them): 435-442 (v1, v2),
# 488 (DeiT-S); the shared memory they hand batches through: (prefetch depth + 2) chunks of a
# batch's JPEGs (43 KiB a sample there at short side 256, within 4 % of a prepared sample's).
DALI_RANK_MB = 1650
DALI_WORKER_MB = 490
# A prepared sample's bytes at short side 256 (benchmarks/README.md, prepare rehearsal: 854 MB
# for 20,000 images, tar framing included); by its pixels at another short side (assumed: at one
# quality a JPEG's bytes grow about as its pixels). The staged copy and DALI's shared memory.
PREPARED_SAMPLE_BYTES_AT_256 = 42_700
# Batches a loader worker holds in flight: the DataLoader's prefetch_factor (training.data's
# train_loader, which accuracy.shard_loader uses too), shared memory or pinned once the main
# process takes them; the preflight's loader timing drains them first (preflight.rank).
PREFETCH_BATCHES = 4
# ESTIMATED, not measured (no GPU here): a CUDA rank's host memory beyond a CPU rank's
# (the CUDA context, cuDNN/cuBLAS host allocations, pinned staging buffers); 2-3 GiB is
# what a PyTorch CUDA process commonly holds. A compile worker: measured on the CPU, one
# inductor pool process 119 MiB RSS plus the C++ compiler it runs, up to 255 MiB; on a GPU
# it compiles Triton kernels instead (not measured).
CUDA_RANK_EXTRA_MB = 2500
COMPILE_WORKER_MB = 400
# Inductor's compile workers per rank (TORCHINDUCTOR_COMPILE_THREADS): torch's default
# min(32, CPUs) makes 8 ranks x 32 processes ~ 100 GB, for a one-off at start.
MAX_COMPILE_THREADS = 4


# With a train copy in RAM, what the sum leaves out (page cache, pinned buffers,
# fragmentation) has only mem_mb's rest: below this share, a warning. A judgement.
RAM_COPY_HEADROOM = 0.15
# The dataset's per-sample arrays (five int64 each), held by the rank and each loader worker:
# 46 MB at the full train split's 1,153,050 images. Arithmetic.
DATASET_BYTES_PER_SAMPLE = 5 * 8


@dataclass(frozen=True)
class DataSizes:
    """A run's memory beyond its settings: the split's images, the train copy each node
    stages in RAM (``scratch_mb``: 0 unless on a tmpfs; measured or not; what says so) and a
    prepared sample's bytes (``sample_bytes``: what DALI's workers hand over as JPEG)."""

    train_images: int = 0
    holdout_images: int = 0
    scratch_mb: float = 0.0
    scratch_measured: bool = False
    scratch_where: str = ""
    sample_bytes: float = PREPARED_SAMPLE_BYTES_AT_256


def prepared_sample_bytes(short_side: int) -> float:
    """A prepared sample's bytes at ``short_side`` (:data:`PREPARED_SAMPLE_BYTES_AT_256`)."""
    return PREPARED_SAMPLE_BYTES_AT_256 * (short_side / 256) ** 2


def compile_threads(cpus_per_task: int) -> int:
    """Inductor's compile workers per rank: its CPUs, at most :data:`MAX_COMPILE_THREADS`."""
    return max(1, min(int(cpus_per_task), MAX_COMPILE_THREADS))


def _batch_mb(batch_size: int, crop: int) -> float:
    """One batch of uint8 crops (the transforms' output; normalized on the device)."""
    return batch_size * 3 * crop * crop / MIB


def _dali_rank_mb(workers: int, batch_size: int, sample_bytes: float) -> float:
    """A ``loader: dali`` rank (training.dali_loader): DALI's pipelines in it, its external
    source's ``workers`` spawned processes and their shared memory (none without workers: the
    rank's thread draws). The holdout's pipeline has no worker processes."""
    if not workers:
        return DALI_RANK_MB
    shared = (max(2, workers) + 2) * batch_size * sample_bytes / MIB
    return DALI_RANK_MB + workers * DALI_WORKER_MB + shared


def estimate_mb(run: Mapping[str, Any], data: DataSizes = DataSizes()) -> dict[str, float]:
    """Per node: ``measured`` and ``estimated`` MiB of a run's training job (see module)."""
    workers = loader_workers(run["workers"], run["cpus_per_task"])
    crop = eval_crop(run)
    # The holdout's loader (as many workers, the same batch size) keeps its workers from the
    # first evaluation on, beside the training loader's persistent workers.
    batch = run["batch_size"]
    train_arrays = data.train_images * DATASET_BYTES_PER_SAMPLE / MIB
    holdout_arrays = data.holdout_images * DATASET_BYTES_PER_SAMPLE / MIB
    if run.get("loader") == "dali":
        per_rank = _dali_rank_mb(workers, batch, data.sample_bytes) + train_arrays + holdout_arrays
        per_rank += workers * train_arrays  # its workers unpickle the training set's arrays
    else:
        train_worker = LOADER_WORKER_MB + PREFETCH_BATCHES * _batch_mb(batch, run["crop_size"])
        holdout_worker = LOADER_WORKER_MB + PREFETCH_BATCHES * _batch_mb(batch, crop)
        per_rank = RANK_MB + (FORKSERVER_MB if workers else 0) + train_arrays + holdout_arrays
        per_rank += workers * (train_worker + train_arrays + holdout_worker + holdout_arrays)
    extra = CUDA_RANK_EXTRA_MB if run["gpus_per_node"] > 0 else 0
    if run.get("compile"):
        extra += compile_threads(run["cpus_per_task"]) * COMPILE_WORKER_MB
    ranks = run["tasks_per_node"]
    measured, estimated = ranks * per_rank, ranks * extra
    if data.scratch_measured:
        measured += data.scratch_mb
    else:
        estimated += data.scratch_mb
    return {"measured": measured, "estimated": estimated, "workers": workers}


def memory_problem(
    name: str, run: Mapping[str, Any], mem_mb: float | None, data: DataSizes = DataSizes()
) -> tuple[str, Notice | None]:
    """(refusal line, warning) for run ``name`` against the train job's ``mem_mb`` per node;
    ``""`` and None where it fits or no ``mem_mb`` is known."""
    if mem_mb is None:
        return "", None
    figures = estimate_mb(run, data)
    measured, total = figures["measured"], figures["measured"] + figures["estimated"]
    # with a copy in RAM the estimate must leave RAM_COPY_HEADROOM of mem_mb free
    room = 1 - RAM_COPY_HEADROOM if data.scratch_mb else 1.0
    copy = f" and the {data.scratch_mb:.0f} MiB train copy staged in RAM" if data.scratch_mb else ""
    advice = (
        "raise mem_mb (set-resources train: mem_mb), or lower tasks_per_node, workers or "
        "batch_size"
        + (", or set stage.scratch_dir to a node-local disk" if copy else "")
        + " (docs/configuration.md, memory per node)"
    )
    needed = math.ceil(total / room / 1000) * 1000
    if measured > mem_mb:
        return (
            f"config.yaml: run {name!r}: train's mem_mb {mem_mb:.0f} per node is below the "
            f"{measured:.0f} MiB that {run['tasks_per_node']} rank(s) per node with "
            f"{figures['workers']} loader worker(s) each{copy}"
            + (f" ({data.scratch_where})" if copy else "")
            + f" hold (measured figures); {advice.replace('mem_mb', f'mem_mb to {needed}', 1)}",
            None,
        )
    parts = ["CUDA"] * (run["gpus_per_node"] > 0) + ["compile workers"] * bool(run.get("compile"))
    parts += ["the RAM copy"] * bool(data.scratch_mb and not data.scratch_measured)
    head = f"train's mem_mb {mem_mb:.0f} per node"
    estimated = f"({' and '.join(parts)} estimated)"
    docs = "(docs/configuration.md, memory per node)"
    detail = f"~{total:.0f} MiB: mem_mb {needed}"
    if total > mem_mb:
        kind = f"{head} is below the estimated need {estimated}: raise it, or lower"
        return "", Notice(f"{kind} tasks_per_node, workers or batch_size {docs}", name, detail)
    if total > room * mem_mb:
        kind = f"{head} leaves under {RAM_COPY_HEADROOM:.0%} free beyond the estimate {estimated}"
        return "", Notice(
            f"{kind} with the train copy in RAM ({data.scratch_where}): raise it or stage on "
            f"a node-local disk {docs}",
            name,
            detail,
        )
    return "", None


def node_memory_problems(
    runs: Mapping[str, Mapping[str, Any]], mem_mb: float | None, data: DataSizes = DataSizes()
) -> tuple[list[str], list[Notice]]:
    """(refusal lines, warnings) of every run's training job against ``mem_mb``."""
    refusals, warnings = [], []
    for name, run in runs.items():
        refusal, warning = memory_problem(name, run, mem_mb, data)
        refusals += [refusal] if refusal else []
        warnings += [warning] if warning else []
    return refusals, warnings


def compile_threads_env(cpus_per_task: int) -> dict[str, str]:
    """The rank's TORCHINDUCTOR_COMPILE_THREADS, unless the environment sets it."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return {}
    return {"TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads(cpus_per_task))}
