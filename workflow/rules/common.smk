# The rules' helpers: input functions, params and resources. What runs are and whether they can
# train is decided in the package (imagenet_ddp.settings.runs), torch-free: this file runs in
# every parse, the main Snakemake's and each job's own (the SLURM jobstep's), and does the same
# in both. It writes nothing: what must be written is a rule's output.

import json
import os
import re
import sys
import time

from snakemake.exceptions import WorkflowError
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

# What runs while Snakemake parses the rules comes from this workflow's own source tree and
# needs only Snakemake and its dependencies (no torch, numpy or pandas): a dry-run or --lint
# works from a login node's bare Snakemake environment, the package not installed there.
sys.path.insert(0, os.path.join(workflow.basedir, "src"))

from imagenet_ddp import __version__ as PACKAGE_VERSION
from imagenet_ddp.data.layouts import LAYOUTS, dry_run_layout, find_layout
from imagenet_ddp.data.stage import configured_scratch_problem, scratch_in_ram
from imagenet_ddp.errors import InputError
from imagenet_ddp.jobs.attempts import nodes_ahead, refusal_ahead
from imagenet_ddp.jobs.container import host_runtime_env
from imagenet_ddp.jobs.launchers import launcher_problem
from imagenet_ddp.jobs.spec import SpecError, compact_spec
from imagenet_ddp.settings.evaluation import eval_settings
from imagenet_ddp.settings.geometry import (
    GEOMETRY_KEYS,
    global_batch,
    on_nodes,
    slurm_resources,
)
from imagenet_ddp.settings.kinds import declarations, rerun_line
from imagenet_ddp.settings.node_memory import DataSizes, node_memory_problems
from imagenet_ddp.settings.presets import scaled_lr
from imagenet_ddp.settings.run_checks import (
    CHECKED_SETTINGS,
    container_problem,
    optional_component_problems,
    split_sizes,
    warmup_warnings,
)
from imagenet_ddp.settings.runs import RunsError, resolve_runs, written_settings
from imagenet_ddp.settings.stage_versions import STAGE_VERSIONS


def refuse(lines):
    """Stop the parse with ``lines``, each a whole refusal naming config.yaml (or the setting)
    and the fix: one line each, no traceback (a WorkflowError would add the Snakefile's line).
    """
    for line in lines:
        print(line, file=sys.stderr)
    sys.exit(1)


# Validation fills in the schema's defaults, the one home of every setting's default: the rules
# read config[...] directly. Runs resolve from their entries as written (settings.runs).
_WRITTEN = written_settings(config)
validate(config, "../schemas/config.schema.yaml")
_SCHEMA = os.path.join(workflow.basedir, "workflow/schemas/config.schema.yaml")
# Each run setting's kind (x-kind in the schema): what a change of it reruns.
SETTINGS = declarations(_SCHEMA)

# Every run, resolved (sweeps, presets, train_defaults) and checked from the config alone: what
# would fail on the GPU node fails here, one line per problem. What needs torch (a model built
# on the meta device, a weights file's keys) is the local `check` rule's, before any GPU job.
try:
    RUNS = resolve_runs(config, _WRITTEN, _SCHEMA)
except RunsError as error:
    refuse([str(error)])


# A run is one of config.yaml's runs: a target of another name (results/runs/nope/model.pt) is
# "No rule to produce" it, not an input function's KeyError.
wildcard_constraints:
    run="|".join(re.escape(name) for name in RUNS) or "(?!)",


def data_dir():
    """The directory holding the images in one input layout (the generated demo set if
    enabled)."""
    if config["demo"]["enabled"]:
        return "resources/demo/ILSVRC2012"
    return config["data"]["dir"]


def _input_layout():
    """data.dir's input layout (imagenet_ddp.data.layouts), checked where data.dir is mounted;
    where it is not (a typo, or a node without that filesystem), the named layout, and the
    verify rule's missing input names the file Snakemake looks for."""
    where, named = data_dir(), config["data"]["layout"]
    if config["demo"]["enabled"]:
        return LAYOUTS["archives"]  # written by the demo_data rule
    if not os.path.isdir(where):
        print(f"note: data.dir {where} does not exist here", file=sys.stderr)
        return LAYOUTS["archives" if named == "auto" else named]
    try:
        return dry_run_layout(where, named)
    except InputError as error:
        refuse([str(error)])


