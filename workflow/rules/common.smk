# The rules' helpers: input functions, params and resource helpers. What runs are and whether they
# can train is decided in the package (imagenet_ddp.settings.runs), process settings in the Snakefile.

import functools
import json
import os
import re
import sys
import time

from snakemake.exceptions import WorkflowError
from snakemake.resources import Resource
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

# What runs while Snakemake parses the rules comes from this workflow's own source tree and
# needs only Snakemake and its dependencies (no torch, numpy or pandas): a dry-run or --lint
# works from a login node's bare Snakemake environment, the package not installed there.
sys.path.insert(0, os.path.join(workflow.basedir, "src"))

from imagenet_ddp.data.archive_names import (
    DEVKIT_ARCHIVE,
    INDEX_FORMAT_VERSION,
    TRAIN_ARCHIVE,
    VAL_ARCHIVE,
)
from imagenet_ddp.jobs.attempts import nodes_ahead, refusal_ahead
from imagenet_ddp.jobs.holders import (
    dependency_flag,
    executor_comment,
    holders_ahead,
    live_jobs,
    same_jobs,
)
from imagenet_ddp.settings.evaluation import eval_settings
from imagenet_ddp.settings.geometry import GEOMETRY_KEYS, on_nodes, slurm_resources
from imagenet_ddp.jobs.spec import SpecError, from_dict, to_dict
from imagenet_ddp.settings.node_memory import node_memory_problems
from imagenet_ddp.preflight.report import known_projection_problems
from imagenet_ddp.data.prepared_layout import FORMAT_VERSION as PREPARED_FORMAT_VERSION
from imagenet_ddp.settings.run_checks import container_problem, user_cache_dir
from imagenet_ddp.settings.runs import RunsError, resolve_runs, written_settings
from imagenet_ddp.settings.kinds import declarations
from imagenet_ddp.data.stage import configured_scratch_problem
from imagenet_ddp.settings.presets import scaled_lr

# Validation fills in the schema's defaults, the one home of every setting's default: the rules
# read config[...] directly. Runs resolve from their entries as written (imagenet_ddp.settings.runs).
_WRITTEN = written_settings(config)
validate(config, "../schemas/config.schema.yaml")
_SCHEMA = os.path.join(workflow.basedir, "workflow/schemas/config.schema.yaml")
# Each run setting's kind (x-kind in the schema): what a change of it reruns.
SETTINGS = declarations(_SCHEMA)

# Every run, resolved (sweeps, presets, train_defaults) and checked: what would fail on the GPU
# node fails here, at the dry-run, one line per problem. Raised here, not in the module, so
# Snakemake shows no traceback beyond this line. torchvision's model names are cached per user
# (importing torch takes seconds).
try:
    RUNS = resolve_runs(config, _WRITTEN, _SCHEMA, cache_dir=user_cache_dir())
except RunsError as error:
    raise WorkflowError(str(error)) from None


def data_dir():
    """The directory holding the ILSVRC2012 archives (the generated demo set if enabled)."""
    if config["demo"]["enabled"]:
        return "resources/demo/ILSVRC2012"
    return config["data"]["dir"]


ARCHIVES = {"train": TRAIN_ARCHIVE, "val": VAL_ARCHIVE, "devkit": DEVKIT_ARCHIVE}


def archive_paths():
    return {key: f"{data_dir()}/{name}" for key, name in ARCHIVES.items()}


def training_settings(name):
    """The run's settings as the worker reads them, geometry included (no `evaluate` or
    `preflight`: the workflow's, imagenet_ddp.settings.kinds)."""
    return SETTINGS.rank_settings(RUNS[name])


def run_rerun_key(wildcards):
    """What reruns the run's train (and preflight) when it changes: its rule param. The
    settings of its checkpoint key (kinds weights, numerics, geometry: imagenet_ddp.settings.kinds),
    a setting added later left out at the value earlier runs had (x-earlier)."""
    rerun = SETTINGS.rerun_settings(RUNS[wildcards.run])
    return json.dumps(rerun, sort_keys=True, separators=(",", ":"))


