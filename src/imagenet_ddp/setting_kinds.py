"""Kinds of run settings: bookkeeping (changes neither the weights nor the speed), not the
weights, not a hyperparameter; each list once, the next derived from it.

Torch-free: the attempt record reads it, and the workflow while Snakemake parses the rules
(common.smk).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from imagenet_ddp.geometry import GEOMETRY_KEYS

# Settings that change neither the trained weights nor the speed: how a run is logged, bounded
# or checked. Scaling groups ignore them (aggregate.scaling_key), and so does the match of a
# preflight's projection to today's run (preflight_report.known_projection_problem).
BOOKKEEPING = (
    "log_interval",
    "timeout_minutes",
    "max_allocations",
    "checkpoint_interval_minutes",
    "keep_checkpoints",
    "extra",
    "mlflow_uri",
    "wandb_project",
    "wandb_mode",
    "preflight",
)

# Settings that do not change the trained weights: the above, and how fast and where a run
# trains. Left out of the checkpoint fingerprint (training.config.TrainConfig.fingerprint):
# changing one resumes the run's checkpoints. The geometry is the checkpoint key's other part.
NOT_WEIGHTS = (
    *BOOKKEEPING,
    "workers",
    "throughput_warmup_steps",
    # Which epochs are evaluated: the history's holdout columns and the run's wall time change,
    # the weights and RNG streams do not (evaluation draws from no shared generator: accuracy).
    "eval_interval",
    "recipe",  # its values are the other keys
    "gpu_type",  # where it trains, like the geometry
    *GEOMETRY_KEYS,
)

# Added after checkpoints existed: left out of the key at the value every earlier checkpoint was
# trained with (a fact about those checkpoints, not a default), so runs keep resuming them; any
# other value enters the key.
ADDED_AT_DEFAULT = {"crop_scale": [0.08, 1.0], "crop_ratio": [3 / 4, 4 / 3], "hflip": 0.5}


def digest(settings: dict[str, Any]) -> str:
    """A short, stable hash of settings: the checkpoint fingerprint, the attempt record's key."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def weight_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run (a resolved run, or TrainConfig's fields) that change its
    weights: what the checkpoint fingerprint hashes."""
    data = {k: v for k, v in settings.items() if k not in NOT_WEIGHTS}
    for key, earlier in ADDED_AT_DEFAULT.items():
        if key in data and data[key] == earlier:
            del data[key]
    return data


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
