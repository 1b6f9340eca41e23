"""What a run cost: the ``cost`` block of ``train_metrics.json`` (pure functions, no torch).
The figures' scope is :data:`SCOPE` (written into the block); ``gpu_telemetry`` is rank 0's
node sampled with NVML (:mod:`imagenet_ddp.monitoring.telemetry`), or why not, with energy for
all nodes and per 1,000 training images derived from it, each labelled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SCOPE = (
    "wall_seconds: rank 0, this job, start of training to outputs written (staging excluded); "
    "gpu_hours and core_hours: allocated GPUs and cores x wall_seconds; gpu_hours_per_epoch "
    "and core_hours_per_epoch: allocated GPUs or cores x mean epoch time (holdout evaluation "
    "and checkpoints excluded)"
)
ENERGY_NOTE = (
    "measured on rank 0's node over this job's training loop (holdout evaluation and "
    "checkpoints included); energy_kwh_all_nodes multiplies it by the node count (estimate)"
)


def cost_block(
    geometry: Mapping[str, int], wall_seconds: float, epochs: Sequence[Mapping[str, Any]],
    telemetry: Mapping[str, Any], *, resumed: bool, slurm_job_id: str | None,
) -> dict[str, Any]:  # fmt: skip
    """The cost block from the job's geometry, rank 0's wall time, the epoch records (all
    jobs' epochs: the history) and the NVML summary of this job."""
    nodes = geometry["nodes"]
    gpus = nodes * geometry["gpus_per_node"]
    cores = nodes * geometry["tasks_per_node"] * geometry["cpus_per_task"]
    epoch_seconds = [e["epoch_seconds"] for e in epochs]
    mean_epoch = sum(epoch_seconds) / len(epoch_seconds) if epoch_seconds else None
    return {
        "scope": SCOPE,
        "slurm_job_id": slurm_job_id,
        "wall_seconds": wall_seconds,
        "gpus": gpus,
        "cores": cores,
        "gpu_hours": gpus * wall_seconds / 3600,
        "core_hours": cores * wall_seconds / 3600,
        "gpu_hours_per_epoch": None if mean_epoch is None else gpus * mean_epoch / 3600,
        "core_hours_per_epoch": None if mean_epoch is None else cores * mean_epoch / 3600,
        "gpu_telemetry": energy_figures(telemetry, nodes, epochs, resumed),
    }


def energy_figures(
    telemetry: Mapping[str, Any], nodes: int, epochs: Sequence[Mapping[str, Any]], resumed: bool
) -> dict[str, Any]:
    """The NVML summary plus energy for all nodes and per 1,000 training images; absent
    (None, with the reason) where they cannot be known, never zero."""
    out = dict(telemetry)
    if not telemetry.get("available"):
        return out
    out["note"] = ENERGY_NOTE
    if telemetry.get("unsampled"):  # energy_kwh covers only the GPUs NVML could read
        out["energy_kwh_all_nodes"] = out["energy_wh_per_1k_images"] = None
        out["energy_per_image_reason"] = (
            f"{len(telemetry['unsampled'])} GPU(s) of rank 0's node not sampled (unsampled)"
        )
        return out
    out["energy_kwh_all_nodes"] = telemetry["energy_kwh"] * nodes
    if resumed:
        # This job's sampler saw only its own part; earlier jobs' energy was not kept.
        out["energy_wh_per_1k_images"] = None
        out["energy_per_image_reason"] = "resumed run: earlier jobs' energy not measured"
    else:
        images = sum(e["images"] for e in epochs)
        out["energy_wh_per_1k_images"] = (
            out["energy_kwh_all_nodes"] * 1000 / images * 1000 if images else None
        )
    return out


OVER_ATTEMPTS_SCOPE = (
    "wall_seconds, gpu_hours, core_hours: summed over all allocations (attempts) of the run, "
    "each from its launcher's start (staging included) to its end, the last one to outputs "
    "written; gpu_hours_lost, core_hours_lost: work after the newest checkpoint of each "
    "interrupted attempt (redone by the next); this_job: the old single-job figures (rank 0, "
    "start of training to outputs written); gpu_hours_per_epoch and core_hours_per_epoch: "
    "allocated GPUs or cores x mean epoch time (holdout evaluation and checkpoints excluded); "
    "code_versions: the code each allocation ran (commit, +dirty:<digest of uncommitted "
    "changes>), each once; code_changed: true where the allocations ran different code"
)


def over_attempts(cost: Mapping[str, Any], attempts: Mapping[str, Any]) -> dict[str, Any]:
    """The job's cost block with wall time and GPU-/core-hours summed over every attempt of
    the run (:func:`imagenet_ddp.jobs.attempts.cost_over_attempts`); this job's own figures stay
    under ``this_job``."""
    out = dict(cost)
    out["this_job"] = {k: cost[k] for k in ("wall_seconds", "gpu_hours", "core_hours")}
    out.update(
        scope=OVER_ATTEMPTS_SCOPE,
        **{k: attempts[k] for k in ("allocations", "slurm_job_ids", "wall_seconds", "gpu_hours",
                                    "core_hours", "gpu_hours_lost", "core_hours_lost",
                                    "code_versions", "code_changed", "attempts")},
    )  # fmt: skip
    return out
