"""One train job of a run at a time (imagenet_ddp.jobs.holders), with a fake squeue and
scontrol: the job finds another live job holding its run and gives its allocation back at once
(requeued behind it, or ended for the workflow's retry). On the real SLURM cluster:
tests/test_slurm_e2e.py (its controller killed and restarted mid-train)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from imagenet_ddp.io import SILENT_S
from imagenet_ddp.jobs import attempts, holders

RUN = {"run": "r", "epochs": 2, "lr": 0.1, "batch_size": 4, "nodes": 1, "tasks_per_node": 1}


@pytest.fixture
def fake_squeue(tmp_path, monkeypatch):
    """A squeue on PATH that prints tmp/squeue.out (exit 0), or tmp/squeue.err (exit 1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "squeue"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/squeue.calls\n'
        f"if [ -f {tmp_path}/squeue.err ]; then cat {tmp_path}/squeue.err >&2; exit 1; fi\n"
        f"cat {tmp_path}/squeue.out\n"
    )
    script.chmod(0o755)
    scontrol = bin_dir / "scontrol"  # records its calls; fails where tmp/scontrol.err exists
    scontrol.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/scontrol.calls\n'
        f"if [ -f {tmp_path}/scontrol.err ]; then cat {tmp_path}/scontrol.err >&2; exit 1; fi\n"
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "squeue.out").write_text("")
    return tmp_path


def open_entry(root, job_id: str, alive: float, beat: str = "") -> None:
    """An attempt of job ``job_id`` ("": outside SLURM) that its launcher has not closed (it is
    training), whose job's heartbeat (``beat``, else the job id) last beat at ``alive``."""
    entry = {"attempt": 1, "key": attempts.settings_key(RUN), "slurm_job_id": job_id or None,
             "host": "node1", "started": alive - 600, "beat": beat or job_id, "ended": None,
             "outcome": "running"}  # fmt: skip
    attempts._save(root, [entry])
    beat = root / attempts.ALIVE_DIR / entry["beat"]
    beat.parent.mkdir(exist_ok=True)
    beat.touch()
    os.utime(beat, (alive, alive))


def test_a_job_gives_its_allocation_back_while_another_live_job_holds_the_run(
    fake_squeue, monkeypatch
):
    """Job 41 finds job 40's open entry, running: it requeues itself behind it (held first,
    then the dependency, then released), never waiting while it holds its GPUs; its own entry
    (a requeued job keeps its id), a pending or an ended job holds nothing."""
    import signal

    root = fake_squeue / "ckpt"
    open_entry(root, "40", time.time())
    (fake_squeue / "squeue.out").write_text("RUNNING\n")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    holder = holders.live_holder(root, RUN)
    assert holder["slurm_job_id"] == "40" and holder["state"] == "RUNNING"
    lines = []
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # SLURM's SIGTERM is ignored there
    assert holders.give_back(holder, "r", log=lines.append) == attempts.EXIT_REQUEUE
    calls = (fake_squeue / "scontrol.calls").read_text().splitlines()
    assert calls == ["requeuehold 41", "update JobId=41 Dependency=afterany:40", "release 41"]
    assert "job 40 (attempt 1 on node1, RUNNING) still trains it" in lines[0], lines
    assert "this job 41 is requeued behind it and resumes after it" in lines[0], lines
    # a site that does not let a job requeue itself: it ends, for the workflow's retry
    (fake_squeue / "scontrol.err").write_text("Requeue of JobId=41 not allowed")
    assert holders.give_back(holder, "r", log=lines.append) == attempts.EXIT_REQUEUE
    assert "this job ends without training; the workflow submits the run again" in lines[1]
    for state in ("PENDING", ""):  # requeued or held by an admin; ended
        (fake_squeue / "squeue.out").write_text(f"{state}\n")
        assert holders.live_holder(root, RUN) is None, state
    open_entry(root, "41", time.time())
    (fake_squeue / "squeue.out").write_text("RUNNING\n")
    assert holders.live_holder(root, RUN) is None


