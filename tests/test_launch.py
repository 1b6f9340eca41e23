"""Launcher pieces that do not need a cluster (the real srun path runs in the SLURM tests)."""

from __future__ import annotations

import json

from imagenet_ddp.jobs.distributed import master_port
from imagenet_ddp.jobs.launchers import (
    THREAD_COUNT_VARIABLES,
    srun_argv,
    worker_env,
)
from imagenet_ddp.settings.geometry import Geometry, slurm_resources
from tests.workflow_helpers import make_job


def test_master_port_is_below_the_ephemeral_range_and_follows_the_job():
    ports = {master_port(job) for job in range(0, 100_000, 7)}
    assert min(ports) >= 1024 and max(ports) < 32768
    assert master_port(12345) == master_port(12345)
    assert master_port(12345) != master_port(12346)


def test_srun_launches_one_task_per_rank_or_one_per_node():
    g = Geometry(nodes=2, tasks_per_node=4, cpus_per_task=8)
    ranks = srun_argv(g, per_node=False, extra=["--gres-flags=allow-task-sharing"])
    assert "--ntasks=8" in ranks and "--ntasks-per-node=4" in ranks
    assert "--cpus-per-task=8" in ranks and ranks[-1] == "--gres-flags=allow-task-sharing"
    per_node = srun_argv(g, per_node=True, extra=[])
    assert "--ntasks=2" in per_node and "--ntasks-per-node=1" in per_node


def test_the_sbatch_shape_takes_one_of_tasks_and_tasks_per_node_and_gpus_per_node():
    """The executor's rules (docs/slurm-notes.md 5): with `mpi` exactly one of tasks and
    tasks_per_node, > 1; one rank has no `mpi` (it runs in the executor's own step)."""

    def shape(nodes, per_node, gpus=0, gpu_type=""):
        settings = {"nodes": nodes, "tasks_per_node": per_node, "gpus_per_node": gpus,
                    "gpu_type": gpu_type}  # fmt: skip
        return slurm_resources(settings)

    assert shape(2, 4, 4, "h100") == {
        "tasks_per_node": 4, "tasks": None, "gres": "gpu:h100:4", "mpi": "srun"
    }  # fmt: skip
    assert shape(2, 1, 1) == {"tasks_per_node": None, "tasks": 2, "gres": "gpu:1", "mpi": "srun"}
    assert shape(1, 2) == {"tasks_per_node": 2, "tasks": None, "gres": None, "mpi": "srun"}
    assert shape(1, 1, 1) == {"tasks_per_node": None, "tasks": None, "gres": "gpu:1", "mpi": None}


def test_ranks_get_their_tasks_thread_count_not_snakemakes(monkeypatch):
    # Snakemake exports the whole job's thread count in these; ranks must not inherit it.
    for name in THREAD_COUNT_VARIABLES:
        monkeypatch.setenv(name, "16")
    env = worker_env(Geometry(1, 2, 3))
    assert {env[name] for name in THREAD_COUNT_VARIABLES} == {"3"}
    assert "MKL_NUM_THREADS" in THREAD_COUNT_VARIABLES


def test_inductor_compiles_with_a_few_workers_per_rank_not_32(monkeypatch):
    """torch's own default is min(32, the CPUs it sees): 8 ranks x 32 compile processes per
    node. Each rank gets its CPUs, at most 4, and torch's own reader of the variable
    (torch._inductor.config.decide_compile_threads) takes it; a value already set stays."""
    import subprocess
    import sys

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert worker_env(Geometry(1, 8, 16))["TORCHINDUCTOR_COMPILE_THREADS"] == "4"
    env = worker_env(Geometry(1, 2, 3))
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "3"
    read = "from torch._inductor.config import decide_compile_threads as d; print(d())"
    out = subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "3", out.stderr
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # a site's or user's choice
    assert worker_env(Geometry(1, 8, 16))["TORCHINDUCTOR_COMPILE_THREADS"] == "1"


