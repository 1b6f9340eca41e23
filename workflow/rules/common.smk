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
from snakemake.settings.enums import PersistenceBackend
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

# What runs while Snakemake parses the rules comes from this workflow's own source tree and
# needs only Snakemake and its dependencies (no torch, numpy or pandas): a dry-run or --lint
# works from a login node's bare Snakemake environment, the package not installed there.
sys.path.insert(0, os.path.join(workflow.basedir, "src"))

from imagenet_ddp.data.archive_names import INDEX_FORMAT_VERSION
from imagenet_ddp.data.layouts import LAYOUTS, dry_run_layout, find_layout
from imagenet_ddp.errors import InputError
from imagenet_ddp.jobs.attempts import nodes_ahead, refusal_ahead
from imagenet_ddp.jobs.container import host_runtime_env
from imagenet_ddp.jobs.launchers import launcher_problem
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
from imagenet_ddp.jobs.spec import store as store_spec
from imagenet_ddp.settings.node_memory import DataSizes, node_memory_problems
from imagenet_ddp.preflight.report import known_projection_problems
from imagenet_ddp.data.prepared_layout import FORMAT_VERSION as PREPARED_FORMAT_VERSION
from imagenet_ddp.data.prepared_layout import adopt_earlier_copy, current_key
from imagenet_ddp.settings.run_checks import (
    container_problem,
    init_weights_problems,
    optional_component_problems,
    split_sizes,
    unchecked_model_notes,
    user_cache_dir,
    warmup_warnings,
)
from imagenet_ddp.settings.runs import RunsError, resolve_runs, written_settings
from imagenet_ddp.settings.kinds import declarations
from imagenet_ddp.settings.rerun_migration import migrate_rerun_params, rerun_param
from imagenet_ddp.data.stage import configured_scratch_problem, scratch_in_ram
from imagenet_ddp.settings.presets import scaled_lr
from imagenet_ddp.settings.code_digest import STAGES, code_digest

# Each stage's code digest (imagenet_ddp.settings.code_digest), a param of its rule: a change
# of the code a stage runs reruns it (Snakemake compares only a rule's shell text). Training's
# is no param of train (no finished GPU job resubmitted for a code change): aggregate flags a
# run trained by other training code.
CODE = {stage: code_digest(stage) for stage in STAGES}

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
# The batch check reads results/split: in the submitting Snakemake only (workdir None: a job's
# own Snakemake judges from the config's figures, issue 36).
_RESULTS_ROOT = "." if workflow.is_main_process else None
try:
    RUNS = resolve_runs(
        config, _WRITTEN, _SCHEMA, cache_dir=user_cache_dir(), workdir=_RESULTS_ROOT
    )
except RunsError as error:
    raise WorkflowError(str(error)) from None
# A timm model, model_kwargs or a timm optimizer in a bare login-node environment (no torch,
# no timm): not checked here, said so (the job checks them when it builds them).
if workflow.is_main_process:
    for _line in unchecked_model_notes(RUNS):
        print(f"note: {_line}", file=sys.stderr)


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
    """data.dir's input layout (imagenet_ddp.data.layouts), found as the jobs find it. The
    Snakemake that submits says which and checks its structure (one line naming data.dir where
    it is bad or absent); a job's own Snakemake may run where data.dir is not mounted.
    """
    if config["demo"]["enabled"]:
        return LAYOUTS["archives"]  # written by the demo_data rule
    where, named = config["data"]["dir"], config["data"]["layout"]
    if not workflow.is_main_process:
        try:
            return find_layout(where)
        except InputError:
            return LAYOUTS["archives"]
    try:
        layout = dry_run_layout(where, named)
    except InputError as error:
        raise WorkflowError(str(error)) from None
    print(f"data: {layout.summary} found in data.dir {where}", file=sys.stderr)
    return layout


LAYOUT = _input_layout()


def _class_count():
    """The data's class count as the dry-run knows it (the demo's, or the layout's)."""
    if config["demo"]["enabled"]:
        return config["demo"]["num_classes"]
    return LAYOUT.class_count(data_dir())


