"""Staging prepared data to node-local scratch: copy once, verify, reuse, clean up."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections import namedtuple
from pathlib import Path

import pytest

from imagenet_ddp.data import stage
from imagenet_ddp.data.stage import cleanup_staged, scratch_problem, scratch_root, stage_dataset
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import Heartbeat
from imagenet_ddp.jobs.attempts import beat_path
from tests.workflow_helpers import make_job


def _tree(root):
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.name != stage.MARKER
    }


@pytest.mark.parametrize("verify", ["size", "sha256"])
def test_stage_copies_then_reuses_then_cleans_up(prepared_demo, tmp_path, verify):
    src = prepared_demo["train"]
    scratch = tmp_path / "scratch"
    report = stage_dataset(src, scratch, verify=verify)
    dest = stage.user_stage_dir(scratch) / stage.fingerprint(src) / "train"
    assert report["dest"] == str(dest) and report["src"] == str(src)
    assert report["host"] == socket.gethostname() and report["verify"] == verify
    assert report["reused"] is False and report["bytes_per_s"] > 0
    assert report["files"] == len(_tree(src)) and report["bytes"] == sum(
        len(b) for b in _tree(src).values()
    )
    assert _tree(dest) == _tree(src)
    assert json.loads((dest / stage.MARKER).read_text())["fingerprint"] == stage.fingerprint(src)
    again = stage_dataset(src, scratch, verify=verify)
    assert again["reused"] is True and again["dest"] == report["dest"]
    cleanup_staged(dest)
    assert list(scratch.iterdir()) == []
    cleanup_staged(dest)  # idempotent


def test_train_and_val_stage_side_by_side(prepared_demo, tmp_path):
    reports = {
        w: stage_dataset(prepared_demo[w], tmp_path, verify="size") for w in ("train", "val")
    }
    assert reports["train"]["dest"] != reports["val"]["dest"]
    cleanup_staged(stage.staged_path(prepared_demo["train"], tmp_path))
    assert stage.user_stage_dir(tmp_path).is_dir()  # val is still there
    cleanup_staged(stage.staged_path(prepared_demo["val"], tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def node_local(monkeypatch):
    """A scratch dir on another filesystem than the tests' tmp dirs (the prepared data, the
    workdir): /dev/shm, a tmpfs, as a node-local disk would be (this machine's own memory
    limit left out: the copy-in-RAM check has its own tests)."""
    from imagenet_ddp.jobs import launch

    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == Path(tempfile.gettempdir()).stat().st_dev:
        pytest.skip("needs /dev/shm on its own filesystem")
    monkeypatch.setattr(launch, "memory_limit", lambda: None)
    path = Path(tempfile.mkdtemp(dir=shm, prefix="test-stage-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_jobs_memory_limit_is_its_cgroups_lowest_or_slurms_mem_per_node(tmp_path):
    """cgroup v2 (memory.max) and v1 (memory.limit_in_bytes), the job's level limited and
    its step's not; $SLURM_MEM_PER_NODE where lower; none set: None."""
    from imagenet_ddp.data.stage import memory_limit

    def tree(lines: str, files: dict[str, str]) -> tuple[Path, Path]:
        root = tmp_path / f"cg{len(list(tmp_path.iterdir()))}"
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text + "\n")
        (root / "self-cgroup").write_text(lines)
        return root, root / "self-cgroup"

    job = "system.slice/slurmstepd.scope/job_7"
    root, proc = tree(f"0::/{job}/step_0/user/task_0\n", {
        "memory.max": "max", f"{job}/memory.max": "134217728000",
        f"{job}/step_0/memory.max": "max", f"{job}/step_0/user/task_0/memory.max": "max",
    })  # fmt: skip
    limit = memory_limit({}, root, proc)
    assert limit == (134217728000, str(root / job / "memory.max"))
    assert memory_limit({"SLURM_MEM_PER_NODE": "64000"}, root, proc) == (
        64000 * 2**20, "$SLURM_MEM_PER_NODE",
    )  # fmt: skip
    root, proc = tree("5:devices:/slurm\n4:memory:/slurm/uid_0/job_7/step_0\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712",
        "memory/slurm/uid_0/job_7/memory.limit_in_bytes": "134217728000",
        "memory/slurm/uid_0/job_7/step_0/memory.limit_in_bytes": "9223372036854771712",
    })  # fmt: skip
    assert memory_limit({}, root, proc)[0] == 134217728000
    root, proc = tree("0::/\n", {"memory.max": "max"})
    assert memory_limit({}, root, proc) is None
    assert memory_limit({}, root, tmp_path / "no-such-file") is None