def _execution(prefix="srun", srun_extra=""):
    return make_job(launcher="srun", srun_extra=srun_extra, launch_prefix=prefix).execution


def test_evaluation_and_training_ranks_start_as_one_srun_step(monkeypatch):
    from imagenet_ddp.jobs import launchers

    steps = []
    monkeypatch.setattr(launchers, "_run_step", lambda argv, geometry: steps.append(argv) or (0, 0))
    srun = launchers.get_launcher("srun")
    extra = "--foo --comment='two words' --export=ALL,A=\"b c\""
    srun.start_ranks(_execution(srun_extra=extra), Geometry(2, 4, 8), ["python", "-m", "x"])
    srun.on_every_node(_execution(srun_extra=extra), Geometry(2, 4, 8), None, ["stage"])
    for argv in steps:  # srun_extra split as a shell would (shlex), quoted values whole
        assert argv[0] == "srun"
        assert "--comment=two words" in argv and "--export=ALL,A=b c" in argv and "--foo" in argv
    assert "--ntasks=8" in steps[0] and "--cpus-per-task=8" in steps[0]
    assert steps[0][-3:] == ["python", "-m", "x"]


def test_local_launcher_refuses_several_nodes():
    import pytest

    from imagenet_ddp.jobs.launchers import get_launcher

    with pytest.raises(ValueError, match="one node"):
        get_launcher("local").start_ranks(_execution(), Geometry(2, 1, 1), ["true"])


def test_auto_launcher_is_decided_by_the_job_not_by_the_config():
    from imagenet_ddp.jobs.launchers import resolve_launcher

    assert resolve_launcher("auto", {"SLURM_JOB_ID": "42"}) == "srun"
    assert resolve_launcher("auto", {}) == "local"
    assert resolve_launcher("local", {"SLURM_JOB_ID": "42"}) == "local"  # explicit wins


def test_the_ranks_step_starts_with_the_rules_mpi_prefix(monkeypatch):
    import pytest

    from imagenet_ddp.jobs import launchers

    steps = []
    monkeypatch.setattr(launchers, "_run_step", lambda argv, geometry: steps.append(argv) or (0, 0))
    srun = launchers.get_launcher("srun")
    srun.start_ranks(_execution("srun --mpi=pmix"), Geometry(2, 2, 1), ["x"])
    assert steps[0][:2] == ["srun", "--mpi=pmix"] and "--ntasks=4" in steps[0]
    with pytest.raises(ValueError, match="must start with srun"):
        srun_argv(Geometry(2, 2, 1), per_node=False, extra=[], prefix="mpirun -np 4")


def test_srun_tasks_enter_the_rules_container_again():
    import sys

    from imagenet_ddp.jobs.launchers import task_python

    assert task_python({}) == [sys.executable]
    image = "/images/imagenet-ddp.sif"
    argv = task_python({"APPTAINER_CONTAINER": image})
    assert argv == ["apptainer", "exec", "--nv", image, sys.executable]
    assert task_python({"SINGULARITY_CONTAINER": image})[0] == "singularity"