def preflight_input(wildcards):
    """A passing preflight before `train` for runs with `preflight: true`. Not ancient(): with
    it, Snakemake 9 skips train's params check while the preflight is rerun, so a changed
    setting would rerun the preflight but not the training (seen in a dry-run)."""
    if RUNS[wildcards.run]["preflight"]:
        return f"results/preflight/{wildcards.run}/preflight.json"
    return []


def preflight_reports():
    """The preflight reports of the runs with `preflight: true` (the aggregate table shows
    their projection beside what training measured)."""
    return [
        f"results/preflight/{name}/preflight.json"
        for name, run in RUNS.items()
        if run["preflight"]
    ]


def _runtime_minutes(resources):
    """A rule's `runtime` when it is a number (set-resources parses 24h to 1440); None else."""
    if resources is None or "runtime" not in resources:
        return None
    value = resources["runtime"].value
    return value if isinstance(value, (int, float)) else None


def _train_runtime():
    """The train rule's time limit per allocation in minutes (set-resources, else
    default-resources); None where no limit is set (a local run). An expression (e.g.
    `60 * attempt`) is not evaluated here: None too."""
    overwrite = workflow.resource_settings.overwrite_resources
    minutes = _runtime_minutes(overwrite["train"]) if "train" in overwrite else None
    if minutes is None:
        minutes = _runtime_minutes(workflow.resource_settings.default_resources)
    return minutes


# A run whose last preflight on the same settings projected more allocations of today's train
# runtime than its max_allocations is refused here, before it is queued.
_problems = known_projection_problems(
    {name: training_settings(name) for name in RUNS},
    "results/preflight",
    _train_runtime(),
)
if _problems:
    raise WorkflowError("\n".join(_problems))


def _first_attempt_mb(resource):
    """A mem_mb resource at the first attempt: a number, or `<number> * attempt`; None for
    any other expression (not checked)."""
    if resource is None:
        return None
    if not resource.is_evaluable():
        value = resource.value
        return value if isinstance(value, (int, float)) else None
    match = re.fullmatch(
        r"\s*['\"]?\s*(\d+(?:\.\d+)?)\s*(?:\*\s*attempt)?\s*['\"]?\s*",
        str(resource.raw),
    )
    return float(match.group(1)) if match else None


def _train_mem_mb():
    """The train job's memory per node (sbatch --mem) in MB: set-resources (`mem` is given
    as mem_mb by Snakemake), else default-resources; None where neither sets it (a local
    run: nothing enforces it)."""
    overwrite = workflow.resource_settings.overwrite_resources
    if "train" in overwrite and "mem_mb" in overwrite["train"]:
        return _first_attempt_mb(overwrite["train"]["mem_mb"])
    defaults = workflow.resource_settings.default_resources
    if defaults is not None and "mem_mb" in defaults.keys():
        return _first_attempt_mb(defaults["mem_mb"])
    return None


# Memory per node: each run's training job against train's mem_mb, from the measured and
# estimated per-process figures of imagenet_ddp.settings.node_memory. Above the measured part alone it
# is refused; above measured + estimated (CUDA, compile workers) it is a warning. Checked by
# the Snakemake that submits (a job's own Snakemake has passed it already).
if workflow.is_main_process:
    _refusals, _warnings = node_memory_problems(RUNS, _train_mem_mb())
    for _line in _warnings:
        print(f"warning: {_line}", file=sys.stderr)
    if _refusals:
        raise WorkflowError("\n".join(_refusals))