def test_a_copy_into_ram_above_the_jobs_memory_limit_is_refused_before_it_is_made(
    prepared_demo, tmp_path, monkeypatch
):
    """A diskless node: $SLURM_TMPDIR unset, $TMPDIR a tmpfs (here the real /dev/shm), so the
    copy is charged to the job's memory cgroup: the copy's real size plus the ranks'
    estimate above the job's limit is refused with one line before any byte is copied."""
    from imagenet_ddp.data.stage import ram_copy_problem
    from imagenet_ddp.jobs import launch
    from imagenet_ddp.jobs.launch import stage_this_node, unstage_this_node
    from imagenet_ddp.settings.node_memory import DataSizes, estimate_mb

    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == Path(tempfile.gettempdir()).stat().st_dev:
        pytest.skip("needs /dev/shm on its own filesystem")
    src = prepared_demo["train"]
    run = {"nodes": 1, "tasks_per_node": 8, "gpus_per_node": 8, "cpus_per_task": 16,
           "workers": "auto", "batch_size": 256, "crop_size": 224, "eval_crop_size": 0}  # fmt: skip
    copy = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    samples = json.loads((src / stage.PREPARED_JSON).read_text())["num_samples"]
    figures = estimate_mb(run, DataSizes(train_images=samples))
    need = copy + (figures["measured"] + figures["estimated"]) * 2**20
    driver = tmp_path / "nvidia-gpus"  # /proc/driver/nvidia/gpus of a node with 8 GPUs
    for bus in range(8):
        (driver / f"0000:{bus:02x}:00.0").mkdir(parents=True)
    monkeypatch.setattr(stage, "NVIDIA_GPUS", driver)
    tmpdir = Path(tempfile.mkdtemp(dir=shm, prefix="test-ram-"))
    try:
        monkeypatch.delenv("SLURM_TMPDIR", raising=False)
        monkeypatch.setenv("TMPDIR", str(tmpdir))
        monkeypatch.chdir(tmp_path)
        job = make_job(run=run, prepared_train=src, run_dir=tmp_path / "r", launcher="srun")
        monkeypatch.setattr(launch, "memory_limit", lambda: (int(need) - 1, "memory.max"))
        with pytest.raises(InputError) as info:
            stage_this_node(job)
        message = str(info.value)
        assert "\n" not in message and message.startswith(
            f"scratch {tmpdir} (from $TMPDIR) is tmpfs, in RAM: the train copy"
        )
        assert "above this job's memory limit" in message and "(memory.max)" in message
        assert "set stage.scratch_dir to a node-local disk, or raise train's mem_mb" in message
        assert list(tmpdir.iterdir()) == [], "refused before the copy"
        monkeypatch.setattr(launch, "memory_limit", lambda: (int(need) + 1, "memory.max"))
        assert stage_this_node(job)["reused"] is False  # it fits: copied
        # a complete copy is there (charged when it was made): not refused again
        assert ram_copy_problem(src, tmpdir, "$TMPDIR", run, (1, "memory.max")) is None
        unstage_this_node(job)
        # a dali run: its workers' shared memory at this copy's own bytes per sample, not
        # the dry-run's figure at short side 256 (the demo's samples are far smaller)
        dali = {**run, "loader": "dali"}
        own = estimate_mb(dali, DataSizes(train_images=samples, sample_bytes=copy / samples))
        dali_need = copy + (own["measured"] + own["estimated"]) * 2**20
        at_256 = estimate_mb(dali, DataSizes(train_images=samples))
        assert at_256["measured"] - own["measured"] > 100, "the two figures must differ here"
        other = tmpdir / "other"
        assert ram_copy_problem(src, other, "$TMPDIR", dali, (int(dali_need) - 1, "x"))
        assert ram_copy_problem(src, other, "$TMPDIR", dali, (int(dali_need) + 1, "x")) is None
        # no driver (fake GPUs, the local cluster): the CUDA estimate is left out
        without = (int(need - figures["estimated"] * 2**20) + 1, "x")
        assert ram_copy_problem(src, other, "$TMPDIR", run, without) is not None
        nodriver = tmp_path / "no-driver"
        assert ram_copy_problem(src, other, "$TMPDIR", run, without, nodriver) is None
        fake_mounts(monkeypatch, [], base=[MOUNTS[0]])  # on a disk: never a RAM problem
        assert ram_copy_problem(src, tmpdir, "$TMPDIR", run, (1, "x")) is None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_a_shared_copy_is_removed_by_the_last_job_that_leaves(prepared_demo, tmp_path, node_local):
    """Two runs on one node share the scratch copy: the first to finish must not delete the
    data the other is still reading (local launcher; clusters without a per-job scratch)."""
    from imagenet_ddp.jobs.launch import stage_this_node, unstage_this_node

    def spec(run):
        return make_job(
            prepared_train=prepared_demo["val"], run_dir=tmp_path / run, launcher="srun",
            scratch_dir=str(node_local / "scratch"), checkpoint_root=tmp_path / f"ckpt-{run}",
        )  # fmt: skip

    # each job's heartbeat (run_staged's) lives while it reads the copy
    beats = [Heartbeat(beat_path(spec(run).paths.checkpoint_root)) for run in "ab"]
    for beat in beats:
        beat.__enter__()
    first, second = stage_this_node(spec("a")), stage_this_node(spec("b"))
    dest = Path(first["dest"])
    assert second["dest"] == first["dest"] and second["reused"] is True
    assert first["lease"] != second["lease"]
    unstage_this_node(spec("a"))
    assert _tree(dest) == _tree(prepared_demo["val"]), "run b still reads it"
    report_a = json.loads((tmp_path / "a" / "staging" / f"{first['host']}.json").read_text())
    assert report_a["cleaned"] is True and report_a["removed"] is False
    # A requeued attempt of run b first gives up the lease its killed attempt left behind.
    again = stage_this_node(spec("b"))
    assert again["reused"] is True and len(list(dest.parent.glob("*.leases/*"))) == 1
    unstage_this_node(spec("b"))
    assert list((node_local / "scratch").iterdir()) == [], "the last run removes the copy"
    for beat in beats:
        beat.__exit__()