def test_srun_tasks_enter_the_image_with_the_rules_binds_and_the_scratch_root(monkeypatch):
    """Issue 51 item 5: the profile's --apptainer-args binds reached the rule's container only;
    srun's tasks entered the image with `exec --nv`, so a scratch outside $HOME, $PWD and /tmp
    was not there. Snakemake's --apptainer-args travel in the environment (host_args_env); each
    task repeats their binds and GPU flag, not --cleanenv (it would take SLURM_PROCID), and
    binds the scratch root unless bound already or by default."""
    import sys

    from imagenet_ddp.jobs import launch, launchers
    from imagenet_ddp.jobs.container import ARGS_VARIABLE, host_args_env, task_options

    args = ("--nv --cleanenv --bind /etc/slurm,/run/munge:/run/munge:ro -B /data "
            "--bind=/usr/bin/srun --mount type=bind,src=/opt/x,dst=/opt/x")  # fmt: skip
    carried = host_args_env(args)
    assert carried[ARGS_VARIABLE] == carried[f"APPTAINERENV_{ARGS_VARIABLE}"] == args
    assert host_args_env("") == {}
    image = "/images/imagenet-ddp.sif"
    inside = {"APPTAINER_CONTAINER": image, **carried}
    argv = launchers.task_python(inside, binds=["/local/scratch", "/data", "/tmp"])
    assert argv == [
        "apptainer", "exec", "--nv", "--bind", "/etc/slurm,/run/munge:/run/munge:ro",
        "-B", "/data", "--bind", "/usr/bin/srun", "--mount", "type=bind,src=/opt/x,dst=/opt/x",
        "--bind", "/local/scratch", image, sys.executable,
    ]  # fmt: skip
    assert task_options({ARGS_VARIABLE: "--rocm"}) == ["--rocm"]  # its GPU flag, not --nv
    assert task_options({}, ["/scratch/"]) == ["--nv", "--bind", "/scratch"]
    # run_staged hands the job's scratch root to every task: staging, ranks, unstaging
    for name, value in inside.items():
        monkeypatch.setenv(name, value)
    steps = []
    monkeypatch.setattr(launchers, "_run_step", lambda argv, geometry: steps.append(argv) or (0, 0))
    run = {"nodes": 2, "tasks_per_node": 2, "cpus_per_task": 3}
    spec = make_job("preflight", run, launcher="srun", scratch_dir="/local/scratch")
    assert launch.run_staged(spec, "/nowhere/spec.json") == 0
    assert len(steps) == 3
    for step in steps:
        entered = step[step.index("apptainer") : step.index(image)]
        assert entered[-2:] == ["--bind", "/local/scratch"] and "-B" in entered, step
        assert "--cleanenv" not in entered


def test_srun_tasks_run_the_hosts_apptainer_from_a_module_dir(tmp_path):
    """Issue 36: apptainer from a module (here a Spack-like dir on PATH, no other one): the
    Snakemake that starts the container resolves its absolute path on the host, the
    container's environment carries it, and each task's argv starts with it, though the
    container's own PATH (reset by Apptainer) holds no apptainer."""
    import os
    import sys

    from imagenet_ddp.jobs.container import RUNTIME_VARIABLE, host_runtime_env
    from imagenet_ddp.jobs.launchers import task_python

    module_bin = tmp_path / "opt/spack/linux-x86_64/apptainer-1.3.4-abc/bin"
    module_bin.mkdir(parents=True)
    (module_bin / "apptainer").write_text("#!/bin/sh\n")
    (module_bin / "apptainer").chmod(0o755)
    host_path = os.pathsep.join([str(tmp_path / "empty"), str(module_bin)])
    carried = host_runtime_env(host_path)
    assert carried[RUNTIME_VARIABLE] == str(module_bin / "apptainer")
    assert carried[f"APPTAINERENV_{RUNTIME_VARIABLE}"] == str(module_bin / "apptainer")
    image = "/images/imagenet-ddp.sif"
    inside = {"APPTAINER_CONTAINER": image, "PATH": "/usr/local/bin:/usr/bin:/bin", **carried}
    argv = task_python(inside)
    assert argv == [str(module_bin / "apptainer"), "exec", "--nv", image, sys.executable]
    assert os.path.isabs(argv[0]) and os.access(argv[0], os.X_OK)
    assert host_runtime_env(str(tmp_path / "empty")) == {}  # none on the host: nothing set