LAYOUT = _input_layout()


def class_count(wildcards=None):
    """The data's class count (the demo's, or the layout's: a folder count at most), for the
    check of a weights file's classifier."""
    if config["demo"]["enabled"]:
        return config["demo"]["num_classes"]
    return LAYOUT.class_count(data_dir()) if os.path.isdir(data_dir()) else 0


def archive_paths():
    """The verify, index and prepare rules' inputs: the layout's archives or folders."""
    return LAYOUT.inputs(data_dir())


def md5sums_input(wildcards):
    """md5sums is optional for real data; the demo set always writes one."""
    path = f"{data_dir()}/md5sums"
    if LAYOUT.name != "archives":
        return []
    if config["demo"]["enabled"] or os.path.exists(path):
        return [path]
    return []


def training_settings(name):
    """The run's settings as the worker reads them, geometry included (no `evaluate` or
    `preflight`: the workflow's, imagenet_ddp.settings.kinds)."""
    return SETTINGS.rank_settings(RUNS[name])


def run_rerun_settings(wildcards):
    """What reruns the run's train (and preflight): one line `key=value ...` of its checkpoint
    key's settings (kinds weights, numerics, geometry), a frozen format: a setting a newer
    version adds stays off the line while at the value earlier runs had (x-earlier), so an
    upgrade reruns nothing (imagenet_ddp.settings.kinds.rerun_line)."""
    return rerun_line(SETTINGS.rerun_settings(RUNS[wildcards.run]))


# What a training is made from, by content (the data_content checkpoint: the sha256 of the
# prepared copy's content and of the split's files). A checkpoint, so that each job reading
# it is judged again once it has run: a data stage that reruns and makes the same data
# retrains nothing; other images retrain every run (docs/configuration.md "Reruns").
DATA_CONTENT = "results/data/content.json"


def data_content_file(wildcards):
    """Train's and evaluate's input: the data content record, once written (ancient: its time
    is no reason, its digest is their param)."""
    return ancient(checkpoints.data_content.get().output[0])


def data_content(key):
    """A param: the content digest of what a job of this kind reads (train, evaluate)."""

    def value(wildcards):
        with open(checkpoints.data_content.get().output[0]) as f:
            return json.load(f)[key]

    return value


def run_check_file(wildcards):
    """Train's input: the run's check (the checks that need torch), once passed."""
    return ancient(checkpoints.check.get(run=wildcards.run).output[0])


def init_weights_sha256(wildcards):
    """A param: the sha256 of the run's init_weights file as its check read it ('' without a
    file), so another file's content retrains the run and a moved file does not."""
    with open(checkpoints.check.get(run=wildcards.run).output[0]) as f:
        return json.load(f)["init_weights_sha256"]


def check_params(wildcards):
    """What the run's check judges (run_checks.CHECKED_SETTINGS) and its weights file (path,
    size, mtime: a replaced file is read again), on one line."""
    run = RUNS[wildcards.run]
    checked = {k: run.get(k) for k in CHECKED_SETTINGS}
    path = run.get("init_weights") or ""
    try:
        stat = os.stat(path) if path else None
        checked["init_weights"] = (
            f"{path} {stat.st_size} {stat.st_mtime_ns}" if stat else ""
        )
    except OSError:
        checked["init_weights"] = f"{path} missing"
    return rerun_line(checked)


def preflight_input(wildcards):
    """A passing preflight before `train` for runs with `preflight: true`."""
    if RUNS[wildcards.run]["preflight"]:
        return f"results/preflight/{wildcards.run}/preflight.json"
    return []


def preflight_reports():
    """The preflight reports of the runs with `preflight: true` (the aggregate table shows
    their projection beside what training measured)."""
    return [
        f"results/preflight/{n}/preflight.json"
        for n, r in RUNS.items()
        if r["preflight"]
    ]