def test_a_job_after_the_runs_final_checkpoint_stages_nothing(prepared_demo, tmp_path, node_local):
    """A job killed after its last epoch's checkpoint but before its outputs: the next one
    only resumes it and writes them; it copies no train set to any node."""
    from imagenet_ddp.jobs import attempts
    from imagenet_ddp.jobs.launch import stage_this_node, unstage_this_node

    run = {"run": "r", "epochs": 2, "batch_size": 4, "nodes": 1, "tasks_per_node": 1,
           "cpus_per_task": 1}  # fmt: skip
    root, scratch = tmp_path / "checkpoints", node_local / "scratch"
    job = make_job(run=run, prepared_train=prepared_demo["val"], run_dir=tmp_path / "r",
                   checkpoint_root=root, launcher="srun", scratch_dir=str(scratch))  # fmt: skip

    def attempt(n: int, epoch: int) -> None:  # an attempt that checkpointed ``epoch``, stopped
        entry, _ = attempts.begin(root, run, attempt=n, gpus=0, cores=1)
        path = root / "fp-tag" / f"checkpoint-e{epoch:04d}-s0000000.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        attempts.end(root, entry, 75)

    attempt(1, 1)
    assert "in_place" not in stage_this_node(job)  # one epoch to go: copied
    unstage_this_node(job)
    attempt(2, 2)
    other = make_job(run={**run, "lr": 0.5}, prepared_train=prepared_demo["val"],
                     run_dir=tmp_path / "o", checkpoint_root=root, launcher="srun",
                     scratch_dir=str(scratch))  # fmt: skip
    assert "in_place" not in stage_this_node(other), "another settings' final is not this run's"
    unstage_this_node(other)
    report = stage_this_node(job)
    assert report["dest"] == str(prepared_demo["val"]) and "final checkpoint" in report["in_place"]
    assert not scratch.exists() or not any(scratch.rglob("*.json")), "nothing copied"
    unstage_this_node(job)
    assert (prepared_demo["val"] / stage.PREPARED_JSON).is_file(), "the data must stay"


def test_incomplete_copy_is_replaced(prepared_demo, tmp_path):
    src = prepared_demo["val"]
    report = stage_dataset(src, tmp_path, verify="size")
    dest = stage.staged_path(src, tmp_path)
    (dest / stage.MARKER).unlink()  # e.g. a node died before the marker was written
    (dest / "samples.csv").write_text("garbage")
    again = stage_dataset(src, tmp_path, verify="size")
    assert again["reused"] is False and again["dest"] == report["dest"]
    assert _tree(dest) == _tree(src)


def test_scratch_too_small(prepared_demo, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(stage.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000))
    with pytest.raises(InputError) as info:
        stage_dataset(prepared_demo["train"], tmp_path / "scratch", verify="size")
    message = str(info.value)
    assert "has 1000.0 B free, needs" in message
    assert "set stage.scratch_dir to a larger node-local disk" in message
    assert not list((tmp_path / "scratch").rglob("*.tar"))


