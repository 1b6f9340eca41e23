"""A Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or a SIGTERM to the
group during a data stage or an evaluation: every process of the command ends within seconds,
and nothing half-written is left that a rerun would take as done. `prepare` hung for ever after
a Ctrl-C (its pool workers died of it holding the pool's queue lock; the parent waited on
them), and its temporary copy (``.<out>.tmp-*``, ~55 GB at full scale) stayed after a kill: a
later prepare removes such leftovers under its lock.

Real commands in subprocesses, real signals; the demo data, large enough that prepare's pool
runs for a few seconds."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import prepared_copy
from tests.test_evaluate import eval_inputs  # noqa: F401 (a fixture of that module)

CLI = [sys.executable, "-m", "imagenet_ddp.cli"]


@pytest.fixture(scope="module")
def bigger_demo(tmp_path_factory) -> dict[str, Path]:
    """1,200 train images at 160 px (the archives), their index, and the ImageFolder tree."""
    from imagenet_ddp.data.demo import make_demo_dataset
    from tests.demo_layouts import extract_demo_layout

    root = tmp_path_factory.mktemp("interrupt")
    make_demo_dataset(root / "archives", num_classes=8, train_per_class=150, val_per_class=4,
                      image_size=160)  # fmt: skip
    subprocess.run([*CLI, "index", "--data-dir", root / "archives", "--out-dir", root / "index"],
                   check=True, capture_output=True)  # fmt: skip
    extract_demo_layout(root / "archives", root / "folders", "imagefolder")
    return {"archives": root / "archives", "index": root / "index", "folders": root / "folders"}


@pytest.fixture(scope="module")
def many_files(bigger_demo) -> Path:
    """The ImageFolder tree with 20,000 more train files (links to an image of their class):
    index's threads list and stat them for most of a second, so a Ctrl-C sent once they start
    lands among them, not after the command (it ended first once in 75 on the small tree)."""
    root = bigger_demo["folders"].with_name("many")
    shutil.copytree(bigger_demo["folders"], root, copy_function=os.link)
    for folder in sorted((root / "train").iterdir()):
        first = min(folder.iterdir())
        for i in range(2500):
            os.link(first, folder / f"link_{i:05d}.JPEG")
    return root


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc's ppid fields)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _interrupt(argv, ready, tmp_path: Path, sig=signal.SIGINT) -> tuple[int, str]:
    """Start ``argv`` in a process group of its own with SIGINT at its default (a shell's
    background job ignores it), wait until ``ready(pid)``, send ``sig`` to the group, and
    check that the command and every process it started end within 20 s. Returns (exit code,
    output)."""
    log = tmp_path / f"log-{time.monotonic_ns()}.txt"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not ready(process.pid):
            assert process.poll() is None, f"ended before it was ready: {log.read_text()}"
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.02)
        processes = {process.pid} | _descendants(process.pid)
        os.killpg(process.pid, sig)
        sent = time.monotonic()
        try:
            code = process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            for pid in filter(_alive, processes):  # what the test started: end it, then fail
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"{argv[3]} still runs 20 s after {sig.name}: {log.read_text()}")
        while any(_alive(pid) for pid in processes) and time.monotonic() < sent + 20:
            time.sleep(0.05)
        print(f"{argv[3]}: every process ended {time.monotonic() - sent:.1f} s after {sig.name}")
        left = [pid for pid in processes if _alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"{len(left)} of its processes outlived it by 20 s"
    return code, log.read_text()


# Each in a Python of its own: a stop that escaped would end the test's process.
THREADED_STOP = """
import os, signal, threading, time, traceback
from imagenet_ddp.data.layouts import _threaded

calls = []
def call(item):
    calls.append(item)
    if item == 100:
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler in the main thread
    time.sleep(0.005)
try:
    for _ in _threaded(call, range(20_000)):
        pass
except KeyboardInterrupt as exc:
    print("raised in", traceback.extract_tb(exc.__traceback__)[-1].name)
print(len(calls), threading.active_count(), signal.getsignal(signal.SIGINT).__name__)
"""


def test_a_ctrl_c_in_the_io_threads_is_raised_between_items_and_the_pool_ends():
    """The hang CI met once: a KeyboardInterrupt raised inside concurrent.futures' calls left
    its idle semaphore's lock held, and index waited for ever at the pool's shutdown (here, 1
    Ctrl-C in 24). It is noted there and raised by the check between items (io.stops_noted); the
    queued calls (the first 4,096 take 1.3 s) are cancelled; no thread is left."""
    done = subprocess.run([sys.executable, "-c", THREADED_STOP], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    raised, counts = done.stdout.splitlines()
    calls, threads, handler = counts.split()
    assert raised == "raised in _raise_noted", done.stdout + done.stderr
    assert int(calls) < 4096 and threads == "1" and handler == "default_int_handler", counts


NOTED = """
import os, signal
from imagenet_ddp.io import stops_noted

def send(sig):
    os.kill(os.getpid(), sig)
    sum(range(10_000))  # the handler runs by now: it must not raise

try:
    with stops_noted() as check:
        send(signal.SIGTERM)
        print("noted")
        check()
except SystemExit as exc:
    print("checked:", exc.code)
try:
    with stops_noted(), stops_noted():
        send(signal.SIGINT)
except KeyboardInterrupt:
    print("nested, never checked: raised on leaving")
defaults = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
print("defaults back:", defaults == (signal.default_int_handler, signal.SIG_DFL))
signal.signal(signal.SIGINT, signal.SIG_IGN)
with stops_noted() as check:
    send(signal.SIGINT)
    check()