def test_without_squeue_a_fresh_heartbeat_holds_the_run_and_a_stale_one_does_not(
    fake_squeue, monkeypatch
):
    root = fake_squeue / "ckpt"
    (fake_squeue / "squeue.err").write_text("squeue: error: Unable to contact slurm controller")
    open_entry(root, "50", time.time() - SILENT_S - 5)  # killed with its launcher
    assert holders.live_holder(root, RUN) is None
    open_entry(root, "50", time.time())
    assert holders.live_holder(root, RUN)["state"] == "heartbeat"
    # a purged job id: ended, whatever its heartbeat says
    (fake_squeue / "squeue.err").write_text("slurm_load_jobs error: Invalid job id specified")
    assert holders.live_holder(root, RUN) is None


def test_a_job_outside_slurm_killed_with_its_launcher_holds_nothing_though_its_heartbeat_is_fresh(
    fake_squeue,
):
    """A local job SIGKILLed with Snakemake (no cleanup: its entry open, its heartbeat fresh):
    the job a restarted Snakemake starts at once trains, as this host shows its launcher's pid
    gone or a zombie (CI's init reaps no orphan); a live launcher's, or another host's (this
    host cannot say), holds the run."""
    import socket
    import subprocess
    import sys

    import psutil

    root = fake_squeue / "ckpt"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    host = socket.gethostname()
    # killed, never reaped (its parent dead too, an init that does not wait): a zombie, ended
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    for beat, held in ((f"local-{host}-{gone}", False), (f"local-{host}-{os.getpid()}", True),
                       (f"local-{host}-{zombie.pid}", False),
                       (f"local-othernode-{gone}", True)):  # fmt: skip
        open_entry(root, "", time.time(), beat=beat)
        holder = holders.live_holder(root, RUN)
        assert (holder is not None) == held and (not held or holder["state"] == "heartbeat"), beat
    zombie.wait()


