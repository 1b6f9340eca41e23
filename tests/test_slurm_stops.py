"""A run longer than its allocations, through `snakemake --profile profiles/slurm` on the real
local SLURM cluster: every way a running training job is told to stop writes a checkpoint,
exits for requeue (75) and is recorded `stopped`; one invocation resubmits the run until it is
done (imagenet_ddp.jobs.attempts), its cost and accounting count every allocation, and its final
weights are bitwise those of an uninterrupted run (deterministic mode, CPU, gloo, one thread
per rank), trained meanwhile at the lowest CPU priority.

One invocation trains a 2-node run (its ranks are an srun step started by the launcher in the
batch step, as every multi-rank job) and the test stops four of its jobs in turn:

1. `kill` (SIGTERM) of the launcher alone: it must not pass SIGTERM to srun, which would
   SIGKILL the step; it passes SIGUSR1, which srun forwards to the ranks unchanged;
2. `scancel <job>`: SIGTERM to every step, the batch step (srun, the launcher) included, as
   preemption and a time limit without `--signal` deliver it (docs/slurm-notes.md section 7);
   the test cluster tracks processes with cgroups (`proctrack/cgroup`, as most sites), so
   slurmstepd SIGKILLs the batch step once its shell died of the SIGTERM: the launcher never
   closes its entry, and the next job records it `stopped` from the ranks' stop records;
3. `scancel -s TERM --batch <job>`: SIGTERM to the batch shell alone, which dies of it, so the
   job ends and SLURM sends the other steps SIGTERM; this job has one rank (below), so the
   rule's shell runs inside the executor's own `srun -n1` step, next to Snakemake: the signal
   reaches Snakemake, the rule's shell, the launcher, the rank and its loader worker;
4. the time limit: sbatch `--signal=USR1@30` (as profiles/slurm asks, with a shorter warning
   for a 2-minute limit) sends SIGUSR1 to the ranks' step 30-60 s before the limit;

then lets it finish in one more job, whose time limit the test raises (as a user would
`scontrol update` a run's last job), so that the test's path and length do not depend on how
many epochs each 2-minute job trains.

Before the second stop, the test drains the second node, as a node failure or a busy queue
leaves a run fewer nodes than it asks for. The run accepts 1 node as well (`fallback_nodes`):
its next job, on 2 nodes, waits in the queue until the test cancels it (a long queue wait); the
resubmission asks for 1 node and trains there with 2 micro-batches per step, the same global
batch: it is the third, and the node comes back before it is stopped, so the run continues on
2 nodes and finishes there.

Meanwhile a second invocation in the same directory trains a run whose ranks fail at start on
every node (it asks for a GPU; the nodes' fake GPUs have no CUDA behind them, as a node with a
broken driver): it is retried once with its GPUs, and its next retry, which refuses, is
submitted as one task without GPUs.

What SLURM does in each case, read in its source: docs/slurm-notes.md section 7. The time limit
without `--signal` (SIGTERM at the limit, state TIMEOUT) delivers the signal as `scancel` does;
docs/slurm-notes.md says what was shown of it on this cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch

from imagenet_ddp.data.prepared_layout import resolve_prepared
from imagenet_ddp.jobs import attempts
from imagenet_ddp.settings.geometry import on_nodes
from tests.test_resume import CONFIG, assert_bitwise_equal, torchrun, weights
from tests.test_slurm_e2e import TEST_PROFILE
from tests.workflow_helpers import SNAKEMAKE, copy_workflow, shown_specs, snakemake

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

# 2 nodes x 1 rank, one loader worker, batch 2, crop 24, fp32: 81 steps, ~11 s per epoch on an
# idle 2-core machine (measured in CI; ~8 s on a faster one). The first three jobs are stopped
# as soon as they train (the third after 2 epochs on 1 node, its time limit raised so that its
# own warning never comes first: 2-4 epochs done by then); the
# fourth trains until its warning, 60-90 s after its start (30-60 s before its 2-minute limit:
# slurmctld checks every 30 s), 4-9 epochs after start-up, so it must have more left than
# that (with 8 epochs a fast machine's fourth job finished before its warning: seen in CI);
# the next, its limit raised by the test, finishes.
RUN = {key: CONFIG[key] for key in CONFIG if key != "run"} | {
    "name": "stops", "nodes": 2, "tasks_per_node": 1, "cpus_per_task": 1, "epochs": 12,
    "max_allocations": 12, "batch_size": 2, "crop_size": 24, "eval_resize": 24, "workers": 1,
    "precision": "fp32",  # deterministic CPU bf16 runs without oneDNN (~25x slower per step)
    "fallback_nodes": [1],  # elastic: on 1 node with accumulation 2
}  # fmt: skip
# Fails at start on every node: a GPU run where CUDA is unusable (a broken driver); its
# invocation's only run, so the rule's retries are max_allocations - 1 = 2. Two loader workers:
# none on a GPU run is refused at the dry-run (run_checks._loader_workers_problem).
CRASH = {**RUN, "name": "crash", "epochs": 1, "gpus_per_node": 1, "max_allocations": 3,
         "workers": 2, "fallback_nodes": []}  # fmt: skip
RUNTIME_MINUTES = 2  # the warning comes 60-90 s after the start, the ranks long trained
WARNING_SECONDS = 30  # slurmctld sends it 30-60 s before the limit (its 30 s check)
SLURM = ["--profile", "profiles/slurm", "--workflow-profile", str(TEST_PROFILE)]
PROGRESS = re.compile(r"epoch \d+ step \d+/\d+")


def job_log(workdir: Path, job: int) -> Path | None:
    found = list((workdir / "logs/train/stops").glob(f"job-{job}-*.log"))
    return found[0] if found else None


def poll(find, run: subprocess.Popen, workdir: Path, timeout: float, what: str, more=str):
    """``find()``'s first answer other than None, asked every second; fails with Snakemake's
    output if it exits first, and after ``timeout`` seconds (with ``more()``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.poll() is not None:
            said = (workdir.parent / "snakemake.out").read_text(errors="replace")[-3000:]
            raise AssertionError(f"snakemake exited {run.returncode} before {what}:\n{said}")
        found = find()
        if found is not None:
            return found
        time.sleep(1)
    raise AssertionError(f"no {what} within {timeout} s{more()}")


def running_train_job(cluster, workdir: Path, seen: set[int], proc, timeout: float = 600) -> int:
    """The next train job (not in ``seen``) once its ranks print progress."""

    def find() -> int | None:
        for line in cluster.run("squeue", "-h", "-o", "%i|%k|%T").stdout.splitlines():
            job, comment, state = line.split("|")
            if comment.startswith("rule_train") and state == "RUNNING" and int(job) not in seen:
                log = job_log(workdir, int(job))
                if log is not None and PROGRESS.search(log.read_text(errors="replace")):
                    return int(job)
        return None

    return poll(find, proc, workdir, timeout, "new train job training",
                lambda: f":\n{cluster.logs()}")  # fmt: skip


def launcher_pid(workdir: Path, job: int) -> int:
    """The `imagenet-ddp train` process of SLURM job ``job`` in this workdir (the rule's shell
    exec'd it). By its job id: the crash run's launchers (the same workdir, beside it) are
    `imagenet-ddp train` processes too."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ours = b"--job" in argv and (proc / "cwd").resolve() == workdir
            environ = (proc / "environ").read_bytes().split(b"\0")
            ours = ours and f"SLURM_JOB_ID={job}".encode() in environ
            if ours and b"train" in argv and any(a.endswith(b"imagenet-ddp") for a in argv):
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError("launcher process not found")


def reference_run(prepared, workdir, out, settings) -> subprocess.CompletedProcess:
    """The run uninterrupted, at nice 19 (it trains while the SLURM run waits)."""
    proc = torchrun(prepared, workdir / "results/split", out / "out", out / "ckpt",
                    config=settings, popen=True)  # fmt: skip
    os.setpriority(os.PRIO_PROCESS, proc.pid, 19)  # before it starts its ranks (inherited)
    stdout, _ = proc.communicate(timeout=1500)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, "")


def crash_invocation(workdir) -> subprocess.CompletedProcess:
    """The run that fails at start, in its own invocation (beside the other: --nolock; the
    outputs differ) with a config of its own: its runs alone. A --set-resources on the command
    line replaces the profile's set-resources whole, so mem_mb is restated (without it the job
    asks default-resources' 500 MB, which the dry-run's memory check refuses), and so is the
    stop warning: the default's 300 s lead within a 5-minute limit reached a job as it started,
    and killed its one task before its handlers were in place (seen once; the
    dry-run now refuses such a limit)."""
    (workdir / "crash.yaml").write_text(json.dumps({"runs": [CRASH]}))  # YAML
    return snakemake(
        workdir, "results/runs/crash/model.pt", *SLURM, "--nolock", "--configfile", "crash.yaml",
        "--set-resources", "train:runtime=5", "train:mem_mb=4000",
        f"train:slurm_extra='--signal=USR1@{WARNING_SECONDS}'", check=False, timeout=1500,
    )  # fmt: skip


def sacct_jobs(cluster, log: str, fields: str) -> list[list[str]]:
    """The train jobs of the invocation whose output is ``log``: ``fields`` of each."""
    run_uuid = re.search(r"SLURM run ID: (\S+)", log).group(1)
    # -S: without it (and without -j) sacct lists only jobs since today's midnight.
    out = cluster.run(
        "sacct", "-X", "-n", "-P", "-S", "2000-01-01", "--name", run_uuid, "-o", fields
    ).stdout
    return [line.split("|") for line in out.splitlines() if "rule_train" in line]


def stop_four_ways(cluster, workdir: Path, run: subprocess.Popen) -> dict[str, tuple[int, str]]:
    """Each way of stopping, on the next train job once it trains: its job id and final state.
    The second node is drained before the second stop: the next job (2 nodes) waits in the
    queue until it is cancelled, and its resubmission, on 1 node, is the third; the node comes
    back before that one is stopped, for the jobs after it."""
    node = cluster.node_names[1]

    def drain_then_scancel(job: int) -> None:
        cluster.run("scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=test")
        cluster.run("scancel", str(job))

    def node_back_then_scancel_batch(job: int) -> None:
        cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
        cluster.run("scancel", "-s", "TERM", "--batch", str(job))

    stops = {
        "kill": lambda job: os.kill(launcher_pid(workdir, job), signal.SIGTERM),
        # the job's end, as preemption and a time limit without --signal deliver it too
        "scancel": drain_then_scancel,
        # a one-rank job: its launcher inside the executor's srun step, not the batch step
        "scancel --batch": node_back_then_scancel_batch,
        "time limit": lambda job: None,  # its --signal warning comes by itself
    }
    stopped: dict[str, tuple[int, str]] = {}
    for how, stop in stops.items():
        seen = {j for j, _ in stopped.values()}
        if how == "scancel --batch":  # a long queue wait: cancel the job waiting for 2 nodes
            waiting, reason = pending_train_job(cluster, workdir, seen, run)
            cluster.run("scancel", str(waiting))
            seen.add(waiting)
            # Its resubmission trains on 1 node at half the speed: its own warning (60-90 s
            # after its start) could stop it before the two epochs this test waits for (seen:
            # "no 2 epochs done by job 7 within 300 s"). A longer limit leaves its stop to the
            # test, always, right after those epochs.
            third = next_train_job(cluster, workdir, seen, run)
            cluster.run("scontrol", "update", f"JobId={third}",
                        f"TimeLimit={RUNTIME_MINUTES + 5}")  # fmt: skip
        job = running_train_job(cluster, workdir, seen, run)
        if how == "scancel --batch":  # on 1 node: a whole epoch there first (throughput, shape)
            nodes = int(cluster.run("squeue", "-h", "-j", str(job), "-o", "%D").stdout.split()[0])
            epochs_done(workdir, job, 2, run)
        stop(job)
        stopped[how] = (job, cluster.wait_job(job, timeout=RUNTIME_MINUTES * 60 + 120))
    stopped["waiting"] = (waiting, reason)
    stopped["nodes of the third"] = (nodes, "")
    return stopped


def epochs_done(workdir: Path, job: int, count: int, proc, timeout: float = 300) -> None:
    """Wait until ``job``'s log says ``count`` epochs done (the first may be one it resumed)."""

    def find() -> bool | None:
        text = job_log(workdir, job).read_text(errors="replace")
        return True if len(re.findall(r"^epoch \d+ done", text, flags=re.M)) >= count else None

    poll(find, proc, workdir, timeout, f"{count} epochs done by job {job}")


