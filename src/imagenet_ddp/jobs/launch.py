"""A job at the job level, the same for every launcher: the train and evaluate stages (write
the job spec, run the attempt, record job.json and the provenance); an attempt (stage on
every node, each writing ``<run_dir>/staging/<host>.json``, start the ranks, unstage); and the
per-node staging steps. Every step and rank gets the job spec's path only. Torch-free: the
rule's process only waits for the ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from imagenet_ddp.data.prepared_layout import prepared_content
from imagenet_ddp.data.stage import (
    cleanup_staged,
    in_place_report,
    memory_limit,
    ram_copy_problem,
    reclaim_stale_leases,
    refuse_shared_scratch,
    scratch_info,
    scratch_problem,
    scratch_root,
    stage_dataset,
)
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import EXIT_INPUT, Heartbeat, write_json_atomic
from imagenet_ddp.jobs import attempts, rerun_keys
from imagenet_ddp.jobs.early_signals import EXIT_REQUEUE, STOP_SIGNALS
from imagenet_ddp.jobs.holders import (
    CONTROLLER_BEAT,
    beat_owner_ended,
    begin_unless_held,
    give_back,
    invocation_watched,
    live_holder,
)
from imagenet_ddp.jobs.launchers import get_launcher, resolve_launcher
from imagenet_ddp.jobs.spec import (
    EVAL_SPEC,
    TRAIN_SPEC,
    EvalJob,
    TrainJob,
    read_spec,
    staging_report_path,
    with_launcher,
    write_spec,
)
from imagenet_ddp.provenance import provenance_path, write_provenance
from imagenet_ddp.settings.geometry import LAUNCH_KEYS, on_nodes

STAGED_KINDS = ("train", "preflight")  # jobs that stage the prepared copy on every node
DELIVERED = "delivered.json"  # in the checkpoint root: this run's outputs were written
INVOCATION_STARTED = "IMAGENET_DDP_INVOCATION_STARTED"  # the main Snakemake's (common.smk)


def start_afresh_if_delivered(checkpoint_root: Path, environ=None, epoch=None) -> Path | None:
    """A run whose outputs were delivered (the marker is written only after them) before this
    Snakemake invocation began, and whose train Snakemake runs again, was asked for again
    (`--forcerun`, `-R`, its outputs deleted, `--delete-all-output` then a run, a rerun key
    changed): it trains from scratch, never resumes its final checkpoint into the same model.
    Its checkpoints, attempt record and marker move to ``<root>.previous`` (one kept), which is
    returned. Nothing moves (None) for a run not delivered (a resubmission after a stop
    resumes), nor for one delivered since the invocation began: a job of a Snakemake that
    died finished it while this one waited behind it (docs/reliability.md "A controller that
    dies"), and resuming writes the same outputs without training. ``epoch``: the epoch this
    job trains to (a rung's stop_epoch, settings.halving); a delivery of an earlier epoch (the
    rung before) is where it resumes, not a reason to start afresh (None: any delivery is)."""
    environ = os.environ if environ is None else environ
    root = Path(checkpoint_root)
    marker = root / DELIVERED
    if not marker.is_file():
        return None
    began = float(environ.get(INVOCATION_STARTED, "inf"))
    delivered = json.loads(marker.read_text())
    if delivered.get("delivered_at", 0.0) >= began:
        return None
    if epoch is not None and delivered.get("epoch", float("inf")) < epoch:
        return None
    previous = root.with_name(root.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    os.replace(root, previous)
    print(
        f"train: {root} held a delivered run; training from scratch (its checkpoints: {previous})"
    )
    return previous


def train_job(job: TrainJob, key: str | None = None) -> int:
    """Train one run on ``job.run``'s geometry of ranks; on success write ``job.json`` (with
    its rerun ``key``'s content) and the provenance beside ``model.pt``, then remove the run's
    other keys (jobs.rerun_keys). Not where the Snakemake that submitted the job has ended
    (jobs.holders.invocation_watched): the next one's job delivers from the final checkpoint."""
    _ = job.geometry  # a run without its geometry is refused before anything is written
    # Another job of the run still training (its controller died, a new one submitted this
    # one): give the allocation back before writing anything of the run (jobs.holders).
    holder = live_holder(job.paths.checkpoint_root, job.run)
    if holder:
        return give_back(holder, job.name)
    target = job.stop_epoch or job.run.get("epochs")
    start_afresh_if_delivered(job.paths.checkpoint_root, epoch=target)
    job = on_allocation(with_launcher(job, resolve_launcher(job.execution.launcher)))
    run_dir = job.paths.run_dir
    spec_path = write_spec(run_dir / TRAIN_SPEC, job)
    started = time.time()
    code = run_attempt(job, spec_path)
    if code != 0:
        return code
    if not invocation_watched(job.paths.checkpoint_root.parent):
        # Delivered now, its outputs would stay unrecorded (incomplete), and the next
        # invocation's rerun of them could not be told from a run asked for again (trained
        # from scratch); its final checkpoint left, that job delivers it without training.
        print(f"train: run {job.name!r} is trained, but the Snakemake that submitted this job "
              "has ended (its heartbeat: jobs.holders): nothing delivered; the next "
              "invocation's train job writes the outputs from the final checkpoint, without "
              "training", flush=True)  # fmt: skip
        return 0
    record = {
        "launcher": job.execution.launcher,
        **{key: job.run[key] for key in LAUNCH_KEYS},
        "wall_seconds": time.time() - started,
        "spec": str(spec_path),
        "key": rerun_keys.read_key(key) if key else None,  # the parse names what changed
        # the Snakemake that submitted it, by its heartbeat's name (jobs.holders; None: unknown)
        "submitted_by": os.environ.get(CONTROLLER_BEAT) or None,
    }
    write_json_atomic(run_dir / "job.json", record)
    # The worker's resolved settings (every default filled in), beside the model.
    config = json.loads((run_dir / "train_metrics.json").read_text())["config"]
    provenance = provenance_path(run_dir / "model.pt")
    # What it trained on, by content (the provenance's code block holds the package version,
    # by which aggregate flags a model that another version trained).
    extra = {"prepared_train": prepared_content(job.paths.prepared_train)}
    write_provenance(provenance, "train", config, seeds={"train": config["seed"]}, extra=extra)
    delivered = {"model": str(run_dir / "model.pt"), "delivered_at": time.time(), "epoch": target}
    write_json_atomic(job.paths.checkpoint_root / DELIVERED, delivered)
    if key:
        rerun_keys.keep_only(key)
    return 0


def evaluate_job(job: EvalJob, key: str | None = None) -> int:
    """Evaluate a model on ``job.geometry``'s ranks; rank 0 writes eval.json, to which the job's
    wall time (start-up and model loading included) is added; then the run's other evaluate
    keys are removed (jobs.rerun_keys)."""
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
    if key:
        rerun_keys.keep_only(key)
    return 0


# --------------------------------------------------------------------------- an attempt


def stage_this_node(job: TrainJob) -> dict:
    """Copy the prepared data into this node's scratch (a one-node launcher reads it in place
    where a copy would land on the same disk; else a shared scratch is refused); report it."""
    paths, stage = job.paths, job.execution.stage
    path = staging_report_path(paths.run_dir, socket.gethostname())
    previous = json.loads(path.read_text()) if path.is_file() else {}
    src = paths.prepared_train
    scratch, origin = scratch_root(stage.scratch_dir or None)
    local = get_launcher(job.execution.launcher).single_node
    shared = {"prepare.dir": src} if local else {"prepare.dir": src, "the workdir": Path.cwd()}
    kind, problem = scratch_problem(scratch, shared) or (None, None)
    final = job.kind == "train" and attempts.final_checkpoint(paths.checkpoint_root, job.run)
    if final:  # the ranks resume it and write the outputs: 50 GB per node copied for nothing
        report = in_place_report(src, f"the run's final checkpoint {final} is written")
        print(f"staging: none, {report['in_place']}: the ranks write the outputs", flush=True)
    elif kind == "shared" and local:  # one machine, one disk: a copy would buy nothing
        report = in_place_report(src, f"scratch {scratch} (from {origin}) is {problem}")
        print(f"staging: reading {src} in place: {report['in_place']}", flush=True)
    elif problem:
        raise refuse_shared_scratch(scratch, origin, problem)
    elif in_ram := ram_copy_problem(src, scratch, origin, job.run, memory_limit()):
        raise InputError(in_ram)  # before the copy: in RAM it would be OOM-killed in epoch 0
    else:  # the lease names this job's heartbeat, which every node sees
        lease = os.path.abspath(attempts.beat_path(paths.checkpoint_root))
        # copies pinned by jobs killed before their cleanup (squeue: ended ones at once)
        reclaim_stale_leases(scratch, ended=beat_owner_ended)
        report = stage_dataset(src, scratch, verify=stage.verify, lease=lease)
        report["lease"] = lease
    report["scratch"] = scratch_info(scratch, origin)  # a site's node-local disk shows here
    # An earlier attempt of this run (requeued, or killed before its cleanup) left its lease:
    # give it up now that this attempt holds its own.
    if previous.get("lease") not in (None, report.get("lease")) and not previous.get("cleaned"):
        cleanup_staged(Path(previous["dest"]), previous["lease"])
    write_json_atomic(staging_report_path(paths.run_dir, report["host"]), report)
    return report


def unstage_this_node(job: TrainJob) -> None:
    """Give up this run's lease on the node's copy (which goes with the last lease)."""
    path = staging_report_path(job.paths.run_dir, socket.gethostname())
    report = json.loads(path.read_text())
    # cleaned: this run gave up its copy; removed: the copy is gone (no other run holds it)
    if report.get("in_place"):
        report["removed"] = False
    else:
        report["removed"] = cleanup_staged(Path(report["dest"]), report.get("lease"))
    report["cleaned"] = True
    write_json_atomic(path, report)


# Each kind's ranks: ``python -m MODULE --spec FILE`` (names across a process boundary, so
# jobs/ may name the layers above it).
RANK_MODULES = {
    "train": "imagenet_ddp.training.worker",
    "preflight": "imagenet_ddp.preflight.rank",
    "evaluate": "imagenet_ddp.evaluation.evaluate",
}


def rank_argv(job: TrainJob | EvalJob, spec_path: Path, python: list[str]) -> list[str]:
    """The command of one rank of ``job``: its kind's module, given the spec's path."""
    return [*python, "-m", RANK_MODULES[job.kind], "--spec", str(spec_path)]


def on_allocation(job: TrainJob) -> TrainJob:
    """``job`` on its allocation's node count: a run with ``fallback_nodes`` given fewer nodes
    keeps its global batch (settings.geometry.on_nodes)."""
    run = job.run
    if not run.get("fallback_nodes"):
        return job
    if attempts.refusal_ahead(job.paths.checkpoint_root, run, job.execution.attempt):
        return job  # submitted on one node without GPUs: it refuses, it does not train
    nodes = get_launcher(job.execution.launcher).allocated_nodes()
    if nodes is None or nodes == run["nodes"]:
        return job
    try:
        shifted = on_nodes(run, nodes)
    except ValueError as error:
        raise InputError(f"{error}; this job's allocation has {nodes} node(s)") from None
    print(f"run {run.get('run')!r}: this allocation has {nodes} of its {run['nodes']} nodes: "
          f"accumulation {shifted['accumulation']} (was {run.get('accumulation', 1)}), the "
          "same global batch", flush=True)  # fmt: skip
    return dataclasses.replace(job, run=shifted)


def run_attempt(job: TrainJob, spec_path: Path) -> int:
    """One recorded attempt of the run (unless another job holds it): refused where a retry
    cannot help, else staged, run and closed with its exit code, which it returns."""
    run, root = job.run, job.paths.checkpoint_root
    geometry = job.geometry
    begun, holder = begin_unless_held(
        root,
        run,
        lambda: attempts.begin(
            root,
            run,
            attempt=job.execution.attempt,
            gpus=geometry.nodes * int(run.get("gpus_per_node") or 0),
            cores=geometry.world_size * geometry.cpus_per_task,
            shape=geometry,
        ),
    )
    if holder:  # started beside another job of the run after this job's first look
        return give_back(holder, job.name)
    entry, refused = begun
    print(f"run {run.get('run')!r}: attempt {entry['attempt']} (job "
          f"{entry['slurm_job_id'] or 'local'}), from epoch {entry['start']['epoch']} step "
          f"{entry['start']['step']}", flush=True)  # fmt: skip
    if refused:
        print(f"run {run.get('run')!r}: {refused}", flush=True)
        return 1
    code = 1
    try:
        code = stopped_after_all(run_staged(job, spec_path), job, entry)
        if code == EXIT_REQUEUE:  # Snakemake's own "Error in rule train" block follows it
            print(f"run {run.get('run')!r}: a planned stop (exit {EXIT_REQUEUE}), not a failure: "
                  "its checkpoint is written and Snakemake resubmits the job (the rule's "
                  "retries), which resumes from it", flush=True)  # fmt: skip
    except Exception as error:
        entry["error"] = f"launcher on {socket.gethostname()}: {type(error).__name__}: {error}"
        raise
    finally:
        attempts.end(root, entry, code)
    return code


def stopped_after_all(code: int, job: TrainJob, entry: dict) -> int:
    """``code``, or EXIT_REQUEUE where the step exited 0 without finishing the run (srun gave
    up waiting for a stopped step) or failed after its ranks recorded a stop whose checkpoint
    was written (a rank tearing down killed KillWait after SIGTERM); both seen in CI."""
    if code == 0 and not (job.paths.run_dir / "train_metrics.json").is_file():
        print("the ranks' step exited 0 but the run did not finish (no train_metrics.json): "
              "stopped, the next job resumes from the newest checkpoint", flush=True)  # fmt: skip
        return EXIT_REQUEUE
    if code in (0, EXIT_REQUEUE):
        return code
    stop = attempts.stopped_by_ranks(job.paths.checkpoint_root, entry)
    if stop is None:
        return code
    print(f"the ranks' step exited {code}, but its ranks stopped at epoch {stop['epoch']} "
          f"step {stop['step']} ({stop['signal'] or 'another rank'}'s stop) and that "
          "checkpoint was written: stopped, the next job resumes from it", flush=True)  # fmt: skip
    return EXIT_REQUEUE


def run_staged(job: TrainJob, spec_path: Path) -> int:
    """Stage on every node, run the ranks of ``job``'s kind, clean up: the exit code. The
    job's heartbeat (named by its leases and attempt entry) beats meanwhile."""
    execution = job.execution
    launcher = get_launcher(execution.launcher)
    launcher.check(job.geometry)
    # the scratch root as the launcher sees it (srun passes its environment to every node)
    python = launcher.python(binds=[scratch_root(execution.stage.scratch_dir or None)[0]])

    def on_every_node(command: str, here) -> tuple[int, int]:
        # one task per node (stage-node, unstage-node: main below), or a call here
        argv = [*python, "-m", "imagenet_ddp.jobs.launch", command, "--spec", str(spec_path)]
        return launcher.on_every_node(execution, job.geometry, lambda: here(job), argv)

    with Heartbeat(attempts.beat_path(job.paths.checkpoint_root)):
        code, signalled = on_every_node("stage-node", stage_this_node)
        # Stopped while staging (the launcher was signalled, or a node's step exited 75 after
        # finishing its copy): no ranks, rerun to resume.
        if code == EXIT_REQUEUE or (code == 0 and signalled):
            print("stop signal while staging: the ranks are not started", flush=True)
            return EXIT_REQUEUE
        if code != 0:
            return code
        signalled = 0
        try:
            ranks = rank_argv(job, spec_path, python)
            code, signalled = launcher.start_ranks(execution, job.geometry, ranks)
        finally:
            if execution.stage.cleanup and signalled and launcher.stop_skips_cleanup():
                print("stop signal received: node-local copies are left to the job's epilog, "
                      "else to the next job staging on each node (data.stage)")  # fmt: skip
            elif execution.stage.cleanup:
                on_every_node("unstage-node", unstage_this_node)
        return code


def run_evaluation(job: EvalJob, spec_path: Path) -> int:
    """The evaluation's ranks, through the same launcher (nothing staged): its exit code."""
    launcher = get_launcher(job.execution.launcher)
    launcher.check(job.geometry)
    ranks = rank_argv(job, spec_path, launcher.python())
    return launcher.start_ranks(job.execution, job.geometry, ranks)[0]


def main(argv: list[str] | None = None) -> int:
    """The per-node steps of a staged job: one srun task per node, not called by hand."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m imagenet_ddp.jobs.launch")
    parser.add_argument("command", choices=["stage-node", "unstage-node"])
    parser.add_argument("--spec", type=Path, required=True, help="the job spec file")
    args = parser.parse_args(argv)
    # A stop signal must not kill a copy half-way: the step finishes it, exits 75, and the
    # launcher starts no ranks (they would never hear of a warning that came before them).
    received: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        job = read_spec(args.spec, STAGED_KINDS)
        if args.command == "stage-node":
            stage_this_node(job)
        else:
            unstage_this_node(job)
    except InputError as error:  # one line per node in the job's log, as the CLI prints it
        print(f"{args.command} on {socket.gethostname()}: error: {error}", file=sys.stderr)
        return EXIT_INPUT
    if received:
        print(f"{socket.gethostname()}: {signal.Signals(received[0]).name} while "
              f"{args.command}: finished it, exit {EXIT_REQUEUE}", flush=True)  # fmt: skip
        return EXIT_REQUEUE
    return 0


if __name__ == "__main__":
    sys.exit(main())