# Each run's init_weights file against its model with the data's class count (known once the
# layout is found): by the Snakemake that submits (settings.run_checks).
if workflow.is_main_process and any(run["init_weights"] for run in RUNS.values()):
    _problems = init_weights_problems(RUNS, _class_count(), user_cache_dir())
    if _problems:
        raise WorkflowError("\n".join(_problems))


def archive_paths():
    """The verify, index and prepare rules' inputs: the layout's archives or folders."""
    return LAYOUT.inputs(data_dir())


def input_data_dir(wildcards):
    """data.dir for the rules' shell, a recorded param: the profiles leave `input` out of the
    rerun triggers (a renamed input must resubmit no finished training), so a data.dir that
    names other data reruns verify and index through this param, and what follows by mtime.
    """
    return data_dir()


def training_settings(name):
    """The run's settings as the worker reads them, geometry included (no `evaluate` or
    `preflight`: the workflow's, imagenet_ddp.settings.kinds)."""
    return SETTINGS.rank_settings(RUNS[name])


class _LeftOut:
    """A rerun setting that a run leaves out (added later, at its x-earlier value): a value
    Snakemake cannot represent, so it records no param for it and the run's params stay
    those it was trained with."""

    def __repr__(self):
        return "<at its x-earlier value>"


def _rerun_param(key):
    def value(wildcards):
        rerun = SETTINGS.rerun_settings(RUNS[wildcards.run])
        if key not in rerun:
            return _LeftOut()
        return rerun_param(key, rerun[key])

    return value


def rerun_params():
    """What reruns the run's train (and preflight) when it changes: its rule params, one per
    setting of its checkpoint key (kinds weights, numerics, geometry:
    imagenet_ddp.settings.kinds), each `key=value`, so that a dry-run's reason names what
    changed (`before: lr=0.1 now: lr=0.2`; Snakemake compares the set of values). A setting
    added later is left out at the value earlier runs had (x-earlier)."""
    keys = sorted({k for run in RUNS.values() for k in SETTINGS.rerun_settings(run)})
    return {key: _rerun_param(key) for key in keys}


def migrate_recorded_params(*job_rules):
    """A workflow whose train and preflight_run jobs were recorded with the earlier param
    format (one JSON param, up to 1e9350b): their records carried over to today's where the
    run's settings are unchanged, so the upgrade resubmits none of them (a dry-run shows it).
    By the Snakemake that submits, with Snakemake's file backend, while no other Snakemake
    holds the working directory (imagenet_ddp.settings.rerun_migration)."""
    settings = getattr(workflow, "workflow_settings", None)  # None through some APIs
    backend = getattr(settings, "persistence_backend", None)
    if not workflow.is_main_process or backend != PersistenceBackend.FILE:
        return
    for name, run in RUNS.items():
        outputs = [str(f).format(run=name) for r in job_rules for f in r.output]
        migrate_rerun_params(".snakemake", outputs, SETTINGS.rerun_settings(run))


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
# runtime than its max_allocations is refused here, before it is queued. Only by the Snakemake
# that submits: a job's own Snakemake parses again with the plugin's --set-resources, and one
# run's preflight report must not fail every other run's jobs (issue 36).
if workflow.is_main_process:
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


def data_sizes():
    """What the memory check needs of the data: the split's sizes (each loader worker holds
    the dataset's arrays) and the train copy staged in RAM where stage.scratch_dir is a tmpfs
    here (imagenet_ddp.data.stage.scratch_in_ram)."""
    train, holdout, _ = split_sizes(config, ".")
    in_ram = scratch_in_ram(
        config["stage"]["scratch_dir"],
        f"{config['prepare']['dir']}/train",
        train + holdout,
        config["prepare"]["short_side"],
    )
    if in_ram is None:
        return DataSizes(train, holdout)
    return DataSizes(train, holdout, *in_ram)


# Memory per node: each run's training job against train's mem_mb, from the measured and
# estimated per-process figures of imagenet_ddp.settings.node_memory. Above the measured part alone it
# is refused; above measured + estimated (CUDA, compile workers) it is a warning. Checked by
# the Snakemake that submits (a job's own Snakemake has passed it already).
if workflow.is_main_process:
    _refusals, _warnings = node_memory_problems(RUNS, _train_mem_mb(), data_sizes())
    for _line in _warnings:
        print(f"warning: {_line}", file=sys.stderr)
    if _refusals:
        raise WorkflowError("\n".join(_refusals))
    # A scaled LR reached in fewer warm-up steps than Goyal et al.'s rule (run_checks).
    for _line in warmup_warnings(RUNS, config):
        print(f"warning: {_line}", file=sys.stderr)


