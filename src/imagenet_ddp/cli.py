"""``imagenet-ddp``: one subcommand per workflow stage. The Snakemake rules call these.

Each subcommand only parses its arguments and calls its stage's one function
(demo.write_demo_dataset, archives.write_verify_report, archives.write_index,
split.split_index, prepare.prepare, jobs.train_job, preflight.preflight_job, jobs.evaluate_job,
accounting.write_accounting, aggregate.write_aggregate, plots.make_plots). Every stage writes
its artifact atomically and its provenance beside it
(:func:`imagenet_ddp.provenance.provenance_path`). A bad input raises :class:`InputError`,
printed as one line that names the file and what to do (exit 2)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from imagenet_ddp.errors import InputError
from imagenet_ddp.eval_settings import eval_settings

# What an evaluation uses for a setting not given: one node, one CPU rank (eval_settings).
EVAL_DEFAULTS = eval_settings(None, {})


def cmd_demo_data(args: argparse.Namespace) -> None:
    from imagenet_ddp.demo import write_demo_dataset

    write_demo_dataset(
        args.out,
        num_classes=args.num_classes,
        train_per_class=args.train_per_class,
        val_per_class=args.val_per_class,
        image_size=args.image_size,
        seed=args.seed,
    )


def cmd_verify(args: argparse.Namespace) -> None:
    from imagenet_ddp.archives import write_verify_report

    write_verify_report(args.data_dir, args.report, check_md5=args.check_md5)


def cmd_index(args: argparse.Namespace) -> None:
    from imagenet_ddp.archives import write_index

    write_index(args.data_dir, args.out_dir)


def cmd_split(args: argparse.Namespace) -> None:
    from imagenet_ddp.split import split_index

    split_index(args.index_dir, args.out_dir, args.holdout_fraction, args.seed)


def _prepare_settings(args: argparse.Namespace) -> dict:
    return {
        "short_side": args.short_side,
        "quality": args.quality,
        "on_corrupt": args.on_corrupt,
        "shard_samples": args.shard_samples,
        "workers": args.workers,
    }


def cmd_prepare(args: argparse.Namespace) -> None:
    from imagenet_ddp.prepare import prepare

    if prepare(args.data_dir, args.index_dir, args.which, args.out, **_prepare_settings(args)):
        print(f"{args.out} is already prepared from the same index and settings; reusing")


def cmd_prepare_chunk(args: argparse.Namespace) -> None:
    from imagenet_ddp.prepare import prepare_chunk

    prepare_chunk(
        args.data_dir,
        args.index_dir,
        args.which,
        args.chunk_dir,
        chunk=args.chunk,
        chunks=args.chunks,
        **_prepare_settings(args),
    )


def cmd_prepare_join(args: argparse.Namespace) -> None:
    from imagenet_ddp.prepare import join_chunks

    if join_chunks(args.chunk_dirs, args.out):
        print(f"{args.out} is already prepared from the same index and settings; reusing")


def _add_prepare_parsers(sub) -> None:
    for name, help_text, func in (
        ("prepare", "decode once into training-ready shards", cmd_prepare),
        ("prepare-chunk", "job k of K of prepare: one range of shards", cmd_prepare_chunk),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--data-dir", type=Path, required=True)
        p.add_argument("--index-dir", type=Path, required=True)
        p.add_argument("--which", choices=["train", "val"], required=True)
        if func is cmd_prepare:
            p.add_argument("--out", type=Path, required=True)
        else:
            p.add_argument("--chunk", type=int, required=True)
            p.add_argument("--chunks", type=int, required=True)
            p.add_argument("--chunk-dir", type=Path, required=True)
        p.add_argument("--short-side", type=int, required=True)
        p.add_argument("--quality", type=int, required=True)
        p.add_argument("--workers", type=int, required=True)
        p.add_argument("--on-corrupt", choices=["fail", "skip"], required=True)
        p.add_argument("--shard-samples", type=int, required=True)
        p.set_defaults(func=func)
    p = sub.add_parser("prepare-join", help="join the K prepare-chunk outputs into one copy")
    p.add_argument("--chunk-dirs", type=Path, nargs="+", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_prepare_join)


def _staged_job(args: argparse.Namespace) -> dict:
    """What train and its preflight share: the data and where/how the job runs."""
    from imagenet_ddp.jobs import spec_execution

    return {
        "prepared_train": args.prepared_train,
        "split_dir": args.split_dir,
        "execution": spec_execution(
            args.launcher,
            args.srun_extra,
            args.scratch_dir,
            args.stage_verify,
            args.cleanup,
            launch_prefix=args.launch_prefix,
        ),
    }


def cmd_train(args: argparse.Namespace) -> int:
    from imagenet_ddp.jobs import train_job

    job = _staged_job(args)
    job["execution"]["attempt"] = args.attempt  # Snakemake's attempt: a resubmission if > 1
    return train_job(
        args.run_config_json, run_dir=args.run_dir, checkpoint_root=args.checkpoint_root, **job
    )


def cmd_preflight(args: argparse.Namespace) -> int:
    from imagenet_ddp.preflight import preflight_job

    return preflight_job(
        args.run_config_json,
        out=args.out,
        train_runtime_minutes=args.train_runtime_minutes,
        checkpoint_root=args.checkpoint_root,
        **_staged_job(args),
    )


def _add_staged_job_arguments(p: argparse.ArgumentParser) -> None:
    """A job that stages the prepared copy and runs a run's ranks: train and its preflight."""
    p.add_argument(
        "--run-config-json",
        type=json.loads,
        required=True,
        help="the run's settings, geometry (nodes, tasks_per_node, cpus_per_task, "
        "gpus_per_node) included",
    )
    p.add_argument("--prepared-train", type=Path, required=True)
    p.add_argument("--split-dir", type=Path, required=True)
    _add_launcher_arguments(p)
    p.add_argument(
        "--scratch-dir",
        required=True,
        help="stage.scratch_dir; empty: $SLURM_TMPDIR, else $TMPDIR, else /tmp",
    )
    p.add_argument("--stage-verify", choices=["size", "sha256"], required=True)
    p.add_argument("--cleanup", action=argparse.BooleanOptionalAction, required=True)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from imagenet_ddp.geometry import GEOMETRY_KEYS
    from imagenet_ddp.jobs import evaluate_job, spec_execution

    keys = {
        "paths": ("model", "prepared_train", "prepared_val", "split_dir", "classes", "out"),
        "geometry": GEOMETRY_KEYS,
        "settings": ("batch_size", "workers", "device"),
    }
    parts = {part: {key: getattr(args, key) for key in names} for part, names in keys.items()}
    parts["paths"]["per_class"] = args.per_class
    execution = spec_execution(args.launcher, args.srun_extra, launch_prefix=args.launch_prefix)
    return evaluate_job(**parts, execution=execution)


