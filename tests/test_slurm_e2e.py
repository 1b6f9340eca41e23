"""End to end on the local SLURM cluster: `snakemake --profile profiles/slurm` on the tiny demo.

The cluster (2 nodes x 2 CPUs x 2 fake GPUs, accounting in slurmdbd) comes from the
`slurm_cluster` session fixture; the test-only profile layer tests/slurm_cluster/profile points
the real profile at it. Three runs cover the train rule's three SLURM shapes: 2 nodes x 1 rank
(`mpi`, `tasks`), 2 nodes x 2 ranks with `gpus_per_node: 2` (`mpi`, `tasks_per_node`, `gres`)
and 1 x 1 (no `mpi`: inside the executor's step). The GPU run gets SLURM's real GPU allocation
and binding (`--gres=gpu:2`, CUDA_VISIBLE_DEVICES per task) of the fake GPUs; its ranks choose
their GPU as on a GPU node and compute on the CPU (IMAGENET_DDP_FAKE_GPUS, gloo). The run is
started with a `--config` on the command line, which once wiped the profile's launcher.

The controller dies on the way, as on a login node that reboots: Snakemake is SIGKILLed while
the GPU run's train job trains, and the same command runs again as the controller job
(profiles/slurm/controller.sbatch on the cluster's service partition, which unlocks first). It
must not start a second train job of that run while the first runs: the next one starts after
it (its nodes busy, or requeued behind it: jobs.holders), and the run's result is the first
job's. Beside it, the controller
job's own restart at its time limit runs with a Snakemake that only waits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from imagenet_ddp.jobs import attempts
from imagenet_ddp.jobs.distributed import FAKE_GPUS
from imagenet_ddp.jobs.launchers import srun_argv
from imagenet_ddp.settings.geometry import Geometry
from imagenet_ddp.training.model import read_model_file
from tests.workflow_helpers import REPO, SNAKEMAKE, TINY_CONFIG_OVERRIDES, copy_workflow

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

TEST_PROFILE = Path(__file__).parent / "slurm_cluster" / "profile"
GPU_RUN = "resnet18-2x2-gpu"
RUNS = [
    # Evaluated like it trained: 2 nodes x 1 rank (an `mpi` srun step); the others use the
    # default evaluation geometry (one node, one rank without GPUs).
    {"name": "resnet18-2x1", "nodes": 2, "tasks_per_node": 1, "evaluate": {"nodes": 2}},
    # 2 nodes x 2 fake GPUs, one rank per GPU; evaluated on one node's 2 GPUs (the default).
    # batch 8 per rank: the global batch (32) and step count of a 2-rank run, which learns.
    # Trains after a passing preflight on its geometry (one more sbatch job, same snakemake).
    {
        "name": GPU_RUN,
        "nodes": 2,
        "tasks_per_node": 2,
        "gpus_per_node": 2,
        "batch_size": 8,
        "workers": 2,  # fewer on a GPU run is refused at the dry-run (run_checks)
        "preflight": True,
    },
    {"name": "resnet18-1x1", "nodes": 1, "tasks_per_node": 1},
]


# The --config replaces any profile `config:`.
SNAKEMAKE_ARGS = ["--profile", "profiles/slurm", "--workflow-profile", str(TEST_PROFILE),
                  "--config", "data={dir: /not/used/by/the/demo}"]  # fmt: skip
PROGRESS = re.compile(r"epoch \d+ step \d+")


def _live_jobs(cluster, workdir: Path) -> dict[int, tuple[str, str]]:
    """{job id: (comment, state)} of this workflow's jobs that squeue shows."""
    out = cluster.run("squeue", "-h", "-o", "%i|%k|%T|%Z").stdout
    rows = [line.split("|") for line in out.splitlines()]
    return {int(r[0]): (r[1], r[2]) for r in rows if Path(r[3]) == workdir}


