"""Stop signals reach every process of a SLURM step: the loader workers must survive them and
the launcher must pass them on and return the ranks' exit code (real processes, no mocks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from imagenet_ddp.jobs.launchers import spawn_local_ranks
from imagenet_ddp.jobs.signals import (
    EXIT_REQUEUE,
    ForwardStopSignals,
    StopFlag,
    ignore_stop_signals,
    stop_signals_blocked,
)
from imagenet_ddp.settings.geometry import Geometry


class Pids(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        time.sleep(0.01)
        return torch.tensor(os.getpid())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_loader_workers_survive_stop_signals(sig):
    loader = DataLoader(Pids(), batch_size=4, num_workers=1, worker_init_fn=ignore_stop_signals)
    with stop_signals_blocked():
        batches = iter(loader)
    worker = int(next(batches)[0])
    assert worker != os.getpid()
    os.kill(worker, sig)  # what SLURM does to every process of the step
    assert len(list(batches)) == 15  # the remaining batches, no "worker killed by signal"


def test_without_the_worker_init_fn_the_worker_dies():
    """The failure the workers are protected from (so the test above can fail)."""
    loader = DataLoader(Pids(), batch_size=4, num_workers=1)
    batches = iter(loader)
    worker = int(next(batches)[0])
    os.kill(worker, signal.SIGTERM)
    with pytest.raises(RuntimeError, match="DataLoader worker .* (killed by signal|exited)"):
        list(batches)


def test_stop_flag_without_a_process_group_polls_at_its_interval():
    flag = StopFlag(interval=5)
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.signalled == signal.SIGUSR1
        assert not flag.poll(4) and flag.poll(5) and flag.agreed()
    finally:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(
                sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler
            )


RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    def stop(*_):
        open(os.path.join(sys.argv[1], "terminated-" + os.environ["RANK"]), "w").close()
        sys.exit({term_code})
    signal.signal(signal.SIGTERM, stop)
    open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").write(os.environ["WORLD_SIZE"])
    if os.environ["RANK"] == "1":
        sys.exit({rank1_code})
    time.sleep(60)
    """
)


def _rank_script(tmp_path, term_code: int, rank1_code: int) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(term_code=term_code, rank1_code=rank1_code))
    return [sys.executable, str(script), str(tmp_path)]


def test_a_failed_rank_stops_the_others_and_its_code_is_returned(tmp_path):
    argv = _rank_script(tmp_path, term_code=0, rank1_code=3)
    code = spawn_local_ranks(argv, Geometry(1, 2, 1), grace_seconds=10)
    assert code == 3
    assert (tmp_path / "terminated-0").exists()  # stopped, not left to sleep its 60 s
    assert (tmp_path / "0").read_text() == (tmp_path / "1").read_text() == "2"


def test_the_launcher_forwards_a_stop_signal_and_returns_the_ranks_requeue_code(tmp_path):
    """A launcher process signalled alone (e.g. `kill <pid>`) passes the signal to its ranks;
    each rank exits 75, and so does the launcher."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        textwrap.dedent(
            f"""
            import sys
            from imagenet_ddp.settings.geometry import Geometry
            from imagenet_ddp.jobs.launchers import spawn_local_ranks
            argv = {_rank_script(tmp_path, term_code=EXIT_REQUEUE, rank1_code=0)!r}
            argv[-1] = {str(tmp_path)!r}
            sys.exit(spawn_local_ranks(argv, Geometry(1, 2, 1)))
            """
        )
    )
    # Rank 1 exits 0 at once; rank 0 waits to be signalled.
    proc = subprocess.Popen([sys.executable, str(launcher)], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "0").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # passed on as SIGTERM
    assert proc.wait(timeout=60) == EXIT_REQUEUE


def test_forwarding_restores_the_previous_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with ForwardStopSignals():
        assert signal.getsignal(signal.SIGTERM) != before
    assert signal.getsignal(signal.SIGTERM) == before


# Stands in for srun (unit test only; tests/test_slurm_stops.py runs the real one): records
# every signal it gets and, like srun, would kill its step on SIGTERM/SIGHUP (exit 137 here)
# and passes SIGUSR1 on (exit 75 here, as its tasks would after their checkpoint).
FAKE_SRUN = """
import os, signal, sys, time
log = sys.argv[1]
def note(signum, frame):
    with open(log, "a") as f:
        f.write(f"{signal.Signals(signum).name} sid={os.getsid(0)}\\n")
    if signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        os._exit(137)
    if signum == signal.SIGUSR1:
        os._exit(75)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
    signal.signal(sig, note)
open(log + ".ready", "w").close()
while True:
    time.sleep(0.1)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_the_launcher_never_sends_srun_a_signal_that_kills_the_step(tmp_path, sig):
    """A stop signal to the launcher's whole process group (`kill -- -<pgid>`, Ctrl-C under
    salloc) reaches srun only as SIGUSR1 from the launcher: srun runs in its own session."""
    fake, log = tmp_path / "srun.py", tmp_path / "srun.log"
    fake.write_text(FAKE_SRUN)
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        textwrap.dedent(
            f"""
            import sys
            from imagenet_ddp.settings.geometry import Geometry
            from imagenet_ddp.jobs.launchers import _run_step
            code, signalled = _run_step([sys.executable, {str(fake)!r}, {str(log)!r}],
                                        Geometry(1, 1, 1))
            sys.exit(code if signalled else 1)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(launcher)], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "srun.log.ready").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, sig)  # the launcher's process group, as a terminal's Ctrl-C
    assert proc.wait(timeout=60) == EXIT_REQUEUE
    received = log.read_text().splitlines()
    assert [line.split()[0] for line in received] == ["SIGUSR1"], received
    assert received[0].split("sid=")[1] != str(proc.pid)  # a session of its own


def test_a_stop_signal_held_before_torch_is_honoured_by_the_stop_flag():
    """`--signal=USR1@N` reaching a rank while it imports torch: held (early_signals), then
    the StopFlag takes it as its own, so the rank stops at its first step."""
    from imagenet_ddp.jobs import early_signals

    previous = {sig: signal.getsignal(sig) for sig in early_signals.STOP_SIGNALS}
    try:
        early_signals.hold()
        os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs before the next bytecode
        flag = StopFlag(2)
        flag.catch()
        assert flag.signalled == signal.SIGUSR1 and flag.poll(2)
        assert early_signals.taken() == 0  # taken once
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _catches(pid: int, sig: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(
        next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16
    )
    return bool(caught >> (sig - 1) & 1)


def test_a_rank_signalled_while_it_imports_torch_survives():
    """The rank's module as the launcher starts it: SIGUSR1 as soon as it handles it, which
    is before `import torch` ends (was: the default action killed the rank)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "imagenet_ddp.training.worker", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while proc.poll() is None and not _catches(proc.pid, signal.SIGUSR1):
        assert time.monotonic() < deadline, "the rank never handled SIGUSR1"
        time.sleep(0.005)
    assert proc.poll() is None, "exited without ever handling SIGUSR1"
    importing = "torch" not in Path(f"/proc/{proc.pid}/maps").read_text()  # not yet loaded
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "--spec" in out, (proc.returncode, out)
    assert importing  # the signal came before torch was loaded
