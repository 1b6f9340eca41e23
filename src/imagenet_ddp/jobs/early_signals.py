"""Stop signals held from a rank's first second, before torch is imported (seconds on a
loaded filesystem): a ``--signal=USR1@N`` or scancel's SIGTERM meanwhile would kill the rank
before :meth:`imagenet_ddp.jobs.signals.StopFlag.catch`, without its checkpoint. Imported first
by a rank started as one of :data:`ENTRY_MODULES`, this notes them; :func:`taken` hands them
to the StopFlag. Anything else that imports it keeps its own handlers. Torch-free.
"""

from __future__ import annotations

import signal
import sys
import time

# The signals that stop a rank (their one home: jobs.signals, which imports torch, uses these)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# The exit code of a job stopped after writing its checkpoint (EX_TEMPFAIL: rerun to resume)
EXIT_REQUEUE = 75
ENTRY_MODULES = ("imagenet_ddp.training.worker",)

_held: list[tuple[int, float]] = []  # (signal, when) in the order they came


def _note(signum, frame) -> None:
    _held.append((signum, time.time()))


def hold() -> None:
    """Note the stop signals from now on, until :meth:`StopFlag.catch` takes over."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note)


def taken() -> int:
    """The first stop signal held so far (0: none); the notes are cleared."""
    first = _held[0][0] if _held else 0
    _held.clear()
    return first


def _started_as_entry() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name in ENTRY_MODULES


if _started_as_entry():
    hold()
