"""A job's geometry (nodes x ranks per node, CPUs per rank, GPUs per node): its one home.

Torch-free: the launcher, the rule's process and the workflow at parse time import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The geometry keys of a run's settings (config.yaml `train_defaults`/`runs`, the evaluation's
# `evaluate` block, the job spec). The world size is the product of the first two.
GEOMETRY_KEYS = ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node")
WORLD_KEYS = GEOMETRY_KEYS[:2]
# What starting the ranks needs; gpus_per_node, where absent, follows the device (a rank
# started by hand).
LAUNCH_KEYS = GEOMETRY_KEYS[:3]


@dataclass(frozen=True)
class Geometry:
    """Where a job runs, and so where a run's figures were measured: every row of the results
    states it. ``workers`` (DataLoader workers per rank) is part of it for a training rank;
    the launcher leaves it 0."""

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int = 0
    workers: int = 0

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> Geometry:
        """The geometry that ``settings`` (a run's, an evaluation's, a spec's) states."""
        nodes, tasks, cpus = (int(settings[key]) for key in LAUNCH_KEYS)
        return cls(nodes, tasks, cpus, int(settings.get("gpus_per_node") or 0))

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def shape(self) -> str:
        """Nodes x ranks per node: what each epoch row and attempt says it ran on."""
        return f"{self.nodes}x{self.tasks_per_node}"

    @property
    def tag(self) -> str:
        """All of it in one word (train_metrics.json's ``geometry``), e.g. ``n2x8-c14-g8-w13``;
        no key (:func:`checkpoint_tag` is)."""
        return (
            f"n{self.nodes}x{self.tasks_per_node}-c{self.cpus_per_task}"
            f"-g{self.gpus_per_node}-w{self.workers}"
        )


def loader_workers(setting: int | str, cpus_per_task: int) -> int:
    """``auto``: one DataLoader worker per CPU of this task but one (the training loop's)."""
    if setting != "auto":
        return int(setting)
    return max(0, cpus_per_task - 1)


def world_size(settings: Mapping[str, Any]) -> int:
    """Ranks of the job that ``settings`` (nodes, tasks_per_node) describes."""
    return int(settings.get("nodes") or 1) * int(settings.get("tasks_per_node") or 1)


# The sample order's version in the checkpoint key (:func:`checkpoint_tag`): "o2" is global
# batches cut into micro-batch groups (training.data.EpochSampler). Before it each rank read a
# strided share of the epoch, so a multi-rank checkpoint of an earlier version would resume
# under another order: never resumed.
SAMPLE_ORDER = "o2"


def global_batch(settings: Mapping[str, Any], world: int | None = None) -> int:
    """Samples per optimizer step: batch_size x ranks x accumulation. ``world``: the ranks that
    started (a rank); else the settings' nodes x tasks_per_node. What a checkpoint keys on
    instead of the rank count (training.checkpoint), and what the LR scales with."""
    world = world_size(settings) if world is None else world
    return int(settings["batch_size"]) * world * int(settings.get("accumulation") or 1)


def trains_on_gpus(settings: Mapping[str, Any]) -> bool:
    """Whether the run computes on GPUs: ``device: cuda``, or ``auto`` with GPUs asked
    (jobs.distributed.select_device decides the same way)."""
    device = settings.get("device") or "auto"
    return device == "cuda" or (device == "auto" and int(settings.get("gpus_per_node") or 0) > 0)


def checkpoint_tag(settings: Mapping[str, Any], world: int | None = None) -> str:
    """The checkpoint key's second part (the fingerprint is its first), e.g. ``b1024-o2-gpu``:
    the global batch, the sample order's version and CPU or GPU (their numerics differ; under
    ``device: auto`` the GPUs asked decide). With ``sync_bn`` the batch statistics span the
    ranks of a micro-step, so the rank count changes the weights: ``-r32``. Not the rank count
    otherwise (an elastic resume), nor the loader's CPUs or workers: the order is a function of
    (seed, epoch) and each sample seeds its own augmentation (training.data), so the stream is
    the same under any. The one home of the key: the checkpoint directory
    (training.checkpoint) and the attempt record (jobs.attempts.settings_key) both use it."""
    world = world_size(settings) if world is None else world
    device = "gpu" if trains_on_gpus(settings) else "cpu"
    tag = f"b{global_batch(settings, world)}-{SAMPLE_ORDER}-{device}"
    return f"{tag}-r{world}" if settings.get("sync_bn") else tag


def accepted_nodes(settings: Mapping[str, Any]) -> tuple[int, ...]:
    """The node counts a run trains on, preferred first: ``nodes``, then its ``fallback_nodes``
    largest first (docs/reliability.md "Elastic resume")."""
    fallback = sorted({int(n) for n in settings.get("fallback_nodes") or ()}, reverse=True)
    return (int(settings.get("nodes") or 1), *fallback)


def on_nodes(settings: Mapping[str, Any], nodes: int) -> dict[str, Any]:
    """``settings`` on ``nodes`` of its accepted counts, with the same global batch:
    ``accumulation`` scaled by nodes / ``nodes`` (settings.run_checks refuses a count that
    does not divide). ValueError for a count the run does not accept."""
    preferred = int(settings.get("nodes") or 1)
    accumulation = int(settings.get("accumulation") or 1)
    if nodes == preferred:
        return dict(settings)
    if nodes not in accepted_nodes(settings) or (preferred * accumulation) % nodes:
        raise ValueError(
            f"run {settings.get('run')!r}: {nodes} node(s) is not one of the counts it accepts "
            f"(nodes {preferred}, fallback_nodes {list(settings.get('fallback_nodes') or [])})"
        )
    return {**settings, "nodes": nodes, "accumulation": preferred * accumulation // nodes}


def slurm_resources(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The SLURM executor's resources of a job of ``settings`` (a run's or its evaluation's:
    nodes, tasks_per_node, gpus_per_node, gpu_type) beside nodes and cpus_per_task, as
    docs/slurm-notes.md section 5 found them; None leaves a resource out."""
    per_node, gpus = settings["tasks_per_node"], settings["gpus_per_node"]
    world = world_size(settings)
    # A GPU type (a100, h100, ...) as the site's gres.conf names it: gpu:<type>:<n>.
    gpu_type = settings["gpu_type"]
    gres = f"gpu:{gpu_type}:{gpus}" if gpu_type else f"gpu:{gpus}"
    return {
        # With `mpi` the plugin takes exactly one of tasks/tasks_per_node, and it must be > 1.
        "tasks_per_node": per_node if world > 1 and per_node > 1 else None,
        "tasks": world if world > 1 and per_node == 1 else None,
        "gres": gres if gpus > 0 else None,  # per node
        # One rank runs inside the plugin's own `srun -n1` step (the launcher adds --overlap).
        "mpi": "srun" if world > 1 else None,
    }
