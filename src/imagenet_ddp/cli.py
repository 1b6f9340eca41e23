"""``imagenet-ddp``: one subcommand per workflow stage. The Snakemake rules call these.

Each subcommand only parses its arguments and calls its stage's one function, imported when it
runs. A bad input raises :class:`InputError`, printed as one line that names the file and what
to do (exit 2)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
from pathlib import Path

from imagenet_ddp.errors import PLAN_VERSION_ENV, InputError, version_problem
from imagenet_ddp.io import EXIT_INPUT, exit_by_signal


def _function(target: str):
    """``module:function`` of the package, imported when its subcommand runs."""
    module, name = target.split(":")
    return getattr(importlib.import_module(f"imagenet_ddp.{module}"), name)


def _call(target: str):
    """A subcommand that calls its stage's function with its arguments, by name (exit 0)."""

    def call(args: argparse.Namespace) -> None:
        _function(target)(**{k: v for k, v in vars(args).items() if k not in ("command", "func")})

    return call


def _required(p, names: str) -> None:
    """A required ``--name`` for each of ``names``, ``name[:int|float|str][+]``: a path unless
    typed, one or more values with ``+``."""
    for spec in names.split():
        name, _, kind = spec.rstrip("+").partition(":")
        kind = {"int": int, "float": float, "str": str}.get(kind, Path)
        nargs = "+" if spec.endswith("+") else None
        p.add_argument(f"--{name}", type=kind, nargs=nargs, required=True)


def _command(sub, name: str, help_text: str, func, required: str = ""):
    p = sub.add_parser(name, help=help_text)
    p.set_defaults(func=func)
    _required(p, required)
    return p


def _add_prepare_parsers(sub) -> None:
    for name, help_text, func in (
        ("prepare", "decode once into training-ready shards", _call("data.prepare:prepare_shared")),
        ("prepare-chunk", "job k of K: one range of shards", _call("data.prepare:prepare_chunk")),
    ):
        p = sub.add_parser(name, help=help_text)
        _required(p, "data-dir index-dir")
        p.add_argument("--which", choices=["train", "val"], required=True)
        if name == "prepare":  # the copy in prepare.dir (content-addressed), named by a file
            _required(p, "manifest prepared-dir")
        else:
            _required(p, "chunk:int chunks:int chunk-dir")
            p.add_argument("--prepared-dir", type=Path, help="convert nothing if a copy is there")
        _required(p, "short-side:int quality:int workers:int shard-samples:int")
        p.add_argument("--on-corrupt", choices=["fail", "skip"], required=True)
        p.set_defaults(func=func)
    _command(sub, "prepare-join", "join the K prepare-chunk outputs into one copy",
             _call("data.prepare:join_shared"), "chunk-dirs+ manifest prepared-dir")  # fmt: skip


def cmd_key(args: argparse.Namespace) -> None:
    """The `key` rule: a run's rerun key, written where its digest names it (jobs.rerun_keys)."""
    from imagenet_ddp.io import write_text_atomic
    from imagenet_ddp.jobs.rerun_keys import key_digest, key_text

    try:
        key = json.loads(args.text)
    except ValueError:
        raise InputError(f"{args.out}: not a key: {args.text[:80]!r}") from None
    if key_digest(key) != args.out.stem:
        raise InputError(f"{args.out}: the key given is {key_digest(key)}'s, not this path's")
    write_text_atomic(args.out, key_text(key) + "\n")


def cmd_data_content(args: argparse.Namespace) -> None:
    from imagenet_ddp.data.prepared_layout import content_record
    from imagenet_ddp.io import write_json_atomic

    paths = (args.prepared_train, args.prepared_val, args.split_train, args.split_holdout)
    write_json_atomic(args.out, content_record(*paths, args.classes))


