"""Stop signals: how a job that SLURM (or a user) ends keeps its progress.

SLURM's SIGTERM (or ``--signal``'s SIGUSR1) and a terminal's SIGINT reach every process at once:

- a rank only records it (:class:`StopFlag`); all agree at a step boundary, rank 0 writes a
  checkpoint and every rank exits with :data:`EXIT_REQUEUE`;
- loader workers ignore it (:func:`ignore_stop_signals`: one killed makes its rank raise before
  any checkpoint); they come from a fork server (:func:`loader_context`), not forked from a
  rank whose threads may hold a lock (seen: a worker hung at start);
- the launcher passes it on and returns the ranks' exit code (:class:`ForwardStopSignals`),
  to ``srun`` as SIGUSR1 only: srun kills its step on SIGTERM, SIGHUP or a second SIGINT
  (docs/slurm-notes.md section 7).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import subprocess
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from imagenet_ddp.jobs import early_signals

EXIT_REQUEUE, STOP_SIGNALS = early_signals.EXIT_REQUEUE, early_signals.STOP_SIGNALS
# The launcher also stops on SIGHUP (the terminal of an interactive allocation closed).
LAUNCHER_SIGNALS = (*STOP_SIGNALS, signal.SIGHUP)
# What srun passes on to its tasks unchanged (and the ranks take for a stop).
SRUN_STOP_SIGNAL = signal.SIGUSR1


def ignore_stop_signals(_worker_id: int | None = None) -> None:
    """DataLoader ``worker_init_fn``: the rank decides when to stop, never its workers."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def loader_context() -> multiprocessing.context.BaseContext:
    """The ``multiprocessing_context`` of every DataLoader with workers (see the module doc)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["imagenet_ddp.jobs.loader_server"])
    return context


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block the stop signals while DataLoader workers are forked: a worker inherits the mask,
    so one that comes before its ``worker_init_fn`` waits to be discarded there."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class StopFlag:
    """Set by a stop signal; agreed on by all ranks at step boundaries. :meth:`poll` never
    synchronizes the GPU: an asynchronous max all-reduce on a CPU (gloo) group, started at one
    check and read at the next, so all ranks stop at the same step. It also carries
    ``checkpoint_due`` (``checkpoint_seconds`` since the last, on any rank) and ``suspected``
    (some rank's ``suspect`` of divergence, training.guard)."""

    def __init__(self, interval: int, checkpoint_seconds: float = 0.0) -> None:
        self.interval = interval
        self.signalled = 0
        self.checkpoint_seconds = checkpoint_seconds
        self.checkpoint_due = False
        self.suspect = False  # this rank's divergence guard suspects (training.guard)
        self.suspected = False  # some rank's did, as of the last agreement
        self._last_checkpoint = time.monotonic()
        self._group = None
        self._pending: tuple[torch.Tensor, object] | None = None

    def catch(self) -> None:
        """Record the stop signals from now on (first thing in a rank: one during start-up
        stops it at its first step instead of killing it)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        self.signalled = self.signalled or early_signals.taken()  # one during `import torch`

    def install(self) -> None:
        """Catch the stop signals; call after the process group is up (all ranks: collective)."""
        self.catch()
        if dist.is_available() and dist.is_initialized() and self._group is None:
            # NCCL only reduces GPU tensors; a CPU group keeps the flag off the GPU's stream.
            gloo = dist.get_backend() == "gloo"
            self._group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")

    def _handler(self, signum, frame) -> None:
        self.signalled = signum

    def cause(self) -> str:
        """' by SIGUSR1' (this rank's signal) for its log; '' for none."""
        return f" by {signal.Signals(self.signalled).name}" if self.signalled else ""

    def checkpointed(self) -> None:
        """A checkpoint was just written: the interval starts again."""
        self._last_checkpoint = time.monotonic()
        self.checkpoint_due = False

    def _local(self) -> torch.Tensor:
        elapsed = time.monotonic() - self._last_checkpoint
        due = 0 < self.checkpoint_seconds <= elapsed
        flags = (self.signalled, due, self.suspect)
        return torch.tensor([1.0 if flag else 0.0 for flag in flags])

    def poll(self, step: int) -> bool:
        """After every step (``step``: the same count on all ranks): True when all stop now."""
        self.checkpoint_due = False
        if step % self.interval:
            return False
        if not (dist.is_available() and dist.is_initialized()):
            flags = self._local()
            self.checkpoint_due, self.suspected = bool(flags[1]), self.suspect
            return bool(self.signalled)
        stop = False
        if self._pending is not None:
            flag, work = self._pending
            work.wait()
            stop, self.checkpoint_due = bool(flag[0]), bool(flag[1])
            self.suspected = bool(flag[2])
        flag = self._local()
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (flag, work)
        return stop

    def settle(self) -> None:
        """Wait for a pending agreement (before the process group is destroyed)."""
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None

    def agreed(self) -> bool:
        """Synchronous agreement (at epoch ends); also settles a pending :meth:`poll`."""
        if not (dist.is_available() and dist.is_initialized()):
            return bool(self.signalled)
        self.settle()
        flag = self._local()[:1]
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


class ForwardStopSignals:
    """While active, a stop signal to this process is recorded and passed on to ``children``
    (the launcher outlives it and returns the ranks' code): as it came (SIGINT, SIGHUP as
    SIGTERM), or to ``srun`` as SIGUSR1, which srun forwards unchanged. :meth:`relay` sends it
    again (srun drops one while it still launches its step)."""

    def __init__(self, *, srun: bool = False) -> None:
        self.children: list[subprocess.Popen] = []
        self.received = 0
        self.srun = srun
        self._previous: dict[int, object] = {}

    def __enter__(self) -> ForwardStopSignals:
        for sig in LAUNCHER_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _forward(self, signum, frame) -> None:
        self.received = self.received or signum
        self.relay(signum)

    def relay(self, signum: int | None = None) -> None:
        """Pass a stop on to the children still running (``signum``: the one received)."""
        signum = signum or self.received
        soft = {signal.SIGINT: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}
        forwarded = SRUN_STOP_SIGNAL if self.srun else soft.get(signum, signum)
        for child in self.children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(forwarded)
