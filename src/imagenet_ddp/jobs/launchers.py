"""The launchers: how a job's ranks (and its per-node staging steps) are started, by name.

``execution.launcher`` names one of :data:`LAUNCHERS` (``srun``: srun tasks in a SLURM
allocation; ``local``: one process per rank on this node), or ``auto``: the first whose
:meth:`Launcher.detect` sees its environment. A new launcher (``mpirun``, Flux) is one
:func:`register`-ed subclass. Torch-free at import (the workflow reads the names at parse time).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

import psutil

from imagenet_ddp.errors import InputError
from imagenet_ddp.io import exit_by_signal
from imagenet_ddp.jobs.container import task_options, task_runtime
from imagenet_ddp.settings.geometry import Geometry
from imagenet_ddp.settings.node_memory import compile_threads_env

AUTO = "auto"


class Launcher:
    """One way to start a job's ranks. A step returns (exit code, the stop signal that reached
    the launcher, 0 for none), passing stop signals on to what it started."""

    name: ClassVar[str]
    # One node only; its staging reads the prepared copy in place where a copy would land on
    # the same disk.
    single_node: ClassVar[bool] = False

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Whether ``auto`` picks this launcher where the job runs."""
        return False

    def check(self, geometry: Geometry) -> None:
        """Refuse a geometry this launcher cannot start (ValueError, one line)."""
        if self.single_node and geometry.nodes != 1:
            raise ValueError(
                f"launcher {self.name!r} runs on one node; use launcher 'srun' for nodes > 1"
            )

    def python(self, binds: Iterable[str] = ()) -> list[str]:
        """The command that starts Python for a rank or a per-node step, which must see the
        paths ``binds`` (the scratch root: in a container, bound)."""
        return [sys.executable]

    def on_every_node(
        self, execution, geometry: Geometry, here: Callable[[], object], argv: list[str]
    ) -> tuple[int, int]:
        """Run a per-node step on every node: ``argv`` elsewhere, ``here()`` on this machine."""
        raise NotImplementedError

    def start_ranks(self, execution, geometry: Geometry, argv: list[str]) -> tuple[int, int]:
        """Run ``argv`` as the job's ranks (:func:`worker_env`) to their end."""
        raise NotImplementedError

    def allocated_nodes(self) -> int | None:
        """The job's node count where it may differ from the run's (``fallback_nodes``)."""
        return None

    def stop_skips_cleanup(self) -> bool:
        """Whether a stop leaves the node-local copies to the job's end (no new steps then)."""
        return False


LAUNCHERS: dict[str, Launcher] = {}


def register(cls: type[Launcher]) -> type[Launcher]:
    """Class decorator: ``cls`` is the launcher ``cls.name`` (``auto`` tries them in order)."""
    if cls.name == AUTO or cls.name in LAUNCHERS:
        raise ValueError(f"launcher name {cls.name!r} is taken")
    LAUNCHERS[cls.name] = cls()
    return cls


def launcher_problem(name: str) -> str | None:
    """One line when ``name`` is not a launcher (the dry-run's and the spec's check)."""
    names = [AUTO, *LAUNCHERS]
    return None if name in names else f"execution.launcher {name!r}: give {', '.join(names)}"


def get_launcher(name: str) -> Launcher:
    """The launcher ``name`` (``auto`` resolved here first)."""
    return LAUNCHERS[resolve_launcher(name)]


def resolve_launcher(name: str, environ: Mapping[str, str] | None = None) -> str:
    """``auto``: the first launcher that detects its environment, where the job runs."""
    if name != AUTO:
        return name
    environ = os.environ if environ is None else environ
    return next(n for n, launcher in LAUNCHERS.items() if launcher.detect(environ))


# ------------------------------------------------------------------ every launcher's ranks

# Snakemake exports its job's thread count (all ranks' cores together) in each of these; a rank
# that inherits them runs that many BLAS/OpenMP threads and the ranks oversubscribe the node
# (measured: 2 ranks on 2 cores drop from ~330 to 30-150 img/s).
THREAD_COUNT_VARIABLES = (
    *(f"{lib}_NUM_THREADS" for lib in ("OMP", "MKL", "OPENBLAS", "GOTO", "NUMEXPR")),
    "VECLIB_MAXIMUM_THREADS",
)


def worker_env(geometry: Geometry) -> dict[str, str]:
    """The ranks' environment: its task's CPUs as each thread count, a few compile workers."""
    env = dict(os.environ)
    env.update(dict.fromkeys(THREAD_COUNT_VARIABLES, str(geometry.cpus_per_task)))
    env.update(compile_threads_env(geometry.cpus_per_task))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ------------------------------------------------------------------ srun


@register
class Srun(Launcher):
    """srun steps in the job's SLURM allocation (found through the kept SLURM_JOB_ID)."""

    name = "srun"

    def detect(self, environ: Mapping[str, str]) -> bool:
        return bool(environ.get("SLURM_JOB_ID"))

    def python(self, binds: Iterable[str] = ()) -> list[str]:
        return task_python(binds=binds)

    def on_every_node(self, execution, geometry, here, argv):
        extra = shlex.split(execution.srun_extra)  # a quoted value is one word, as in a shell
        return _run_step([*srun_argv(geometry, per_node=True, extra=extra), *argv], geometry)

    def start_ranks(self, execution, geometry, argv):
        prefix = execution.launch_prefix or "srun"
        extra = shlex.split(execution.srun_extra)
        step = srun_argv(geometry, per_node=False, extra=extra, prefix=prefix)
        return _run_step([*step, *argv], geometry)

    def allocated_nodes(self) -> int:
        return allocated_nodes()

    def stop_skips_cleanup(self) -> bool:
        # The job is ending (time limit, scancel, preemption): SLURM creates no new step now.
        # A site's epilog may remove $SLURM_TMPDIR; else the next job staging on the node
        # reclaims the copy once this job's heartbeat has stopped (data.stage).
        return True


