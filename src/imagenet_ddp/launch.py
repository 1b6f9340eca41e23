"""Run one training job: stage data on every node, start one worker per device, clean up.

Evaluation starts its ranks through the same :func:`launch_ranks` (without staging). Every
step and rank gets the path of the job's spec file (:mod:`imagenet_ddp.job_spec`), nothing else.
Two launchers share this code path:
- ``local``: one node; staging in this process, one worker process per rank started here
  (:func:`spawn_local_ranks`), with the variables torchrun would set.
- ``srun``: inside a SLURM allocation (a Snakemake rule with the ``mpi`` resource); staging is
  one ``srun`` task per node, the workers are ``nodes x tasks_per_node`` srun tasks, each reading
  its rank from SLURM_PROCID/SLURM_LOCALID and deriving MASTER_ADDR/MASTER_PORT from the job.

Each node writes ``<run_dir>/staging/<host>.json``; each rank reads the copy its host staged.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from imagenet_ddp.io import write_json_atomic
from imagenet_ddp.job_spec import geometry_of, read_spec, staging_report_path
from imagenet_ddp.signals import EXIT_REQUEUE, ForwardStopSignals
from imagenet_ddp.stage import cleanup_staged, scratch_root_from_env, stage_dataset

# Below Linux's default ephemeral range (32768-60999), so it cannot collide with client ports.
MASTER_PORT_BASE, MASTER_PORT_SPAN = 15000, 15000
STAGED_KINDS = ("train", "preflight")  # jobs that stage the prepared copy on every node


@dataclass(frozen=True)
class Geometry:
    nodes: int
    tasks_per_node: int
    cpus_per_task: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def master_port(job_id: int) -> int:
    """A port derived from the job id: concurrent jobs sharing a node rarely collide."""
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM hostlist expression -> host names, via ``scontrol show hostnames``."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    ).stdout
    return out.split()


def rendezvous_from_slurm_env() -> None:
    """Set MASTER_ADDR/MASTER_PORT in an srun task from the variables srun gives every task."""
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ["SLURM_JOB_NODELIST"]
        os.environ["MASTER_ADDR"] = expand_nodelist(nodelist)[0]
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(master_port(int(os.environ["SLURM_JOB_ID"])))


def stage_this_node(spec: dict) -> dict:
    paths, execution = spec["paths"], spec["execution"]
    path = staging_report_path(paths["run_dir"], socket.gethostname())
    previous = json.loads(path.read_text()) if path.is_file() else {}
    lease = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    report = stage_dataset(
        Path(paths["prepared_train"]),
        scratch_root_from_env(Path(execution["scratch_dir"])),
        verify=execution["stage_verify"],
        lease=lease,
    )
    report["lease"] = lease
    # An earlier attempt of this run (requeued, or killed before its cleanup) left its lease:
    # give it up now that this attempt holds its own.
    if previous.get("lease") and not previous.get("cleaned"):
        cleanup_staged(Path(previous["dest"]), previous["lease"])
    write_json_atomic(staging_report_path(paths["run_dir"], report["host"]), report)
    return report


def unstage_this_node(spec: dict) -> None:
    """Give up this run's lease on the node's copy; the copy goes with the last lease (another
    run on this node may still read it)."""
    path = staging_report_path(spec["paths"]["run_dir"], socket.gethostname())
    report = json.loads(path.read_text())
    # cleaned: this run gave up its copy; removed: the copy is gone (no other run holds it)
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
    """Environment of the ranks: each gets its task's CPUs as its thread count."""
    env = dict(os.environ)
    env.update(dict.fromkeys(THREAD_COUNT_VARIABLES, str(geometry.cpus_per_task)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def srun_argv(geometry: Geometry, *, per_node: bool, extra: list[str]) -> list[str]:
    """srun for a step in the job's allocation (found through the kept SLURM_JOB_ID).

    The SLURM executor strips the allocation's SLURM_* defaults from the rule's environment,
    so the geometry is always explicit. A rule without the ``mpi`` resource (world size 1)
    already runs inside the executor's ``srun -n1`` step, which holds the job's CPUs/GPUs: a
    new step would wait for them forever, so it shares them (``--overlap``).
    """
    tasks_per_node = 1 if per_node else geometry.tasks_per_node
    inside_step = "SLURM_STEP_ID" in os.environ
    return [
        "srun",
        f"--nodes={geometry.nodes}",
        f"--ntasks={geometry.nodes * tasks_per_node}",
        f"--ntasks-per-node={tasks_per_node}",
        f"--cpus-per-task={geometry.cpus_per_task if not per_node else 1}",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        *(["--overlap"] if inside_step else []),
        *extra,
    ]


def geometry_of_spec(spec: dict) -> Geometry:
    shape = geometry_of(spec)
    return Geometry(shape["nodes"], shape["tasks_per_node"], shape["cpus_per_task"])


def _srun_extra(spec: dict) -> list[str]:
    return spec["execution"]["srun_extra"].split()


def run_training(spec_path: Path) -> int:
    """Stage on every node, run the ranks, clean up: the exit code of the job.

    Every step gets only ``spec_path`` (:mod:`imagenet_ddp.job_spec`) and reads the rest.
    """
    return run_staged(spec_path, "train", "worker")


def run_staged(spec_path: Path, kind: str, rank_command: str) -> int:
    """Stage on every node, run ``rank_command`` as the job's ranks, clean up: the exit code.
    Training (``worker``) and its preflight (``preflight-worker``) stage the same way."""
    spec = read_spec(spec_path, kind)
    geometry, execution = geometry_of_spec(spec), spec["execution"]
    launcher, cleanup = execution["launcher"], execution["cleanup"]
    me = [sys.executable, "-m", "imagenet_ddp.launch"]
    on_spec = ["--spec", str(spec_path)]
    worker = [*me, rank_command, *on_spec]
    if launcher == "local":
        _check_local(geometry)
        stage_this_node(spec)
        try:
            code, _ = launch_ranks(launcher, geometry, worker)
        finally:
            if cleanup:
                unstage_this_node(spec)
        return code

    extra = _srun_extra(spec)
    stage = [*srun_argv(geometry, per_node=True, extra=extra), *me, "stage-node", *on_spec]
    code, signalled = _run_step(stage, geometry)
    if code != 0:
        return code
    try:
        code, signalled = launch_ranks(launcher, geometry, worker, extra)
    finally:
        if cleanup and signalled:
            # The job is ending (time limit, scancel, preemption): SLURM creates no new step
            # now; its epilog removes $SLURM_TMPDIR.
            print("stop signal received: node-local copies are left to the job's epilog")
        elif cleanup:
            _run(
                [*srun_argv(geometry, per_node=True, extra=extra), *me, "unstage-node", *on_spec],
                geometry,
            )
    return code


def run_evaluation(spec_path: Path) -> int:
    """The evaluation's ranks, through the same launcher (nothing staged): its exit code."""
    spec = read_spec(spec_path, "evaluate")
    worker = [sys.executable, "-m", "imagenet_ddp.launch", "evaluate-worker"]
    code, _ = launch_ranks(
        spec["execution"]["launcher"],
        geometry_of_spec(spec),
        [*worker, "--spec", str(spec_path)],
        _srun_extra(spec),
    )
    return code


def _check_local(geometry: Geometry) -> None:
    if geometry.nodes != 1:
        raise ValueError("launcher 'local' runs on one node; use launcher 'srun' for nodes > 1")


def launch_ranks(
    launcher: str, geometry: Geometry, argv: list[str], srun_extra: list[str] | None = None
) -> tuple[int, bool]:
    """Run ``argv`` as ``nodes x tasks_per_node`` ranks: training workers and evaluation alike.

    ``local``: one process per rank here (:func:`spawn_local_ranks`); ``srun``: one srun step
    of one task per rank. Both give each rank ``cpus_per_task`` threads (:func:`worker_env`)
    and pass stop signals on. Returns (exit code, whether a stop signal arrived during an
    srun step).
    """
    if launcher == "local":
        _check_local(geometry)
        return spawn_local_ranks(argv, geometry), False
    return _run_step(
        [*srun_argv(geometry, per_node=False, extra=srun_extra or []), *argv], geometry
    )


def _run(argv: list[str], geometry: Geometry) -> int:
    return _run_step(argv, geometry)[0]


def _run_step(argv: list[str], geometry: Geometry) -> tuple[int, bool]:
    """Run an srun step to its end, surviving stop signals: (exit code, signalled).

    srun gets the signal from SLURM too and passes it to its tasks; it then exits with their
    code (EXIT_REQUEUE after a checkpoint). Killing it early would lose the checkpoint.
    """
    print("+ " + shlex.join(argv), flush=True)
    with ForwardStopSignals() as forward:
        proc = subprocess.Popen(argv, env=worker_env(geometry))
        forward.children.append(proc)
        code = proc.wait()
    return code, bool(forward.received)


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
    with ForwardStopSignals() as forward:
        for rank in range(geometry.tasks_per_node):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            forward.children.append(subprocess.Popen(argv, env=rank_env))
        return _wait_for_ranks(forward.children, grace_seconds)


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
    """Per-node and per-rank entry points used by the launcher (not meant to be called by hand);
    each reads the job spec whose path it is given."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m imagenet_ddp.launch")
    parser.add_argument(
        "command",
        choices=["stage-node", "unstage-node", "worker", "evaluate-worker", "preflight-worker"],
    )
    parser.add_argument("--spec", type=Path, required=True, help="the job spec file")
    args = parser.parse_args(argv)
    if args.command == "stage-node":
        stage_this_node(read_spec(args.spec, STAGED_KINDS))
        return 0
    if args.command == "unstage-node":
        unstage_this_node(read_spec(args.spec, STAGED_KINDS))
        return 0
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        rendezvous_from_slurm_env()
    if args.command == "evaluate-worker":  # reads the shared prepared copy: nothing staged
        from imagenet_ddp import evaluate as evaluation

        return evaluation.main(["--spec", str(args.spec)])
    if args.command == "preflight-worker":  # reads the copy its host staged, like training
        from imagenet_ddp import preflight_rank

        return preflight_rank.main(["--spec", str(args.spec)])
    from imagenet_ddp import train

    return train.main(["--spec", str(args.spec)])  # it reads the copy its host staged


if __name__ == "__main__":
    sys.exit(main())
