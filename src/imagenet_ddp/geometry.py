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
    states it. ``workers`` (DataLoader workers per rank) is part of it for a training rank,
    which keys its checkpoints by :attr:`tag`; the launcher leaves it 0."""

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
    def tag(self) -> str:
        """The checkpoint key's geometry part: a changed geometry never resumes."""
        return (
            f"n{self.nodes}x{self.tasks_per_node}-c{self.cpus_per_task}"
            f"-g{self.gpus_per_node}-w{self.workers}"
        )


def world_size(settings: Mapping[str, Any]) -> int:
    """Ranks of the job that ``settings`` (nodes, tasks_per_node) describes."""
    return int(settings["nodes"]) * int(settings["tasks_per_node"])