def _rule_resource(rule, key):
    """A resource that set-resources gives `rule`, else default-resources; a number, a string,
    or None (unset, or an expression such as `60 * attempt`, not evaluated here). Read through
    Snakemake's public ResourceSettings, never changed."""
    settings = workflow.resource_settings
    for resources in (
        settings.overwrite_resources.get(rule),
        settings.default_resources,
    ):
        given = None if resources is None or key not in resources else resources[key]
        if given is not None:
            value = getattr(given, "value", given)
            if isinstance(value, str) and key == "mem_mb":
                match = re.fullmatch(
                    r"\s*['\"]?(\d+(?:\.\d+)?)\s*(\*\s*attempt)?['\"]?\s*", value
                )
                value = float(match.group(1)) if match else None
            return value if isinstance(value, (int, float, str)) else None
    return None


def _train_runtime():
    """The train rule's time limit per allocation in minutes; None where none is set."""
    value = _rule_resource("train", "runtime")
    return value if isinstance(value, (int, float)) else None


def data_sizes():
    """What the memory check needs of the data: the split's sizes from the config (each loader
    worker holds the dataset's arrays) and the train copy staged in RAM where stage.scratch_dir
    is a tmpfs here (imagenet_ddp.data.stage.scratch_in_ram)."""
    train, holdout, _ = split_sizes(config, None)
    in_ram = scratch_in_ram(
        config["stage"]["scratch_dir"],
        f"{config['prepare']['dir']}/train",
        train + holdout,
        config["prepare"]["short_side"],
    )
    return (
        DataSizes(train, holdout)
        if in_ram is None
        else DataSizes(train, holdout, *in_ram)
    )


# Memory per node: each run's training job against train's mem_mb (imagenet_ddp.settings.
# node_memory): refused above the measured per-process figures, a warning above measured +
# estimated. The node checks again before it stages, with its real limit.
_mem_mb = _rule_resource("train", "mem_mb")
_refusals, _warnings = node_memory_problems(
    RUNS, _mem_mb if isinstance(_mem_mb, (int, float)) else None, data_sizes()
)
if _refusals:
    refuse(_refusals)
for _line in _warnings + warmup_warnings(RUNS, config, None):
    print(f"warning: {_line}", file=sys.stderr)


def run_hyperparameters(wildcards):
    """The run's hyperparameters on one compact line (shown by `snakemake -n`): model, epochs,
    batch size, lr, lr_scaling and the LR used, then every shown setting not at the schema's
    default (a preset's values included): review them before spending GPU hours."""
    run = RUNS[wildcards.run]
    shown = SETTINGS.shown_settings(run)
    always = ("model", "epochs", "batch_size", "lr", "lr_scaling")
    values = {k: shown[k] for k in always if k in shown}
    values["global_batch"] = global_batch(run)  # as a published recipe states it
    values["lr_used"] = round(scaled_lr(run), 8)  # after lr_scaling
    values.update(sorted(SETTINGS.changed_from_default(shown).items()))
    return " ".join(
        f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in values.items()
    )


# A training job stopped by its time limit, scancel or preemption is resubmitted (Snakemake's
# retries, one rule-wide number); the job itself holds each run to its own max_allocations and
# refuses a retry after two attempts without progress (imagenet_ddp.jobs.attempts), and a
# retry inside its own allocation (imagenet_ddp.jobs.launch: a rule's retries reach the jobstep,
# snakemake-executor-plugin-slurm#284).
TRAIN_RETRIES = max([run["max_allocations"] for run in RUNS.values()] or [1]) - 1


def run_setting(key):
    """An input function: the run's setting `key` (its resolved value)."""
    return lambda wildcards: RUNS[wildcards.run][key]


def evaluation_settings(run_name):
    """The run's evaluation settings, on the GPU type it trained on."""
    run = RUNS[run_name]
    return {**eval_settings(config.get("evaluate"), run), "gpu_type": run["gpu_type"]}


def evaluation_setting(key):
    return lambda wildcards: evaluation_settings(wildcards.run)[key]


def eval_threads(wildcards):
    """Cores of a local evaluation: all its ranks' threads."""
    settings = evaluation_settings(wildcards.run)
    return settings["tasks_per_node"] * settings["cpus_per_task"]


def slurm_resource(key, settings=lambda name: RUNS[name]):
    """An input function: the SLURM resource `key` of the run's `train` job (with
    evaluation_settings: of its `evaluate` job); None drops the resource."""
    return lambda wildcards: slurm_resources(settings(wildcards.run))[key]