def run_hyperparameters(wildcards):
    """The run's resolved hyperparameters, one `key=value` each (shown by `snakemake -n -p`):
    review a preset's values before spending GPU hours."""
    run = RUNS[wildcards.run]
    # The kinds shown (imagenet_ddp.settings.kinds.KINDS): the geometry is under resources.
    values = dict(sorted(SETTINGS.shown_settings(run).items()))
    values["lr_used"] = round(scaled_lr(run), 8)  # after lr_scaling
    return " ".join(
        f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in values.items()
    )


# A training job stopped by its time limit, scancel or preemption is resubmitted (Snakemake's
# retries, one rule-wide number); the job itself holds each run to its own max_allocations and
# refuses a retry after two attempts without progress (imagenet_ddp.jobs.attempts). Only the
# Snakemake that submits retries: inside a SLURM job the jobstep's Snakemake would honour a
# rule's retries too and rerun a failed attempt in the same allocation (seen on the test
# cluster: six attempts in one job).
TRAIN_RETRIES = (
    max([run["max_allocations"] for run in RUNS.values()] or [1]) - 1
    if workflow.is_main_process
    else 0
)


def run_setting(key):
    """An input function: the run's setting `key` (its resolved value, imagenet_ddp.settings.runs)."""
    return lambda wildcards: RUNS[wildcards.run][key]


def evaluation_setting(key):
    """An input function: one of the run's evaluation settings (imagenet_ddp.settings.evaluation:
    geometry, loader)."""
    return lambda wildcards: evaluation_settings(wildcards.run)[key]


def eval_threads(wildcards):
    """Cores of a local evaluation: all its ranks' threads."""
    settings = evaluation_settings(wildcards.run)
    return settings["tasks_per_node"] * settings["cpus_per_task"]


def run_settings(run_name):
    """The run's resolved settings: its training geometry and everything else."""
    return RUNS[run_name]


def evaluation_settings(run_name):
    """The run's evaluation settings, on the GPU type it trained on."""
    run = RUNS[run_name]
    return {**eval_settings(config.get("evaluate"), run), "gpu_type": run["gpu_type"]}


def slurm_resource(key, settings=run_settings):
    """An input function: the SLURM resource `key` of the run's `train` job (with
    evaluation_settings: of its `evaluate` job); None drops the resource
    (imagenet_ddp.settings.geometry.slurm_resources).
    """

    def value(wildcards):
        return slurm_resources(settings(wildcards.run))[key]

    return value


# A retry that its job will refuse (imagenet_ddp.jobs.attempts: two attempts in a row without
# progress, or max_allocations reached) only prints why and exits: Snakemake's retries are one
# rule-wide count, so it is still submitted, but as one task on one node without GPUs.
_REFUSED_SHAPE = {"nodes": 1, "cpus_per_task": 1, "tasks_per_node": None, "tasks": None,
                  "gres": None, "mpi": None}  # fmt: skip


@functools.lru_cache(maxsize=None)
def _retry_refused(run, attempt):
    """Whether this retry of `run` will refuse: the attempt record is read once per retry, not
    once per resource (it is complete by then: the previous attempt has ended)."""
    checkpoint_root = f"{CHECKPOINT_DIR}/{run}"
    return bool(refusal_ahead(checkpoint_root, training_settings(run), attempt))


# When this invocation began: the attempt record's entries started since are its own
# (imagenet_ddp.jobs.attempts.choose_nodes). Set once, by the submitting Snakemake, and
# inherited by its jobs (sbatch --export=ALL): a job's own Snakemake evaluates the resources
# again, and must choose the same node count (it decides whether the shell runs in an srun
# step of one node or in the batch step).
INVOCATION_STARTED = float(
    os.environ.setdefault("IMAGENET_DDP_INVOCATION_STARTED", repr(time.time()))
)


@functools.lru_cache(maxsize=None)
def _allocation_settings(run, attempt):
    """The run's settings on the node count this submission asks for: its `nodes`, or one of
    its `fallback_nodes` after a failed or never-started job (read once per retry)."""
    checkpoint_root = f"{CHECKPOINT_DIR}/{run}"
    settings = training_settings(run)
    nodes = nodes_ahead(checkpoint_root, settings, attempt, INVOCATION_STARTED)
    return on_nodes(RUNS[run], nodes)