def cmd_train(args: argparse.Namespace) -> int:
    from imagenet_ddp.jobs.attempts import ran_in_this_allocation
    from imagenet_ddp.jobs.launch import train_job
    from imagenet_ddp.jobs.rerun_keys import read_key
    from imagenet_ddp.jobs.spec import load, with_init_weights

    key = read_key(args.key) if args.key else {}
    job = with_init_weights(load(args.job, "train"), key.get("init_weights_sha256", ""))
    # A rule's retries reach the jobstep's own Snakemake (snakemake-executor-plugin-slurm#284),
    # which would run the job again in its allocation. Before the attempt log: {log} keeps
    # pointing at the attempt that ran.
    ran = ran_in_this_allocation(job.paths.checkpoint_root, job.run)
    if ran:
        print(f"run {job.name!r}: attempt {ran['attempt']} ended in this allocation "
              f"({ran['outcome']}); not again in it", file=sys.stderr)  # fmt: skip
        return ran["exit_code"] or 1
    if args.attempt_log:
        from imagenet_ddp.jobs.attempt_log import open_attempt_log

        open_attempt_log(args.attempt_log, job)
    return train_job(job, args.key)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from imagenet_ddp.jobs.launch import evaluate_job
    from imagenet_ddp.jobs.spec import load

    return evaluate_job(load(args.job, "evaluate"), args.key)


def _job(target: str):
    """A job that runs ranks (preflight, evaluate): its stage's function of the loaded spec."""
    return lambda args: _function(target)(_function("jobs.spec:load")(args.job, args.command))


def _add_job_parser(sub, name: str, help_text: str, func) -> None:
    """A job that runs ranks (train, preflight, evaluate): its whole spec is one value."""
    p = sub.add_parser(name, help=help_text)
    p.add_argument(
        "--job",
        required=True,
        metavar="FILE|JSON",
        help=f"the {name} job spec (imagenet_ddp.jobs.spec): a file's path (the workflow's "
        "rule passes one it wrote; or one a job wrote, edited) or JSON",
    )
    if name in ("train", "evaluate"):
        p.add_argument(
            "--key",
            metavar="FILE",
            help="the job's rerun key (jobs.rerun_keys, the rule's input): recorded in job.json,"
            " the run's other keys removed once it delivered; train's holds the init_weights"
            " file's digest as the check read it",
        )
    if name == "train":
        p.add_argument(
            "--attempt-log",
            metavar="LINK",
            help="write this job's output to its own log beside LINK "
            "(<dir>/<run>/job-<id>-attempt<n>-<start>.log) and point LINK at it",
        )
    p.set_defaults(func=func)


def cmd_convert_checkpoint(args: argparse.Namespace) -> None:
    """Rewrite checkpoints or model.pt files of an earlier version as tensors and plain data
    (training.checkpoint.convert_trusted): each is unpickled in full, so only files you trust."""
    from imagenet_ddp.training.checkpoint import convert_trusted

    for path in args.paths:
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        print(f"converted {convert_trusted(path)}: it loads with weights_only=True now")