@pytest.mark.parametrize("verify", ["size", "sha256"])
def test_bad_copy_is_detected_and_not_kept(prepared_demo, tmp_path, monkeypatch, verify):
    real_copy = shutil.copyfile

    def damaging_copy(src, dst):
        real_copy(src, dst)
        if str(dst).endswith("shard-00001.tar"):
            data = bytearray(Path(dst).read_bytes())
            if verify == "size":
                data = data[:-1]
            else:
                data[0] ^= 0xFF
            Path(dst).write_bytes(bytes(data))

    monkeypatch.setattr(stage.shutil, "copyfile", damaging_copy)
    with pytest.raises(InputError, match="shard-00001.tar"):
        stage_dataset(prepared_demo["train"], tmp_path, verify=verify)
    assert not stage.staged_path(prepared_demo["train"], tmp_path).exists()


def test_not_a_prepared_dir(tmp_path):
    with pytest.raises(InputError, match="not a prepared directory"):
        stage_dataset(tmp_path, tmp_path / "scratch", verify="size")
    # A bad stage.verify is refused by the schema (tests/test_single_default.py).


def test_scratch_root_is_the_setting_else_slurm_tmpdir_else_tmpdir_else_tmp(tmp_path):
    env = {"SLURM_TMPDIR": str(tmp_path / "job"), "TMPDIR": str(tmp_path / "tmp")}
    assert scratch_root("/local/scratch", env) == (Path("/local/scratch"), "stage.scratch_dir")
    assert scratch_root("", env) == (tmp_path / "job", "$SLURM_TMPDIR")
    assert scratch_root(None, {**env, "SLURM_TMPDIR": ""}) == (tmp_path / "tmp", "$TMPDIR")
    assert scratch_root(None, {}) == (Path("/tmp"), "the default /tmp")


# The mount table as psutil gives it (device, mount point, type, options), in mount order.
MOUNTS = [
    ("/dev/sda1", "/", "ext4", "rw,relatime"),
    ("tmpfs", "/dev/shm", "tmpfs", "rw,nosuid,nodev"),
    ("work", "/gpfs/work", "gpfs", "rw,relatime"),
    ("10.0.0.1@o2ib:/fs", "/lustre", "lustre", "rw,relatime,flock"),
    ("nas:/export/home", "/home", "nfs4", "rw,relatime,vers=4.2"),
    ("user@host:/d", "/mnt/my data", "fuse.sshfs", "rw,relatime"),
    ("/dev/sdb1", "/lustre/local", "xfs", "rw,relatime"),
]


def fake_mounts(monkeypatch, extra, base=MOUNTS) -> None:
    """psutil's mount table, as it would read ``base`` and ``extra`` mounted."""
    import psutil

    part = namedtuple("sdiskpart", "device mountpoint fstype opts")
    table = [part(*m) for m in [*base, *extra]]
    monkeypatch.setattr(psutil, "disk_partitions", lambda all=False: table)


@pytest.mark.parametrize(
    ("path", "fs"),
    [("/home/me/scratch", "nfs4"), ("/lustre/proj/tmp", "lustre"), ("/gpfs/work", "gpfs"),
     ("/mnt/my data/x", "fuse.sshfs")],
)  # fmt: skip
def test_a_scratch_root_on_a_network_filesystem_is_refused(monkeypatch, path, fs):
    fake_mounts(monkeypatch, [])
    kind, text = scratch_problem(Path(path), {})
    assert kind == "network" and text.startswith(f"on {fs} "), text
    # A node-local filesystem mounted below a network one is not refused for its parent's type.
    assert scratch_problem(Path("/lustre/local/x"), {}) is None
    assert scratch_problem(Path("/dev/shm/x"), {}) is None


def test_a_scratch_root_on_the_filesystem_of_the_data_or_workdir_is_refused(
    prepared_demo, tmp_path, monkeypatch
):
    """Under srun the refusal holds and nothing is copied; the local launcher reads the
    prepared copy in place instead (one machine: a copy onto its own disk buys nothing)."""
    from imagenet_ddp.jobs.launch import stage_this_node, unstage_this_node

    src = prepared_demo["val"]
    assert scratch_problem(tmp_path / "not-yet" / "x", {"prepare.dir": src})[0] == "shared"
    assert scratch_problem(tmp_path, {"the workdir": tmp_path})[1] == (
        f"on the same filesystem as the workdir ({tmp_path})"
    )
    monkeypatch.chdir(tmp_path)

    def spec(launcher):
        return make_job(prepared_train=src, run_dir=tmp_path / launcher, launcher=launcher,
                        scratch_dir="scratch")  # fmt: skip

    with pytest.raises(InputError) as info:
        stage_this_node(spec("srun"))
    message = str(info.value)
    assert "\n" not in message and "(from stage.scratch_dir)" in message
    assert "on the same filesystem as prepare.dir" in message
    assert "set stage.scratch_dir to a node-local disk" in message
    assert not (tmp_path / "scratch").exists() and not (tmp_path / "srun").exists()
    report = stage_this_node(spec("local"))
    assert report["dest"] == str(src) and "is on the same filesystem" in report["in_place"]
    assert not (tmp_path / "scratch").exists() and "lease" not in report
    unstage_this_node(spec("local"))
    assert _tree(src) and (src / stage.PREPARED_JSON).is_file(), "the data must stay"


