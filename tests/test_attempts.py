"""The attempt record (imagenet_ddp.jobs.attempts): every allocation of a run counted, a retry that
cannot help refused, the run's bound kept; with the real launcher where it matters."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pandas as pd
import pytest

from imagenet_ddp.io import Heartbeat
from imagenet_ddp.jobs import attempts
from imagenet_ddp.monitoring.cost import over_attempts

RUN = {"run": "r", "lr": 0.1, "batch_size": 4, "nodes": 1, "tasks_per_node": 2,
       "cpus_per_task": 1, "max_allocations": 3}  # fmt: skip


def checkpoint(root: Path, epoch: int, step: int) -> Path:
    path = root / "fp-n1x2" / f"checkpoint-e{epoch:04d}-s{step:07d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def test_each_attempt_is_recorded_with_its_start_and_newest_checkpoint(tmp_path):
    first, why = attempts.begin(tmp_path, RUN, attempt=1, gpus=8, cores=16)
    assert why is None and first["start"] == {"epoch": 0, "step": 0, "path": None}
    checkpoint(tmp_path, 1, 0)
    attempts.end(tmp_path, first, 75)
    second, why = attempts.begin(tmp_path, RUN, attempt=2, gpus=8, cores=16)
    assert why is None and (second["start"]["epoch"], second["attempt"]) == (1, 2)
    record = attempts.load(tmp_path)
    assert record[0]["outcome"] == "stopped" and record[0]["last_checkpoint"]["epoch"] == 1
    assert attempts.made_progress(record[0])
    # a changed setting is another run: its own count
    other, _ = attempts.begin(tmp_path, {**RUN, "lr": 0.2}, attempt=1, gpus=8, cores=16)
    assert other["attempt"] == 1
    # a changed bound is the same run
    assert attempts.settings_key(RUN) == attempts.settings_key({**RUN, "max_allocations": 9})


def test_the_count_follows_the_checkpoints_key():
    """Settings that resume the checkpoints continue the count; the others start both afresh
    (settings.geometry.checkpoint_tag: the weights' settings, the global batch, CPU or GPU;
    not the rank count nor the loader)."""
    key = attempts.settings_key
    for same in ({"gpu_type": "h100"}, {"mlflow_uri": "http://m"}, {"log_interval": 7},
                 {"throughput_warmup_steps": 9}, {"recipe": "named"},
                 {"tasks_per_node": 1, "accumulation": 2},  # the same global batch, 8
                 {"nodes": 2, "tasks_per_node": 1},
                 {"cpus_per_task": 4}, {"workers": 3}):  # the loader: the same stream  # fmt: skip
        assert key({**RUN, **same}) == key(RUN), same
    for other in ({"lr": 0.2}, {"nodes": 2}, {"accumulation": 2}, {"seed": 1},
                  {"gpus_per_node": 2, "device": "auto"}):  # fmt: skip
        assert key({**RUN, **other}) != key(RUN), other
    synced = {**RUN, "sync_bn": True}  # keyed by the rank count too
    assert key({**synced, "tasks_per_node": 1, "accumulation": 2}) != key(synced)


def test_entries_of_an_earlier_version_keyed_by_the_loader_still_count(tmp_path):
    """An earlier version keyed the entries on cpus_per_task, gpus_per_node and workers too: a
    run upgraded mid-training keeps its count (max_allocations) and cost."""
    legacy = {**RUN, "workers": 0, "gpus_per_node": 0}
    first, _ = attempts.begin(tmp_path, legacy, attempt=1, gpus=0, cores=2)
    attempts.end(tmp_path, first, 75)
    record = attempts.load(tmp_path)
    record[0]["key"] = attempts._earlier_key(legacy)  # as the earlier version wrote it
    (tmp_path / attempts.RECORD).write_text(json.dumps({"attempts": record}))
    second, _ = attempts.begin(tmp_path, legacy, attempt=2, gpus=0, cores=2)
    assert second["attempt"] == 2 and second["key"] == attempts.settings_key(legacy)
    cost = attempts.cost_over_attempts(tmp_path, attempts.run_keys(legacy), time.time())
    assert [a["attempt"] for a in cost["attempts"]] == [1, 2]


def test_each_attempt_records_the_shape_it_ran_on(tmp_path):
    from imagenet_ddp.settings.geometry import Geometry

    two = Geometry(2, 1, 1)
    first, _ = attempts.begin(tmp_path, RUN, attempt=1, gpus=0, cores=2, shape=two)
    attempts.end(tmp_path, first, 75)
    smaller = {**RUN, "tasks_per_node": 1, "accumulation": 2}
    second, _ = attempts.begin(tmp_path, smaller, attempt=2, gpus=0, cores=1,
                               shape=Geometry(1, 1, 1))  # fmt: skip
    assert second["attempt"] == 2  # the same line of checkpoints
    cost = attempts.cost_over_attempts(tmp_path, attempts.settings_key(RUN), time.time())
    assert [(a["shape"], a["attempt"]) for a in cost["attempts"]] == [("2x1", 1), ("1x1", 2)]
    assert [a["accumulation"] for a in attempts.load(tmp_path)] == [1, 2]


def test_a_failure_without_progress_is_retried_once_then_refused_with_its_error(tmp_path):
    def fail(attempt):
        entry, why = attempts.begin(tmp_path, RUN, attempt=attempt, gpus=0, cores=2)
        attempts.record_error(tmp_path, 1, "node2", ValueError("batch_size 4096 too large\nmore"))
        attempts.end(tmp_path, entry, 1)
        return why

    assert fail(1) is None
    assert attempts.load(tmp_path)[0]["error"] == (
        "rank 1 on node2: ValueError: batch_size 4096 too large"
    )
    # one real retry (a bad node, a transient start-up failure) ...
    assert attempts.refusal_ahead(tmp_path, RUN, 2) is None
    assert fail(2) is None
    # ... none after the second failure in a row; the workflow knows it before submitting
    ahead = attempts.refusal_ahead(tmp_path, RUN, 3)
    assert len(attempts.load(tmp_path)) == 2  # asking writes nothing
    _, why = attempts.begin(tmp_path, RUN, attempt=3, gpus=0, cores=2)
    assert why == ahead and why.startswith("not retrying") and "batch_size 4096 too large" in why
    more = {**RUN, "max_allocations": 5}  # the same run (a bound is not a setting)
    assert attempts.refusal_ahead(tmp_path, more, 4) == why  # refused again, not nested
    # a new invocation (attempt 1: the user fixed something) may try again
    _, why = attempts.begin(tmp_path, RUN, attempt=1, gpus=0, cores=2)
    assert why is None


def test_progress_between_failures_keeps_retrying(tmp_path):
    first, _ = attempts.begin(tmp_path, RUN, attempt=1, gpus=0, cores=2)
    attempts.end(tmp_path, first, 1)
    second, _ = attempts.begin(tmp_path, RUN, attempt=2, gpus=0, cores=2)
    checkpoint(tmp_path, 1, 0)
    attempts.end(tmp_path, second, 1)  # failed, but after a checkpoint
    assert attempts.refusal_ahead(tmp_path, RUN, 3) is None


def test_the_bound_and_a_killed_attempt_closed_at_its_last_heartbeat(tmp_path):
    _, why = attempts.begin(tmp_path, RUN, attempt=4, gpus=0, cores=2)
    assert "above its max_allocations (3)" in why
    killed, _ = attempts.begin(tmp_path, RUN, attempt=1, gpus=4, cores=8)
    beat = attempts.beat_path(tmp_path)
    assert killed["beat"] == beat.name
    heart = Heartbeat(beat, seconds=0.05).__enter__()  # never left: SIGKILLed with its job
    time.sleep(0.3)
    heart._stop.set()
    heart._thread.join()
    last = beat.stat().st_mtime
    assert last > killed["started"] + 0.1  # it beat after its start
    checkpoint(tmp_path, 0, 5)
    # never ended (its launcher was SIGKILLed): the next attempt closes it at its last beat
    attempts.begin(tmp_path, RUN, attempt=2, gpus=4, cores=8)
    entry = [a for a in attempts.load(tmp_path) if a["outcome"] == "killed"][0]
    assert entry["ended"] == last and entry["last_checkpoint"]["step"] == 5
    with Heartbeat(beat, seconds=10):  # a job that ends cleanly leaves no heartbeat
        assert beat.is_file()
    assert not beat.exists()


def test_cost_sums_every_allocation_and_the_work_lost_after_each_checkpoint(tmp_path):
    record = [
        {"attempt": 1, "key": "k", "outcome": "stopped", "started": 0.0, "ended": 3600.0,
         "gpus": 8, "cores": 16, "slurm_job_id": "11", "start": {"epoch": 0, "step": 0},
         "last_checkpoint": {"epoch": 3, "step": 0, "written": 3240.0}},
        {"attempt": 2, "key": "k", "outcome": "failed", "started": 4000.0, "ended": 5800.0,
         "gpus": 8, "cores": 16, "slurm_job_id": "12", "start": {"epoch": 3, "step": 0},
         "last_checkpoint": None},
        {"attempt": 3, "key": "k", "outcome": "refused", "started": 5900.0, "ended": 5900.0,
         "gpus": 8, "cores": 16, "slurm_job_id": "13"},
        {"attempt": 4, "key": "k", "outcome": "running", "started": 6000.0, "ended": None,
         "gpus": 8, "cores": 16, "slurm_job_id": "14", "start": {"epoch": 3, "step": 0},
         "last_checkpoint": None},
    ]  # fmt: skip
    (tmp_path / attempts.RECORD).write_text(json.dumps({"attempts": record}))
    summed = attempts.cost_over_attempts(tmp_path, "k", now=7800.0)
    assert summed["allocations"] == 3 and summed["slurm_job_ids"] == ["11", "12", "14"]
    assert summed["wall_seconds"] == 3600 + 1800 + 1800
    assert summed["gpu_hours"] == pytest.approx(8 * 2.0)
    # attempt 1: 360 s after its last checkpoint; attempt 2: all 1800 s (none written)
    assert summed["gpu_hours_lost"] == pytest.approx(8 * (360 + 1800) / 3600)
    this_job = {"wall_seconds": 1700.0, "gpu_hours": 3.8, "core_hours": 7.6, "gpus": 8}
    cost = over_attempts(this_job, summed)
    assert cost["allocations"] == 3 and cost["this_job"]["wall_seconds"] == 1700.0
    assert cost["gpu_hours"] == summed["gpu_hours"] and "summed over all" in cost["scope"]


def test_a_crash_that_repeats_at_start_uses_at_most_two_jobs(prepared_demo, demo_split, tmp_path):
    """The real launcher: the ranks of the first job and of its one retry fail at start; the
    next retry refuses at once with their error, without staging or starting a rank."""
    from tests.test_resume import CONFIG, launch
    from tests.workflow_helpers import output_within

    config = {**CONFIG, "batch_size": 100_000}  # larger than the training set: fails at start
    for attempt in (1, 2):
        job = launch(prepared_demo["train"], demo_split, tmp_path, config, tasks=2, cpus=1,
                     attempt=attempt)  # fmt: skip
        output = output_within(job, 180)
        assert job.returncode == 1 and "exceeds" in output, output[-3000:]
    begun = time.monotonic()
    retry = launch(prepared_demo["train"], demo_split, tmp_path, config, tasks=2, cpus=1,
                   attempt=3)  # fmt: skip
    output = output_within(retry, 120)
    assert retry.returncode == 1 and "not retrying" in output, output[-3000:]
    assert (
        "batch_size 100000 x 2 ranks x accumulation 1, exceeds" in output and "+ " not in output
    ), output
    assert time.monotonic() - begun < 60
    outcomes = [a["outcome"] for a in attempts.load(tmp_path / "ckpt")]
    assert outcomes == ["failed", "failed", "refused"]
    assert not os.path.exists(tmp_path / "run" / "model.pt")


def test_a_full_disk_during_a_checkpoint_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    import errno

    import torch

    from imagenet_ddp.training import checkpoint as ckpt

    ckpt.save_checkpoint(tmp_path, {"epoch": 1, "step_in_epoch": 0, "w": torch.ones(3)}, keep=1)

    def full(state, path):
        with open(path, "wb") as f:
            f.write(b"partial")  # what a write cut off by ENOSPC leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(ckpt.CheckpointWriteError) as error:
        ckpt.save_checkpoint(tmp_path, {"epoch": 2, "step_in_epoch": 0}, keep=1)
    assert error.value.errno == errno.ENOSPC
    assert "No space left on device" in str(error.value)
    assert "checkpoint-e0001-s0000000.pt, is intact" in str(error.value)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-e0001-s0000000.pt"]
    monkeypatch.undo()
    assert torch.equal(ckpt.load_latest_checkpoint(tmp_path)["w"], torch.ones(3))


def test_the_end_of_a_job_a_hung_rank_ended_names_that_rank_and_its_host(tmp_path, capsys):
    entry, _ = attempts.begin(tmp_path, RUN, attempt=1, gpus=0, cores=2)
    entry["started"] -= 1000  # the job began 1000 s ago
    ranks = [attempts.RankProgress(tmp_path, r, f"node{r + 1}", seconds=0.02) for r in (0, 1)]
    ranks[1].mark(0, 7)  # rank 1 stopped stepping here ...
    for step in (8, 9):
        ranks[0].mark(0, step)
        _written(ranks[0], step)
    stale = _written(ranks[1], 7)
    ranks[1].path.write_text(json.dumps({**stale, "time": stale["time"] - 600}))
    assert attempts.hung_rank(tmp_path, since=time.time() - 100) is None  # an earlier job's
    ranks[1].path.write_text(json.dumps({**stale, "time": time.time() - 600}))
    # ... and the others waited for it until the process-group timeout failed them
    attempts.record_error(tmp_path, 0, "node1", RuntimeError("gloo: Timed out waiting"))
    attempts.end(tmp_path, entry, 1)
    line = "rank 1 on node2 made no step for 600 s while the others trained"
    assert line in capsys.readouterr().out
    error = attempts.load(tmp_path)[0]["error"]
    assert error.startswith(line) and "last at epoch 0 step 7" in error and "Timed out" in error


def _written(progress, step: int) -> dict:
    """The rank's progress file once its heartbeat wrote ``step``."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            mark = json.loads(progress.path.read_text())
            if mark["step"] == step:
                return mark
        time.sleep(0.01)
    raise AssertionError(f"step {step} never written")