def test_ranks_start_as_their_kinds_module_and_nodes_run_the_staging_steps(monkeypatch):
    """srun path, steps recorded: stage on every node, the ranks as `python -m <module>`
    (one process per rank, no launcher in between), unstage; the spec is handed on, not
    re-read (no file exists at the path)."""
    import importlib
    import sys

    from imagenet_ddp.jobs import launch, launchers

    steps = []
    monkeypatch.setattr(launchers, "_run_step", lambda argv, geometry: steps.append(argv) or (0, 0))
    run = {"nodes": 2, "tasks_per_node": 2, "cpus_per_task": 3}
    spec = make_job("preflight", run, launcher="srun")
    assert launch.run_staged(spec, "/nowhere/spec.json") == 0
    stage, ranks, unstage = steps
    assert stage[-4:] == ["imagenet_ddp.jobs.launch", "stage-node", "--spec", "/nowhere/spec.json"]
    assert "--ntasks=4" in ranks and "--cpus-per-task=3" in ranks
    assert ranks[-5:] == [sys.executable, "-m", "imagenet_ddp.preflight.rank", "--spec",
                          "/nowhere/spec.json"]  # fmt: skip
    assert unstage[-3] == "unstage-node"
    steps.clear()
    evaluation = make_job("evaluate", run, launcher="srun")
    assert launch.run_evaluation(evaluation, "/e.json") == 0
    assert steps[0][-4:] == ["-m", "imagenet_ddp.evaluation.evaluate", "--spec", "/e.json"]
    for module in launch.RANK_MODULES.values():  # each is a rank's entry point
        assert callable(importlib.import_module(module).main)


def test_the_gloo_interface_is_the_one_that_routes_to_the_other_nodes():
    from imagenet_ddp.jobs.distributed import interface_towards

    assert interface_towards("127.0.0.1") == "lo"


def test_the_dry_run_shows_the_mpi_prefix_and_refuses_one_that_is_not_srun(tmp_path):
    from tests.workflow_helpers import copy_workflow, shown_specs, snakemake

    # "hot": an LR its warm-up reaches too fast, a dry-run warning (run_checks.warmup_warnings)
    runs = [{"name": "r", "tasks_per_node": 2, "preflight": True}, {"name": "hot", "lr": 20.0}]
    workdir = copy_workflow(tmp_path / "wf", runs=runs)
    target = "results/runs/r/model.pt"
    shown = snakemake(
        workdir, "-n", "-p", "-c2", target, "--config", "data={dir: /x}",
        "--set-resources", "train:mpi=srun --mpi=pmix",
    )  # fmt: skip
    text = shown.stdout + shown.stderr
    warned = [line for line in text.splitlines() if "warm-up steeper than Goyal et al." in line]
    assert len(warned) == 1 and "'hot' (0 steps to lr_used 20" in warned[0], warned  # one line
    # train's ranks, and its preflight's: they are measured as they will run
    for rule, kind in (("train", "train"), ("preflight_run", "preflight")):
        job = text[text.index(f"rule {rule}:") :]
        spec = shown_specs(job, kind, workdir)[0]
        assert spec["execution"]["launch_prefix"] == "srun --mpi=pmix", rule
        assert spec["execution"]["launcher"] == "auto", rule
    bad = snakemake(
        workdir, "-n", "-c2", target, "--set-resources", "train:mpi=mpirun -np 2", check=False
    )
    assert bad.returncode != 0
    assert "the ranks are started with srun" in bad.stdout + bad.stderr
    unknown = snakemake(
        workdir, "-n", "-c2", target, "--config", "execution={launcher: mpirun}", check=False
    )
    assert unknown.returncode != 0
    line = "config.yaml: execution.launcher 'mpirun': give auto, srun, local"
    assert line in unknown.stdout + unknown.stderr


