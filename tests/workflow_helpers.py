"""Helpers for tests that run the real `snakemake` on a copy of the workflow."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


def with_schema_defaults(config: dict) -> dict:
    """A copy of ``config`` with the schema's defaults filled in, as workflow/rules/common.smk
    validates it; ``runs`` stay as written (common.smk merges them over train_defaults)."""
    from snakemake.utils import validate

    filled = copy.deepcopy(config)
    validate(filled, str(SCHEMA))
    filled["runs"] = copy.deepcopy(config["runs"])
    return filled


def run_settings(**settings) -> dict:
    """A run's settings as the train rule passes them to the worker (every key, the schema's
    defaults filled in), then ``settings``, "auto" made the model family's value. The geometry
    is left out unless given: a rank started by hand (torchrun) reads it from the ranks that
    started."""
    from imagenet_ddp.settings.geometry import GEOMETRY_KEYS
    from imagenet_ddp.settings.kinds import declarations
    from imagenet_ddp.settings.runs import per_family

    properties = yaml.safe_load(SCHEMA.read_text())["definitions"]["run_settings"]["properties"]
    defaults = {k: v["default"] for k, v in properties.items() if "default" in v}
    passed = declarations(SCHEMA).rank_settings(defaults)  # as the rule passes them
    for key in GEOMETRY_KEYS:
        passed.pop(key, None)
    return per_family({"run": "run", **passed, **settings})


def shown_specs(text: str, kind: str, workdir: Path | None = None) -> list[dict]:
    """The job specs of ``kind`` that ``snakemake -n -p`` printed (each rule's `--job '<JSON>'`,
    workflow/rules/common.smk job_spec), in order, each run's settings completed as the job
    completes them (imagenet_ddp.jobs.spec)."""
    import json

    from imagenet_ddp.jobs.spec import _from_compact

    found = re.findall(r"--job '(\{.*?\})'", text)
    specs = [_from_compact(json.loads(spec)) for spec in found]
    return [spec for spec in specs if spec["kind"] == kind]


def make_job(kind: str = "train", run: dict | None = None, root="/nowhere", **given):
    """A typed job spec (imagenet_ddp.jobs.spec) for a test: ``run`` (train, preflight) or its
    geometry (evaluate), each path ``root/<name>`` unless given, a local launcher and default
    staging unless ``launcher``, ``launch_prefix``, ``srun_extra``, ``scratch_dir``,
    ``verify``, ``cleanup``, ``attempt``, ``batch_size``, ``workers``, ``device`` or
    ``train_runtime_minutes`` say otherwise."""
    import dataclasses

    from imagenet_ddp.jobs import spec as J
    from imagenet_ddp.settings.geometry import Geometry

    run = run if run is not None else {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1}
    stage = J.Stage(given.pop("scratch_dir", ""), given.pop("verify", "size"),
                    given.pop("cleanup", True))  # fmt: skip
    execution = J.Execution(
        given.pop("launcher", "local"), given.pop("launch_prefix", "srun"),
        given.pop("srun_extra", ""),
        attempt=given.pop("attempt", 1), stage=None if kind == "evaluate" else stage,
    )  # fmt: skip
    path_class = {"train": J.TrainPaths, "preflight": J.PreflightPaths, "evaluate": J.EvalPaths}
    paths = path_class[kind](
        **{f.name: Path(given.pop(f.name, Path(root) / f.name))
           for f in dataclasses.fields(path_class[kind])}
    )  # fmt: skip
    if kind == "evaluate":
        settings = J.EvalSettings(given.pop("batch_size", 3), given.pop("workers", 0),
                                  given.pop("device", "cpu"))  # fmt: skip
        job = J.EvalJob(Geometry.of(run), settings, paths, execution)
    elif kind == "preflight":
        job = J.PreflightJob(
            run, paths, execution, train_runtime_minutes=given.pop("train_runtime_minutes", None)
        )
    else:
        job = J.TrainJob(run, paths, execution)
    assert not given, f"make_job: unknown {sorted(given)}"
    return job


def train_config(**settings):
    """The worker's TrainConfig of :func:`run_settings`."""
    from imagenet_ddp.settings.kinds import TrainConfig

    return TrainConfig.from_dict(run_settings(**settings))


# Small enough for 2 CPU cores, large enough that a ResNet-18 learns well above chance.
TINY_CONFIG_OVERRIDES = {
    "demo": {
        "enabled": True,
        "num_classes": 6,
        "train_per_class": 60,
        "val_per_class": 10,
        "image_size": 48,
        "seed": 0,
    },
    "prepare": {"short_side": 40, "jpeg_quality": 90, "on_corrupt": "fail", "workers": 2},
    "train_defaults_update": {
        "epochs": 3,
        "batch_size": 16,
        "lr": 0.05,
        "lr_scaling": "none",  # the tiny runs' tuned LR, whatever their global batch
        "warmup_epochs": 0,  # tuned without the demo's warm-up
        "crop_size": 32,
        "eval_resize": 36,
        "workers": 0,
        "log_interval": 5,
    },
}


