"""The train and evaluate stages at the job level: write the job spec, start the ranks through
the launcher, record the job. The per-rank code is :mod:`imagenet_ddp.training.worker` and
:mod:`imagenet_ddp.evaluate`; both read the spec this module writes (:mod:`imagenet_ddp.job_spec`).

Torch-free: this runs in the rule's process, which only waits for the ranks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from imagenet_ddp.errors import InputError
from imagenet_ddp.geometry import LAUNCH_KEYS
from imagenet_ddp.io import write_json_atomic
from imagenet_ddp.job_spec import EVAL_SPEC, TRAIN_SPEC, write_spec
from imagenet_ddp.provenance import provenance_path, write_provenance


def resolve_launcher(launcher: str, environ=None) -> str:
    """``auto``: ``srun`` inside a SLURM allocation (the job's own SLURM_JOB_ID, which the
    SLURM executor's job step keeps), ``local`` elsewhere. Decided where the job runs, so no
    ``--config`` on the Snakemake command line can change it."""
    if launcher != "auto":
        return launcher
    return "srun" if (os.environ if environ is None else environ).get("SLURM_JOB_ID") else "local"


def spec_execution(
    launcher: str,
    srun_extra: str,
    scratch_dir: Path | None = None,
    stage_verify=None,
    cleanup=None,
    launch_prefix: str = "srun",
) -> dict[str, Any]:
    """The job spec's ``execution`` block: where and how the job runs (not results: the rule
    passes them as resources).

    ``launch_prefix``: the rule's ``mpi`` resource, the command that starts the ranks' step
    (``srun``, ``srun --mpi=pmix``); the launcher adds the geometry to it.
    """
    execution: dict[str, Any] = {
        "launcher": resolve_launcher(launcher),
        "srun_extra": srun_extra,
        "launch_prefix": launch_prefix or "srun",
    }
    if scratch_dir is not None:
        execution.update(scratch_dir=str(scratch_dir), stage_verify=stage_verify, cleanup=cleanup)
    return execution


def train_job(
    run: dict[str, Any],
    *,
    prepared_train: Path,
    split_dir: Path,
    run_dir: Path,
    checkpoint_root: Path,
    execution: dict[str, Any],
) -> int:
    """Train one run as ``run``'s geometry of ranks; on success write ``job.json`` and the
    provenance beside ``model.pt``.

    ``run``: the run's settings as the rule resolved them (``train_defaults`` merged in),
    geometry included: the worker checks the ranks that started against it and keys
    checkpoints by it.
    """
    from imagenet_ddp.launch import run_training

    missing = [key for key in LAUNCH_KEYS if key not in run]
    if missing:
        raise InputError(
            f"run {run.get('run')!r}: the run settings lack {', '.join(missing)}; give the job's "
            "geometry in the run settings (the workflow's rule always does)"
        )
    spec = {
        "kind": "train",
        "run": run,
        "paths": {
            "prepared_train": str(prepared_train),
            "split_dir": str(split_dir),
            "run_dir": str(run_dir),
            "checkpoint_root": str(checkpoint_root),
        },
        "execution": execution,
    }
    spec_path = write_spec(Path(run_dir) / TRAIN_SPEC, spec)
    started = time.time()
    code = run_training(spec, spec_path)
    if code != 0:
        return code
    job = {
        "launcher": execution["launcher"],
        **{key: run[key] for key in LAUNCH_KEYS},
        "wall_seconds": time.time() - started,
        "spec": str(spec_path),
    }
    write_json_atomic(Path(run_dir) / "job.json", job)
    # The worker's resolved settings (every default filled in), beside the model.
    config = json.loads((Path(run_dir) / "train_metrics.json").read_text())["config"]
    provenance = provenance_path(Path(run_dir) / "model.pt")
    write_provenance(provenance, "train", config, seeds={"train": config["seed"]})
    return 0


def evaluate_job(
    *,
    paths: dict[str, Path],
    geometry: dict[str, int],
    settings: dict[str, Any],
    execution: dict[str, Any],
) -> int:
    """Evaluate a model on ``geometry``'s ranks; rank 0 writes ``paths["out"]`` (eval.json),
    to which the launcher's wall time (process start-up and model loading included) is added.

    ``paths``: model, prepared_train, prepared_val, split_dir, classes, out, per_class;
    ``settings``: batch_size, workers, device.
    """
    from imagenet_ddp.launch import run_evaluation

    out = Path(paths["out"])
    spec = {
        "kind": "evaluate",
        "geometry": geometry,
        "settings": settings,
        "paths": {key: str(value) for key, value in paths.items()},
        "execution": execution,
    }
    spec_path = write_spec(out.with_name(EVAL_SPEC), spec)
    started = time.time()
    code = run_evaluation(spec, spec_path)
    if code != 0:
        return code
    result = json.loads(out.read_text())
    result["evaluation"]["job_wall_seconds"] = time.time() - started
    write_json_atomic(out, result)
    return 0
