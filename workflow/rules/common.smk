# The rules' helpers: input functions, params and resources; the logic is the package's. This
# file runs in every parse (the main Snakemake's and each job's own), the same in both, and
# writes nothing: what must be written is a rule's output.

import json
import os
import re
import sys
import time

from snakemake.exceptions import WorkflowError
from snakemake.settings.types import DeploymentMethod

# This workflow's folder (Snakefile's): where it is used as a `module`, workflow.basedir is the
# using workflow's. What runs at parse comes from its own source tree, src/ beside it, and needs
# only Snakemake and its dependencies: a dry-run or --lint works in a login node's bare Snakemake
# environment. A copy of the workflow without src/ parses with the installed package.
WORKFLOW_DIR = os.path.dirname(os.path.dirname(str(workflow.current_basedir)))
sys.path.insert(0, os.path.join(WORKFLOW_DIR, "src"))

from imagenet_ddp import __version__ as PACKAGE_VERSION  # report.smk's param
from imagenet_ddp.data.layouts import LAYOUTS, dry_run_layout
from imagenet_ddp.errors import InputError
from imagenet_ddp.jobs.container import host_args_env, host_runtime_env
from imagenet_ddp.jobs.holders import stop_watching, watch_invocation
from imagenet_ddp.jobs.site import (
    launch_prefix,
    memory_problems,
    site_problems,
    stop_warning_problem,
    train_resources,
)
from imagenet_ddp.jobs.spec import PREPARED, SpecError
from imagenet_ddp.jobs.spec import job_spec as spec_json
from imagenet_ddp.settings.evaluation import eval_settings
from imagenet_ddp.settings.geometry import slurm_resources
from imagenet_ddp.settings.kinds import declarations, hyperparameter_line, load_schema
from imagenet_ddp.settings.kinds import rerun_line
from imagenet_ddp.settings.run_checks import CHECKED_SETTINGS, reference_notes
from imagenet_ddp.settings.run_checks import warmup_warnings
from imagenet_ddp.settings.notices import summarised
from imagenet_ddp.settings.run_checks import report_settings, training_warnings
from imagenet_ddp.settings.runs import RunsError, resolve_runs, written_settings
from imagenet_ddp.settings.runs import config_problems
from imagenet_ddp.jobs.stage_versions import STAGE_VERSIONS
from imagenet_ddp.jobs.plan import DATA_CONTENT, RerunKeys, RuleResources, refuse

# The version this plan is made with: every `imagenet-ddp` command of its jobs refuses to run
# another (imagenet_ddp.cli, exit 2). Inherited by the jobs' own Snakemake (sbatch
# --export=ALL), which keeps the plan's where its checkout has changed since.
# The main Snakemake's parse sets it first; each job's own parse inherits it.
MAIN_PARSE = "IMAGENET_DDP_PLAN_VERSION" not in os.environ
os.environ.setdefault("IMAGENET_DDP_PLAN_VERSION", PACKAGE_VERSION)


# Validation fills in the schema's defaults (their one home); runs resolve as written.
_WRITTEN = written_settings(config)
_SCHEMA = os.path.join(WORKFLOW_DIR, "workflow/schemas/config.schema.yaml")
_SCHEMA_DOC = load_schema(_SCHEMA)  # read once: validation and the runs' resolution
_problems = config_problems(
    config, _SCHEMA_DOC
)  # as snakemake.utils.validate, one line each
if _problems:
    refuse(_problems)
SETTINGS = declarations(_SCHEMA)

# Every run, resolved (sweeps, presets, train_defaults) and checked from the config alone: what
# would fail on the GPU node fails here, one line per problem. What needs torch (a model built
# on the meta device, a weights file's keys) is the local `check` rule's, before any GPU job.
try:
    RUNS = resolve_runs(config, _WRITTEN, _SCHEMA_DOC)
except RunsError as error:
    refuse([str(error)])


# A target of no configured run (results/runs/nope/model.pt) is "No rule to produce" it.
wildcard_constraints:
    run="|".join(re.escape(name) for name in RUNS) or "(?!)",