def test_a_new_launcher_is_one_registered_class(monkeypatch):
    """Issue 34: a launcher registered in jobs/launchers.py is accepted by the spec, picked by
    `auto` where it detects its environment, and runs the per-node steps and the ranks of a
    staged job and an evaluation, with nothing else changed."""
    import sys

    from imagenet_ddp.jobs import launch, launchers
    from imagenet_ddp.jobs.spec import SpecError

    calls = []

    class Recorded(launchers.Launcher):
        name = "recorded"

        def detect(self, environ):
            return environ.get("RECORDED") == "1"

        def on_every_node(self, execution, geometry, here, argv):
            calls.append(("node", argv[-3]))
            here()
            return 0, 0.0

        def start_ranks(self, execution, geometry, argv):
            calls.append(("ranks", geometry.world_size, argv[-3]))
            return 0, 0.0

    assert launchers.launcher_problem("recorded") is not None
    built_in = dict(launchers.LAUNCHERS)
    monkeypatch.setattr(launchers, "LAUNCHERS", {})
    launchers.register(Recorded)  # first: auto tries it before srun and local
    launchers.LAUNCHERS.update(built_in)
    assert launchers.resolve_launcher("auto", {"RECORDED": "1", "SLURM_JOB_ID": "7"}) == "recorded"
    assert launchers.resolve_launcher("auto", {"SLURM_JOB_ID": "7"}) == "srun"
    staged = []
    monkeypatch.setattr(launch, "stage_this_node", lambda job: staged.append("stage"))
    monkeypatch.setattr(launch, "unstage_this_node", lambda job: staged.append("unstage"))
    run = {"nodes": 3, "tasks_per_node": 2, "cpus_per_task": 1}
    assert launch.run_staged(make_job("preflight", run, launcher="recorded"), "/p.json") == 0
    assert launch.run_evaluation(make_job("evaluate", run, launcher="recorded"), "/e.json") == 0
    assert calls == [
        ("node", "stage-node"),
        ("ranks", 6, "imagenet_ddp.preflight.rank"),
        ("node", "unstage-node"),
        ("ranks", 6, "imagenet_ddp.evaluation.evaluate"),
    ]
    assert staged == ["stage", "unstage"]
    assert sys.executable in launchers.get_launcher("recorded").python()
    import pytest

    with pytest.raises(SpecError, match="give auto, recorded, srun, local"):
        make_job(launcher="flux")


def test_a_stop_while_staging_finishes_the_copy_and_starts_no_ranks(monkeypatch, tmp_path):
    """A node's staging step signalled (a `--signal` warning, SIGUSR1 from the launcher)
    finishes its copy and exits 75; the launcher then starts no ranks and returns 75, as it
    does when it was signalled itself during the staging step."""
    import subprocess
    import sys
    import textwrap

    from imagenet_ddp.jobs import launch, launchers

    node_step = tmp_path / "node_step.py"
    node_step.write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            from imagenet_ddp.jobs import launch
            launch.read_spec = lambda path, kinds: None
            def stage(spec):  # signalled half-way through its copy, which it finishes
                os.kill(os.getpid(), signal.SIGUSR1)
                print("copy finished")
            launch.stage_this_node = stage
            sys.exit(launch.main(["stage-node", "--spec", "x.json"]))
            """
        )
    )
    done = subprocess.run([sys.executable, str(node_step)], capture_output=True, text=True)
    assert done.returncode == 75, done.stdout + done.stderr
    assert "copy finished" in done.stdout and "SIGUSR1 while stage-node" in done.stdout

    spec = make_job("train", {"nodes": 2, "tasks_per_node": 1, "cpus_per_task": 1}, launcher="srun")
    for result in ((75, False), (0, True)):  # a node's step was signalled; the launcher was
        steps: list[list[str]] = []
        monkeypatch.setattr(
            launchers, "_run_step", lambda argv, g, r=result, s=steps: s.append(argv) or r
        )
        assert launch.run_staged(spec, "/nowhere/spec.json") == 75
        assert len(steps) == 1 and "stage-node" in steps[0]  # no ranks, no unstage step


def fake_squeue(monkeypatch, tmp_path, nodes: str) -> None:
    """A `squeue` on PATH that prints ``nodes`` as the job's node count (%D)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho '{nodes}'\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "123")


