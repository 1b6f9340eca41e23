"""Start a job's ranks (training, preflight, evaluation), here or through srun; stage and unstage.

Evaluation starts its ranks through the same :func:`launch_ranks` (without staging). Every
step and rank gets the path of the job's spec file (:mod:`imagenet_ddp.jobs.spec`), nothing else;
a rank is its kind's own module (``python -m imagenet_ddp.training.worker --spec FILE``,
:data:`RANK_MODULES`), started directly.
Two launchers share this code path:
- ``local``: one node; staging in this process, one worker process per rank started here
  (:func:`spawn_local_ranks`), with the variables torchrun would set.
- ``srun``: inside a SLURM allocation (a Snakemake rule with the ``mpi`` resource); staging is
  one ``srun`` task per node, the workers are ``nodes x tasks_per_node`` srun tasks, each reading
  its rank from SLURM_PROCID/SLURM_LOCALID and deriving MASTER_ADDR/MASTER_PORT from the job
  (:func:`imagenet_ddp.jobs.distributed.rendezvous_from_slurm_env`).

Each node writes ``<run_dir>/staging/<host>.json``; each rank reads the copy its host staged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from imagenet_ddp.data.stage import (
    cleanup_staged,
    in_place_report,
    reclaim_stale_leases,
    refuse_shared_scratch,
    scratch_info,
    scratch_problem,
    scratch_root,
    stage_dataset,
)
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import write_json_atomic
from imagenet_ddp.jobs import attempts
from imagenet_ddp.jobs.container import task_runtime
from imagenet_ddp.jobs.signals import EXIT_REQUEUE, STOP_SIGNALS, ForwardStopSignals
from imagenet_ddp.jobs.spec import EvalJob, TrainJob, read_spec, staging_report_path
from imagenet_ddp.settings.geometry import Geometry, on_nodes
from imagenet_ddp.settings.node_memory import compile_threads_env

STAGED_KINDS = ("train", "preflight")  # jobs that stage the prepared copy on every node


def stage_this_node(job: TrainJob) -> dict:
    """Copy the prepared data into this node's scratch (or, with the local launcher, read it in
    place where a copy would land on its own filesystem); write the node's staging report.
    A scratch root that every node shares (or on a network filesystem) is refused before any
    copy, under srun always: that is the multi-node case staging exists for."""
    paths, stage = job.paths, job.execution.stage
    path = staging_report_path(paths.run_dir, socket.gethostname())
    previous = json.loads(path.read_text()) if path.is_file() else {}
    src = paths.prepared_train
    scratch, origin = scratch_root(stage.scratch_dir or None)
    local = job.execution.launcher == "local"
    shared = {"prepare.dir": src} if local else {"prepare.dir": src, "the workdir": Path.cwd()}
    kind, problem = scratch_problem(scratch, shared) or (None, None)
    if kind == "shared" and local:  # one machine, one disk: a copy would buy nothing
        report = in_place_report(src, f"scratch {scratch} (from {origin}) is {problem}")
        print(f"staging: reading {src} in place: {report['in_place']}", flush=True)
    elif problem:
        raise refuse_shared_scratch(scratch, origin, problem)
    else:
        lease = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        reclaim_stale_leases(scratch)  # copies pinned by jobs killed before their cleanup
        report = stage_dataset(src, scratch, verify=stage.verify, lease=lease)
        report["lease"] = lease
    report["scratch"] = scratch_info(scratch, origin)  # a site's node-local disk shows here
    # An earlier attempt of this run (requeued, or killed before its cleanup) left its lease:
    # give it up now that this attempt holds its own.
    if previous.get("lease") and not previous.get("cleaned"):
        cleanup_staged(Path(previous["dest"]), previous["lease"])
    write_json_atomic(staging_report_path(paths.run_dir, report["host"]), report)
    return report


def unstage_this_node(job: TrainJob) -> None:
    """Give up this run's lease on the node's copy; the copy goes with the last lease (another
    run on this node may still read it). A copy read in place is left alone."""
    path = staging_report_path(job.paths.run_dir, socket.gethostname())
    report = json.loads(path.read_text())
    # cleaned: this run gave up its copy; removed: the copy is gone (no other run holds it)
    if report.get("in_place"):
        report["removed"] = False
    else:
        report["removed"] = cleanup_staged(Path(report["dest"]), report.get("lease"))
    report["cleaned"] = True
    write_json_atomic(path, report)


# Snakemake exports its job's thread count (all ranks' cores together) in each of these; a rank
# that inherits them runs that many BLAS/OpenMP threads and the ranks oversubscribe the node
# (measured: 2 ranks on 2 cores drop from ~330 to 30-150 img/s).
THREAD_COUNT_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def worker_env(geometry: Geometry) -> dict[str, str]:
    """Environment of the ranks: each gets its task's CPUs as its thread count, and a few
    inductor compile workers (node_memory.compile_threads; harmless without compile)."""
    env = dict(os.environ)
    env.update(dict.fromkeys(THREAD_COUNT_VARIABLES, str(geometry.cpus_per_task)))
    env.update(compile_threads_env(geometry.cpus_per_task))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def srun_argv(
    geometry: Geometry, *, per_node: bool, extra: list[str], prefix: str = "srun"
) -> list[str]:
    """srun for a step in the job's allocation (found through the kept SLURM_JOB_ID).

    ``prefix``: how the ranks' step starts (the rule's ``mpi`` resource, e.g.
    ``srun --mpi=pmix``); the per-node staging steps use plain ``srun``.

    The SLURM executor strips the allocation's SLURM_* defaults from the rule's environment,
    so the geometry is always explicit. A rule without the ``mpi`` resource (world size 1)
    already runs inside the executor's ``srun -n1`` step, which holds the job's CPUs/GPUs: a
    new step would wait for them forever, so it shares them (``--overlap``).
    """
    tasks_per_node = 1 if per_node else geometry.tasks_per_node
    inside_step = "SLURM_STEP_ID" in os.environ
    words = shlex.split(prefix)
    if not words or os.path.basename(words[0]) != "srun":
        raise ValueError(f"launch prefix {prefix!r} (the rule's mpi resource) must start with srun")
    return [
        *words,
        f"--nodes={geometry.nodes}",
        f"--ntasks={geometry.nodes * tasks_per_node}",
        f"--ntasks-per-node={tasks_per_node}",
        f"--cpus-per-task={geometry.cpus_per_task if not per_node else 1}",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        *(["--overlap"] if inside_step else []),
        *extra,
    ]


def _srun_extra(job: TrainJob | EvalJob) -> list[str]:
    return job.execution.srun_extra.split()


def _prefix(job: TrainJob | EvalJob) -> str:
    return job.execution.launch_prefix or "srun"


# Apptainer/Singularity export these inside a container: the image the rule's shell runs in.
CONTAINER_IMAGE_VARIABLES = ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER")


def task_python(environ=None) -> list[str]:
    """The command that starts Python for a task of an srun step.

    Inside a container (``--sdm apptainer``) the rule's shell runs in the image but srun starts
    its tasks on the host, where the image's interpreter does not exist: each task enters the
    same image again (``--nv``: the node's NVIDIA driver and GPUs). Binds reach these tasks
    only through the environment (``APPTAINER_BIND``, exported by ``srun --export=ALL``),
    not from Snakemake's ``--apptainer-args``, which only the rule's own container gets.
    Not run here (no apptainer): unit-tested for the command it builds.
    """
    environ = os.environ if environ is None else environ
    image = next((environ[v] for v in CONTAINER_IMAGE_VARIABLES if environ.get(v)), None)
    if image is None:
        return [sys.executable]
    # The host's runtime by its absolute path (imagenet_ddp.jobs.container): the container's
    # PATH does not hold a module's apptainer.
    return [task_runtime(environ), "exec", "--nv", image, sys.executable]


# The module each kind of job runs as its ranks (``python -m MODULE --spec FILE``): the
# rank's own entry point, which parses its arguments once and reads the spec once.
# Names, not imports: a process boundary, so jobs/ may name modules of the stages above
# it here (docs/layout.md).
RANK_MODULES = {
    "train": "imagenet_ddp.training.worker",
    "preflight": "imagenet_ddp.preflight.rank",
    "evaluate": "imagenet_ddp.evaluation.evaluate",
}


def rank_argv(job: TrainJob | EvalJob, spec_path: Path, python: list[str]) -> list[str]:
    """The command of one rank of ``job``: its kind's module, given the spec's path."""
    return [*python, "-m", RANK_MODULES[job.kind], "--spec", str(spec_path)]


def on_allocation(job: TrainJob) -> TrainJob:
    """``job`` on the node count of its allocation. A run with ``fallback_nodes`` may be given
    fewer than ``nodes`` (common.smk asks for a smaller count after a failed or never-started
    job): it trains there with the same global batch, ``accumulation`` scaled to match
    (settings.geometry.on_nodes). Other runs, and the local launcher, keep their settings."""
    run = job.run
    if job.execution.launcher != "srun" or not run.get("fallback_nodes"):
        return job
    if attempts.refusal_ahead(job.paths.checkpoint_root, run, job.execution.attempt):
        return job  # submitted on one node without GPUs: it refuses, it does not train
    nodes = allocated_nodes()
    if nodes == run["nodes"]:
        return job
    try:
        shifted = on_nodes(run, nodes)
    except ValueError as error:
        raise InputError(f"{error}; this job's allocation has {nodes} node(s)") from None
    print(f"run {run.get('run')!r}: this allocation has {nodes} of its {run['nodes']} nodes: "
          f"accumulation {shifted['accumulation']} (was {run.get('accumulation', 1)}), the "
          "same global batch", flush=True)  # fmt: skip
    return dataclasses.replace(job, run=shifted)


def allocated_nodes() -> int:
    """The node count of this SLURM job, from squeue: the rule's environment has none (the
    SLURM executor strips SLURM_JOB_NUM_NODES, docs/slurm-notes.md section 3)."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    try:
        result = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%D"], capture_output=True, text=True, timeout=60
        )
        return int(result.stdout.split()[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        raise InputError(
            f"job {job_id or '(no SLURM_JOB_ID)'}: cannot read the allocation's node count "
            "with squeue, which a run with fallback_nodes needs (in a container: bind squeue, "
            'docs/cluster.md "Containers")'
        ) from None


def run_attempt(job: TrainJob, spec_path: Path) -> int:
    """Stage on every node, run the ranks, clean up: the exit code of the job.

    ``job``: the job spec the caller wrote at ``spec_path`` (:mod:`imagenet_ddp.jobs.spec`);
    every step and rank gets only the path and reads the rest.
    The job is one attempt of the run (:mod:`imagenet_ddp.jobs.attempts`): recorded before staging,
    refused at once where a retry cannot help, closed with its exit code.
    """
    run, root = job.run, job.paths.checkpoint_root
    geometry = job.geometry
    entry, refused = attempts.begin(
        root,
        run,
        attempt=job.execution.attempt,
        gpus=geometry.nodes * int(run.get("gpus_per_node") or 0),
        cores=geometry.world_size * geometry.cpus_per_task,
        shape=geometry,
    )
    print(f"run {run.get('run')!r}: attempt {entry['attempt']} (job "
          f"{entry['slurm_job_id'] or 'local'}), from epoch {entry['start']['epoch']} step "
          f"{entry['start']['step']}", flush=True)  # fmt: skip
    if refused:
        print(f"run {run.get('run')!r}: {refused}", flush=True)
        return 1
    code = 1
    try:
        with attempts.Heartbeat(root, entry):
            code = unfinished_is_stopped(run_staged(job, spec_path), job)
            code = stopped_by_its_ranks(code, job, entry)
    except Exception as error:
        entry["error"] = f"launcher on {socket.gethostname()}: {type(error).__name__}: {error}"
        raise
    finally:
        attempts.end(root, entry, code)
    return code


def unfinished_is_stopped(code: int, job: TrainJob) -> int:
    """The job's exit code: EXIT_REQUEUE where the ranks' step exited 0 but rank 0 wrote no
    ``train_metrics.json`` (it does after the last epoch only). srun exits 0 after a stop signal
    when it gives up waiting for the step ("srun: error: Timed out waiting for job step to
    complete", seen in CI at a time limit) although the ranks checkpointed and exited 75: the
    job must not be taken for complete, its attempt recorded "completed", its outputs written."""
    if code == 0 and not (job.paths.run_dir / "train_metrics.json").is_file():
        print("the ranks' step exited 0 but the run did not finish (no train_metrics.json): "
              "stopped, the next job resumes from the newest checkpoint", flush=True)  # fmt: skip
        return EXIT_REQUEUE
    return code


def stopped_by_its_ranks(code: int, job: TrainJob, entry: dict) -> int:
    """EXIT_REQUEUE where the ranks' step failed but its ranks recorded a stop and its
    checkpoint was written (:func:`attempts.stopped_by_ranks`), whether or not the signal
    reached the launcher: ``scancel -s TERM --batch`` signals only the batch shell, the job's
    end then the ranks, and a rank still tearing down after the checkpoint is killed KillWait
    seconds later (seen in CI: the attempt recorded failed)."""
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
    """Stage on every node, run the ranks of ``job``'s kind, clean up: the exit code.
    Training and its preflight (a TrainJob too) stage the same way."""
    geometry = job.geometry
    launcher, cleanup = job.execution.launcher, job.execution.stage.cleanup
    on_spec = ["--spec", str(spec_path)]
    if launcher == "local":
        _check_local(geometry)
        stage_this_node(job)
        try:
            code, _ = launch_ranks(launcher, geometry, rank_argv(job, spec_path, [sys.executable]))
        finally:
            if cleanup:
                unstage_this_node(job)
        return code

    python = task_python()
    node_step = [*python, "-m", "imagenet_ddp.jobs.launch"]  # one task per node: stage, unstage
    extra = _srun_extra(job)
    stage = [*srun_argv(geometry, per_node=True, extra=extra), *node_step, "stage-node", *on_spec]
    code, signalled = _run_step(stage, geometry)
    # Stopped while staging (the launcher was signalled, or a node's step was: exit 75 after
    # finishing its copy): no ranks, rerun to resume.
    if code == EXIT_REQUEUE or (code == 0 and signalled):
        print("stop signal while staging: the ranks are not started", flush=True)
        return EXIT_REQUEUE
    if code != 0:
        return code
    try:
        ranks = rank_argv(job, spec_path, python)
        code, signalled = launch_ranks(launcher, geometry, ranks, extra, _prefix(job))
        code = killed_after_its_checkpoint(code, signalled, job)
    finally:
        if cleanup and signalled:
            # The job is ending (time limit, scancel, preemption): SLURM creates no new step
            # now; its epilog removes $SLURM_TMPDIR.
            print("stop signal received: node-local copies are left to the job's epilog")
        elif cleanup:
            unstage = [*srun_argv(geometry, per_node=True, extra=extra), *node_step]
            _run([*unstage, "unstage-node", *on_spec], geometry)
    return code


def killed_after_its_checkpoint(code: int, signalled: float, job: TrainJob) -> int:
    """EXIT_REQUEUE where the ranks' step failed after a stop signal reached the launcher
    (``signalled``: when; scancel, the job's end) but a checkpoint was written since: SLURM
    kills what still runs KillWait seconds after its SIGTERM, and a rank still tearing down
    (loader workers, the process group) is killed after its checkpoint. The run lost nothing:
    the attempt is stopped, not failed (after a failed one an elastic run asks for fewer
    nodes, docs/reliability.md)."""
    if not signalled or code in (0, EXIT_REQUEUE):
        return code
    newest = attempts.newest_checkpoint(job.paths.checkpoint_root)
    if newest is None or newest["written"] < signalled:
        return code
    print(f"the ranks' step exited {code} after the stop signal, but {newest['path']} was "
          "written after it: stopped, the next job resumes from it", flush=True)  # fmt: skip
    return EXIT_REQUEUE


def run_evaluation(job: EvalJob, spec_path: Path) -> int:
    """The evaluation's ranks, through the same launcher (nothing staged): its exit code."""
    launcher = job.execution.launcher
    python = [sys.executable] if launcher == "local" else task_python()
    code, _ = launch_ranks(
        launcher,
        job.geometry,
        rank_argv(job, spec_path, python),
        _srun_extra(job),
        _prefix(job),
    )
    return code


def _check_local(geometry: Geometry) -> None:
    if geometry.nodes != 1:
        raise ValueError("launcher 'local' runs on one node; use launcher 'srun' for nodes > 1")


def launch_ranks(
    launcher: str,
    geometry: Geometry,
    argv: list[str],
    srun_extra: list[str] | None = None,
    prefix: str = "srun",
) -> tuple[int, float]:
    """Run ``argv`` as ``nodes x tasks_per_node`` ranks: training workers and evaluation alike.

    ``local``: one process per rank here (:func:`spawn_local_ranks`); ``srun``: one srun step
    of one task per rank. Both give each rank ``cpus_per_task`` threads (:func:`worker_env`)
    and pass stop signals on. Returns (exit code, when a stop signal reached the launcher
    during an srun step: Unix seconds, 0.0 for none or with ``local``).
    """
    if launcher == "local":
        _check_local(geometry)
        return spawn_local_ranks(argv, geometry), 0.0
    step = srun_argv(geometry, per_node=False, extra=srun_extra or [], prefix=prefix)
    return _run_step([*step, *argv], geometry)


def _run(argv: list[str], geometry: Geometry) -> int:
    return _run_step(argv, geometry)[0]


def _run_step(argv: list[str], geometry: Geometry) -> tuple[int, float]:
    """Run an srun step to its end, surviving stop signals: (exit code, when a stop signal
    reached the launcher: Unix seconds, 0.0 for none).

    A stop signal to the launcher reaches srun as SIGUSR1, which srun passes on to its tasks
    unchanged (:class:`ForwardStopSignals`); srun then exits with their code (EXIT_REQUEUE
    after a checkpoint). Never SIGTERM or SIGINT: srun would kill its step (SIGKILL). srun runs
    in a session of its own, so a signal to the launcher's process group (Ctrl-C under
    ``salloc``, ``kill -- -<pgid>``) does not reach it directly either. SLURM's own SIGTERM at
    the job's end still reaches srun (it is in the batch step): srun then asks slurmctld to
    kill the step, which refuses (the job is already ending), and the ranks have ``KillWait``
    seconds (docs/slurm-notes.md section 7).
    """
    print("+ " + shlex.join(argv), flush=True)
    with ForwardStopSignals(srun=True) as forward:
        proc = subprocess.Popen(
            argv, env=worker_env(geometry), stdin=subprocess.DEVNULL, start_new_session=True
        )
        forward.children.append(proc)
        while True:
            try:
                code = proc.wait(timeout=RELAY_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if forward.received:  # again: srun drops a signal while it launches the step
                    forward.relay()
    if forward.received:
        name = signal.Signals(forward.received).name
        print(f"stop signal {name}: passed on to srun as SIGUSR1; srun exited {code}", flush=True)
    return code, forward.received_at


# While the ranks' step runs after a stop signal, srun gets SIGUSR1 again this often.
RELAY_SECONDS = 5.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_local_ranks(argv: list[str], geometry: Geometry, grace_seconds: float = 30) -> int:
    """Start one process per rank on this node, the way srun starts them on a cluster.

    Not torchrun: on a stop signal torchrun exits with its own code 1 (losing the ranks'
    EXIT_REQUEUE) and kills the ranks 30 s later whether their checkpoint is written or not.
    Here a stop signal is passed on to the ranks and their exit code is returned. If a rank
    fails, the others are stopped (SIGTERM, SIGKILL after ``grace_seconds``), as torchrun does.
    """
    env = worker_env(geometry)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(geometry.tasks_per_node),
        LOCAL_WORLD_SIZE=str(geometry.tasks_per_node),
    )
    print("+ " + shlex.join(argv) + f"  (x {geometry.tasks_per_node} ranks)", flush=True)
    _become_subreaper()
    before = _children()
    with ForwardStopSignals() as forward:
        try:
            for rank in range(geometry.tasks_per_node):
                rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                forward.children.append(subprocess.Popen(argv, env=rank_env))
            return _wait_for_ranks(forward.children, grace_seconds)
        finally:
            _end_leftovers(before)


def _become_subreaper() -> None:
    """Orphans of the ranks become this process's children (Linux ``PR_SET_CHILD_SUBREAPER``),
    so :func:`_end_leftovers` can find them."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _children() -> set[int]:
    me, found = str(os.getpid()), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if stat.read_text().rsplit(")", 1)[1].split()[1] == me:
                found.add(int(stat.parent.name))
    return found


def _end_leftovers(before: set[int]) -> None:
    """Kill what the ranks left running once they are gone. A rank killed by SIGKILL (OOM
    killer, ``kill -9``) leaves its loader fork server and workers behind: their parent is the
    fork server, so their watchdog never sees the rank go, and they would hold the job's log
    open for ever. (srun ends every process of a step itself.) ``before``: children this
    process had before the ranks started, left alone."""
    for pid in _children() - before:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _exit_code(proc: subprocess.Popen) -> int:
    code = proc.returncode
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says


def _wait_for_ranks(procs: list[subprocess.Popen], grace_seconds: float) -> int:
    failed = None
    while [p.poll() for p in procs].count(None):  # polls every rank (any() would stop early)
        failed = next((p for p in procs if p.returncode not in (None, 0, EXIT_REQUEUE)), None)
        if failed is not None:
            break
        time.sleep(0.2)
    if failed is not None:
        code = _exit_code(failed)
        print(f"rank (pid {failed.pid}) failed with exit code {code}; stopping the others")
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return code
    codes = [_exit_code(p) for p in procs]
    return next((c for c in codes if c not in (0, EXIT_REQUEUE)), max(codes))


def main(argv: list[str] | None = None) -> int:
    """The per-node steps of a staged job (``stage-node``, ``unstage-node``: one srun task per
    node, not meant to be called by hand); each reads the job spec whose path it is given.
    The ranks are their own modules (:data:`RANK_MODULES`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m imagenet_ddp.jobs.launch")
    parser.add_argument("command", choices=["stage-node", "unstage-node"])
    parser.add_argument("--spec", type=Path, required=True, help="the job spec file")
    args = parser.parse_args(argv)
    # A stop signal (the launcher's SIGUSR1 through srun, --signal=USR1@N) must not kill a
    # copy half-way: the step finishes it (SIGKILL still ends it), then exits 75 and the
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
        return 2
    if received:
        print(f"{socket.gethostname()}: {signal.Signals(received[0]).name} while "
              f"{args.command}: finished it, exit {EXIT_REQUEUE}", flush=True)  # fmt: skip
        return EXIT_REQUEUE
    return 0


if __name__ == "__main__":
    sys.exit(main())