def data_dir():
    """The directory holding the images (the generated demo set if enabled)."""
    if config["demo"]["enabled"]:
        return "resources/demo/ILSVRC2012"
    return config["data"]["dir"]


def _input_layout():
    """data.dir's input layout (data.layouts), checked where data.dir is mounted; elsewhere
    the named one (verify's missing input then names the file Snakemake looks for)."""
    where, named = data_dir(), config["data"]["layout"]
    if config["demo"]["enabled"]:
        return LAYOUTS["archives"]  # written by the demo_data rule
    if not os.path.isdir(where):
        print(f"note: data.dir {where} does not exist here", file=sys.stderr)
        return LAYOUTS["archives" if named == "auto" else named]
    try:
        layout = dry_run_layout(where, named)
    except InputError as error:
        refuse([str(error)])
    print(f"data: {layout.summary} found in data.dir {where}", file=sys.stderr)
    return layout


LAYOUT = _input_layout()


def class_count(wildcards=None):
    """The data's class count (the demo's or the layout's), for a weights file's check."""
    if config["demo"]["enabled"] or not os.path.isdir(data_dir()):
        return config["demo"]["num_classes"] if config["demo"]["enabled"] else 0
    return LAYOUT.class_count(data_dir())


def archive_paths():  # verify's, index's and prepare's inputs: the archives or folders
    return LAYOUT.inputs(data_dir())


def md5sums_input(wildcards):  # optional for real data; the demo set always writes one
    path = f"{data_dir()}/md5sums"
    present = config["demo"]["enabled"] or os.path.exists(path)
    return [path] if LAYOUT.name == "archives" and present else []


def training_settings(name):
    """The run's settings as the rank gets them (imagenet_ddp.settings.kinds)."""
    return SETTINGS.rank_settings(RUNS[name])


# What reruns a run's train and evaluate, by path: its rerun key's file (imagenet_ddp.jobs.plan
# RerunKeys, which the key rule writes; jobs.rerun_keys).
KEYS = RerunKeys(workflow, checkpoints, config, RUNS, SETTINGS)
key_file, key_files = KEYS.key_file, KEYS.key_files
key_records, key_content = KEYS.key_records, KEYS.key_content


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
    path = f"results/preflight/{wildcards.run}/preflight.json"
    return [path] if RUNS[wildcards.run]["preflight"] else []


def preflight_reports():
    """The reports of the runs with `preflight: true` (aggregate shows their projection)."""
    return [
        f"results/preflight/{n}/preflight.json"
        for n, r in RUNS.items()
        if r["preflight"]
    ]


# What set-resources gives train and evaluate, under a `module`'s prefix too (imagenet_train):
# named here, while this file's rules are named.
RESOURCES = RuleResources(workflow)
TRAIN_RUNTIME = RESOURCES.number("train", "runtime")  # minutes per allocation, or None


# Memory per node: each run's training job against train's mem_mb (settings.node_memory):
# refused above the measured per-process figures, a warning above measured + estimated. The
# node checks again before it stages, with its real limit.
_mem_mb = RESOURCES.number("train", "mem_mb")
_refusals, _warnings = memory_problems(RUNS, config, _mem_mb, PREPARED.format("train"))
if _refusals:
    refuse(_refusals)
for _line in summarised(
    _warnings + warmup_warnings(RUNS, config) + reference_notes(RUNS)
):
    print(f"warning: {_line}", file=sys.stderr)  # one line per kind, naming the runs
# Too few steps for BatchNorm, no steady-state window, an adaptive optimizer's lr scaled down.
for _line in summarised(training_warnings(RUNS, config)):
    print(f"warning: {_line}", file=sys.stderr)

# report.target_top1 by run and the sweeps' axes: aggregate's param (settings.run_checks).
_report_problems, REPORT_SETTINGS = report_settings(config, RUNS)
if _report_problems:
    refuse(_report_problems)