def test_a_rank_marks_its_progress_from_a_thread_so_a_slow_filesystem_stalls_no_step(
    tmp_path, monkeypatch
):
    """~1,000 metadata operations a second at 200 runs x 16 ranks: a mark is no I/O, the
    heartbeat writes the last step while it changes, a write waiting on the metadata server
    blocks that thread, not the step, and a rank whose steps stopped writes nothing more."""
    import threading

    released, written = threading.Event(), []

    def slow_write(path, data):
        released.wait(timeout=30)
        written.append(data["step"])

    monkeypatch.setattr(attempts, "write_json_atomic", slow_write)
    progress = attempts.RankProgress(tmp_path, 3, "node4", seconds=0.01)
    started = time.monotonic()
    for step in range(50):
        progress.mark(0, step)
        time.sleep(0.001)
    assert time.monotonic() - started < 5 and written == []  # no step waited for the write
    released.set()
    time.sleep(0.2)
    assert written[-1] == 49 and len(written) <= 3  # the steps marked meanwhile: the last only
    progress.mark(0, 50)
    time.sleep(0.2)
    assert written[-1] == 50 and written.count(50) == 1  # silent once the steps stop


def test_a_retry_that_will_refuse_is_submitted_without_gpus(tmp_path):
    """Real Snakemake, dry-run at a given attempt: the train job's SLURM shape is the run's
    until two attempts in a row failed without progress, then one task without GPUs."""
    from imagenet_ddp.settings.kinds import TrainConfig
    from tests.workflow_helpers import copy_workflow, shown_specs, snakemake

    # 2 loader workers: the dry-run refuses fewer on a GPU run
    run = {"name": "r", "nodes": 2, "tasks_per_node": 2, "gpus_per_node": 2, "workers": 2}
    workdir = copy_workflow(tmp_path / "wf", runs=[run])
    target = "results/runs/r/model.pt"

    def train_job(attempt: int) -> tuple[str, dict]:
        shown = snakemake(workdir, "-n", "-p", target, "--config", "data={dir: /x}",
                          "--attempt", str(attempt))  # fmt: skip
        text = shown.stdout + shown.stderr
        job = text[text.index("rule train:") :]
        # The job's shape; its spec and hyperparameters follow (resources too, not params).
        resources = re.search(r"resources: (.*)", job).group(1).split(", job=")[0]
        settings = shown_specs(job, "train", workdir)[0]["run"]
        return resources, settings

    resources, settings = train_job(3)
    # the dry-run's spec carries every setting resolved ("auto" too): a rank takes it as it is
    assert TrainConfig.from_dict(settings).weight_decay_groups == "torchvision"
    assert "nodes=2, tasks_per_node=2, cpus_per_task=1, gres=gpu:2" in resources
    assert "mpi=srun" in resources
    root = workdir / "results/checkpoints/r"
    for attempt in (1, 2):
        entry, _ = attempts.begin(root, settings, attempt=attempt, gpus=4, cores=4)
        attempts.end(root, entry, 1)
    # a new invocation's first job tries again with its GPUs (the user may have fixed it)
    assert train_job(1)[0] == resources.replace("snakemake_attempt=3", "snakemake_attempt=1")
    refused = train_job(3)[0]
    assert "nodes=1, cpus_per_task=1, tasks_per_gpu=0, slurm_extra=" in refused, refused
    assert "gres=" not in refused and "mpi=" not in refused and "tasks_per_node" not in refused


