"""Where a run's evaluation runs: its geometry and loader settings from config.yaml.

Torch-free on purpose: the workflow imports it while Snakemake parses the rules, and the
evaluation benchmark uses it to project the default geometry's wall time.
"""

from __future__ import annotations

from typing import Any

DEFAULT_BATCH_SIZE = 128
DEFAULT_WORKERS = "auto"  # cpus_per_task - 1, as in training (geometry.loader_workers)


def eval_settings(evaluate: dict[str, Any] | None, run: dict[str, Any]) -> dict[str, Any]:
    """The evaluation settings of one run (its train_defaults already merged in).

    The run's own ``evaluate`` block overrides the top-level ``evaluate`` block key by key.
    Unset keys follow the run: one node, the run's GPUs per node (``tasks_per_node``: one rank
    per GPU, or one rank on CPU) and the run's ``cpus_per_task``.
    """
    chosen = {**(evaluate or {}), **(run.get("evaluate") or {})}
    gpus = chosen.get("gpus_per_node", run.get("gpus_per_node", 0))
    return {
        "nodes": chosen.get("nodes", 1),
        "tasks_per_node": chosen.get("tasks_per_node", gpus if gpus > 0 else 1),
        "cpus_per_task": chosen.get("cpus_per_task", run.get("cpus_per_task", 1)),
        "gpus_per_node": gpus,
        "batch_size": chosen.get("batch_size", DEFAULT_BATCH_SIZE),
        "workers": chosen.get("workers", DEFAULT_WORKERS),
    }