def test_a_lease_left_by_a_killed_job_is_reclaimed_by_the_next_stager(prepared_demo, tmp_path):
    """A job killed before its cleanup, never retried: its lease must not pin the copy. A
    lease names its job's heartbeat (io.Heartbeat), on the shared filesystem every node sees:
    gone or silent for io.STALE_S, the job has ended."""
    import os
    import time

    from imagenet_ddp import io
    from imagenet_ddp.data.stage import reclaim_stale_leases

    killed, alive = tmp_path / "alive" / "7", tmp_path / "alive" / "8"
    with Heartbeat(alive, seconds=60):
        killed.touch()
        report = stage_dataset(prepared_demo["val"], tmp_path, verify="size", lease=str(killed))
        dest = Path(report["dest"])
        leases = dest.parent / f"{dest.name}.leases"
        assert [p.read_text() for p in leases.iterdir()] == [str(killed)]
        again = stage_dataset(prepared_demo["val"], tmp_path, verify="size", lease=str(alive))
        assert again["reused"] and len(list(leases.iterdir())) == 2
        assert reclaim_stale_leases(tmp_path) == [] and len(list(leases.iterdir())) == 2
        silent = time.time() - io.STALE_S - 5  # SIGKILLed with its job (or its node lost)
        os.utime(killed, (silent, silent))
        assert reclaim_stale_leases(tmp_path) == []  # the live job still holds it
        assert [p.read_text() for p in leases.iterdir()] == [str(alive)] and dest.is_dir()
    assert not alive.exists()  # its job ended (its copy left to the next stager: a stop)
    assert reclaim_stale_leases(tmp_path) == [dest] and not dest.exists()


def test_the_dry_run_refuses_a_relative_or_network_scratch_dir(tmp_path, monkeypatch):
    from imagenet_ddp.data.stage import configured_scratch_problem

    fake_mounts(monkeypatch, [("nas:/export/home", str(tmp_path), "nfs4", "rw")])  # "on nfs4"
    assert "is relative" in configured_scratch_problem("scratch")
    assert f"on nfs4 (nas:/export/home at {tmp_path})" in configured_scratch_problem(str(tmp_path))
    assert configured_scratch_problem(str(tmp_path / "missing-here")) is None  # node's
    assert configured_scratch_problem("") is None
    assert configured_scratch_problem("/dev/shm") is None


def test_the_rules_pass_the_scratch_setting_and_the_dry_run_refuses_a_relative_one(
    tmp_path, monkeypatch
):
    """An unset stage.scratch_dir reaches `imagenet-ddp train`/`preflight` as an empty value
    (once `--scratch-dir ''` lost its argument and the local demo failed), a set one as is;
    a relative one stops the dry-run naming the key."""
    import shlex

    from imagenet_ddp.cli import build_parser
    from imagenet_ddp.jobs.spec import load
    from tests.workflow_helpers import copy_workflow, snakemake

    runs = [{"name": "r", "tasks_per_node": 1, "preflight": True}]
    workdir = copy_workflow(tmp_path / "wf", runs=runs)
    monkeypatch.chdir(workdir)  # a spec resolves the prepared manifest where its job runs
    target = "results/runs/r/model.pt"
    cases = [(["data={dir: /x}"], ""), (["data={dir: /x}", "stage={scratch_dir: /l/s}"], "/l/s")]
    for config, expected in cases:
        text = snakemake(workdir, "-n", "-p", "-c1", target, "--config", *config).stdout
        for command in ("train", "preflight"):
            line = next(ln for ln in text.splitlines() if f"imagenet-ddp {command} " in ln)
            words = shlex.split(line.split(f"imagenet-ddp {command} ", 1)[1].split(" >", 1)[0])
            # Before the checkpoints have run, train's --key stands for the records its key is
            # made of (common.smk key_file): one value when the job runs; the spec is what counts.
            words = words[: words.index("--job") + 2]
            given = build_parser().parse_known_args([command, *words])[0].job  # the spec (JSON)
            job = load(given, command)
            assert job.execution.stage.scratch_dir == expected, (command, config)
    bad = snakemake(workdir, "-n", "-c1", target, "--config", "stage={scratch_dir: scratch}",
                    check=False)  # fmt: skip
    assert (
        bad.returncode != 0 and "stage.scratch_dir 'scratch' is relative" in bad.stdout + bad.stderr
    )


