"""Stop signals held from a rank's first second, before torch is imported (seconds on a
loaded filesystem): a ``--signal=USR1@N`` or scancel's SIGTERM meanwhile would kill the rank
before :meth:`imagenet_ddp.jobs.signals.StopFlag.catch`, without its checkpoint. Imported first
by a rank started as one of :data:`ENTRY_MODULES`, this notes them; :func:`taken` hands them
to the StopFlag. Anything else that imports it keeps its own handlers. Torch-free.
"""

from __future__ import annotations

import signal
import sys

from imagenet_ddp.io import EXIT_REQUEUE, STOPS

# The signals that stop a rank (their one home: jobs.signals, which imports torch, and the
# schema's execution.stop_signal, tests/test_schema.py, follow it): a command's, and the time
# limit's warning, SIGUSR1 (what srun passes on to its tasks).
STOP_SIGNALS = (*STOPS, signal.SIGUSR1)
__all__ = ["EXIT_REQUEUE", "STOP_SIGNALS", "hold", "taken"]
ENTRY_MODULES = ("imagenet_ddp.training.worker",)

_held: list[int] = []  # the signals, in the order they came


def hold() -> None:
    """Note the stop signals from now on, until :meth:`StopFlag.catch` takes over."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: _held.append(signum))


def taken() -> int:
    """The first stop signal held so far (0: none); the notes are cleared."""
    first = _held[0] if _held else 0
    _held.clear()
    return first


if getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) in ENTRY_MODULES:
    hold()