def run_hyperparameters(wildcards):
    """train's `hyperparameters` param, shown by `snakemake -n` (settings.kinds)."""
    return hyperparameter_line(RUNS[wildcards.run], SETTINGS, compact=True)


# A training job stopped by its time limit, scancel or preemption is resubmitted (Snakemake's
# retries, one rule-wide number); the job itself holds each run to its own max_allocations and
# refuses a retry after two attempts without progress (imagenet_ddp.jobs.attempts), and a
# retry inside its own allocation (imagenet_ddp.jobs.launch: a rule's retries reach the jobstep,
# snakemake-executor-plugin-slurm#284).
TRAIN_RETRIES = max([run["max_allocations"] for run in RUNS.values()] or [1]) - 1


def evaluation_settings(run_name):
    """The run's evaluation settings, on the GPU type it trained on."""
    run = RUNS[run_name]
    return {**eval_settings(config.get("evaluate"), run), "gpu_type": run["gpu_type"]}


def eval_threads(wildcards):
    """Cores of a local evaluation: all its ranks' threads."""
    settings = evaluation_settings(wildcards.run)
    return settings["tasks_per_node"] * settings["cpus_per_task"]


def job_resource(key, settings=lambda name: RUNS[name]):
    """An input function: the SLURM resource `key` of the run's preflight (with
    evaluation_settings: its `evaluate` job); None drops the resource."""

    def value(wildcards):
        shape = settings(wildcards.run)
        nodes, cpus = shape["nodes"], shape["cpus_per_task"]
        return {**slurm_resources(shape), "nodes": nodes, "cpus_per_task": cpus}[key]

    return value


# When this invocation began: the attempt record's entries started since are its own
# (imagenet_ddp.jobs.attempts.choose_nodes). Inherited by its jobs (sbatch --export=ALL), whose
# own Snakemake must choose the same node count.
INVOCATION_STARTED = float(
    os.environ.setdefault("IMAGENET_DDP_INVOCATION_STARTED", repr(time.time()))
)


def train_resource(key):
    """A SLURM resource of `train` (imagenet_ddp.jobs.site.train_resources): the shape this
    submission asks for, or one task without GPUs for a retry that will refuse."""

    def value(wildcards, attempt):
        name = wildcards.run
        root = f"{CHECKPOINT_DIR}/{name}"
        shape = train_resources(RUNS[name], training_settings(name), root, attempt,
                                INVOCATION_STARTED)  # fmt: skip
        return shape[key]

    return value


STAGING = (
    config["stage"]["scratch_dir"] or "$SLURM_TMPDIR|$TMPDIR|/tmp,chosen-on-each-node"
)


def train_slurm_extra(wildcards):
    """train's sbatch flags: its stop warning (the ranks checkpoint and exit 75 on SIGUSR1,
    docs/reliability.md), then the site's own (execution.slurm_extra). A rule resource, so a
    profile's default-resources cannot drop the warning; a profile's set-resources for train's
    slurm_extra replaces both (the dry-run shows it)."""
    execution = config["execution"]
    return f"--signal={execution['stop_signal']} {execution['slurm_extra']}".strip()


# The command that starts a job's ranks: the rule's `mpi` resource, read here because a rule
# with one rank must not have `mpi` (the SLURM executor refuses it), so its shell cannot read
# {resources.mpi}.
LAUNCH_PREFIX = {}
for _name in ("train", "evaluate"):
    LAUNCH_PREFIX[_name], _problem = launch_prefix(
        RESOURCES.names[_name], RESOURCES.value(_name, "mpi")
    )
    if _problem:
        refuse([_problem])