def _no_flock(monkeypatch):
    """flock as on Lustre mounted without `flock` (before 2.13): ENOSYS, for every caller."""
    import errno
    import fcntl

    def flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", flock)


def test_a_filesystem_without_flock_gets_a_directory_lock_that_excludes(monkeypatch, tmp_path):
    """Issue 36: prepare.dir on Lustre without flock raised a traceback. The fallback lock
    excludes a second holder until the first releases it, and leaves nothing behind."""
    import threading
    import time

    from imagenet_ddp import io

    _no_flock(monkeypatch)
    monkeypatch.setattr(io, "POLL_S", 0.01)
    lock, order = tmp_path / "out" / ".train.lock", []
    second_waits = threading.Event()

    def second():
        second_waits.set()
        with io.exclusive_lock(lock):
            order.append("second")

    with io.exclusive_lock(lock):
        owner = json.loads((tmp_path / "out" / ".train.lock.d" / "owner").read_text())
        assert owner["host"] == socket.gethostname() and owner["pid"] > 0
        thread = threading.Thread(target=second)
        thread.start()
        second_waits.wait()
        time.sleep(0.2)  # the second has polled the lock many times by now
        order.append("first")
    thread.join(timeout=10)
    assert order == ["first", "second"]
    assert not (tmp_path / "out" / ".train.lock.d").exists()


@pytest.mark.parametrize("flock", [True, False])
def test_a_lock_is_never_held_twice_and_can_be_tried_without_waiting(monkeypatch, tmp_path, flock):
    """reclaim_stale_leases tries a copy's lock (wait=False: held means a live stager copies
    it). cleanup_staged removes the lock file while it holds it: a waiter then holding the
    removed file must lock the new one, or it and a newcomer would both hold the lock."""
    import threading

    from imagenet_ddp import io

    if not flock:
        _no_flock(monkeypatch)
    monkeypatch.setattr(io, "POLL_S", 0.01)
    lock, seen = tmp_path / ".train.lock", []
    waiting = threading.Event()

    def waiter():
        waiting.set()
        with io.exclusive_lock(lock) as held, io.exclusive_lock(lock, wait=False) as newcomer:
            seen.append((held, newcomer))

    with io.exclusive_lock(lock) as held:
        assert held is True
        with io.exclusive_lock(lock, wait=False) as other:
            assert other is False, "held: a try fails at once"
        thread = threading.Thread(target=waiter)
        thread.start()
        waiting.wait()
        time.sleep(0.2)  # the waiter waits on the lock file now
        lock.unlink(missing_ok=True)  # as cleanup_staged does, holding it
    thread.join(timeout=10)
    assert seen == [(True, False)], "the waiter and a newcomer held it at once"
    with io.exclusive_lock(lock, wait=False) as free:
        assert free is True


def test_a_stale_directory_lock_is_taken_over_and_other_errors_still_raise(monkeypatch, tmp_path):
    """A holder SIGKILLed (or its node lost) leaves its lock directory: once untouched for
    STALE_S a waiter takes it; a held one is kept fresh by its holder's heartbeat."""
    import errno
    import fcntl
    import os
    import time

    from imagenet_ddp import io

    _no_flock(monkeypatch)
    monkeypatch.setattr(io, "POLL_S", 0.01)
    monkeypatch.setattr(io, "HEARTBEAT_S", 0.05)
    lock = tmp_path / ".train.lock"
    left = tmp_path / ".train.lock.d"
    left.mkdir()  # a dead holder's
    old = time.time() - io.STALE_S - 5
    os.utime(left, (old, old))
    with io.exclusive_lock(lock):
        first = left.stat().st_mtime
        assert first > old
        time.sleep(0.3)
        assert left.stat().st_mtime > first  # the heartbeat
        assert not list(tmp_path.glob("*.stale-*"))
    assert not left.exists()

    def bad(fd, op):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", bad)
    with pytest.raises(OSError, match="Bad file descriptor"), io.exclusive_lock(lock):
        pass