# The subcommands that hand their options, by name, to their stage's function: (help, the
# function, its required options as _required reads them). No defaults: the schema is their
# one home, and the rules pass every one.
STAGES = {
    "demo-data": (
        "write a small synthetic ILSVRC2012 in the real layout",
        "data.demo:write_demo_dataset",
        "out num-classes:int train-per-class:int val-per-class:int image-size:int seed:int",
    ),
    "verify": (
        "check the input layout's structure, counts and files (md5 of archives)",
        "data.layouts:write_verify_report",
        "data-dir report",  # and --check-md5
    ),
    "index": (
        "list every train/val sample without extracting",
        "data.layouts:write_index",
        "data-dir out-dir",
    ),
    "split": (
        "stratified train/holdout split of the train set",
        "data.split:split_index",
        "index-dir out-dir holdout-fraction:float seed:int",
    ),
    "check": (
        "check a run's model, optimizer, weights and transforms with torch",
        "training.data:write_check",
        "num-classes:int run-dir out",  # and --run
    ),
    "aggregate": (
        "one table of all runs",
        "report.aggregate:write_aggregate",
        "run-dirs+ csv markdown report-settings:str",
    ),  # fmt: skip
    "prune": (
        "a pruned sweep's decision at one rung: the ranking and the survivors",
        "settings.halving:write_decision",
        "sweep:int epoch:int eta:int metric:str runs:str+ metrics+ out",
    ),
    "rung-final": (
        "a pruned sweep's run: its last stage's outputs in its run folder",
        "settings.halving:deliver_stage",
        "rung-dir run-dir epoch:int epochs:int",
    ),
    "accounting": (
        "sacct accounting of each run's training job",
        "report.accounting:write_accounting",
        "run-dirs+",
    ),  # fmt: skip
    "progress": (
        "the runs so far: finished runs' table, the others' state and ETA",
        "report.progress:write_progress",
        "runs:str+ run-dirs+ checkpoint-roots+ csv markdown",
    ),
    "plots": (
        "throughput, scaling, training curves, per-class figures (.png or .svg each)",
        "report.plots:make_plots",
        "runs-csv run-dirs+ throughput efficiency curves per-class",  # and --cost
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="imagenet-ddp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    stages = {name: _command(sub, name, text, _call(target), required)
              for name, (text, target, required) in STAGES.items()}  # fmt: skip
    stages["verify"].add_argument(
        "--check-md5", action=argparse.BooleanOptionalAction, required=True
    )
    stages["check"].add_argument("--run", dest="run_json", required=True, help="settings, as JSON")
    stages["plots"].add_argument("--cost", type=Path, help="throughput vs cost per epoch, energy")
    stages["plots"].add_argument("--to-target", type=Path, help="holdout top-1 vs GPU-hours")
    _add_prepare_parsers(sub)
    data = "prepared-train prepared-val split-train split-holdout classes out"
    _command(sub, "key", "write a run's rerun key where its digest names it", cmd_key,
             "text:str out")  # fmt: skip
    _command(sub, "data-content", "record the digests of what trains and evaluates",
             cmd_data_content, data)  # fmt: skip
    _add_job_parser(sub, "train", "stage data on every node and run DDP training", cmd_train)
    _add_job_parser(sub, "preflight", "check a run's placement, network, step and loader speed; "
                    "project it", _job("preflight.job:preflight_job"))  # fmt: skip
    _add_job_parser(sub, "evaluate", "top-1/top-5 and per-class accuracy", cmd_evaluate)
    p = _command(sub, "convert-checkpoint", "rewrite a checkpoint or model.pt of an earlier "
                 "version that you trust so that it loads without running code (it is "
                 "unpickled in full once, here)", cmd_convert_checkpoint)  # fmt: skip
    p.add_argument("paths", type=Path, nargs="+")
    return parser


def refuse_other_version(args: argparse.Namespace) -> None:
    """Refuse a job that its workflow planned with another version of this package (the plan's
    version: inherited from the parse, and in a job spec). A training's refusal goes into its
    attempt record first: its retries then ask for one task without GPUs and refuse at once
    (jobs.attempts.refusal_ahead), never the run's GPUs again."""
    spec = _raw_spec(args.job) if args.command == "train" else None
    planned = (os.environ.get(PLAN_VERSION_ENV), (spec or {}).get("version"))
    problem = version_problem(planned[0]) or version_problem(planned[1])
    if problem is None:
        return
    try:  # what this version reads of another's spec: the record's place, the run, the attempt
        root, attempt = spec["paths"]["checkpoint_root"], int(spec["execution"]["attempt"])
        from imagenet_ddp.settings.kinds import declarations

        run = {**declarations().rank_defaults(), **spec["run"]}
    except (KeyError, TypeError, ValueError):
        raise InputError(problem) from None
    from imagenet_ddp.jobs.attempts import begin

    begin(root, run, attempt=attempt, gpus=0, cores=0, refused=problem)
    raise InputError(problem)


def _raw_spec(value: str) -> dict | None:
    """``--job``'s JSON as written (a spec's text or its file), None where unreadable."""
    try:
        data = json.loads(value if value.lstrip().startswith("{") else Path(value).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        refuse_other_version(args)
        code = args.func(args)
    except InputError as exc:
        print(f"imagenet-ddp {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print(f"imagenet-ddp {args.command}: interrupted", file=sys.stderr)
        return exit_by_signal(signal.SIGINT)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