def train_resource(key):
    """A SLURM resource of `train`: the run's shape on the node count this submission asks
    for, or _REFUSED_SHAPE for a retry that will refuse (asked before each submission, from
    the attempt record beside the checkpoints).
    """

    def value(wildcards, attempt):
        if attempt > 1 and _retry_refused(wildcards.run, attempt):
            return _REFUSED_SHAPE[key]
        settings = _allocation_settings(wildcards.run, attempt)
        if key in ("nodes", "cpus_per_task"):
            return settings[key]
        return slurm_resources(settings)[key]

    return value


# A restarted controller (docs/reliability.md "A controller that dies"): a job whose rule and
# wildcards have a job of an earlier invocation still queued or running in SLURM is submitted
# with --dependency=afterany:<that job> (imagenet_ddp.jobs.holders): it pends for free and runs
# once that one has ended; a train job then resumes where it ended. Through `slurm_extra`,
# after the site's own value (default-resources or set-resources, evaluated as Snakemake
# would): a rule's own resource would be replaced by set-resources, so the composed one takes
# the parsed defaults' and overwrites' place. Only the Snakemake that submits asks squeue.
_LIVE = {"at": 0.0, "jobs": None}


def _live_jobs():
    """This user's live SLURM jobs, asked at most every 10 s (one squeue for a burst of
    submissions); None where squeue cannot answer."""
    if getattr(workflow.executor_plugin, "name", None) != "slurm":
        return {}  # a local run, a dry-run: nothing submits with sbatch
    if time.time() - _LIVE["at"] > 10:
        _LIVE.update(at=time.time(), jobs=live_jobs())
        if _LIVE["jobs"] is None:
            print("warning: squeue cannot say whether jobs of an earlier invocation are still"
                  " in SLURM; jobs are submitted without --dependency (a train job waits at "
                  "start while another job of its run trains)", file=sys.stderr)  # fmt: skip
    return _LIVE["jobs"]


@functools.lru_cache(maxsize=None)
def _jobs_ahead(rulename, values, attempt):
    """The live jobs of an earlier invocation that this job of `rulename` must wait for: for a
    train job the run's (imagenet_ddp.jobs.holders.holders_ahead), else the same rule's with
    the same wildcards."""
    live = _live_jobs()
    if not live:
        return []
    if rulename == "train":
        run = values[0]
        checkpoint_root = f"{CHECKPOINT_DIR}/{run}"
        settings = training_settings(run)
        ids = holders_ahead(checkpoint_root, settings, run, workflow.workdir_init, live)
    else:
        ids = same_jobs(live, executor_comment(rulename, values), workflow.workdir_init)
    if ids:
        print(f"{executor_comment(rulename, values)}: job {', '.join(ids)} of an earlier "
              f"invocation is still in SLURM ({live[ids[-1]]['state']}); this job waits for "
              f"it ({dependency_flag(ids)})", file=sys.stderr)  # fmt: skip
    return ids


def _slurm_extra_after(site):
    def value(wildcards, attempt, rulename, **aux):
        extra = None
        if site is not None:
            given = site.evaluate(wildcards, attempt=attempt, rulename=rulename, **aux)
            extra = given.value
        ids = _jobs_ahead(rulename, tuple(wildcards), attempt)
        return (
            " ".join(filter(None, [extra, dependency_flag(ids) if ids else None]))
            or None
        )

    return value


def _composed(site, raw):
    """A `slurm_extra` Resource: the site's value, then the dependency. `raw`: what a job's own
    Snakemake gets on its command line (it submits nothing)."""
    return Resource("slurm_extra", _slurm_extra_after(site), raw=raw)