def test_two_jobs_that_start_at_once_never_train_together(tmp_path, monkeypatch):
    """Two jobs of a run started together (two controllers, or one restarted within seconds):
    each finds the run free and records its attempt a second later (a check that is not held
    with the record would let both train). Under the lock the second sees the first's open
    entry and gives its allocation back; the first trains."""
    import subprocess
    import sys
    import textwrap

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # no squeue asked: the heartbeat holds
    root = tmp_path / "ckpt"
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            from imagenet_ddp.jobs import attempts, holders
            run, root = {RUN!r}, {str(root)!r}
            check = holders.live_holder

            def slow_check(*args, **kwargs):  # a second between the check and the record
                found = check(*args, **kwargs)
                time.sleep(1.0)
                return found

            holders.live_holder = slow_check
            begin = lambda: attempts.begin(root, run, attempt=1, gpus=0, cores=1)
            begun, holder = holders.begin_unless_held(root, run, begin)
            if holder:
                raise SystemExit(holders.give_back(holder, "r"))
            print("began", time.time(), flush=True)
            time.sleep(2.0)  # trains
            attempts.end(root, begun[0], 0)
            """
        )
    )
    jobs = [
        subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [job.communicate(timeout=60)[0] for job in jobs]
    assert sum("began" in out for out in outputs) == 1, outputs
    assert sum("still trains it" in out for out in outputs) == 1, outputs
    assert sorted(job.returncode for job in jobs) == [0, attempts.EXIT_REQUEUE]
    record = attempts.load(root)
    assert [(a["attempt"], a["outcome"]) for a in record] == [(1, "completed")]


def test_a_retry_inside_the_allocation_it_ended_in_is_not_run(tmp_path, monkeypatch):
    """A rule's retries reach the jobstep's own Snakemake (snakemake-executor-plugin-slurm#284),
    which would run the job again in the allocation it ended in: the job sees its own ended
    attempt (same job id and restart count) and does not; a requeued run of the job does."""
    root = tmp_path / "ckpt"
    monkeypatch.setenv("SLURM_JOB_ID", "60")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    entry, _ = attempts.begin(root, RUN, attempt=1, gpus=0, cores=1)
    assert attempts.ran_in_this_allocation(root, RUN) is None  # still running
    attempts.end(root, entry, attempts.EXIT_REQUEUE)
    assert attempts.ran_in_this_allocation(root, RUN)["attempt"] == 1
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert attempts.ran_in_this_allocation(root, RUN) is None


def test_a_staging_lease_of_an_ended_job_is_reclaimed_before_its_heartbeat_goes_stale(
    fake_squeue, monkeypatch, prepared_demo
):
    """Issue 51 item 2: a job SIGKILLed with its node's copy leaves its heartbeat file, fresh
    for STALE_S (10 min): squeue says at once that the job ended; a local launcher's pid
    that is gone says so too. Where neither can say, the heartbeat decides."""
    import socket
    import subprocess
    import sys

    from imagenet_ddp.data import stage

    tmp_path = fake_squeue
    (tmp_path / "squeue.out").write_text("RUNNING\n")
    assert holders.beat_owner_ended("/ckpt/alive/41") is False
    (tmp_path / "squeue.err").write_text("slurm_load_jobs error: Invalid job id specified\n")
    assert holders.beat_owner_ended("/ckpt/alive/41") is True
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    calls = (tmp_path / "squeue.calls").read_text()
    assert holders.beat_owner_ended("/ckpt/alive/41") is False, "this job's own"
    assert (tmp_path / "squeue.calls").read_text() == calls, "its own: squeue not asked"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    here = f"/ckpt/alive/local-{socket.gethostname()}"
    assert holders.beat_owner_ended(f"{here}-{gone}") is True
    assert holders.beat_owner_ended(f"{here}-{os.getpid()}") is False
    assert holders.beat_owner_ended(f"/ckpt/alive/local-othernode-{gone}") is False
    # the staging: the ended job's lease goes now, its fresh heartbeat notwithstanding
    beat = tmp_path / "ckpt" / "alive" / "57"
    beat.parent.mkdir(parents=True)
    beat.touch()
    scratch = tmp_path / "scratch"
    report = stage.stage_dataset(prepared_demo["val"], scratch, verify="size", lease=str(beat))
    assert stage.reclaim_stale_leases(scratch) == [], "without squeue: the heartbeat is fresh"
    assert stage.reclaim_stale_leases(scratch, holders.beat_owner_ended) == [
        Path(report["dest"])
    ]  # fmt: skip
    assert not Path(report["dest"]).exists()


def test_a_job_knows_whether_the_snakemake_that_submitted_it_still_runs(tmp_path, monkeypatch):
    """The main Snakemake's heartbeat (the Snakefile's onstart, holders.watch_invocation) in
    <checkpoint_dir>/.controllers, its name given to its jobs in $IMAGENET_DDP_CONTROLLER_BEAT:
    a job's Snakemake runs while its file beats and its pid (on this host) runs; it has ended
    where the pid is gone, the file is silent for STALE_S (another host's, where only the beat
    can say) or removed (onsuccess, onerror: stop_watching). Where none is named (a module's
    consumer: Snakemake runs only the main Snakefile's handlers; --no-hooks) nothing is known,
    and a job delivers as before. Stale files of earlier invocations go at the next start."""
    import socket
    import subprocess
    import sys

    from imagenet_ddp.io import STALE_S

    checkpoints = tmp_path / "ckpt"
    monkeypatch.setenv(holders.CONTROLLER_BEAT, "")  # restored (unset) after the test
    assert holders.invocation_watched(checkpoints) is True  # unknown
    named = {holders.CONTROLLER_BEAT: "local-login1-7"}  # no folder here: another filesystem
    assert holders.invocation_watched(checkpoints, named) is True
    folder = checkpoints / holders.CONTROLLERS_DIR
    folder.mkdir(parents=True)
    stale = folder / "local-elsewhere-1"
    stale.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    holders.watch_invocation(checkpoints)
    try:
        name = os.environ[holders.CONTROLLER_BEAT]
        assert name == f"local-{socket.gethostname()}-{os.getpid()}"
        path = folder / name
        assert path.is_file() and not stale.exists()
        assert holders.invocation_watched(checkpoints) is True  # this process: alive, beating
        old = time.time() - STALE_S - 5
        os.utime(path, (old, old))
        assert holders.invocation_watched(checkpoints) is False  # silent
    finally:
        holders.stop_watching()
    assert not path.exists() and holders.invocation_watched(checkpoints) is False  # it ended
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    gone = f"local-{socket.gethostname()}-{dead}"
    (folder / gone).touch()  # beating a second ago, but its process has ended on this host
    assert holders.invocation_watched(checkpoints, {holders.CONTROLLER_BEAT: gone}) is False
    elsewhere = folder / "local-node7-123"
    elsewhere.touch()  # another host's: its beat decides, silent 5 minutes is not ended
    os.utime(elsewhere, (time.time() - 300, time.time() - 300))
    assert holders.invocation_watched(checkpoints, {holders.CONTROLLER_BEAT: elsewhere.name})