def srun_argv(
    geometry: Geometry, *, per_node: bool, extra: list[str], prefix: str = "srun"
) -> list[str]:
    """srun for a step in the job's allocation (``prefix``: the rule's ``mpi`` resource), its
    geometry explicit (the SLURM executor strips SLURM_* defaults). Inside the executor's
    ``srun -n1`` step (a rule without ``mpi``) a new step would wait for ever: ``--overlap``."""
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


# Apptainer/Singularity export these inside a container: the image the rule's shell runs in.
CONTAINER_IMAGE_VARIABLES = ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER")


def task_python(environ=None, binds: Iterable[str] = ()) -> list[str]:
    """The command that starts Python for a task of an srun step. Inside a container (``--sdm
    apptainer``) srun starts its tasks on the host: each enters the same image again, with the
    rule's binds and ``binds`` (jobs.container.task_options)."""
    environ = os.environ if environ is None else environ
    image = next((environ[v] for v in CONTAINER_IMAGE_VARIABLES if environ.get(v)), None)
    if image is None:
        return [sys.executable]
    # The host's runtime by its absolute path (imagenet_ddp.jobs.container): the container's
    # PATH does not hold a module's apptainer.
    return [task_runtime(environ), "exec", *task_options(environ, binds), image, sys.executable]


SLURM_SECONDS = 30


def slurm(*args: str) -> subprocess.CompletedProcess | None:
    """A SLURM client command's result; None where it cannot run or a hung slurmctld holds it
    past SLURM_SECONDS (it must not hang the job)."""
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=SLURM_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None


def allocated_nodes() -> int:
    """The node count of this SLURM job, from squeue (the SLURM executor strips
    SLURM_JOB_NUM_NODES, docs/slurm-notes.md section 3)."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    try:
        return int(slurm("squeue", "-h", "-j", job_id, "-o", "%D").stdout.split()[0])
    except (AttributeError, ValueError, IndexError):
        raise InputError(
            f"job {job_id or '(no SLURM_JOB_ID)'}: cannot read the allocation's node count "
            "with squeue, which a run with fallback_nodes needs (in a container: bind squeue, "
            'docs/cluster.md "Containers")'
        ) from None


def _run_step(argv: list[str], geometry: Geometry) -> tuple[int, int]:
    """Run an srun step to its end: (exit code, the stop signal received). A stop reaches srun
    as SIGUSR1 only (:class:`ForwardStopSignals`), and in a session of its own a signal to the
    launcher's process group does not (docs/slurm-notes.md section 7)."""
    from imagenet_ddp.jobs.signals import ForwardStopSignals

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
    return code, forward.received


# While the ranks' step runs after a stop signal, srun gets SIGUSR1 again this often.
RELAY_SECONDS = 5.0


# ------------------------------------------------------------------ local


@register
class Local(Launcher):
    """One node, this machine: the per-node steps in this process, one process per rank."""

    name = "local"
    single_node = True

    def detect(self, environ: Mapping[str, str]) -> bool:
        return True  # the fallback: registered last

    def on_every_node(self, execution, geometry, here, argv):
        self.check(geometry)
        here()
        return 0, 0

    def start_ranks(self, execution, geometry, argv):
        self.check(geometry)
        return spawn_local_ranks(argv, geometry), 0


def spawn_local_ranks(argv: list[str], geometry: Geometry, grace_seconds: float = 30) -> int:
    """One process per rank on this node, as srun starts them (not torchrun: on a stop it exits
    1 and kills the ranks 30 s later). A failed rank stops the others (SIGTERM, SIGKILL after
    ``grace_seconds``)."""
    import ctypes

    from imagenet_ddp.jobs.signals import ForwardStopSignals

    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = str(geometry.tasks_per_node)
    env = worker_env(geometry)
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=ranks, LOCAL_WORLD_SIZE=ranks
    )
    print("+ " + shlex.join(argv) + f"  (x {ranks} ranks)", flush=True)
    # Orphans of the ranks become this process's children (PR_SET_CHILD_SUBREAPER)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    before = {p.pid for p in psutil.Process().children()}
    with ForwardStopSignals() as forward:
        try:
            for rank in range(geometry.tasks_per_node):
                rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                forward.children.append(subprocess.Popen(argv, env=rank_env))
            return _wait_for_ranks(forward.children, grace_seconds)
        finally:
            _end_leftovers(before)


def _end_leftovers(before: set[int]) -> None:
    """Kill what the ranks left running (a SIGKILLed rank's fork server and loader workers,
    which would hold the job's log open for ever; srun does this itself), but ``before``."""
    for child in psutil.Process().children():
        if child.pid not in before:
            with contextlib.suppress(psutil.Error, OSError):
                child.kill()
                os.waitpid(child.pid, 0)


def _exit_code(proc: subprocess.Popen) -> int:
    code = proc.returncode
    return exit_by_signal(-code) if code < 0 else code  # killed by signal N


def _wait_for_ranks(procs: list[subprocess.Popen], grace_seconds: float) -> int:
    from imagenet_ddp.jobs.signals import EXIT_REQUEUE

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