def job_spec(kind, mpi_rule):
    """A resource: the job's whole spec as compact JSON (imagenet_ddp.jobs.spec.job_spec: the
    run's settings not at their default, its paths, where and how it runs), checked here (a
    spec the job would refuse fails at the dry-run). A resource, not a param: it holds
    bookkeeping too (log_interval, the launcher), which reruns no finished job; as a resource
    it reaches every job that starts. `mpi_rule`: whose `mpi` starts the ranks."""

    def value(wildcards, attempt):
        name = wildcards.run
        settings = (
            evaluation_settings(name) if kind == "evaluate" else training_settings(name)
        )
        rung = getattr(
            wildcards, "epoch", None
        )  # train_rung's stage (settings.halving)
        stage = (
            {"stop_epoch": int(rung), "run_dir": f"results/runs/{name}/rungs/{rung}"}
            if rung
            else {}
        )
        try:
            return spec_json(kind, name, settings, config, attempt=attempt,
                             launch_prefix=LAUNCH_PREFIX[mpi_rule],
                             train_runtime=TRAIN_RUNTIME,
                             **stage)  # fmt: skip
        except SpecError as error:
            raise WorkflowError(f"{kind} job of run {name!r}: job spec: {error}")

    return value


def run_dirs():
    return [
        f"results/runs/{name}" for name in RUNS
    ]  # every run's folder, for the tables


# The image every job runs in with `--sdm apptainer` (built from workflow/envs/imagenet-ddp.def),
# and what would fail every job of the site (a missing local image, a component the jobs'
# environment lacks, a shared scratch dir, an unknown launcher, a train time limit within its
# stop warning): one line each.
CONTAINER = config["container"]["image"]
_SDM = workflow.deployment_settings.deployment_method
_APPTAINER = DeploymentMethod.APPTAINER in _SDM
_problems = site_problems(
    config, RUNS, apptainer=_APPTAINER, conda=DeploymentMethod.CONDA in _SDM
)
# train's time limit against its stop warning, from the slurm_extra train is submitted with
_extra = RESOURCES.value("train", "slurm_extra", False) or train_slurm_extra(None)
_problems += filter(None, [stop_warning_problem(TRAIN_RUNTIME, _extra)])
if _problems:
    refuse(_problems)
# The srun tasks of a containerised job run the host's apptainer, by the absolute path this
# Snakemake resolves here: the container's PATH lacks a module's apptainer; with the binds of
# the rule's --apptainer-args, which srun's tasks do not inherit (jobs.container).
if _APPTAINER:
    os.environ.update(host_runtime_env())
    os.environ.update(host_args_env(workflow.deployment_settings.apptainer_args))


# The training-ready copy; point several workflows (or users) at one shared directory to
# prepare ImageNet once: writers are excluded by a lock, readers only see complete copies.
# Each copy's name is the digest of what it is made from; this workflow's `prepare` output is
# a manifest under results/ naming it (imagenet_ddp.data.prepared_layout), which each job that
# reads the copy resolves when it starts: no copy is ever an output.
PREPARED_DIR = config["prepare"]["dir"]


def prepared_manifest(which):
    return PREPARED.format(which)


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


# Printed by the main Snakemake's parse only, not by each job's own.
if MAIN_PARSE:
    for _line in KEYS.changed():
        print(_line, file=sys.stderr)


# Successive halving (sweep[i].prune; imagenet_ddp.settings.halving): a pruned sweep's runs
# train in stages (train_rung), each rung's `prune` checkpoint keeps the best, and rung_final
# copies a run's last stage into its run folder (imagenet_ddp.jobs.plan.SweepStages).
from imagenet_ddp.settings.halving import halvings, plan_lines
from imagenet_ddp.jobs.plan import SweepStages

HALVINGS, _problems = halvings(config, _WRITTEN, RUNS)
if _problems:
    refuse(_problems)
STAGES = SweepStages(checkpoints, HALVINGS)
HALVING_OF, PRUNE_DECISIONS = STAGES.of_run, STAGES.decisions
_names = lambda names: "|".join(re.escape(n) for n in names) or "(?!)"
PRUNED_RUNS = _names(HALVING_OF)
UNPRUNED_RUNS = _names([n for n in RUNS if n not in HALVING_OF])
if MAIN_PARSE:
    for _line in plan_lines(HALVINGS, RUNS):
        print(_line, file=sys.stderr)