def test_a_run_given_fewer_nodes_than_it_asked_keeps_its_global_batch(monkeypatch, tmp_path):
    """The allocation's node count (squeue) decides: one of fallback_nodes trains with the
    accumulation that keeps the global batch; a count the run does not accept is refused."""
    import pytest

    from imagenet_ddp.errors import InputError
    from imagenet_ddp.jobs.launch import on_allocation
    from imagenet_ddp.settings.geometry import global_batch

    run = {"run": "r", "nodes": 4, "tasks_per_node": 2, "cpus_per_task": 1, "batch_size": 8,
           "accumulation": 1, "fallback_nodes": [2, 1]}  # fmt: skip
    job = make_job(run=run, launcher="srun")
    for nodes, accumulation in (("4", 1), ("2", 2), ("1", 4)):
        fake_squeue(monkeypatch, tmp_path, nodes)
        shifted = on_allocation(job).run
        assert (shifted["nodes"], shifted["accumulation"]) == (int(nodes), accumulation)
        assert global_batch(shifted) == global_batch(run) == 64
    fake_squeue(monkeypatch, tmp_path, "3")
    with pytest.raises(InputError, match=r"3 node\(s\) is not one of the counts .*fallback_nodes"):
        on_allocation(job)
    fake_squeue(monkeypatch, tmp_path, "not a number")
    with pytest.raises(InputError, match="cannot read the allocation's node count with squeue"):
        on_allocation(job)
    # without fallback_nodes (or with the local launcher) squeue is never asked
    fixed = make_job(run={**run, "fallback_nodes": []}, launcher="srun")
    assert on_allocation(fixed).run["nodes"] == 4
    assert on_allocation(make_job(run=run)).run == run


def test_a_retry_that_will_refuse_is_not_shifted_to_its_one_node(monkeypatch, tmp_path):
    """The workflow submits a retry that will refuse on one node (common.smk _REFUSED_SHAPE),
    a count the run may not accept: it must reach the attempt record's refusal, not fail on
    its node count."""
    from imagenet_ddp.jobs import attempts
    from imagenet_ddp.jobs.launch import on_allocation

    run = {"run": "r", "nodes": 4, "tasks_per_node": 2, "cpus_per_task": 1, "batch_size": 8,
           "fallback_nodes": [2], "max_allocations": 10}  # fmt: skip
    root = tmp_path / "ckpt"
    for attempt in (1, 2):  # two failures in a row without progress
        entry, _ = attempts.begin(root, run, attempt=attempt, gpus=8, cores=8)
        attempts.end(root, entry, 1)
    fake_squeue(monkeypatch, tmp_path, "1")
    job = make_job(run=run, launcher="srun", attempt=3, checkpoint_root=root)
    assert on_allocation(job).run == run


def test_a_delivered_run_trains_afresh_when_it_is_asked_for_again(tmp_path):
    """Issue 50: a run delivered before this invocation began whose train runs again
    (`--forcerun`, its outputs deleted, `--delete-all-output`) trains from scratch: its
    checkpoints and attempt record move aside, never resumed into the same model. A run not
    delivered (a resubmission after a stop, a retry) resumes, and so does one delivered since
    the invocation began (a dead controller's job finished it while this one waited)."""
    from imagenet_ddp.jobs.launch import DELIVERED, start_afresh_if_delivered

    root = tmp_path / "checkpoints" / "run"
    (root / "key").mkdir(parents=True)
    (root / "key" / "epoch-3.pt").write_bytes(b"final")
    began = {"IMAGENET_DDP_INVOCATION_STARTED": "1000.0"}
    assert start_afresh_if_delivered(root, began) is None  # in progress: resumes
    (root / DELIVERED).write_text(json.dumps({"delivered_at": 1000.5}))
    assert start_afresh_if_delivered(root, began) is None  # delivered during this invocation
    assert (root / "key" / "epoch-3.pt").read_bytes() == b"final"
    (root / DELIVERED).write_text(json.dumps({"delivered_at": 999.0}))
    previous = start_afresh_if_delivered(root, began)
    assert previous == tmp_path / "checkpoints" / "run.previous" and not root.exists()
    assert (previous / "key" / "epoch-3.pt").read_bytes() == b"final"
    assert start_afresh_if_delivered(root, began) is None  # a retry: nothing delivered now
    (root / "key").mkdir(parents=True)
    (root / DELIVERED).write_text("{}")  # an earlier version's marker, or a job run by hand
    assert start_afresh_if_delivered(root, {}) == previous and not root.exists()