def test_on_lustre_mounted_localflock_the_lock_is_a_directory_every_node_sees(
    tmp_path, monkeypatch
):
    """localflock grants flock on each client alone (two nodes would both hold the lock):
    there, read from the mount's options, the lock is the directory lock; with `flock` it is
    flock."""
    import fcntl

    from imagenet_ddp import io
    from imagenet_ddp.mounts import flock_is_node_local

    shared = tmp_path / "lustre"
    shared.mkdir()
    lustre = ("10.0.0.1@o2ib:/fs", str(shared), "lustre", "rw,relatime,localflock,lazystatfs")
    fake_mounts(monkeypatch, [lustre])
    lock = shared / "out" / ".train.lock"
    assert flock_is_node_local(lock.parent)
    assert not flock_is_node_local(Path("/lustre/x"))  # mounted `flock`: cluster-wide
    with io.exclusive_lock(lock):
        assert (shared / "out" / ".train.lock.d" / "owner").is_file()
        with open(lock, "a") as other:  # no flock taken: another opener gets it at once
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not (shared / "out" / ".train.lock.d").exists()
    fake_mounts(monkeypatch, [(*lustre[:3], "rw,relatime,flock")])
    with io.exclusive_lock(lock), open(lock, "a") as other:
        assert not (shared / "out" / ".train.lock.d").exists()
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_what_an_earlier_version_left_in_the_shared_part_is_reclaimed(prepared_demo, tmp_path):
    """Before issue 51 copies went to <scratch>/imagenet_ddp/<fp>: a killed job's copy and
    partial there, its lease stale, go with the next staging of this user after an upgrade."""
    from imagenet_ddp.data.stage import reclaim_stale_leases

    legacy = tmp_path / "imagenet_ddp" / stage.fingerprint(prepared_demo["val"])
    shutil.copytree(prepared_demo["val"], legacy / "val")
    shutil.copytree(prepared_demo["val"], legacy / ".val.tmp-abc123")
    (legacy / "val.leases").mkdir()
    (legacy / "val.leases" / "0123").write_text(str(tmp_path / "gone-heartbeat"))
    assert reclaim_stale_leases(tmp_path) == [legacy / "val"]
    assert not (tmp_path / "imagenet_ddp").exists()


# A stager that copies one file at a time slowly (a big train set), touching ``progress`` after
# each, with its job's heartbeat beating: argv src scratch progress heartbeat.
SLOW_STAGER = """
import shutil, sys, time
from pathlib import Path
from imagenet_ddp.data.stage import stage_dataset
from imagenet_ddp.io import Heartbeat
real = shutil.copyfile
def slow(a, b):
    real(a, b)
    if str(b).endswith(".tar"):
        Path(sys.argv[3]).touch()
    time.sleep(2)  # the demo's 3 shards: seconds to kill it mid-copy on a loaded machine
shutil.copyfile = slow
with Heartbeat(sys.argv[4]):
    stage_dataset(Path(sys.argv[1]), Path(sys.argv[2]), verify="size", lease=sys.argv[4])
"""


def _start_slow_stager(src, scratch, tmp_path, name):
    import subprocess
    import sys
    import time

    progress, beat = tmp_path / f"{name}.progress", tmp_path / "ckpt" / name / "beat"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_STAGER, str(src), str(scratch), str(progress), str(beat)]
    )
    deadline = time.monotonic() + 60
    while not progress.exists():  # mid-copy: files copied, the marker not yet written
        assert proc.poll() is None and time.monotonic() < deadline, "the stager did not start"
        time.sleep(0.05)
    return proc, str(beat)