def test_a_job_of_another_version_is_refused_once_and_its_retries_ask_for_no_gpus(
    tmp_path, monkeypatch, capsys
):
    """Issue 50: after a `git pull` without a reinstall the workflow plans with one version and
    the jobs run another. The real CLI refuses the train job before anything runs, in one line
    naming both versions and the reinstall (exit 2), and records the refusal, so that the
    workflow sizes each retry as one task without GPUs, which refuses again at once."""
    from imagenet_ddp import __version__, cli
    from imagenet_ddp.jobs.site import REFUSED_SHAPE, train_resources
    from imagenet_ddp.jobs.spec import compact_spec, to_dict
    from imagenet_ddp.settings.kinds import declarations
    from tests.workflow_helpers import make_job, run_settings

    monkeypatch.setenv("IMAGENET_DDP_ROOT", "/clone")
    monkeypatch.delenv("IMAGENET_DDP_PLAN_VERSION", raising=False)
    run = run_settings(run="r", nodes=2, tasks_per_node=4, cpus_per_task=8, gpus_per_node=4)
    root = tmp_path / "checkpoint_root"  # make_job's
    settings = {**declarations().rank_defaults(), **run}
    for attempt in (1, 2):
        spec = compact_spec(to_dict(make_job("train", run, tmp_path, attempt=attempt)))
        other = spec.replace(f'"version":"{__version__}"', '"version":"9.9.9"')
        if attempt == 2:  # the workflow's sizing of the retry, from the record alone
            assert train_resources(run, settings, str(root), 2, 0.0) == REFUSED_SHAPE
        assert cli.main(["train", "--job", other, "--attempt-log", str(tmp_path / "l")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "planned this job with imagenet-ddp 9.9.9" in lines[0]
        assert f"installed here is {__version__}" in lines[0]
        assert "-m pip install -c /clone/requirements/constraints.txt -e /clone" in lines[0]
    record = attempts.of_run(attempts.load(root), attempts.settings_key(settings))
    assert [(a["outcome"], a["snakemake_attempt"], a["gpus"]) for a in record] == [
        ("refused", 1, 0),
        ("refused", 2, 0),
    ]
    assert not (tmp_path / "l").exists() and not (tmp_path / "run_dir").exists()
    # a new invocation's first job (reinstalled, say) asks for the run's GPUs again
    assert train_resources(run, settings, str(root), 1, 0.0)["gres"] == "gpu:4"


@pytest.mark.parametrize("command", ["verify", "index"])
def test_every_stage_refuses_to_run_for_a_plan_of_another_version(
    tmp_path, monkeypatch, capsys, command
):
    """Issue 50: a data stage (every stage: imagenet_ddp.cli.main) run by a workflow whose
    parse had another version (the stage versions it planned are that version's) refuses in
    one line, exit 2, writing nothing; at the plan's own version the stage runs (here: fails
    on its missing input instead)."""
    from imagenet_ddp import __version__, cli

    argv = {
        "verify": ["verify", "--data-dir", "nowhere", "--report", "out/r.json",
                   "--no-check-md5"],
        "index": ["index", "--data-dir", "nowhere", "--out-dir", "out"],
    }[command]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("IMAGENET_DDP_PLAN_VERSION", "0.0.1")
    try:
        code = cli.main(argv)
    except SystemExit as exit:  # argparse: a required option this test does not give
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"imagenet-ddp 0.0.1, but the package installed here is {__version__}" in err
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("IMAGENET_DDP_PLAN_VERSION", __version__)
    with contextlib.suppress(Exception, SystemExit):
        cli.main(argv)
    assert "planned this job" not in capsys.readouterr().err


def test_a_step_that_exits_0_without_finishing_the_run_is_stopped(tmp_path, monkeypatch):
    """srun exits 0 when it gives up waiting for a signalled step (seen in CI at a time
    limit): the job is stopped (75), its attempt not "completed", no output is written."""
    from imagenet_ddp.jobs import launch

    monkeypatch.setattr(launch, "run_staged", lambda spec, path: 0)
    from tests.workflow_helpers import make_job

    spec = make_job("train", RUN, checkpoint_root=tmp_path / "ckpt", run_dir=tmp_path / "run")
    assert launch.run_attempt(spec, tmp_path / "spec.json") == attempts.EXIT_REQUEUE
    assert attempts.load(tmp_path / "ckpt")[0]["outcome"] == "stopped"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_metrics.json").write_text("{}")  # rank 0 finished the run
    assert launch.run_attempt(spec, tmp_path / "spec.json") == 0
    assert attempts.load(tmp_path / "ckpt")[-1]["outcome"] == "completed"


def test_each_attempt_records_the_code_it_ran(tmp_path):
    from imagenet_ddp.provenance import code_version

    entry, _ = attempts.begin(tmp_path, RUN, attempt=1, gpus=0, cores=2)
    code = code_version()
    assert entry["code"]["git_commit"] == code["git_commit"] != "unknown"
    assert entry["code"]["git_dirty"] == code["git_dirty"]
    assert attempts.load(tmp_path)[0]["code"] == entry["code"]


def _code(commit: str, dirty: bool = False, digest: str | None = None) -> dict:
    return {"git_commit": commit, "git_dirty": dirty,
            **({"git_diff_sha256": digest} if digest else {})}  # fmt: skip


@pytest.mark.parametrize(
    ("codes", "versions", "changed"),
    [
        ([_code("aaa"), None, _code("aaa")], ["aaa"], False),  # None: an entry from before
        ([_code("aaa"), _code("bbb")], ["aaa", "bbb"], True),
        ([_code("aaa", True, "d1"), _code("aaa", True, "d1")], ["aaa+dirty:d1"], False),
        (
            [_code("aaa", True, "d1"), _code("aaa", True, "d2")],
            ["aaa+dirty:d1", "aaa+dirty:d2"],
            True,
        ),  # fmt: skip
        ([_code("aaa"), _code("unknown", None)], ["aaa"], False),  # no git in the container
    ],
    ids=["same", "two-commits", "same-changes", "other-changes", "unknown"],
)
def test_attempts_that_ran_different_code_are_flagged(tmp_path, codes, versions, changed):
    record = [
        {"attempt": i + 1, "key": "k", "outcome": "stopped", "started": 100.0 * i,
         "ended": 100.0 * i + 50, "gpus": 0, "cores": 2, "last_checkpoint": None,
         **({"code": code} if code else {})}
        for i, code in enumerate(codes)
    ]  # fmt: skip
    (tmp_path / attempts.RECORD).write_text(json.dumps({"attempts": record}))
    summed = attempts.cost_over_attempts(tmp_path, "k", now=1000.0)
    assert (summed["code_versions"], summed["code_changed"]) == (versions, changed)


def test_an_attempt_record_with_two_commits_marks_the_run_in_the_table(tmp_path):
    """The run's two allocations ran commits aaa and bbb: runs.csv (which the HTML report
    shows) says so in code_changed/code_versions, runs.md marks the run and names both."""
    from imagenet_ddp.report.aggregate import write_aggregate
    from tests.fake_runs import write_run_dir

    record = [
        {"attempt": i + 1, "key": "k", "outcome": outcome, "started": 100.0 * i,
         "ended": 100.0 * i + 50, "gpus": 4, "cores": 8, "last_checkpoint": None,
         "code": _code(commit)}
        for i, (outcome, commit) in enumerate([("stopped", "aaa"), ("completed", "bbb")])
    ]  # fmt: skip
    (tmp_path / attempts.RECORD).write_text(json.dumps({"attempts": record}))
    this_job = {"wall_seconds": 50.0, "gpu_hours": 0.05, "core_hours": 0.1}
    cost = over_attempts(this_job, attempts.cost_over_attempts(tmp_path, "k", now=1000.0))
    dirs = []
    for run, run_cost in (("moved", cost), ("steady", {**cost, "code_changed": False})):
        dirs.append(write_run_dir(tmp_path, run, nodes=1, tasks_per_node=4,
                                  steady_per_worker=100.0))  # fmt: skip
        metrics = json.loads((dirs[-1] / "train_metrics.json").read_text())
        (dirs[-1] / "train_metrics.json").write_text(json.dumps({**metrics, "cost": run_cost}))
    write_aggregate(dirs, tmp_path / "runs.csv", tmp_path / "runs.md")
    table = pd.read_csv(tmp_path / "runs.csv").set_index("run")
    assert list(table["code_changed"]) == [True, False]
    assert table.loc["moved", "code_versions"] == "aaa bbb"
    text = (tmp_path / "runs.md").read_text()
    # "(best)": the two tie on holdout top-1, the first by name is marked
    assert re.search(r"^\| moved \* \(best\) +\|", text, re.M)
    assert re.search(r"^\| steady +\|", text, re.M)
    assert "ran different code" in text and "moved (aaa bbb)" in text and "steady (" not in text


def submission(attempt: int, outcome: str, started: float = 100.0) -> dict:
    return {"snakemake_attempt": attempt, "outcome": outcome, "started": started}


@pytest.mark.parametrize(
    "entries, attempt, nodes",
    [
        ([], 1, 4),  # the first asks for nodes
        ([submission(1, "stopped")], 2, 4),  # after a stop: nodes again
        ([submission(1, "failed")], 2, 2),  # after a failure: the next smaller count
        ([submission(1, "killed")], 2, 2),  # killed with the launcher (a node failure)
        ([], 2, 2),  # the first never started (cancelled while pending)
        ([submission(1, "failed"), submission(2, "failed")], 3, 1),
        ([submission(1, "failed"), submission(2, "failed")], 5, 1),  # the smallest stays
        ([submission(1, "failed"), submission(2, "stopped")], 3, 4),  # back to nodes
        ([submission(2, "stopped")], 3, 4),  # 1 never started, 2 on 2 nodes was stopped
        ([submission(1, "stopped", started=10.0)], 2, 2),  # an earlier invocation's entry
    ],
)  # fmt: skip
def test_the_node_count_of_each_submission_follows_how_the_previous_one_ended(
    entries, attempt, nodes
):
    assert attempts.choose_nodes(entries, (4, 2, 1), attempt, since=50.0) == nodes


def test_a_resubmission_of_an_elastic_run_asks_for_fewer_nodes(tmp_path):
    """Real Snakemake, dry-run at a given attempt: a run with fallback_nodes asks for its
    nodes, and for the smaller shape (tasks, GPUs per node) where the previous submission of
    the invocation left no entry (never started); the job spec keeps the run's own settings
    (the launcher adapts to the allocation it is given)."""
    from tests.workflow_helpers import copy_workflow, shown_specs, snakemake

    run = {"name": "r", "nodes": 2, "tasks_per_node": 2, "gpus_per_node": 2, "workers": 2,
           "fallback_nodes": [1]}  # fmt: skip
    workdir = copy_workflow(tmp_path / "wf", runs=[run])

    def train_job(attempt: int) -> tuple[str, dict]:
        shown = snakemake(workdir, "-n", "-p", "results/runs/r/model.pt", "--config",
                          "data={dir: /x}", "--attempt", str(attempt))  # fmt: skip
        text = shown.stdout + shown.stderr
        resources = re.search(r"resources: (.*)", text[text.index("rule train:") :]).group(1)
        return resources.split(", job=")[0], shown_specs(text, "train", workdir)[0]["run"]

    first, spec = train_job(1)
    assert "nodes=2, tasks_per_node=2, cpus_per_task=1, gres=gpu:2" in first and "mpi=srun" in first
    second, second_spec = train_job(2)
    assert "nodes=1, tasks_per_node=2, cpus_per_task=1, gres=gpu:2" in second, second
    assert "mpi=srun" in second and second_spec == spec
    assert (spec["nodes"], spec["fallback_nodes"], spec["accumulation"]) == (2, [1], 1)


def test_an_attempt_whose_ranks_stopped_and_checkpointed_is_stopped_though_its_launcher_died(
    tmp_path,
):
    """proctrack/cgroup: scancel, preemption or the time limit SIGKILLs the launcher with the
    batch step; the ranks still record their stop and checkpoint. The next attempt (and the
    workflow's node count) reads the entry stopped, not killed; without the stop's checkpoint
    on disk it stays killed."""
    gone, _ = attempts.begin(tmp_path, RUN, attempt=1, gpus=4, cores=8)
    checkpoint(tmp_path, 0, 3)  # an interval checkpoint before the stop
    attempts.record_stop(tmp_path, 1, "node2", 0, 7)  # another rank's signal
    attempts.record_stop(tmp_path, 0, "node1", 0, 7, signal.SIGTERM)
    probe = attempts._closed([dict(gone)], tmp_path)[0]  # the stop's checkpoint not written
    assert probe["outcome"] == "killed" and "stop" not in probe
    # the workflow reads the record as soon as SLURM says the job ended: the checkpoint may
    # still be on its way; a recorded stop is not a node failure
    probe = attempts._closed([dict(gone)], tmp_path, ahead=True)[0]
    assert probe["outcome"] == "stopped", probe
    checkpoint(tmp_path, 0, 7)
    probe = attempts._closed([dict(gone)], tmp_path)[0]  # what the workflow reads ahead
    assert probe["outcome"] == "stopped" and probe["stop"]["signal"] == "SIGTERM", probe
    assert attempts.nodes_ahead(tmp_path, {**RUN, "nodes": 2, "tasks_per_node": 1,
                                           "fallback_nodes": [1]}, 2, since=0.0) == 2  # fmt: skip
    attempts.begin(tmp_path, RUN, attempt=2, gpus=4, cores=8)
    first = attempts.load(tmp_path)[0]
    assert (first["outcome"], first["exit_code"]) == ("stopped", None), first
    assert first["last_checkpoint"]["step"] == 7 and first["ended"] >= first["started"]
    assert attempts.choose_nodes([first], (2, 1), 2, since=0.0) == 2  # not a failure
    assert not attempts._failed_without_progress(first)


def test_a_stop_recorded_by_an_earlier_attempt_does_not_count(tmp_path):
    attempts.record_stop(tmp_path, 0, "node1", 0, 2, signal.SIGUSR1)
    time.sleep(0.01)
    entry, _ = attempts.begin(tmp_path, RUN, attempt=1, gpus=4, cores=8)
    checkpoint(tmp_path, 0, 2)
    assert attempts.stopped_by_ranks(tmp_path, entry) is None


def test_a_rank_killed_by_killwait_after_its_stops_checkpoint_is_a_stopped_job(
    tmp_path, monkeypatch
):
    """`scancel -s TERM --batch`: the batch shell dies, the launcher (alive under
    proctrack/linuxproc) hears nothing, the ranks get the job's SIGTERM, checkpoint, and one
    still tearing down is killed KillWait later: the step fails (137). The ranks' stop record
    and its checkpoint make the job exit 75, recorded stopped (the CI flake, recorded failed)."""
    from imagenet_ddp.jobs import launch
    from tests.workflow_helpers import make_job

    root = tmp_path / "ckpt"

    def ranks_stop_then_one_is_killed(job, path):
        attempts.record_stop(root, 0, "node1", 1, 4, signal.SIGTERM)
        checkpoint(root, 1, 4)
        return 137

    monkeypatch.setattr(launch, "run_staged", ranks_stop_then_one_is_killed)
    spec = make_job("train", RUN, checkpoint_root=root, run_dir=tmp_path / "run")
    assert launch.run_attempt(spec, tmp_path / "spec.json") == attempts.EXIT_REQUEUE
    entry = attempts.load(root)[0]
    assert (entry["outcome"], entry["exit_code"]) == ("stopped", 75), entry
    assert entry["stop"]["signal"] == "SIGTERM"

    def killed_before_the_checkpoint(job, path):  # the stop recorded, its checkpoint not
        attempts.record_stop(root, 0, "node1", 2, 9, signal.SIGTERM)
        return 137

    monkeypatch.setattr(launch, "run_staged", killed_before_the_checkpoint)
    assert launch.run_attempt(spec, tmp_path / "spec.json") == 137
    assert attempts.load(root)[-1]["outcome"] == "failed"


def test_a_checkpoint_write_sigkilled_midway_is_removed_by_the_next_writer(tmp_path):
    """Issue 51 item 2: a rank SIGKILLed inside atomic_path (cgroup kill, OOM) left its
    `.checkpoint-*.pt.tmp-*` on the shared filesystem for ever (pruning globs checkpoint-*.pt
    only). The next writer of the directory removes one silent longer than any live write."""
    import signal
    import subprocess
    import sys
    import time

    import torch

    from imagenet_ddp import io
    from imagenet_ddp.training import checkpoint as ckpt

    final = tmp_path / "checkpoint-e0003-s0000000.pt"
    writer = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom imagenet_ddp.io import atomic_path\n"
         "with atomic_path(sys.argv[1]) as tmp:\n    tmp.write_bytes(b'x' * 2**20)\n"
         "    print('written', flush=True)\n    time.sleep(60)\n", str(final)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert writer.stdout.readline() == "written\n"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    (left,) = io.temporaries(final)
    other = tmp_path / ".eval.json.tmp-abc"  # another file's temporary: not the checkpoints'
    other.write_text("{}")
    ckpt.save_checkpoint(tmp_path, {"epoch": 3, "step_in_epoch": 0, "w": torch.ones(3)}, keep=2)
    assert left.exists(), "just written: it could be a live write"
    silent = time.time() - io.STALE_S - 5
    for path in (left, other):
        os.utime(path, (silent, silent))
    ckpt.save_checkpoint(tmp_path, {"epoch": 4, "step_in_epoch": 0, "w": torch.ones(3)}, keep=2)
    assert not left.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.pt")) == [
        "checkpoint-e0003-s0000000.pt", "checkpoint-e0004-s0000000.pt"
    ]  # fmt: skip
