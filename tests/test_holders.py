"""One train job of a run at a time (imagenet_ddp.jobs.holders), with a fake squeue: the
submitting Snakemake's view (which live jobs hold a run) and the job's own wait. On the real
SLURM cluster: tests/test_slurm_e2e.py (its controller killed and restarted mid-train)."""

from __future__ import annotations

import time

import pytest

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
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "squeue.out").write_text("")
    return tmp_path


def open_entry(root, job_id: str, alive: float) -> None:
    """An attempt of job ``job_id`` that its launcher has not closed (it is training)."""
    entry = {"attempt": 1, "key": attempts.settings_key(RUN), "slurm_job_id": job_id,
             "host": "node1", "started": alive - 60, "alive": alive, "ended": None,
             "outcome": "running"}  # fmt: skip
    attempts._save(root, [entry])


def test_live_jobs_are_this_users_unended_jobs_and_none_where_squeue_cannot_answer(fake_squeue):
    (fake_squeue / "squeue.out").write_text(
        "12|RUNNING|rule_train_wildcards_r|/w\n13|PENDING|rule_evaluate_wildcards_r|/w\n"
        "14|COMPLETED|rule_train_wildcards_r|/w\n15|COMPLETING|a|b|c\n"
    )
    assert holders.live_jobs() == {
        "12": {"state": "RUNNING", "comment": "rule_train_wildcards_r", "workdir": "/w"},
        "13": {"state": "PENDING", "comment": "rule_evaluate_wildcards_r", "workdir": "/w"},
        "15": {"state": "COMPLETING", "comment": "a", "workdir": "b|c"},
    }
    assert "--me" in (fake_squeue / "squeue.calls").read_text()
    (fake_squeue / "squeue.err").write_text("slurm_load_jobs error: Unable to contact slurmctld")
    assert holders.live_jobs() is None


def test_the_runs_holders_are_its_train_jobs_from_this_workflow_and_its_open_entries(tmp_path):
    workdir, root = tmp_path / "w", tmp_path / "ckpt"
    workdir.mkdir()
    open_entry(root, "30", time.time())
    live = {
        "20": {"state": "PENDING", "comment": "rule_train_wildcards_r", "workdir": str(workdir)},
        "21": {"state": "RUNNING", "comment": "rule_train_wildcards_r", "workdir": "/other"},
        "22": {"state": "RUNNING", "comment": "rule_train_wildcards_r2", "workdir": str(workdir)},
        "23": {"state": "RUNNING", "comment": "rule_evaluate_wildcards_r", "workdir": str(workdir)},
        "30": {"state": "RUNNING", "comment": "ours", "workdir": "/anywhere"},
        "100": {"state": "RUNNING", "comment": "rule_train_wildcards_r", "workdir": str(workdir)},
    }  # fmt: skip
    assert holders.holders_ahead(root, RUN, "r", workdir, live) == ["20", "30", "100"]
    # another rule's job: the same rule and wildcards, from this workflow (the executor's
    # comment: rule_<rule>[_wildcards_<values joined by _, / as _>])
    assert holders.executor_comment("evaluate", ["r"]) == "rule_evaluate_wildcards_r"
    assert holders.executor_comment("prepare", ["a/b", "c"]) == "rule_prepare_wildcards_a_b_c"
    assert holders.executor_comment("aggregate", []) == "rule_aggregate"
    assert holders.same_jobs(live, "rule_evaluate_wildcards_r", workdir) == ["23"]
    assert holders.dependency_flag(["20", "30"]) == "--dependency=afterany:20:30"
    # an open entry of a job SLURM no longer runs (killed with its launcher) holds nothing
    assert holders.holders_ahead(root, RUN, "r", workdir, {}) == []