def cmd_aggregate(args: argparse.Namespace) -> None:
    from imagenet_ddp.aggregate import write_aggregate

    write_aggregate(args.run_dirs, args.csv, args.markdown)


def cmd_accounting(args: argparse.Namespace) -> None:
    from imagenet_ddp.accounting import write_accounting

    write_accounting(args.run_dirs)


def cmd_plots(args: argparse.Namespace) -> None:
    from imagenet_ddp.plots import make_plots

    make_plots(
        args.runs_csv,
        args.run_dirs,
        throughput=args.throughput,
        efficiency=args.efficiency,
        curves=args.curves,
        per_class=args.per_class,
        cost=args.cost,
    )


def _add_plots_parser(sub) -> None:
    p = sub.add_parser("plots", help="throughput, scaling, training curves, per-class figures")
    p.add_argument("--runs-csv", type=Path, required=True, help="aggregate runs.csv")
    p.add_argument(
        "--run-dirs",
        type=Path,
        nargs="+",
        required=True,
        help="run directories holding history.csv and per_class.csv",
    )
    for name, text in (
        ("throughput", "throughput vs workers"),
        ("efficiency", "scaling efficiency vs workers"),
        ("curves", "loss and accuracy per epoch"),
        ("per-class", "per-class test top-1 spread"),
    ):
        p.add_argument(f"--{name}", type=Path, required=True, help=f"{text} (.png or .svg)")
    p.add_argument("--cost", type=Path, help="throughput vs cost per epoch and energy")
    p.set_defaults(func=cmd_plots)