def next_train_job(cluster, workdir: Path, seen: set[int], proc, timeout: float = 300) -> int:
    """The next train job of the stops run (not in ``seen``), pending or running."""

    def find() -> int | None:
        for line in cluster.run("squeue", "-h", "-o", "%i|%k").stdout.splitlines():
            job, comment = line.split("|")
            if comment.startswith("rule_train") and "stops" in comment and int(job) not in seen:
                return int(job)
        return None

    return poll(find, proc, workdir, timeout, "the next train job")


def pending_train_job(cluster, workdir: Path, seen: set[int], proc, timeout: float = 300):
    """The next train job of the stops run (not in ``seen``) that waits in the queue: its id and
    squeue's reason."""

    def find() -> tuple[int, str] | None:
        for line in cluster.run("squeue", "-h", "-o", "%i|%k|%T|%r").stdout.splitlines():
            job, comment, state, reason = line.split("|")
            ours = comment.startswith("rule_train") and "stops" in comment
            if ours and state == "PENDING" and int(job) not in seen:
                return int(job), reason
        return None

    return poll(find, proc, workdir, timeout, "train job waiting in the queue")


def assert_crash_retried_once_then_refused_without_gpus(cluster, workdir, crashing) -> None:
    """Two jobs with its GPUs, then one task without GPUs that refuses with their error; no
    more (its retries end there)."""
    crash_log = crashing.stdout + crashing.stderr
    assert crashing.returncode != 0, crash_log[-4000:]
    jobs = sacct_jobs(cluster, crash_log, "JobID,State,NNodes,ReqTRES,Comment")
    shapes = [(state, nnodes, "gres/gpu=2" in tres) for _, state, nnodes, tres, _ in jobs]
    assert shapes == [("FAILED", "2", True)] * 2 + [("FAILED", "1", False)], jobs
    record = attempts.load(workdir / "results/checkpoints/crash")
    assert [a["outcome"] for a in record] == ["failed", "failed", "refused"], record
    assert "CUDA is unusable" in record[0]["error"], record[0]
    assert record[2]["error"].startswith("not retrying") and "CUDA is unusable" in crash_log