def test_a_job_waits_while_another_live_job_holds_the_run_then_goes_on(fake_squeue, monkeypatch):
    root = fake_squeue / "ckpt"
    open_entry(root, "40", time.time())
    (fake_squeue / "squeue.out").write_text("RUNNING\n")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    lines, sleeps = [], []

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 2:  # job 40 ends: its launcher closes its entry
            (fake_squeue / "squeue.out").write_text("")

    waited = holders.wait_for_holders(root, RUN, log=lines.append, seconds=5, sleep=sleep)
    assert waited == 10 and sleeps == [5, 5]
    assert len(lines) == 2, lines
    assert "job 40 (attempt 1 on node1, RUNNING) still trains it" in lines[0], lines
    assert "waits for it to end before it trains" in lines[0] and "after 10 s" in lines[1]
    # its own entry (a requeued job keeps its id) holds nothing
    open_entry(root, "41", time.time())
    (fake_squeue / "squeue.out").write_text("RUNNING\n")
    assert holders.wait_for_holders(root, RUN, log=lines.append, sleep=pytest.fail) == 0


def test_without_squeue_a_fresh_heartbeat_holds_the_run_and_a_stale_one_does_not(
    fake_squeue, monkeypatch
):
    root = fake_squeue / "ckpt"
    (fake_squeue / "squeue.err").write_text("squeue: error: Unable to contact slurm controller")
    open_entry(root, "50", time.time() - holders.STALE_SECONDS - 5)  # killed with its launcher
    assert holders.wait_for_holders(root, RUN, log=pytest.fail, sleep=pytest.fail) == 0
    open_entry(root, "50", time.time())
    lines = []

    def sleep(seconds):  # its heartbeat stops
        open_entry(root, "50", time.time() - holders.STALE_SECONDS - 5)

    assert holders.wait_for_holders(root, RUN, log=lines.append, seconds=1, sleep=sleep) == 1
    assert "job 50 (attempt 1 on node1, heartbeat)" in lines[0], lines
    # a purged job id: ended, whatever its heartbeat says
    (fake_squeue / "squeue.err").write_text("slurm_load_jobs error: Invalid job id specified")
    open_entry(root, "50", time.time())
    assert holders.wait_for_holders(root, RUN, log=pytest.fail, sleep=pytest.fail) == 0


def test_two_jobs_that_start_at_once_train_one_after_the_other(tmp_path, monkeypatch):
    """Two jobs of a run started together, neither with a dependency on the other (two
    controllers, or one restarted within seconds): each finds the run free and records its
    attempt a second later (a check that is not held with the record would let both train).
    Under the lock the second sees the first's open entry and starts when it has ended."""
    import subprocess
    import sys
    import textwrap

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # no squeue asked: the heartbeat holds
    root = tmp_path / "ckpt"
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from imagenet_ddp.jobs import attempts, holders
            run, root = {RUN!r}, {str(root)!r}
            check = holders.wait_for_holders

            def slow_check(*args, **kwargs):  # a second between the check and the record
                waited = check(*args, **kwargs)
                time.sleep(1.0)
                return waited

            holders.wait_for_holders = slow_check
            begin = lambda: attempts.begin(root, run, attempt=1, gpus=0, cores=1)
            entry, _ = holders.begin_when_free(root, run, begin, seconds=0.2)
            print("began", time.time(), flush=True)
            time.sleep(2.0)  # trains
            attempts.end(root, entry, 0)
            print("ended", time.time(), flush=True)
            """
        )
    )
    jobs = [
        subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [job.communicate(timeout=60)[0] for job in jobs]
    spans = sorted(
        tuple(float(line.split()[1]) for line in out.splitlines() if line[:5] in ("began", "ended"))
        for out in outputs
    )
    assert sum("still trains it" in out for out in outputs) == 1, outputs  # the second waited
    assert [job.returncode for job in jobs] == [0, 0]
    (began_1, ended_1), (began_2, _) = spans
    assert began_2 >= ended_1 > began_1, spans
    record = attempts.load(root)
    assert [(a["attempt"], a["outcome"]) for a in record] == [(1, "completed"), (2, "completed")]