def _held_train_job(cluster, workdir: Path, proc, timeout: float = 900) -> int:
    """The GPU run's train job once it trains (other jobs may be queued or running: the
    restarted controller submits each again)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "snakemake ended before the GPU run trained"
        live = _live_jobs(cluster, workdir)
        train = [j for j, (c, st) in live.items()
                 if c == f"rule_train_wildcards_{GPU_RUN}" and st == "RUNNING"]  # fmt: skip
        if train:
            logs = list((workdir / f"logs/train/{GPU_RUN}").glob(f"job-{train[0]}-*.log"))
            if logs and PROGRESS.search(logs[0].read_text(errors="replace")):
                return train[0]
        time.sleep(1)
    raise AssertionError(f"the GPU run's train job did not train within {timeout} s")


def _jobs_of(cluster, run_uuid: str) -> dict[str, dict]:
    """Every SLURM job of one Snakemake invocation (job name = its run ID), by comment."""
    out = cluster.run(
        # -S: without it (and without -j) sacct lists only jobs since today's midnight.
        "sacct", "-X", "-n", "-P", "-S", "2000-01-01", "--name", run_uuid,
        "-o", "JobID,State,NNodes,Comment,Start,End",
    ).stdout  # fmt: skip
    jobs = {}
    for line in out.splitlines():
        job_id, state, nnodes, comment, start, end = line.split("|")
        jobs[comment] = {"id": int(job_id), "state": state, "nnodes": int(nnodes),
                         "start": start, "end": end}  # fmt: skip
    return jobs


# A Snakemake that runs until it is killed, and at once the second time: what the controller
# job's own restart at its time limit needs (the real Snakemake's restart: slurm_run below).
FAKE_SNAKEMAKE = """#!/bin/bash
echo "snakemake $* (job $SLURM_JOB_ID)"
for a in "$@"; do [ "$a" = --unlock ] && exit 0; done
[ -e ran-once ] && exit 0
touch ran-once
sleep 600
"""


def _restarting_controller(cluster, tmp: Path) -> int:
    """profiles/slurm/controller.sbatch with a 1-minute limit warned 50 s before it, running
    FAKE_SNAKEMAKE on the service partition: its first job (returned) submits its successor."""
    (tmp / "profiles/slurm").mkdir(parents=True)
    shutil.copy(REPO / "profiles/slurm/controller.sbatch", tmp / "profiles/slurm")
    (tmp / "snakemake").write_text(FAKE_SNAKEMAKE)
    (tmp / "snakemake").chmod(0o755)
    return cluster.sbatch(
        "-p", cluster.service_partition, "-J", "ci_restart", "-c", "1", "--mem=100", "--time=1",
        "--signal=B:USR1@50", f"--chdir={tmp}",
        f"--export=ALL,IMAGENET_DDP_SNAKEMAKE={tmp}/snakemake",
        "profiles/slurm/controller.sbatch", "--config", "a=b c", "-R", "results/a.pt",
        "results/b.pt", "-F", cwd=tmp,
    )  # fmt: skip


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, module_tmp):
    """The workflow through profiles/slurm, its controller killed (SIGKILL, as a dying login
    node) while the GPU run's train job trains, then started again as the controller job
    profiles/slurm/controller.sbatch (on the cluster's service partition), which finishes."""
    # Staging into each node's own tmpfs, set as a site user sets their node-local disk.
    stage = slurm_cluster.node_scratch_config()
    workdir = copy_workflow(module_tmp / "slurm-e2e", runs=RUNS, stage=stage)
    restart_dir = module_tmp / "controller-restart"
    restart_dir.mkdir()
    restarting = _restarting_controller(slurm_cluster, restart_dir)  # meanwhile, beside it
    os.environ[FAKE_GPUS] = "1"  # sbatch exports it to the jobs (and srun to the ranks)
    first_out = workdir.parent / "snakemake-first.log"
    try:
        with open(first_out, "w") as out:
            proc = subprocess.Popen([*SNAKEMAKE, *SNAKEMAKE_ARGS], cwd=workdir, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            held = _held_train_job(slurm_cluster, workdir, proc)
            first_pid = proc.pid
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the login node dies: no cleanup, no scancel
            proc.wait()
        killed_at = time.monotonic()
        controller = slurm_cluster.sbatch(
            "-p", slurm_cluster.service_partition, "-J", "ci_e2e_controller", "-c", "1",
            "--mem=500", "--time=30", f"--output={workdir.parent}/controller-%j.log",
            # the cluster's clients run with the environment it started with: FAKE_GPUS too
            # the test layer after profiles/slurm restates the rules' resources on purpose
            f"--chdir={workdir}", f"--export=ALL,{FAKE_GPUS}=1,IMAGENET_DDP_PROFILES_AS_GIVEN=1,"
            f"IMAGENET_DDP_SNAKEMAKE={' '.join(SNAKEMAKE)}",
            "profiles/slurm/controller.sbatch", *SNAKEMAKE_ARGS[2:], cwd=workdir,  # its --profile
        )  # fmt: skip
        state = slurm_cluster.wait_job(controller, timeout=1200)
    finally:
        del os.environ[FAKE_GPUS]
    first = first_out.read_text(errors="replace")
    second = (workdir.parent / f"controller-{controller}.log").read_text(errors="replace")
    assert state == "COMPLETED", second[-6000:]
    uuids = [re.search(r"SLURM run ID: (\S+)", log).group(1) for log in (first, second)]
    # The later invocation's job of a rule is the one whose outputs are there.
    jobs = {**_jobs_of(slurm_cluster, uuids[0]), **_jobs_of(slurm_cluster, uuids[1])}
    restarted = slurm_cluster.run("sacct", "-X", "-n", "-P", "-S", "2000-01-01", "--name",
                                  "ci_restart", "-o", "JobID,State,Start,End").stdout  # fmt: skip
    return SimpleNamespace(
        dir=workdir, log=first + second, logs=(first, second), uuids=uuids, jobs=jobs,
        cluster=slurm_cluster, held=held, controller=controller,
        restart_seconds=time.monotonic() - killed_at, restart_dir=restart_dir,
        restarting=restarting, restarted=[line.split("|") for line in restarted.split()],
        first_pid=first_pid,
    )  # fmt: skip


def test_the_controller_job_submits_its_successor_near_its_time_limit(slurm_run):
    """At its warning (USR1 to the batch shell) the controller job submits the next one with
    its own name, resources and arguments less Snakemake's forces (each would force a run that
    finished meanwhile again: a delivered run trains from scratch), and kills Snakemake
    (SIGKILL: no job cancelled); the successor (--dependency=singleton) starts once it has
    ended and runs Snakemake again."""
    first = slurm_run.restarting
    jobs = slurm_run.restarted
    assert [j[0] for j in jobs][:1] == [str(first)] and len(jobs) == 2, jobs
    successor = int(jobs[1][0])
    assert [j[1] for j in jobs] == ["COMPLETED", "COMPLETED"], jobs
    assert jobs[1][2] >= jobs[0][3], jobs  # started after the first ended (ISO times)
    log = (slurm_run.restart_dir / f"ci_restart-{first}.log").read_text()
    assert f"submitted controller job {successor} (-J ci_restart -p service" in log, log
    assert "-c 1 --mem 100M -t 1:00)" in log and "(killed: its successor goes on)" in log, log
    forces = "-R results/a.pt results/b.pt -F"
    assert f"snakemake --profile profiles/slurm --config a=b c {forces} (job {first})" in log, log
    assert f"without {forces} (a force applies once)" in log, log
    # the same arguments less the forces, unlocked first (only one controller of a name runs)
    later = (slurm_run.restart_dir / f"ci_restart-{successor}.log").read_text()
    args = "--profile profiles/slurm --config a=b c"
    assert f"snakemake {args} --unlock (job {successor})" in later, later
    assert f"snakemake {args} (job {successor})" in later and "exited 0" in later, later


def test_a_restarted_controller_waits_for_the_runs_live_train_job_and_adopts_its_result(
    slurm_run,
):
    """Never two train jobs of a run at once, and no allocation held while waiting: the
    restarted controller (a SLURM job itself, asking SLURM nothing at submission) submitted
    the run's next job while the killed one's still trained; it started after that one ended
    (its nodes busy until then, or requeued behind it: jobs.holders), resumed its final
    checkpoint and wrote its weights unchanged: those of the uninterrupted job."""
    first, second = slurm_run.logs
    held = slurm_run.held
    assert f"controller job {slurm_run.controller}" in second, second[:2000]
    assert "--dependency" not in second  # nothing asked of squeue at submission
    first_jobs = _jobs_of(slurm_run.cluster, slurm_run.uuids[0])
    x = first_jobs[f"rule_train_wildcards_{GPU_RUN}"]
    y = slurm_run.jobs[f"rule_train_wildcards_{GPU_RUN}"]
    assert x["id"] == held and x["state"] == "COMPLETED" and y["id"] != held, (x, y)
    # No train job of the restarted invocation ran beside the killed one's of its run (ISO
    # times: one after the other); no other run trained again. The other rules' jobs hold
    # nothing back (docs/reliability.md): an evaluate in flight at the kill may run twice.
    second_jobs = _jobs_of(slurm_run.cluster, slurm_run.uuids[1])
    for comment, job in second_jobs.items():
        if comment in first_jobs and comment.startswith("rule_train"):
            assert job["start"] >= first_jobs[comment]["end"], (comment, first_jobs, job)
    assert y["start"] >= x["end"], (x, y)
    assert [c for c in second_jobs if c.startswith("rule_train")] == [
        f"rule_train_wildcards_{GPU_RUN}"
    ], second_jobs
    root = slurm_run.dir / "results/checkpoints" / GPU_RUN
    entries = attempts.load(root)
    assert [(e["slurm_job_id"], e["outcome"]) for e in entries] == [
        (str(held), "completed"), (str(y["id"]), "completed"),
    ], entries  # fmt: skip
    final = attempts.newest_checkpoint(root)
    # resumed the first job's last checkpoint (the record holds the path as the job saw it)
    assert slurm_run.dir / entries[1]["start"]["path"] == Path(final["path"])
    assert final["written"] < entries[1]["started"]  # and trained nothing itself
    model = read_model_file(slurm_run.dir / f"results/runs/{GPU_RUN}/model.pt")["model"]
    checkpoint = torch.load(final["path"], map_location="cpu", weights_only=False)["model"]
    assert model.keys() == checkpoint.keys()
    assert all(torch.equal(model[k], checkpoint[k]) for k in model)
    log = (slurm_run.dir / f"logs/train/{GPU_RUN}.log").read_text()
    assert "still trains it" not in log  # it started once the other had ended
    # Each job knew the Snakemake that submitted it, by its heartbeat (jobs.holders: whether
    # it still runs when the job finishes), through sbatch and the job's own Snakemake: the
    # GPU run's, the restarted controller's (on the service node); another's, the first's.
    submitters = {run["name"]: json.loads((slurm_run.dir / f"results/runs/{run['name']}/job.json")
                  .read_text())["submitted_by"] for run in RUNS}  # fmt: skip
    assert submitters[GPU_RUN].startswith("local-slurmctl-"), submitters
    others = {v for k, v in submitters.items() if k != GPU_RUN}
    assert others == {f"local-{socket.gethostname()}-{slurm_run.first_pid}"}, submitters


def test_every_job_went_through_sbatch_and_completed(slurm_run):
    first, second = slurm_run.logs
    total = int(re.search(r"(\d+) of \1 steps \(100%\) done", second).group(1))
    # nothing ran here but the target, the runs' checks, the data's content record, the rerun
    # keys and the report rules
    local = re.findall(r"local(?:rule|checkpoint) (\w+):", second)
    assert set(re.findall(r"local(?:rule|checkpoint) (\w+):", slurm_run.log)) == {
        "all", "check", "data_content", "key", "accounting", "aggregate", "plots"
    }  # fmt: skip
    for log, uuid in zip(slurm_run.logs, slurm_run.uuids, strict=True):
        jobs = _jobs_of(slurm_run.cluster, uuid)
        submitted = re.findall(r"has been submitted with SLURM jobid (\d+)", log)
        ids = {str(j["id"]) for j in jobs.values()}
        # the killed one may have died between an sbatch and its log line
        assert set(submitted) <= ids and len(submitted) >= len(ids) - (log is first), (log, ids)
        assert {j["state"] for j in jobs.values()} == {"COMPLETED"}, jobs
    # the restarted invocation: the GPU run's train job again and what follows it
    assert len(_jobs_of(slurm_run.cluster, slurm_run.uuids[1])) == total - len(local)
    rules = {re.sub(r"_wildcards_.*", "", c) for c in slurm_run.jobs}
    # the report rules are local rules (workflow/rules/report.smk), never sbatch jobs
    assert {"rule_train", "rule_evaluate", "rule_prepare"} <= rules, rules
    assert not rules & {"rule_accounting", "rule_aggregate", "rule_plots", "rule_key"}, rules
    for run in RUNS:
        assert f"rule_train_wildcards_{run['name']}" in slurm_run.jobs


def test_multi_node_training_had_ranks_on_both_nodes(slurm_run):
    job = slurm_run.jobs["rule_train_wildcards_resnet18-2x1"]
    assert job["nnodes"] == 2
    metrics = json.loads(
        (slurm_run.dir / "results/runs/resnet18-2x1/train_metrics.json").read_text()
    )
    assert metrics["world_size"] == 2 and metrics["nodes"] == 2
    assert sorted((r["rank"], r["host"]) for r in metrics["ranks"]) == [(0, "node1"), (1, "node2")]
    # Gloo binds the interface towards the other node (the launcher sets it per rank).
    assert {r["gloo_socket_ifname"] for r in metrics["ranks"]} == {"eth0"}


def _gpu_job(slurm_run, rule: str) -> str:
    job_id = slurm_run.jobs[f"rule_{rule}_wildcards_{GPU_RUN}"]["id"]
    return slurm_run.cluster.run("scontrol", "show", "job", str(job_id)).stdout


def _assert_one_gpu_per_rank(ranks: list[dict], hosts: list[str], per_node: int) -> None:
    assert sorted(r["host"] for r in ranks) == sorted(hosts * per_node), ranks
    for r in ranks:
        # --gres=gpu:2: every task of a node sees both of its GPUs and takes cuda:SLURM_LOCALID.
        assert r["cuda_visible_devices"] == "0,1", r
        assert r["would_select"] == f"cuda:{r['local_rank']}" and r["device"] == "cpu", r
    chosen = {
        (r["host"], r["cuda_visible_devices"].split(",")[int(r["would_select"][5:])]) for r in ranks
    }
    assert len(chosen) == len(ranks), ranks  # no two ranks of a node on one GPU


def test_gpu_run_was_allocated_its_gpus_and_each_rank_took_its_own(slurm_run):
    train = _gpu_job(slurm_run, "train")
    # sbatch got --gres=gpu:2 per node and no --ntasks-per-gpu (NtasksPerTRES would show it).
    assert "TresPerNode=gres:gpu:2" in train and "NtasksPerTRES" not in train, train
    assert "gres/gpu=4" in train and "NumNodes=2" in train, train
    run_dir = slurm_run.dir / f"results/runs/{GPU_RUN}"
    metrics = json.loads((run_dir / "train_metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["geometry"]["gpus_per_node"] == 2
    _assert_one_gpu_per_rank(metrics["ranks"], ["node1", "node2"], per_node=2)
    assert metrics["cost"]["gpus"] == 4  # the allocation's GPUs, which the cost block counts
    # Evaluation: one node with the run's 2 GPUs, allocated and bound the same way.
    evaluate = _gpu_job(slurm_run, "evaluate")
    assert "TresPerNode=gres:gpu:2" in evaluate and "NtasksPerTRES" not in evaluate, evaluate
    ranks = json.loads((run_dir / "eval.json").read_text())["evaluation"]["ranks"]
    _assert_one_gpu_per_rank(ranks, [ranks[0]["host"]], per_node=2)


def test_evaluation_ran_as_ranks_on_both_nodes_and_counted_every_sample_once(slurm_run):
    job = slurm_run.jobs["rule_evaluate_wildcards_resnet18-2x1"]
    assert job["nnodes"] == 2
    runs = slurm_run.dir / "results/runs"
    two = json.loads((runs / "resnet18-2x1/eval.json").read_text())
    one = json.loads((runs / "resnet18-1x1/eval.json").read_text())
    assert two["evaluation"]["world_size"] == 2 and two["evaluation"]["backend"] == "gloo"
    assert two["evaluation"]["hosts"] == ["node1", "node2"]
    assert one["evaluation"]["world_size"] == 1
    for split in ("holdout", "test"):
        assert two[split]["samples"] == one[split]["samples"] > 0


def test_training_used_srun_in_the_allocation(slurm_run):
    for run in RUNS:
        log = (slurm_run.dir / f"logs/train/{run['name']}.log").read_text()
        assert "+ srun " in log, log[-2000:]
        # Only the 1x1 run (no `mpi`) runs inside the executor's step and must overlap it.
        assert ("--overlap" in log) == (run["nodes"] * run["tasks_per_node"] == 1), run


def test_each_node_staged_its_own_copy_into_its_scratch_and_cleaned_it(slurm_run):
    """Every node of every staged job copied into its own tmpfs (stage.scratch_dir, the
    same path on each node) and the last job on a node removed the copy; the GPU run's last
    job, which started after its final checkpoint (the restarted controller's), copied
    nothing (issue 42)."""
    cluster = slurm_run.cluster
    for run in RUNS:
        reports = {
            p.stem: json.loads(p.read_text())
            for p in (slurm_run.dir / f"results/runs/{run['name']}/staging").glob("*.json")
        }
        assert len(reports) == run["nodes"], reports
        for host, report in reports.items():
            assert host in cluster.node_names
            assert report["host"] == host and report["bytes"] > 0 and report["files"] > 0
            if run["name"] == GPU_RUN:  # its last job, after its final checkpoint: no copy
                assert "the run's final checkpoint" in report["in_place"], report
                continue
            mine = cluster.scratch / f"imagenet_ddp-{os.getuid()}"  # this user's part
            assert Path(report["dest"]).is_relative_to(mine), report
            assert "in_place" not in report and report["cleaned"] is True, report
            assert report["scratch"] == {
                "root": str(cluster.scratch), "from": "stage.scratch_dir",
                "fs_type": "tmpfs", "source": f"scratch-{host}",  # this node's own tmpfs
            }, report  # fmt: skip
    for node in cluster.node_names:  # nothing left on any node, nothing ever on the host
        assert cluster.node_files(node) == [], node
    assert not any(cluster.scratch.iterdir())


def _stage_step_job(cluster, work: Path, specs: dict[str, dict]) -> dict[str, str]:
    """One sbatch job on both nodes running the launcher's staging step (one srun task per
    node, as training's first step) once per spec: {name: that step's output}."""
    lines = ["#!/bin/bash"]
    for name, spec in specs.items():
        (work / f"{name}.json").write_text(json.dumps(spec))
        lines.append(
            f"srun --nodes=2 --ntasks=2 --ntasks-per-node=1 {sys.executable} -m "
            f"imagenet_ddp.jobs.launch stage-node --spec {name}.json > {name}.out 2>&1; "
            f"echo exit $? >> {name}.out"
        )
    (work / "job.sh").write_text("\n".join(lines) + "\n")
    job_id = cluster.sbatch("--nodes=2", "--ntasks-per-node=1", "--time=5",
                            f"--output={work}/slurm-%j.out", f"--chdir={work}",
                            str(work / "job.sh"))  # fmt: skip
    assert cluster.wait_job(job_id, timeout=180) == "COMPLETED"
    return {name: (work / f"{name}.out").read_text() for name in specs}


def test_staging_under_srun_refuses_shared_scratch_and_copies_into_each_nodes_own(
    slurm_cluster, prepared_demo, tmp_path
):
    """The strict cluster (nothing exports a scratch variable): without stage.scratch_dir,
    staging would land in /tmp, the disk of the prepared copy and workdir: refused on every
    node with one line, nothing copied. With it, each node holds its own copy at the same
    path, seen inside that node's namespace only."""
    cluster, src = slurm_cluster, prepared_demo["train"]

    def spec(name: str, scratch_dir: str) -> dict:
        from imagenet_ddp.jobs.spec import to_dict
        from tests.workflow_helpers import make_job

        run = {"nodes": 2, "tasks_per_node": 1, "cpus_per_task": 1}
        return to_dict(
            make_job("train", run, prepared_train=src, run_dir=tmp_path / name,
                     launcher="srun", scratch_dir=scratch_dir)
        )  # fmt: skip

    out = _stage_step_job(
        cluster,
        tmp_path,
        {"unset": spec("unset", ""), "local": spec("local", str(cluster.scratch))},
    )
    refusals = sorted(line for line in out["unset"].splitlines() if "stage-node on" in line)
    # slurmstepd set TMPDIR=/tmp (the job inherited none): the host's disk, refused.
    nodes = [line.split(":")[0] for line in refusals]
    assert nodes == ["stage-node on node1", "stage-node on node2"], out["unset"]
    tmpdir = os.environ.get("TMPDIR") or "/tmp"  # sbatch exports ours, if any
    expected = f"scratch {tmpdir} (from $TMPDIR) is on the same filesystem as prepare.dir"
    assert all(expected in line for line in refusals), refusals
    assert "exit 0" not in out["unset"] and "Traceback" not in out["unset"], out["unset"]
    assert out["local"].strip().endswith("exit 0"), out["local"]
    reports = [json.loads(p.read_text()) for p in (tmp_path / "local" / "staging").glob("*.json")]
    assert sorted(r["scratch"]["source"] for r in reports) == ["scratch-node1", "scratch-node2"]
    (dest,) = {r["dest"] for r in reports}  # the same path on both nodes ...
    marker = str(Path(dest) / ".staged.json")
    for node in cluster.node_names:  # ... each holding its own copy there
        assert marker in cluster.node_files(node), node
        cluster.on_node(node, "rm", "-rf", str(Path(dest).parent.parent))
    assert not Path(dest).exists() and not any(cluster.scratch.iterdir())  # host: empty


def test_results_are_as_good_as_a_local_run(slurm_run):
    table = pd.read_csv(slurm_run.dir / "results/aggregate/runs.csv")
    chance = 1 / TINY_CONFIG_OVERRIDES["demo"]["num_classes"]
    assert sorted(table["run"]) == sorted(r["name"] for r in RUNS)
    # The thresholds of the local end-to-end test (tests/test_workflow_local.py).
    assert (table["holdout_top1"] > 2 * chance).all(), table
    assert (table["test_top1"] > 2 * chance).all(), table


def test_accounting_of_each_training_job_comes_from_sacct(slurm_run):
    table = pd.read_csv(slurm_run.dir / "results/aggregate/runs.csv").set_index("run")
    for run in RUNS:
        job = slurm_run.jobs[f"rule_train_wildcards_{run['name']}"]
        record = json.loads(
            (slurm_run.dir / f"results/runs/{run['name']}/accounting.json").read_text()
        )
        assert record["available"] is True, record
        assert record["job_id"] == str(job["id"]) and record["state"] == "COMPLETED", record
        assert record["nodes"] == run["nodes"] and record["elapsed_seconds"] > 0, record
        assert int(record["alloc_tres"]["cpu"]) >= run["nodes"] * run["tasks_per_node"], record
        assert table.loc[run["name"], "slurm_state"] == "COMPLETED"
        assert table.loc[run["name"], "slurm_core_hours"] > 0


def test_preflight_ran_on_the_fake_gpus_before_training(slurm_run):
    """The GPU run's preflight, in the same snakemake call: 2 nodes x 2 ranks on the fake GPUs
    (computing on CPU/gloo); every rank reports the CUDA_VISIBLE_DEVICES SLURM gave it and the
    GPU it would use. Two ranks on one GPU failing with its line: tests/test_workflow_local.py,
    tests/test_preflight.py (by hand here, --gres=gpu:1 gave CUDA_VISIBLE_DEVICES=0 to both
    ranks of a node and failed the same way)."""
    preflight = slurm_run.jobs[f"rule_preflight_run_wildcards_{GPU_RUN}"]
    assert preflight["nnodes"] == 2 and preflight["state"] == "COMPLETED"
    train = slurm_run.jobs[f"rule_train_wildcards_{GPU_RUN}"]
    assert preflight["id"] < train["id"]  # submitted first: train depends on it
    folder = slurm_run.dir / "results/preflight" / GPU_RUN
    report = json.loads((folder / "preflight.json").read_text())
    assert report["problems"] == [], report["problems"]
    assert sorted(report["nodes"]) == sorted(slurm_run.cluster.node_names)
    ranks = report["ranks"]
    assert {r["slurm_job_id"] for r in ranks} == {str(preflight["id"])}
    assert [r["visible"] for r in ranks] == [["0", "1"]] * 4  # plain srun: a node's GPUs
    assert [(r["host"], r["gpu"]) for r in ranks] == [
        (host, gpu) for host in sorted(slurm_run.cluster.node_names) for gpu in "01"
    ]
    allreduce = report["allreduce"]
    n = 4  # nccl-tests' bus bandwidth: algbw x 2(n-1)/n
    assert allreduce["busbw_gbps"] == pytest.approx(allreduce["algbw_gbps"] * 2 * (n - 1) / n)
    assert allreduce["busbw_gbps"] > 0
    assert "intra_node" in allreduce["sizes"][0]  # 2 nodes x 2 ranks: both scopes
    for node in report["nodes"].values():  # each node staged into its job's scratch
        assert node["staging"]["bytes"] > 0 and node["staging"]["gb_per_s"] > 0
    # train's time limit (the test profile's 30 min) is what allocations are counted in
    assert report["projection"]["train_runtime_minutes"] == 30
    assert report["projection"]["allocations"] == 1
    assert report["projection"]["gpu_hours"] == pytest.approx(
        report["projection"]["total_seconds"] / 3600 * 2 * 2
    )
    table = pd.read_csv(slurm_run.dir / "results/aggregate/runs.csv").set_index("run")
    measured = table.loc[GPU_RUN, "epoch_seconds_over_preflight"]
    assert 1 / 4 < measured < 4, measured  # the factor docs/preflight.md "Budget" states
    # workers 2 and a passing loader check: the projected step waits for no data
    assert table.loc[GPU_RUN, "preflight_input_bound_pct"] == 0.0


def test_srun_overlaps_only_inside_an_existing_step(monkeypatch):
    geometry = Geometry(nodes=1, tasks_per_node=1, cpus_per_task=2)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert "--overlap" not in srun_argv(geometry, per_node=False, extra=[])
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert srun_argv(geometry, per_node=False, extra=["--x"])[-2:] == ["--overlap", "--x"]