def run_hyperparameters(wildcards):
    """The run's hyperparameters on one compact line (shown by `snakemake -n -p`): model,
    epochs, batch size, lr, lr_scaling and the LR used, then every shown setting not at the
    schema's default (a preset's values included): review them before spending GPU hours.
    Every setting is in the job's spec file (resources.job; <run dir>/job_spec.json)."""
    run = RUNS[wildcards.run]
    # The kinds shown (imagenet_ddp.settings.kinds.KINDS): the geometry is under resources.
    shown = SETTINGS.shown_settings(run)
    always = ("model", "epochs", "batch_size", "lr", "lr_scaling")
    values = {k: shown[k] for k in always if k in shown}
    values["lr_used"] = round(scaled_lr(run), 8)  # after lr_scaling
    values.update(sorted(SETTINGS.changed_from_default(shown).items()))
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


# Where each job's spec is written, under its content's digest (imagenet_ddp.jobs.spec.store):
# beside Snakemake's own records in the working directory, which every node of a SLURM site
# sees (the executor needs it shared).
JOB_SPEC_DIR = ".snakemake/job_specs"


def job_spec(kind, mpi_rule):
    """A resource: the path of the rule's whole job spec (imagenet_ddp.jobs.spec), a file
    written here, for the shell's `imagenet-ddp <kind> --job`: the run's settings (or the
    evaluation's geometry and settings), its paths and the execution block, built here once
    and checked here (a spec the job would refuse fails at the dry-run). A resource, not a
    param: the run's settings hold bookkeeping too (log_interval: no rerun of a finished job,
    imagenet_ddp.settings.kinds); what reruns a job is its params (rerun_params). As a
    resource it still reaches every job that starts, so a run in progress gets a changed value
    at its next job. `mpi_rule`: the rule whose `mpi`
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
        # A short path, not the JSON (kind, run or geometry, paths, execution): the dry-run
        # stays readable and the jobstep's command line short.
        return store_spec(spec, f"{JOB_SPEC_DIR}/{kind}", wildcards.run)

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
# The srun tasks of a containerised job run the host's apptainer, by the absolute path this
# Snakemake (on the host, outside the image: a job's own one on its node) resolves here: the
# container's PATH lacks a module's apptainer (imagenet_ddp.jobs.container).
if _APPTAINER:
    os.environ.update(host_runtime_env())
# A run that asks for W&B or MLflow where the jobs' environment lacks it would train untracked
# ("W&B off" in its log): refused here. The image and the conda env hold every such component.
_SDM = workflow.deployment_settings.deployment_method
_problems = optional_component_problems(
    RUNS,
    deployment=(
        "apptainer" if _APPTAINER else "conda" if DeploymentMethod.CONDA in _SDM else ""
    ),
)
if _problems and workflow.is_main_process:
    raise WorkflowError("\n".join(_problems))
# A scratch dir every node would share fails here, at the dry-run (each node checks its own
# view again before it copies: src/imagenet_ddp/data/stage.py).
_problem = configured_scratch_problem(site_setting("stage", "scratch_dir"))
if _problem:
    raise WorkflowError(_problem)
# The launcher by name (imagenet_ddp.jobs.launchers: its registry is the one list of names).
_problem = launcher_problem(site_setting("execution", "launcher"))
if _problem:
    raise WorkflowError(f"config.yaml: {_problem}")


# The training-ready copy; point several workflows (or users) at one shared directory to
# prepare ImageNet once: writers are excluded by a lock, readers only see complete copies.
# Each copy's name is the digest of what it is made from; this workflow's `prepare` output is
# a manifest under results/ naming it (imagenet_ddp.data.prepared_layout), which each job that
# reads the copy takes as input and resolves when it starts: no copy is ever an output.
PREPARED_DIR = config["prepare"]["dir"]


def prepared_manifest(which):
    return f"results/prepared/{which}.json"


def prepared_key(which):
    """The key file of the prepared copy the manifest names (imagenet_ddp.data.prepared_layout
    KEYS_DIR): written only when the copy changes, so a training reruns when its data is other
    images, never for the same copy made again. None before the first prepare (the run is
    trained after it). Only the submitting Snakemake writes an upgrade's key file."""

    def key(wildcards):
        found = current_key(prepared_manifest(which), adopt=workflow.is_main_process)
        return [] if found is None else str(found)

    return key