def copy_workflow(
    dest: Path,
    *,
    runs: list[dict] | None = None,
    as_shipped: bool = False,
    stage: dict | None = None,
) -> Path:
    """Copy Snakefile, config, workflow/ and profiles/ to ``dest`` with a tiny demo config
    (``as_shipped``: the repository's config.yaml unchanged, the demo a new user runs).
    ``stage``: the config's ``stage`` section (on the local SLURM cluster: its nodes' scratch,
    ``Cluster.node_scratch_config()``, as a site user sets their node-local disk)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "Snakefile", dest / "Snakefile")
    for name in ("workflow", "profiles"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    if as_shipped:
        shutil.copy(REPO / "config.yaml", dest / "config.yaml")
        return dest
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["demo"] = dict(TINY_CONFIG_OVERRIDES["demo"])
    config["prepare"] = dict(TINY_CONFIG_OVERRIDES["prepare"])
    config["train_defaults"].update(TINY_CONFIG_OVERRIDES["train_defaults_update"])
    if runs is not None:
        config["runs"] = runs
    if stage is not None:
        config["stage"] = stage
    write_config(dest, config)
    return dest


def read_config(workdir: Path) -> dict:
    return yaml.safe_load((workdir / "config.yaml").read_text())


def write_config(workdir: Path, config: dict) -> None:
    (workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def snakemake(
    workdir: Path, *args: str, check: bool = True, timeout: float = 900
) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [*SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
        )
    return result


def job_snakemake(
    workdir: Path, job: str, *set_resources: str, check: bool = False
) -> subprocess.CompletedProcess:
    """Parse the workflow as a SLURM job's own Snakemake does: the arguments of the plugin's
    `sbatch --wrap` (captured from snakemake-executor-plugin-slurm 2.8.0 with a fake sbatch:
    `--mode remote`, `--target-jobs`, `--set-resources` base64-encoded), plus `-n`, so the
    parse and the job's resources run and nothing executes. ``job``: `rule:wildcard=value`."""
    import base64

    encoded = [f"base64//{base64.b64encode(r.encode()).decode()}" for r in set_resources]
    args = [
        "--snakefile", "Snakefile", "--target-jobs", job, "--allowed-rules", job.split(":")[0],
        "--cores", "all", "--attempt", "1", "--force-use-threads", "--force",
        "--target-files-omit-workdir-adjustment", "--max-inventory-time", "0", "--retries", "0",
        "--nocolor", "--no-hooks", "--nolock", "--ignore-incomplete",
        *(["--set-resources", *encoded] if encoded else []),
        "--executor", "slurm-jobstep", "--jobs", "1", "--mode", "remote", "-n",
    ]  # fmt: skip
    return snakemake(workdir, *args, check=check)


def planned_jobs(workdir: Path, *args: str) -> dict[str, int]:
    """Rule -> job count that a dry-run plans (empty when there is nothing to do)."""
    result = snakemake(workdir, "-n", *args)
    text = result.stdout + result.stderr
    counts: dict[str, int] = {}
    table = text.split("Job stats:", 1)
    if len(table) < 2:
        return counts
    for line in table[1].splitlines()[3:]:
        match = re.fullmatch(r"\s*(\w+)\s+(\d+)\s*", line)
        if not match:
            break
        if match.group(1) != "total":
            counts[match.group(1)] = int(match.group(2))
    return counts


def output_within(proc: subprocess.Popen, timeout: float, *, head: str = "") -> str:
    """The rest of a process's output, failing (not hanging the suite) if it does not end.

    On a hang every process of the process group gets SIGUSR2 first (ranks dump their Python
    tracebacks on it, see imagenet_ddp.training.worker.main), then the group is killed; the failure
    shows the process list and the output.
    """
    import os
    import signal
    import time

    try:
        return head + proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        listing = subprocess.run(
            ["ps", "-o", "pid,ppid,stat,wchan:24,etime,args", "-g", str(proc.pid)],
            capture_output=True,
            text=True,
        ).stdout
        for sig in (signal.SIGUSR2, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(3)
        rest = proc.communicate()[0]
        raise AssertionError(
            f"process group {proc.pid} still running after {timeout} s:\n{listing}\n"
            f"--- output (tracebacks after SIGUSR2 at the end) ---\n{(head + rest)[-12000:]}"
        ) from None