def _add_evaluate_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="top-1/top-5 and per-class accuracy")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prepared-train", type=Path, required=True)
    p.add_argument("--prepared-val", type=Path, required=True)
    p.add_argument("--split-dir", type=Path, required=True)
    p.add_argument("--classes", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--per-class", type=Path, required=True)
    # Defaults for use by hand: eval_settings' (the workflow passes every one of them).
    for name, kind, text in (
        ("batch-size", int, "images per rank and batch"),
        ("workers", _workers, "loader workers per rank; auto = cpus - 1"),
        ("nodes", int, "nodes"),
        ("tasks-per-node", int, "ranks per node"),
        ("cpus-per-task", int, "CPUs (threads) per rank"),
        ("gpus-per-node", int, "GPUs per node; 0 = CPU"),
    ):
        default = EVAL_DEFAULTS[name.replace("-", "_")]
        p.add_argument(f"--{name}", type=kind, default=default, help=f"{text} (default {default})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    _add_launcher_arguments(p)
    p.set_defaults(func=cmd_evaluate)


def _add_launcher_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--launcher",
        choices=["auto", "local", "srun"],
        required=True,
        help="auto: srun inside a SLURM allocation, else one process per rank here",
    )
    p.add_argument("--srun-extra", default="", help="extra srun flags, space separated")
    p.add_argument(
        "--launch-prefix",
        default="srun",
        help="command starting the ranks' step (the rule's mpi resource), e.g. 'srun --mpi=pmix'",
    )


def _workers(value: str) -> int | str:
    return value if value == "auto" else int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="imagenet-ddp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    # Workflow settings have no defaults here: their one home is the workflow's schema, and the
    # rules pass every one of them.
    p = sub.add_parser("demo-data", help="write a small synthetic ILSVRC2012 in the real layout")
    p.add_argument("--out", type=Path, required=True)
    for name in ("num-classes", "train-per-class", "val-per-class", "image-size", "seed"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.set_defaults(func=cmd_demo_data)

    p = sub.add_parser("verify", help="check the archives' structure and md5")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--check-md5", action=argparse.BooleanOptionalAction, required=True)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("index", help="list every train/val sample without extracting")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.set_defaults(func=cmd_index)

    p = sub.add_parser("split", help="stratified train/holdout split of the train set")
    p.add_argument("--index-dir", type=Path, required=True)
    p.add_argument("--holdout-fraction", type=float, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.set_defaults(func=cmd_split)

    _add_prepare_parsers(sub)

    p = sub.add_parser("train", help="stage data on every node and run DDP training")
    _add_staged_job_arguments(p)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--checkpoint-root", type=Path, required=True)
    p.add_argument(
        "--attempt",
        type=int,
        default=1,
        help="Snakemake's attempt number of this job (retries: 2, 3, ...); a retry after an "
        "attempt that failed without progress is refused, and none above max_allocations runs",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "preflight", help="check a run's placement, network, step and loader speed; project it"
    )
    _add_staged_job_arguments(p)
    p.add_argument("--out", type=Path, required=True, help="preflight.json")
    p.add_argument(
        "--train-runtime-minutes",
        type=lambda v: None if v == "none" else float(v),
        required=True,
        help="the train rule's time limit per allocation, or 'none'",
    )
    p.add_argument(
        "--checkpoint-root",
        type=Path,
        default=None,
        help="where the run's checkpoints go: a probe checkpoint is written there (and removed) "
        "to measure the write rate (default: beside --out)",
    )
    p.set_defaults(func=cmd_preflight)

    _add_evaluate_parser(sub)

    p = sub.add_parser("aggregate", help="one table of all runs")
    p.add_argument("--run-dirs", type=Path, nargs="+", required=True)
    p.add_argument("--csv", type=Path, required=True)
    p.add_argument("--markdown", type=Path, required=True)
    p.set_defaults(func=cmd_aggregate)

    p = sub.add_parser("accounting", help="sacct accounting of each run's training job")
    p.add_argument("--run-dirs", type=Path, nargs="+", required=True)
    p.set_defaults(func=cmd_accounting)

    _add_plots_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except InputError as exc:
        print(f"imagenet-ddp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