# A retry that its job will refuse (max_allocations reached, or two attempts without progress)
# only prints why and exits: Snakemake's retries are one rule-wide count, so it is still
# submitted, but as one task on one node without GPUs.
_REFUSED_SHAPE = {"nodes": 1, "cpus_per_task": 1, "tasks_per_node": None, "tasks": None,
                  "gres": None, "mpi": None}  # fmt: skip

# When this invocation began: the attempt record's entries started since are its own
# (imagenet_ddp.jobs.attempts.choose_nodes). Inherited by its jobs (sbatch --export=ALL), whose
# own Snakemake must choose the same node count.
INVOCATION_STARTED = float(
    os.environ.setdefault("IMAGENET_DDP_INVOCATION_STARTED", repr(time.time()))
)


def train_resource(key):
    """A SLURM resource of `train`: the run's shape on the node count this submission asks
    for (its `nodes`, or one of its `fallback_nodes` after a job that never started), or
    _REFUSED_SHAPE for a retry that will refuse: read from the attempt record."""

    def value(wildcards, attempt):
        root, settings = f"{CHECKPOINT_DIR}/{wildcards.run}", training_settings(
            wildcards.run
        )
        if attempt > 1 and refusal_ahead(root, settings, attempt):
            return _REFUSED_SHAPE[key]
        nodes = nodes_ahead(root, settings, attempt, INVOCATION_STARTED)
        shaped = on_nodes(RUNS[wildcards.run], nodes)
        return (
            shaped[key]
            if key in ("nodes", "cpus_per_task")
            else slurm_resources(shaped)[key]
        )

    return value


def train_slurm_extra(wildcards):
    """train's sbatch flags: its stop warning (the ranks checkpoint and exit 75 on SIGUSR1,
    docs/reliability.md), then the site's own (execution.slurm_extra). A rule resource, so a
    profile's default-resources cannot drop the warning; a profile's set-resources for train's
    slurm_extra replaces both (the dry-run shows it)."""
    execution = config["execution"]
    return f"--signal={execution['stop_signal']} {execution['slurm_extra']}".strip()


def launch_prefix(rule):
    """The command that starts a job's ranks: the rule's `mpi` resource (Snakemake's launch
    prefix; `--set-resources train:mpi="srun --mpi=pmix"`), plain `srun` where none is set.
    Read here because a rule with one rank must not have `mpi` (the SLURM executor refuses it),
    so its shell cannot read {resources.mpi}."""
    given = _rule_resource(rule, "mpi")
    prefix = (
        given.strip("'\"") if isinstance(given, str) and given.strip("'\" ") else "srun"
    )
    if os.path.basename(prefix.split()[0]) != "srun":
        refuse([f"--set-resources {rule}:mpi={prefix!r}: the ranks are started with srun;"
                " give srun and its flags, e.g. 'srun --mpi=pmix'"])  # fmt: skip
    return prefix


LAUNCH_PREFIX = {rule: launch_prefix(rule) for rule in ("train", "evaluate")}


def _execution(rule_name, attempt, staged):
    """A job spec's execution block (imagenet_ddp.jobs.spec.Execution): where and how the job
    runs. Not results: it travels in a resource, so no change of it reruns a finished job.
    """
    execution = config["execution"]
    block = {
        "launcher": execution["launcher"],
        "launch_prefix": LAUNCH_PREFIX[rule_name],
        "srun_extra": execution["srun_extra"],
        "attempt": attempt,  # 2, 3, ...: a resubmission (imagenet_ddp.jobs.attempts)
    }
    if staged:  # train and its preflight copy the prepared train set to every node
        block["stage"] = {
            k: config["stage"][k] for k in ("scratch_dir", "verify", "cleanup")
        }
    return block


def _job_parts(kind, wildcards):
    """A spec's parts but its execution block, per kind (imagenet_ddp.jobs.spec)."""
    run, paths = wildcards.run, {"prepared_train": prepared_manifest("train")}
    if kind == "evaluate":
        settings = evaluation_settings(run)
        paths.update(
            model=f"results/runs/{run}/model.pt",
            prepared_val=prepared_manifest("val"),
            split_dir="results/split",
            classes="results/index/classes.csv",
            out=f"results/runs/{run}/eval.json",
            per_class=f"results/runs/{run}/per_class.csv",
        )
        return {
            "geometry": {key: settings[key] for key in GEOMETRY_KEYS},
            "settings": {
                "batch_size": settings["batch_size"],
                "workers": settings["workers"],
            },
            "paths": paths,
        }
    paths.update(split_dir="results/split", checkpoint_root=f"{CHECKPOINT_DIR}/{run}")
    if kind == "preflight":
        paths["out"] = f"results/preflight/{run}/preflight.json"
        return {"run": training_settings(run), "paths": paths,
                "train_runtime_minutes": _train_runtime()}  # fmt: skip
    paths["run_dir"] = f"results/runs/{run}"
    return {"run": training_settings(run), "paths": paths}


