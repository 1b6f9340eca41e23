"""Which run settings do not change the trained weights: the one list, and what is derived from it.

Torch-free: the workflow reads it while Snakemake parses the rules (common.smk).
"""

from __future__ import annotations

from imagenet_ddp.geometry import GEOMETRY_KEYS

# Settings that do not change the trained weights: how a run is executed, logged, bounded or
# checked. Left out of the checkpoint fingerprint (training.config.TrainConfig.fingerprint):
# changing one resumes the run's checkpoints. The geometry is the checkpoint key's other part.
NOT_WEIGHTS = (
    "log_interval",
    "workers",
    "timeout_minutes",
    "max_allocations",
    "checkpoint_interval_minutes",
    "keep_checkpoints",
    "throughput_warmup_steps",
    "recipe",  # its values are the other keys
    "extra",
    "gpu_type",  # where it trains, like the geometry
    "mlflow_uri",
    "preflight",
    *GEOMETRY_KEYS,
)

# What a dry-run does not show among a run's hyperparameters (rule train's `hyperparameters`
# param, common.smk): the settings above with these differences.
# - shown although not in the fingerprint: `recipe`, the preset's name, which a reviewer reads
#   beside the values it set;
# - hidden although in the fingerprint: how the run is executed, not what it learns: `device`
#   and `backend` (a CPU and a GPU run differ numerically, so their checkpoints must not mix),
#   and `name` (the fingerprint's `run`: two runs never share a checkpoint folder); `evaluate`
#   is no training setting (the worker never sees it). `extra` (TrainConfig's unknown keys)
#   never reaches a resolved run: the schema refuses unknown keys.
# A param: a change here reruns every trained run, so it stays as it was.
NOT_HYPERPARAMETERS = frozenset(
    {*NOT_WEIGHTS, "name", "evaluate", "device", "backend"} - {"recipe"}
)
