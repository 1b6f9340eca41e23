"""A training job's host memory per node, estimated at the dry-run against its ``mem_mb``.

SLURM's ``--mem`` (the train rule's ``mem_mb``) is per node, and the node's memory cgroup is
charged each page once. A node runs ``tasks_per_node`` ranks, each with its loader's processes;
the figures below are per process, in MiB. Measured ones come from
``benchmarks/bench_memory.py`` (torch 2.14.1 on this project's 2-core CPU machine,
benchmarks/README.md "Memory"); ESTIMATED ones could not be measured without a GPU.

Two sums, two outcomes (docs/configuration.md "the dry-run checks"):

* the measured part (a CPU rank, its loader's forkserver and workers with their in-flight
  batches, the holdout loader's workers, kept from the first evaluation on) above ``mem_mb``
  is refused: the job would be killed on the node whatever the GPU;
* the measured part plus the estimated one (a GPU rank's CUDA context and libraries,
  inductor's compile workers under ``compile: true``) above ``mem_mb`` is a warning.

Not counted: the launcher and staging (tens of MiB), and node-local scratch on a tmpfs,
which the kernel may charge to the job's cgroup (site-dependent).

Torch-free: the workflow imports it while Snakemake parses the rules.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from imagenet_ddp.settings.geometry import loader_workers

MIB = 2**20
# Measured (bench_memory.py): RSS of a rank (torch and torchvision imported, its loader
# started): 547; of its loader's forkserver (torch and torchvision preloaded, pages shared
# with the workers it forks, so charged once): 703; USS of one loader worker: 49.
RANK_MB = 550
FORKSERVER_MB = 700
LOADER_WORKER_MB = 50
# Batches a loader worker holds in flight (DataLoader prefetch_factor, training.data and
# accuracy.shard_loader): shared memory, or pinned once the main process takes them.
PREFETCH_BATCHES = 4
# ESTIMATED, not measured (no GPU here): a CUDA rank's host memory beyond a CPU rank's
# (the CUDA context, cuDNN/cuBLAS host allocations, pinned staging buffers); 2-3 GiB is
# what a PyTorch CUDA process commonly holds. A compile worker: measured on the CPU, one
# inductor pool process 119 MiB RSS plus the C++ compiler it runs, up to 255 MiB; on a GPU
# it compiles Triton kernels instead (not measured).
CUDA_RANK_EXTRA_MB = 2500
COMPILE_WORKER_MB = 400
# Inductor's compile workers per rank (TORCHINDUCTOR_COMPILE_THREADS, set per rank by
# launch.worker_env): torch's own default is min(32, CPUs it sees), 8 ranks x 32 such
# processes ~ 100 GB. Compilation is a one-off at start (and per new crop size); a few
# workers keep it parallel.
MAX_COMPILE_THREADS = 4


def compile_threads(cpus_per_task: int) -> int:
    """Inductor's compile workers per rank: its CPUs, at most :data:`MAX_COMPILE_THREADS`."""
    return max(1, min(int(cpus_per_task), MAX_COMPILE_THREADS))


def _batch_mb(batch_size: int, crop: int) -> float:
    """One batch of uint8 crops (the transforms' output; normalized on the device)."""
    return batch_size * 3 * crop * crop / MIB


def estimate_mb(run: Mapping[str, Any]) -> dict[str, float]:
    """Per node: ``measured`` and ``estimated`` MiB of a run's training job (see module)."""
    workers = loader_workers(run["workers"], run["cpus_per_task"])
    eval_crop = run.get("eval_crop_size") or run["crop_size"]
    # The holdout's loader (as many workers, the same batch size) keeps its workers from the
    # first evaluation on, beside the training loader's persistent workers.
    batch = run["batch_size"]
    train_worker = LOADER_WORKER_MB + PREFETCH_BATCHES * _batch_mb(batch, run["crop_size"])
    holdout_worker = LOADER_WORKER_MB + PREFETCH_BATCHES * _batch_mb(batch, eval_crop)
    per_rank = RANK_MB + (FORKSERVER_MB if workers else 0)
    per_rank += workers * (train_worker + holdout_worker)
    extra = CUDA_RANK_EXTRA_MB if run["gpus_per_node"] > 0 else 0
    if run.get("compile"):
        extra += compile_threads(run["cpus_per_task"]) * COMPILE_WORKER_MB
    ranks = run["tasks_per_node"]
    return {"measured": ranks * per_rank, "estimated": ranks * extra, "workers": workers}


def memory_problem(name: str, run: Mapping[str, Any], mem_mb: float | None) -> tuple[str, str]:
    """(refusal, warning) lines for run ``name`` against the train job's ``mem_mb`` per node;
    empty strings where it fits or no ``mem_mb`` is known."""
    if mem_mb is None:
        return "", ""
    figures = estimate_mb(run)
    measured, total = figures["measured"], figures["measured"] + figures["estimated"]
    head = (
        f"config.yaml: run {name!r}: train's mem_mb {mem_mb:.0f} per node is below the "
        f"{{}} MiB that {run['tasks_per_node']} rank(s) per node with {figures['workers']} "
        "loader worker(s) each {}"
    )
    advice = (
        f"raise mem_mb to {math.ceil(total / 1000) * 1000} (set-resources train: mem_mb), or "
        "lower tasks_per_node, workers or batch_size (docs/configuration.md, memory per node)"
    )
    if measured > mem_mb:
        return head.format(f"{measured:.0f}", "hold (measured figures)") + f"; {advice}", ""
    if total > mem_mb:
        parts = ["CUDA"] * (run["gpus_per_node"] > 0) + ["compile workers"] * bool(
            run.get("compile")
        )
        held = f"are estimated to hold ({' and '.join(parts)} estimated)"
        return "", head.format(f"{total:.0f}", held) + f"; {advice}"
    return "", ""


def node_memory_problems(
    runs: Mapping[str, Mapping[str, Any]], mem_mb: float | None
) -> tuple[list[str], list[str]]:
    """(refusals, warnings) of every run's training job against ``mem_mb``."""
    refusals, warnings = [], []
    for name, run in runs.items():
        refusal, warning = memory_problem(name, run, mem_mb)
        refusals += [refusal] if refusal else []
        warnings += [warning] if warning else []
    return refusals, warnings


def compile_threads_env(cpus_per_task: int) -> dict[str, str]:
    """The rank's TORCHINDUCTOR_COMPILE_THREADS, unless the environment already sets it (a
    site's or user's deliberate choice)."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return {}
    return {"TORCHINDUCTOR_COMPILE_THREADS": str(compile_threads(cpus_per_task))}