def job_spec(kind, mpi_rule):
    """A resource: the job's whole spec as compact JSON (imagenet_ddp.jobs.spec.compact_spec:
    the run's settings not at their default, its paths, the execution block), checked here (a
    spec the job would refuse fails at the dry-run), for the shell's `imagenet-ddp <kind>
    --job`. A resource, not a param: the spec holds bookkeeping too (log_interval, the
    launcher: no rerun of a finished job); what reruns a job is its params. As a resource it
    reaches every job that starts, so a run in progress gets a changed value at its next job.
    `mpi_rule`: the rule whose `mpi` starts the ranks (the preflight's start as train's).
    """

    def value(wildcards, attempt):
        spec = {
            "kind": kind,
            **_job_parts(kind, wildcards),
            "execution": _execution(mpi_rule, attempt, staged=kind != "evaluate"),
        }
        try:
            return compact_spec(spec, SETTINGS, PACKAGE_VERSION)
        except SpecError as error:
            raise WorkflowError(
                f"{kind} job of run {wildcards.run!r}: job spec: {error}"
            )

    return value


def run_dirs():
    return [f"results/runs/{name}" for name in RUNS]


# The image every job runs in with `--sdm apptainer` (ignored otherwise): built from
# workflow/envs/imagenet-ddp.def. A local image that is missing fails here, at the dry-run.
CONTAINER = config["container"]["image"]
_SDM = workflow.deployment_settings.deployment_method
_APPTAINER = DeploymentMethod.APPTAINER in _SDM
_problems = [container_problem(CONTAINER, apptainer=_APPTAINER)]
# The srun tasks of a containerised job run the host's apptainer, by the absolute path this
# Snakemake resolves here: the container's PATH lacks a module's apptainer (jobs.container).
if _APPTAINER:
    os.environ.update(host_runtime_env())
# A run that asks for W&B or MLflow where the jobs' environment lacks it would train untracked.
_problems += optional_component_problems(
    RUNS,
    deployment=(
        "apptainer" if _APPTAINER else "conda" if DeploymentMethod.CONDA in _SDM else ""
    ),
)
# A scratch dir every node would share (each node checks its own view again before it copies).
_problems.append(configured_scratch_problem(config["stage"]["scratch_dir"]))
_problem = launcher_problem(config["execution"]["launcher"])
_problems.append(_problem and f"config.yaml: {_problem}")
if any(_problems):
    refuse([p for p in _problems if p])


# The training-ready copy; point several workflows (or users) at one shared directory to
# prepare ImageNet once: writers are excluded by a lock, readers only see complete copies.
# Each copy's name is the digest of what it is made from; this workflow's `prepare` output is
# a manifest under results/ naming it (imagenet_ddp.data.prepared_layout), which each job that
# reads the copy resolves when it starts: no copy is ever an output.
PREPARED_DIR = config["prepare"]["dir"]


def prepared_manifest(which):
    return f"results/prepared/{which}.json"


CHECKPOINT_DIR = config["execution"]["checkpoint_dir"]
VERIFY_REPORT = "results/verify/report.json"

# prepare: one job, or prepare.jobs independent jobs over ranges of shards and a join that
# places their whole shard files (byte for byte the one-job result; data/prepare.py).
PREPARE = config["prepare"]
PREPARE_JOBS = PREPARE["jobs"]


# What the copy is made with (a change reruns it); workers are {threads}: no rerun.
def prepare_flags(wildcards):
    return (
        f"--which {wildcards.which} --short-side {PREPARE['short_side']}"
        f" --quality {PREPARE['jpeg_quality']} --on-corrupt {PREPARE['on_corrupt']}"
        f" --shard-samples {PREPARE['shard_samples']}"
    )
