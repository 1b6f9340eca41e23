"""The train and evaluate stages at the job level: write the job spec, start the ranks through
the launcher, record the job. Torch-free: the rule's process only waits for the ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from imagenet_ddp.data.prepared_layout import prepared_content
from imagenet_ddp.io import write_json_atomic
from imagenet_ddp.jobs.holders import give_back, live_holder
from imagenet_ddp.jobs.launchers import resolve_launcher
from imagenet_ddp.jobs.spec import (
    EVAL_SPEC,
    TRAIN_SPEC,
    EvalJob,
    TrainJob,
    with_launcher,
    write_spec,
)
from imagenet_ddp.provenance import provenance_path, write_provenance
from imagenet_ddp.settings.geometry import LAUNCH_KEYS

DELIVERED = "delivered.json"  # in the checkpoint root: this run's outputs were written
RETRAIN = "IMAGENET_DDP_RETRAIN"  # =1: a delivered run trains again from scratch


def start_afresh_if_delivered(checkpoint_root: Path, environ=None) -> Path | None:
    """`IMAGENET_DDP_RETRAIN=1 snakemake --forcerun train` (docs/configuration.md "Reruns"): a
    delivered run trains from scratch. Asked for, never inferred (a restarted Snakemake reruns
    it as incomplete, and must resume). Its checkpoints, record and marker move to
    ``<root>.previous``, which is returned (None if nothing moved)."""
    environ = os.environ if environ is None else environ
    root = Path(checkpoint_root)
    if environ.get(RETRAIN) != "1" or not (root / DELIVERED).is_file():
        return None
    previous = root.with_name(root.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    os.replace(root, previous)
    print(f"train: {root} held a delivered run; training afresh (earlier: {previous})")
    return previous


def train_job(job: TrainJob) -> int:
    """Train one run on ``job.run``'s geometry of ranks; on success write ``job.json`` and the
    provenance beside ``model.pt``."""
    from imagenet_ddp.jobs.launch import on_allocation, run_attempt

    _ = job.geometry  # a run without its geometry is refused before anything is written
    # Another job of the run still training (its controller died, a new one submitted this
    # one): give the allocation back before writing anything of the run (jobs.holders).
    holder = live_holder(job.paths.checkpoint_root, job.run)
    if holder:
        return give_back(holder, job.name)
    start_afresh_if_delivered(job.paths.checkpoint_root)
    job = on_allocation(with_launcher(job, resolve_launcher(job.execution.launcher)))
    run_dir = job.paths.run_dir
    spec_path = write_spec(run_dir / TRAIN_SPEC, job)
    started = time.time()
    code = run_attempt(job, spec_path)
    if code != 0:
        return code
    record = {
        "launcher": job.execution.launcher,
        **{key: job.run[key] for key in LAUNCH_KEYS},
        "wall_seconds": time.time() - started,
        "spec": str(spec_path),
    }
    write_json_atomic(run_dir / "job.json", record)
    # The worker's resolved settings (every default filled in), beside the model.
    config = json.loads((run_dir / "train_metrics.json").read_text())["config"]
    provenance = provenance_path(run_dir / "model.pt")
    # What it trained on, by content (the provenance's code block holds the package version,
    # by which aggregate flags a model that another version trained).
    extra = {"prepared_train": prepared_content(job.paths.prepared_train)}
    write_provenance(provenance, "train", config, seeds={"train": config["seed"]}, extra=extra)
    write_json_atomic(job.paths.checkpoint_root / DELIVERED, {"model": str(run_dir / "model.pt")})
    return 0


def evaluate_job(job: EvalJob) -> int:
    """Evaluate a model on ``job.geometry``'s ranks; rank 0 writes eval.json, to which the job's
    wall time (start-up and model loading included) is added."""
    from imagenet_ddp.jobs.launch import run_evaluation

    job = with_launcher(job, resolve_launcher(job.execution.launcher))
    out = job.paths.out
    spec_path = write_spec(out.with_name(EVAL_SPEC), job)
    started = time.time()
    code = run_evaluation(job, spec_path)
    if code != 0:
        return code
    result = json.loads(out.read_text())
    result["evaluation"]["job_wall_seconds"] = time.time() - started
    write_json_atomic(out, result)
    return 0