def test_every_way_of_stopping_a_job_checkpoints_and_the_run_finishes_in_one_invocation(
    slurm_cluster, tmp_path
):
    stage = slurm_cluster.node_scratch_config()  # the nodes' own tmpfs, as a site user sets it
    workdir = copy_workflow(tmp_path / "wf", runs=[RUN], stage=stage).resolve()
    target = "results/prepared/train.json"  # names the copy in prepare.dir
    # Every data stage, data_content included: the two invocations below share the workdir
    # (--nolock), and each would otherwise run the missing ones too, one rewriting the records
    # the other's rerun key is made of (its key job then ran with the placeholder).
    data = (target, "results/split/train.csv", "results/data/content.json")
    snakemake(workdir, "--profile", "profiles/local", *data)  # (the data steps are not tested)
    prepared = resolve_prepared(workdir / target)
    # with the profile's rerun triggers, as the run below (without them, Snakemake's `input`
    # trigger replans index: its verify gate is an input only until verify has run)
    shown = snakemake(
        workdir, "-n", "-p", "--profile", "profiles/local", "results/runs/stops/model.pt"
    ).stdout
    settings = shown_specs(shown, "train", workdir)[0]["run"]

    # Its output goes to a file: a pipe nobody reads fills up (64 KB: the shell commands it
    # prints at each resubmission) and blocks Snakemake before it notices a job's end.
    out = (tmp_path / "snakemake.out").open("w")
    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(reference_run, prepared, workdir, tmp_path / "ref", settings)
        crashing = pool.submit(crash_invocation, workdir)
        run = subprocess.Popen(
            [*SNAKEMAKE, *SLURM, "results/runs/stops/accounting.json", "--set-resources",
             f"train:runtime={RUNTIME_MINUTES}", "train:mem_mb=2000",
             f"train:slurm_extra='--signal=USR1@{WARNING_SECONDS}'"],
            cwd=workdir, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            stopped = stop_four_ways(slurm_cluster, workdir, run)
            waiting, reason = stopped.pop("waiting")
            elastic = {"waiting": waiting, "reason": reason,
                       "on_one": stopped["scancel --batch"][0],
                       "nodes": stopped.pop("nodes of the third")[0]}  # fmt: skip
            # Then the run ends in one more job, its limit raised as the third's: else each
            # 2-minute job, stopped by its own warning, trains 2-3 epochs and waits for the
            # next (plugin's status checks, queue), and the test ran past 1,200 s (seen alone
            # on an idle machine, 2026-11-27).
            seen = {waiting, *(job for job, _ in stopped.values())}
            last = next_train_job(slurm_cluster, workdir, seen, run)
            slurm_cluster.run("scontrol", "update", f"JobId={last}",
                              f"TimeLimit={RUNTIME_MINUTES + 8}")  # fmt: skip
            run.wait(timeout=900)  # then it runs to the end
        finally:
            node = slurm_cluster.node_names[1]
            slurm_cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
            if run.poll() is None:
                run.send_signal(signal.SIGINT)  # cancels its jobs
                try:
                    run.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    run.kill()
                    run.wait()
            out.close()
            for line in slurm_cluster.run("squeue", "-h", "-o", "%i|%k").stdout.splitlines():
                if line.split("|")[1].startswith("rule_train") and "crash" not in line:
                    slurm_cluster.run("scancel", line.split("|")[0], check=False)
        reference, crashing = reference.result(), crashing.result()
    output = (tmp_path / "snakemake.out").read_text(errors="replace")
    assert run.returncode == 0, output[-4000:]
    # proctrack/cgroup (the test cluster where the machine allows, as most sites): the batch
    # shell's exit SIGKILLs the batch step, the launcher and its srun with it (the multi-rank
    # job of `scancel`: its launcher runs in the batch step)
    sigkilled = {"scancel"} if slurm_cluster.proctrack == "cgroup" else set()
    assert_each_stop_checkpointed_and_the_next_job_resumed(workdir, stopped, output, sigkilled)
    assert_the_run_continued_on_one_node(slurm_cluster, workdir, elastic, output)
    assert_every_allocation_counted(slurm_cluster, workdir, output, elastic["waiting"])

    # The run as the workflow resolved it (train_defaults, schema defaults): the same settings,
    # on the node count of its last job.
    run_dir = workdir / "results/runs/stops"
    last_nodes = int(attempts.load(workdir / "results/checkpoints/stops")[-1]["shape"][0])
    spec = json.loads((run_dir / "job_spec.json").read_text())["run"]
    assert spec == on_nodes(settings, last_nodes)
    assert reference.returncode == 0, reference.stdout[-3000:]
    assert_bitwise_equal(weights(run_dir), weights(tmp_path / "ref" / "out"))
    assert torch.load(run_dir / "model.pt", weights_only=False)["config"]["epochs"] == RUN["epochs"]

    assert_crash_retried_once_then_refused_without_gpus(slurm_cluster, workdir, crashing)


def assert_each_stop_checkpointed_and_the_next_job_resumed(
    workdir, stopped, output, sigkilled=frozenset()
) -> None:
    """``sigkilled``: the stops whose launcher SLURM SIGKILLed with the batch step: the next
    job closed its entry (no exit code) as stopped, from the ranks' own stop records."""
    record = attempts.load(workdir / "results/checkpoints/stops")
    ids = [str(job) for job, _ in stopped.values()]
    assert [a.get("slurm_job_id") for a in record[:4]] == ids, (record, output[-4000:])
    outcomes = {how: a["outcome"] for how, a in zip(stopped, record, strict=False)}
    assert outcomes == dict.fromkeys(stopped, "stopped"), (outcomes, stopped, output[-4000:])
    # One path: the four stopped jobs, each with a checkpoint, then one (its limit raised)
    # completed the run.
    assert len(record) == 5 and record[-1]["outcome"] == "completed", record
    assert all(a["outcome"] == "stopped" and a["last_checkpoint"] for a in record[:-1]), record
    codes = {how: a["exit_code"] for how, a in zip(stopped, record, strict=False)}
    # No exit code: the launcher was killed and the next job closed its entry. Where the
    # ranks' stop takes longer than KillWait (5 s here; seen on a loaded machine) SLURM also
    # kills the launcher of `scancel --batch` (its step gets the job's SIGTERM too).
    allowed = {"kill": {75}, "time limit": {75}, "scancel --batch": {75, None}}
    allowed["scancel"] = {None} if "scancel" in sigkilled else {75, None}
    assert all(codes[how] in allowed[how] for how in stopped), (codes, record)
    # every rank that stopped recorded it (attempts.record_stop): the first four were signalled
    signals = {
        how: (a.get("stop") or {}).get("signal") for how, a in zip(stopped, record, strict=False)
    }
    assert all(signals.values()), (signals, record)
    starts = [(a["start"]["epoch"], a["start"]["step"]) for a in record]
    # Each of the four trained before its stop, so the next resumed further on.
    assert starts[:5] == sorted(set(starts[:5])) and starts == sorted(starts), starts
    logs = {how: job_log(workdir, job).read_text(errors="replace")
            for how, (job, _) in stopped.items()}  # fmt: skip
    for how, text in logs.items():
        assert "killed by signal" not in text, (how, text)
        if how in sigkilled:  # its srun, which carried the ranks' output, died with it
            assert "stop signal" not in text and signals[how] == "SIGTERM", (how, text[-3000:])
            continue
        assert re.search(r"interrupted( by SIG\w+)? (at|after) epoch", text), (how, text[-3000:])
    # No SIGKILL where nothing but our own signals stop the step. After scancel's SIGTERM,
    # SLURM kills what still runs KillWait (5 s here) later: a rank slow to tear down on a
    # loaded machine may be killed after its checkpoint, which the launcher records stopped.
    for how in ("kill", "time limit"):
        assert "task 0: Killed" not in logs[how], (how, logs[how])
    for how in ("scancel", "scancel --batch"):
        killed = "task 0: Killed" in logs[how] or "task 1: Killed" in logs[how]
        recorded = "stopped, the next job resumes" in logs[how] or codes[how] is None
        assert not killed or recorded, (how, logs[how])  # None: from the ranks' records
    # The launcher passed its SIGTERM on as SIGUSR1; the time limit's warning reached the ranks.
    assert "stop signal SIGTERM: passed on to srun as SIGUSR1" in logs["kill"], logs["kill"]
    assert "interrupted by SIGUSR1" in logs["time limit"], logs["time limit"][-3000:]
    assert stopped["scancel"][1].startswith("CANCELLED"), stopped
    assert stopped["time limit"][1] == "FAILED", stopped  # exit 75 before the limit, not TIMEOUT


def assert_the_run_continued_on_one_node(cluster, workdir, elastic, output) -> None:
    """The job cancelled in the queue asked for 2 nodes and never started; its resubmission ran
    on 1 node with accumulation 2 (the same global batch); both shapes are in the attempt
    record and the cost."""
    assert elastic["nodes"] == 1, elastic
    assert re.search(r"DRAINED|ReqNodeNotAvail", elastic["reason"]), elastic
    waiting = cluster.run("sacct", "-X", "-n", "-P", "-j", str(elastic["waiting"]), "-o",
                          "State,AllocNodes,ElapsedRaw").stdout.strip().split("|")  # fmt: skip
    assert waiting[0].startswith("CANCELLED") and waiting[1:] == ["0", "0"], waiting
    record = attempts.load(workdir / "results/checkpoints/stops")
    ids = [a["slurm_job_id"] for a in record]
    assert str(elastic["waiting"]) not in ids, ids
    one = record[ids.index(str(elastic["on_one"]))]
    assert (one["shape"], one["accumulation"], one["snakemake_attempt"]) == ("1x1", 2, 4), one
    assert record[ids.index(str(elastic["on_one"])) - 1]["shape"] == "2x1", record
    log = job_log(workdir, elastic["on_one"]).read_text(errors="replace")
    assert "this allocation has 1 of its 2 nodes: accumulation 2" in log, log[-3000:]
    # One rank: no `mpi`, so the rule's shell ran inside the executor's `srun -n1` step, beside
    # Snakemake, which the job's SIGTERM reached too; the rank ran in a step of its own.
    assert "--overlap" in log, log[-3000:]
    run_dir = workdir / "results/runs/stops"
    metrics = json.loads((run_dir / "train_metrics.json").read_text())
    shapes = [a["shape"] for a in metrics["cost"]["attempts"]]
    assert "1x1" in shapes and "2x1" in shapes, shapes
    # its whole epoch on 1 node: a row of that shape, and throughput per shape, never averaged
    assert "1x1" in pd.read_csv(run_dir / "history.csv")["shape"].tolist(), output[-3000:]
    assert {"1x1", "2x1"} <= set(metrics["throughput_by_shape"]), metrics["throughput_by_shape"]


def assert_every_allocation_counted(cluster, workdir, output, waiting: int) -> None:
    """The cost record and the accounting (sacct) count every job that started (the one
    cancelled in the queue had no allocation); each job's log is kept."""
    train = [fields[:2] for fields in sacct_jobs(cluster, output, "JobID,State,Comment")
             if fields[0] != str(waiting)]  # fmt: skip
    assert len(train) == 5 and train[-1][1] == "COMPLETED", (train, output[-4000:])
    run_dir = workdir / "results/runs/stops"
    cost = json.loads((run_dir / "train_metrics.json").read_text())["cost"]
    assert cost["allocations"] == len(train)
    assert cost["slurm_job_ids"] == [job_id for job_id, _ in train]
    assert cost["core_hours"] == pytest.approx(sum(a["core_hours"] for a in cost["attempts"]))
    assert cost["core_hours_lost"] >= 0 and cost["this_job"]["core_hours"] < cost["core_hours"]
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["available"] and accounting["allocations"] == len(train)
    assert accounting["job_ids"] == cost["slurm_job_ids"]
    assert accounting["core_hours"] == pytest.approx(
        sum(job["core_hours"] for job in accounting["jobs"])
    )
    assert [job["state"] for job in accounting["jobs"]] == [state for _, state in train]
    # Every job's log kept (logs/train/<run>/), the run's log linking to the last.
    job_of = {int(re.match(r"job-(\d+)-", p.name).group(1)): p
              for p in (workdir / "logs/train/stops").glob("job-*.log")}  # fmt: skip
    assert sorted(job_of) == [int(j) for j, _ in train], sorted(job_of)
    logs = [job_of[int(j)] for j, _ in train]
    assert (workdir / "logs/train/stops.log").resolve() == logs[-1].resolve()
    assert all("resuming from" in log.read_text() for log in logs[1:]), logs