if workflow.is_main_process:
    _DEFAULTS = workflow.resource_settings._parsed_default_resources
    _SITE = _DEFAULTS.get("slurm_extra")
    _DEFAULTS["slurm_extra"] = _composed(_SITE, None if _SITE is None else _SITE.raw)
    # a rule's set-resources (profiles/slurm: train's --signal) replaces the default
    for _resources in workflow.resource_settings._parsed_overwrite_resources.values():
        _SITE = _resources.get("slurm_extra")
        if _SITE is not None:
            _resources["slurm_extra"] = _composed(_SITE, _SITE.raw)


def launch_prefix(rule):
    """The command that starts a job's ranks: the rule's `mpi` resource (Snakemake's
    convention for the launch prefix; `--set-resources train:mpi="srun --mpi=pmix"`), plain
    `srun` where the rule sets none. A resource of its own because a rule with one rank must
    not have `mpi` (the SLURM executor refuses it), so its shell cannot read {resources.mpi}.
    """

    def value(wildcards):
        overwritten = workflow.resource_settings.overwrite_resources
        given = overwritten[rule].get("mpi") if rule in overwritten else None
        # A Resource: from the command line an expression (its raw text; quotes optional),
        # in a remote job (SLURM jobstep) the value the submitting Snakemake computed.
        if hasattr(given, "is_evaluable"):
            given = given.raw if given.is_evaluable() else given.value
            if (
                isinstance(given, str)
                and given[:1] in "'\""
                and given[:1] == given[-1:]
            ):
                given = given[1:-1]
        prefix = given if isinstance(given, str) and given.strip() else "srun"
        if os.path.basename(prefix.split()[0]) != "srun":
            raise WorkflowError(
                f"--set-resources {rule}:mpi={prefix!r}: the ranks are started with srun;"
                " give srun and its flags, e.g. 'srun --mpi=pmix'"
            )
        return prefix

    return value


def _execution(rule_name, wildcards, attempt, staged):
    """A job spec's execution block (imagenet_ddp.jobs.spec.Execution): where and how the job
    runs, from the site's settings and the rule's `mpi` resource (launch_prefix). Not results:
    it travels in a resource, so no change of it reruns a finished job."""
    block = {
        "launcher": site_setting("execution", "launcher"),
        "launch_prefix": launch_prefix(rule_name)(wildcards),
        "srun_extra": site_setting("execution", "srun_extra"),
        "attempt": attempt,  # 2, 3, ...: a resubmission (imagenet_ddp.jobs.attempts)
    }
    if staged:  # train and its preflight copy the prepared train set to every node
        stage = config["stage"]
        block["stage"] = {
            "scratch_dir": stage["scratch_dir"],
            "verify": stage["verify"],
            "cleanup": stage["cleanup"],
        }
    return block


def _output(rule_name, key, wildcards):
    """Rule `rule_name`'s output `key` for this run: the output's one home is the rule."""
    return expand(getattr(rules, rule_name).output[key], run=wildcards.run)[0]


def _train_paths(wildcards, input):
    return {
        "prepared_train": input.prepared,
        "split_dir": os.path.dirname(input.split_train),
        "run_dir": os.path.dirname(_output("train", "model", wildcards)),
        "checkpoint_root": f"{CHECKPOINT_DIR}/{wildcards.run}",
    }


def _job_parts(kind, wildcards, input):
    """A spec's parts but its execution block, per kind (imagenet_ddp.jobs.spec)."""
    if kind == "evaluate":
        settings = evaluation_settings(wildcards.run)
        return {
            "geometry": {key: settings[key] for key in GEOMETRY_KEYS},
            "settings": {
                "batch_size": settings["batch_size"],
                "workers": settings["workers"],
            },
            "paths": {
                "model": input.model,
                "prepared_train": input.prepared_train,
                "prepared_val": input.prepared_val,
                "split_dir": os.path.dirname(input.holdout),
                "classes": input.classes,
                "out": _output("evaluate", "metrics", wildcards),
                "per_class": _output("evaluate", "per_class", wildcards),
            },
        }
    parts = {
        "run": training_settings(wildcards.run),
        "paths": _train_paths(wildcards, input),
    }
    if kind == "preflight":
        paths = parts["paths"]
        del paths["run_dir"]
        paths["out"] = _output("preflight_run", "report", wildcards)
        parts["train_runtime_minutes"] = (
            _train_runtime()
        )  # what train's allocations last
    return parts