CHECKPOINT_DIR = site_setting("execution", "checkpoint_dir")


VERIFY_REPORT = "results/verify/report.json"


def verify_gate(wildcards):
    """index's dependency on verify, only where verify will check other archives: its report
    missing, written for another data.dir, or older than an archive (replaced since). Not
    ancient(): Snakemake skips a job's own checks while a job upstream reruns, so ancient()
    would hide newer archives from index in that invocation. A report that stays is a gate
    passed: no input; verify stays in the DAG through `rule all`, where its rerun
    (check_md5, its code) reruns nothing else.
    """
    if not os.path.exists(VERIFY_REPORT):
        return [VERIFY_REPORT]
    if _verified_data_dir() != os.path.normpath(
        data_dir()
    ):  # other data: verify it first
        return [VERIFY_REPORT]
    verified = os.path.getmtime(VERIFY_REPORT)
    archives = [p for p in archive_paths().values() if os.path.exists(p)]
    if any(os.path.getmtime(p) > verified for p in archives):
        return [VERIFY_REPORT]
    return []


def _verified_data_dir():
    """The data.dir the verify report was written for (its provenance), None if unreadable."""
    try:
        with open(f"{VERIFY_REPORT}.provenance.json") as f:
            return os.path.normpath(json.load(f)["config"]["data_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# What the training data is made from, as a file whose rule (data_key) reruns when a setting of
# it changes: train and its preflight take it as input, and the split and prepared files as
# ancient(), so a data stage rerun for its code alone resubmits no finished training while a
# changed split seed or prepared size does (docs/configuration.md "Reruns").
DATA_KEY = "results/data_key.json"


def data_key_settings():
    demo = config["demo"] if config["demo"]["enabled"] else None
    prepare = {
        k: config["prepare"][k] for k in ("short_side", "jpeg_quality", "on_corrupt")
    }
    return {
        "demo": demo,  # the real archives: their own times rerun index and what follows
        "split": config["split"],
        "prepare": {**prepare, "shard_samples": config["prepare"]["shard_samples"]},
        "index_format": INDEX_FORMAT_VERSION,
        "prepared_format": PREPARED_FORMAT_VERSION,
    }


def _any_run_trained():
    """Whether a run of this workflow has its model: one trained by an earlier version."""
    return any(os.path.exists(f"results/runs/{name}/model.pt") for name in RUNS)


def _adopt_data_key():
    """A workflow trained by a version without data_key: its file, written here at the epoch
    (older than every model) and without Snakemake's record, reruns no finished training; a
    setting changed after that reruns data_key, and through it the training."""
    if os.path.exists(DATA_KEY):
        return
    os.makedirs(os.path.dirname(DATA_KEY), exist_ok=True)
    with open(DATA_KEY, "w") as handle:
        json.dump(data_key_settings(), handle, sort_keys=True)
    os.utime(DATA_KEY, (0, 0))


def _adopt_prepared_copies():
    """A workflow trained by a version without prepared manifests: a manifest naming its copy
    at prepare.dir/<which>, at the epoch, so prepare's rerun after the upgrade resubmits no
    finished training (imagenet_ddp.data.prepared_layout.adopt_earlier_copy)."""
    for which in ("train", "val"):
        adopt_earlier_copy(prepared_manifest(which), PREPARED_DIR, which)


if workflow.is_main_process and _any_run_trained():
    _adopt_data_key()
    _adopt_prepared_copies()


def md5sums_input(wildcards):
    """md5sums is optional for real data; the demo set always writes one."""
    path = f"{data_dir()}/md5sums"
    if LAYOUT.name != "archives":
        return []
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