def test_a_copy_sigkilled_midway_is_reclaimed_by_the_next_stager_of_any_run(
    prepared_demo, tmp_path
):
    """Issue 51 item 2: a stager SIGKILLed mid-copy (scancel past KillWait, cgroup kill) left a
    partial `.train.tmp-*` that nothing reclaimed, and cleanup said removed. Its lock (held for
    the whole copy) is free once the kernel ends it: the next stager, of another data set,
    removes the partial, but never a live stager's; the killed job's lease (its heartbeat
    still fresh) goes once stale; cleanup reports True only when nothing is left."""
    import os
    import signal
    import time

    from imagenet_ddp import io
    from imagenet_ddp.data.stage import reclaim_stale_leases

    scratch, src = tmp_path / "scratch", prepared_demo["train"]
    dest = stage.staged_path(src, scratch)
    live, first_beat = _start_slow_stager(src, scratch, tmp_path, "live")
    try:
        (partial,) = io.temporaries(dest)
        assert reclaim_stale_leases(scratch) == [] and partial.is_dir(), "a live copy is kept"
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    killed, beat = _start_slow_stager(src, scratch, tmp_path, "killed")
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    (left,) = io.temporaries(dest)  # the first's removed by the second, which held the lock
    assert left != partial and list(left.rglob("*.tar")), "the kill left a partial copy"
    assert os.path.exists(beat), "SIGKILLed: its heartbeat file stays, fresh for STALE_S"
    # The next job on the node stages another data set: it reclaims the partials at once.
    (tmp_path / "b").touch()  # that job's heartbeat
    assert reclaim_stale_leases(scratch) == []  # as stage_this_node does, before its copy
    other = stage_dataset(prepared_demo["val"], scratch, verify="size", lease=str(tmp_path / "b"))
    assert io.temporaries(dest) == [] and not dest.exists()
    assert len(list(dest.parent.glob("*.leases/*"))) == 2, "the killed jobs' leases look live"
    silent = time.time() - io.STALE_S - 5
    for path in (first_beat, beat):
        os.utime(path, (silent, silent))
    assert reclaim_stale_leases(scratch) == [dest]
    assert not dest.parent.exists(), "nothing of the killed copy is left"
    assert Path(other["dest"]).is_dir(), "the other data set's copy is untouched"
    # Killed again; its own run's next attempt gives its lease up (stage_this_node): cleanup
    # says True only with nothing left (before: True, the partial copy still there).
    killed, beat = _start_slow_stager(src, scratch, tmp_path, "again")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert io.temporaries(dest)
    assert cleanup_staged(dest, beat) is True
    assert io.temporaries(dest) == [] and not dest.parent.exists()
    # Killed once more; the same data set staged next: the partial goes, a full copy is made.
    killed, _ = _start_slow_stager(src, scratch, tmp_path, "last")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert stage_dataset(src, scratch, verify="size")["reused"] is False
    assert io.temporaries(dest) == [] and _tree(dest) == _tree(src)


def _stage_as(uid: int, src: Path, scratch: Path) -> tuple[int, str]:
    """Stage ``src`` into ``scratch`` in a child of this process that runs as ``uid`` (forked:
    this interpreter lives under root's 0700 home): (exit code, the dest or the error line)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                said, code = stage_dataset(src, scratch, verify="size")["dest"], 0
            except InputError as error:
                said, code = f"error: {error}", 1
            except BaseException as error:  # the old code's traceback, as its type and text
                said, code = f"{type(error).__name__}: {error}", 2
            os.write(write, said.encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), said


OTHER_UID = 65534  # nobody


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="runs a stager as another uid"
)
def test_a_second_user_stages_on_a_node_the_first_staged_on(prepared_demo):
    """Issue 51 item 3: copies went to <scratch>/imagenet_ddp/<fp>, 0755, for every user: a
    second uid got a PermissionError traceback on `.prepared.lock`. Each user has a private
    part now; one it cannot write is one line naming the path and what to do."""

    def as_other(src, scratch):
        return _stage_as(OTHER_UID, src, scratch)

    shared = Path(tempfile.mkdtemp(prefix="test-stage-users-"))  # tmp_path is root's own, 0700
    try:
        shared.chmod(0o755)
        src = shared / "val"
        shutil.copytree(prepared_demo["val"], src)
        scratch = shared / "tmp"  # a node's /tmp: every user's, sticky
        scratch.mkdir(mode=0o1777)
        scratch.chmod(0o1777)
        mine = Path(stage_dataset(src, scratch, verify="size")["dest"])
        code, theirs = as_other(src, scratch)
        assert code == 0, theirs  # before: PermissionError on <scratch>/imagenet_ddp/<fp>
        relative = mine.relative_to(stage.user_stage_dir(scratch))
        assert Path(theirs) == scratch / f"imagenet_ddp-{OTHER_UID}" / relative
        assert _tree(Path(theirs)) == _tree(src) == _tree(mine)
        assert stage.user_stage_dir(scratch).stat().st_mode & 0o777 == 0o700
        # a scratch root it may not write: one line naming it, no traceback
        closed = shared / "closed"
        closed.mkdir(mode=0o755)
        code, line = as_other(src, closed)
        assert code == 1 and len(line.splitlines()) == 1, line
        assert f"scratch {closed}/imagenet_ddp-{OTHER_UID}: permission denied to uid" in line
        assert "set stage.scratch_dir to a node-local directory this user may write" in line
        # its part made by someone else (here root): refused, not written into
        (closed / f"imagenet_ddp-{OTHER_UID}").mkdir(mode=0o777)
        (closed / f"imagenet_ddp-{OTHER_UID}").chmod(0o777)
        code, line = as_other(src, closed)
        assert code == 1 and f"belongs to uid 0, not to this job's uid {OTHER_UID}" in line
    finally:
        shutil.rmtree(shared, ignore_errors=True)