def job_spec(kind, mpi_rule):
    """A resource: the rule's whole job spec (imagenet_ddp.jobs.spec) as one JSON value for the
    shell's `imagenet-ddp <kind> --job`: the run's settings (or the evaluation's geometry and
    settings), its paths and the execution block, built here once and checked here (a spec the
    job would refuse fails at the dry-run). A resource, not a param: the run's settings hold
    bookkeeping too (log_interval: no rerun of a finished job, imagenet_ddp.settings.kinds); what
    reruns a job is params.rerun_on. As a resource it still reaches every job that starts, so
    a run in progress gets a changed value at its next job. `mpi_rule`: the rule whose `mpi`
    resource starts the ranks (the preflight's are started as train's)."""

    def value(wildcards, input, attempt):
        spec = {
            "kind": kind,
            **_job_parts(kind, wildcards, input),
            "execution": _execution(
                mpi_rule, wildcards, attempt, staged=kind != "evaluate"
            ),
        }
        try:
            spec = to_dict(from_dict(spec, kind))
        except SpecError as error:
            raise WorkflowError(
                f"{kind} job of run {wildcards.run!r}: job spec: {error}"
            )
        return json.dumps(spec)  # kind, run (or geometry), paths, execution

    return value


def run_dirs():
    return [f"results/runs/{name}" for name in RUNS]


def site_setting(section, key):
    """A site's setting (config[section][key]): where/how a job runs. Passed as a resource,
    not a param: it does not change results, so it must not trigger a rerun, and a profile
    may override it with set-resources."""
    return config[section][key]


# The image every job runs in with `--sdm apptainer` (ignored otherwise): built from
# workflow/envs/imagenet-ddp.def. A local image that is missing fails here, at the dry-run.
CONTAINER = config["container"]["image"]
_APPTAINER = (
    DeploymentMethod.APPTAINER in workflow.deployment_settings.deployment_method
)
_problem = container_problem(CONTAINER, apptainer=_APPTAINER)
if _problem:
    raise WorkflowError(_problem)
# A scratch dir every node would share fails here, at the dry-run (each node checks its own
# view again before it copies: src/imagenet_ddp/data/stage.py).
_problem = configured_scratch_problem(site_setting("stage", "scratch_dir"))
if _problem:
    raise WorkflowError(_problem)


# The training-ready copy; point several workflows (or users) at one shared directory to
# prepare ImageNet once: writers are excluded by a lock, readers only see complete copies.
PREPARED_DIR = config["prepare"]["dir"]
CHECKPOINT_DIR = site_setting("execution", "checkpoint_dir")


def md5sums_input(wildcards):
    """md5sums is optional for real data; the demo set always writes one."""
    path = f"{data_dir()}/md5sums"
    if config["demo"]["enabled"] or os.path.exists(path):
        return [path]
    return []


# prepare: one job, or prepare.jobs independent jobs over ranges of shards and a join that
# places their whole shard files (byte for byte the one-job result; src/imagenet_ddp/data/prepare.py).
PREPARE = config["prepare"]
PREPARE_JOBS = PREPARE["jobs"]


# What the copy is made with (a change reruns it); workers are {threads}: no rerun.
def prepare_flags(wildcards):
    return (
        f"--which {wildcards.which} --short-side {PREPARE['short_side']}"
        f" --quality {PREPARE['jpeg_quality']} --on-corrupt {PREPARE['on_corrupt']}"
        f" --shard-samples {PREPARE['shard_samples']}"
    )