print("ignored stays ignored")
"""


def test_a_stop_is_noted_then_raised_by_the_check_or_at_the_end_and_an_ignored_one_stays():
    done = subprocess.run([sys.executable, "-c", NOTED], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.stdout.splitlines() == [
        "noted", "checked: 143", "nested, never checked: raised on leaving", "defaults back: True",
        "ignored stays ignored",
    ], done.stdout + done.stderr  # fmt: skip


def _prepare_argv(demo, shared: Path, workers: int = 8) -> list:
    """More workers than cores, as a job's prepare.workers on a busy node: some wait for a
    chunk when the signal comes (where multiprocessing.Pool's queue lock is held). The copy
    goes into ``shared`` (prepare.dir), ``shared.json`` names it."""
    return [*CLI, "prepare", "--data-dir", demo["archives"], "--index-dir", demo["index"],
            "--which", "train", "--manifest", shared.with_suffix(".json"), "--prepared-dir",
            shared, "--short-side", "144", "--quality", "90", "--workers", workers,
            "--on-corrupt", "fail", "--shard-samples", "40"]  # fmt: skip


def _converting(shared: Path):
    """Ready once the pool has written a shard into prepare's temporary copy."""
    return lambda pid: any(shared.glob(".train-*.tmp-*/.parts/*"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_prepare_ends_with_its_pool_and_leaves_no_copy(bigger_demo, tmp_path, sig):
    shared = tmp_path / "prepared"
    code, log = _interrupt(_prepare_argv(bigger_demo, shared), _converting(shared), tmp_path, sig)
    assert code == (130 if sig == signal.SIGINT else 128 + sig), log
    if sig == signal.SIGINT:
        assert log.strip().endswith("imagenet-ddp prepare: interrupted"), log
    left = [*shared.glob("train-*"), *shared.glob(".train-*.tmp-*")]
    assert not left and not shared.with_suffix(".json").exists(), "nothing half-written"


def test_a_killed_prepares_temporary_copy_is_removed_by_the_next(bigger_demo, tmp_path):
    """SIGKILL leaves the temporary copy (and no pool worker: they die with their parent);
    the next prepare, under the same lock, removes it and writes the copy."""
    shared = tmp_path / "prepared"
    _interrupt(_prepare_argv(bigger_demo, shared), _converting(shared), tmp_path, signal.SIGKILL)
    [stale] = shared.glob(".train-*.tmp-*")
    done = subprocess.run([str(a) for a in _prepare_argv(bigger_demo, shared, workers=2)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert f"removing {stale}" in done.stdout and not stale.exists()
    copy = prepared_copy(shared.with_suffix(".json"))
    assert (copy / "prepared.json").is_file() and not list(shared.glob(".train-*.tmp-*"))


def _threads_started(pid: int) -> bool:
    """The listing's thread pool runs (layouts._threaded, ThreadPoolExecutor)."""
    return len(list(Path(f"/proc/{pid}/task").glob("*"))) > 2


def _reading(data: Path):
    """Ready once the command has a file of ``data`` open (verify: the archives' md5)."""

    def ready(pid: int) -> bool:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                if os.readlink(fd).startswith(str(data)):
                    return True
            except OSError:
                continue
        return False

    return ready


@pytest.mark.parametrize("command", ["index", "verify"])
def test_index_and_verify_end_at_a_ctrl_c_without_output(
    bigger_demo, many_files, tmp_path, command
):
    """index lists an ImageFolder tree on threads, verify reads the archives: a Ctrl-C's
    KeyboardInterrupt ends either; the threads finish the file at hand; nothing is written."""
    if command == "index":
        data = many_files
        argv = [*CLI, "index", "--data-dir", data, "--out-dir", tmp_path / "index"]
        ready = _threads_started
    else:
        data = bigger_demo["archives"]
        argv = [*CLI, "verify", "--data-dir", data, "--report", tmp_path / "verify/report.json",
                "--check-md5"]  # fmt: skip
        ready = _reading(data)
    code, log = _interrupt(argv, ready, tmp_path)
    assert code == 130 and log.strip().endswith(f"imagenet-ddp {command}: interrupted"), log
    assert not (tmp_path / "index").exists() and not (tmp_path / "verify").exists()


def test_an_evaluation_ends_at_a_ctrl_c_ranks_and_loader_workers_too(
    eval_inputs,  # noqa: F811 (the fixture, imported)
    prepared_demo,
    demo_split,
    tmp_path,
):
    """Two local ranks with a loader worker each: the launcher passes the stop on, the ranks
    end, nothing is written."""
    from imagenet_ddp.jobs.spec import write_spec
    from tests.workflow_helpers import make_job

    inputs = eval_inputs
    geometry = {"nodes": 1, "tasks_per_node": 2, "cpus_per_task": 1, "gpus_per_node": 0}
    job = make_job(
        "evaluate", geometry, model=inputs["model"], classes=inputs["classes"],
        prepared_train=prepared_demo["train"], prepared_val=prepared_demo["val"],
        split_dir=demo_split, out=tmp_path / "eval.json", per_class=tmp_path / "per_class.csv",
        launcher="local", workers=1,
    )  # fmt: skip
    spec = write_spec(tmp_path / "spec.json", job)

    def ranks_started(pid: int) -> bool:
        ranks = [p for p in _descendants(pid) if b"evaluation.evaluate" in _cmdline(p)]
        return len(ranks) == 2

    code, log = _interrupt([*CLI, "evaluate", "--job", spec], ranks_started, tmp_path)
    assert code != 0, log
    assert not (tmp_path / "eval.json").exists() and not (tmp_path / "per_class.csv").exists()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
