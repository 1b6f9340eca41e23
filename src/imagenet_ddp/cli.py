"""``imagenet-ddp``: one subcommand per workflow stage. The Snakemake rules call these.

Each subcommand only parses its arguments and calls its stage's one function
(demo.write_demo_dataset, layouts.write_verify_report, layouts.write_index,
split.split_index, prepare.prepare, jobs.train_job, preflight.preflight_job, jobs.evaluate_job,
accounting.write_accounting, aggregate.write_aggregate, plots.make_plots). Every stage writes
its artifact atomically and its provenance beside it
(:func:`imagenet_ddp.provenance.provenance_path`). A bad input raises :class:`InputError`,
printed as one line that names the file and what to do (exit 2)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from imagenet_ddp.errors import InputError


def cmd_demo_data(args: argparse.Namespace) -> None:
    from imagenet_ddp.data.demo import write_demo_dataset

    write_demo_dataset(
        args.out,
        num_classes=args.num_classes,
        train_per_class=args.train_per_class,
        val_per_class=args.val_per_class,
        image_size=args.image_size,
        seed=args.seed,
    )


def cmd_verify(args: argparse.Namespace) -> None:
    from imagenet_ddp.data.layouts import write_verify_report

    write_verify_report(args.data_dir, args.report, check_md5=args.check_md5)


def cmd_index(args: argparse.Namespace) -> None:
    from imagenet_ddp.data.layouts import write_index

    write_index(args.data_dir, args.out_dir)


def cmd_split(args: argparse.Namespace) -> None:
    from imagenet_ddp.data.split import split_index

    split_index(args.index_dir, args.out_dir, args.holdout_fraction, args.seed)


def _prepare_settings(args: argparse.Namespace) -> dict:
    return {
        "short_side": args.short_side,
        "quality": args.quality,
        "on_corrupt": args.on_corrupt,
        "shard_samples": args.shard_samples,
        "workers": args.workers,
    }


def _shared(args: argparse.Namespace) -> bool:
    """--manifest (with its --prepared-dir), the workflow's way; else --out."""
    if args.manifest and not args.prepared_dir:
        raise InputError("--manifest needs --prepared-dir (the directory holding the copies)")
    return bool(args.manifest)


def cmd_prepare(args: argparse.Namespace) -> None:
    from imagenet_ddp.data.prepare import prepare, prepare_shared

    if _shared(args):
        copy = prepare_shared(
            args.data_dir, args.index_dir, args.which, args.manifest, args.prepared_dir,
            **_prepare_settings(args),
        )  # fmt: skip
        print(f"{args.manifest} names {copy}")
    elif prepare(args.data_dir, args.index_dir, args.which, args.out, **_prepare_settings(args)):
        print(f"{args.out} is already prepared from the same index and settings; reusing")


def cmd_prepare_chunk(args: argparse.Namespace) -> None:
    from imagenet_ddp.data.prepare import prepare_chunk

    prepare_chunk(
        args.data_dir,
        args.index_dir,
        args.which,
        args.chunk_dir,
        chunk=args.chunk,
        chunks=args.chunks,
        shared_root=args.prepared_dir,
        **_prepare_settings(args),
    )


def cmd_prepare_join(args: argparse.Namespace) -> None:
    from imagenet_ddp.data.prepare import join_chunks, join_shared

    if _shared(args):
        copy = join_shared(args.chunk_dirs, args.manifest, args.prepared_dir)
        print(f"{args.manifest} names {copy}")
    elif join_chunks(args.chunk_dirs, args.out):
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
            _add_out_arguments(p)
        else:
            p.add_argument("--chunk", type=int, required=True)
            p.add_argument("--chunks", type=int, required=True)
            p.add_argument("--chunk-dir", type=Path, required=True)
            p.add_argument("--prepared-dir", type=Path, help="convert nothing if a copy is there")
        p.add_argument("--short-side", type=int, required=True)
        p.add_argument("--quality", type=int, required=True)
        p.add_argument("--workers", type=int, required=True)
        p.add_argument("--on-corrupt", choices=["fail", "skip"], required=True)
        p.add_argument("--shard-samples", type=int, required=True)
        p.set_defaults(func=func)
    p = sub.add_parser("prepare-join", help="join the K prepare-chunk outputs into one copy")
    p.add_argument("--chunk-dirs", type=Path, nargs="+", required=True)
    _add_out_arguments(p)
    p.set_defaults(func=cmd_prepare_join)


def _add_out_arguments(p) -> None:
    """Where the copy goes: a directory (--out), or the workflow's way, a manifest naming a
    content-addressed copy in a shared directory (--manifest with --prepared-dir)."""
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="the prepared directory itself")
    group.add_argument(
        "--manifest", type=Path, help="a file naming the copy (needs --prepared-dir)"
    )
    p.add_argument("--prepared-dir", type=Path, help="the shared directory of the copies")


def cmd_data_content(args: argparse.Namespace) -> None:
    from imagenet_ddp.data.prepared_layout import content_record
    from imagenet_ddp.io import write_json_atomic

    paths = (args.prepared_train, args.prepared_val, args.split_train, args.split_holdout)
    write_json_atomic(args.out, content_record(*paths, args.classes))


def cmd_check(args: argparse.Namespace) -> None:
    from imagenet_ddp.settings.run_checks import write_check

    write_check(args.run, args.num_classes, args.run_dir, args.out)


def cmd_train(args: argparse.Namespace) -> int:
    from imagenet_ddp.jobs.attempts import ran_in_this_allocation
    from imagenet_ddp.jobs.spec import load, with_init_weights
    from imagenet_ddp.jobs.stages import train_job

    job = with_init_weights(load(args.job, "train"), args.init_weights_sha256)
    # A rule's retries reach the jobstep's own Snakemake (snakemake-executor-plugin-slurm#284),
    # which would run the job again in the allocation it ended in: the workflow's next job
    # resumes it. Before the attempt log: {log} keeps pointing at the attempt that ran.
    ran = ran_in_this_allocation(job.paths.checkpoint_root, job.run)
    if ran:
        print(f"run {job.name!r}: attempt {ran['attempt']} ended in this allocation "
              f"({ran['outcome']}); not again in it", file=sys.stderr)  # fmt: skip
        return ran["exit_code"] or 1
    if args.attempt_log:
        from imagenet_ddp.jobs.attempt_log import open_attempt_log

        open_attempt_log(args.attempt_log, job)
    return train_job(job)


def cmd_preflight(args: argparse.Namespace) -> int:
    from imagenet_ddp.jobs.spec import load
    from imagenet_ddp.preflight.job import preflight_job

    return preflight_job(load(args.job, "preflight"))


def cmd_evaluate(args: argparse.Namespace) -> int:
    from imagenet_ddp.jobs.spec import load
    from imagenet_ddp.jobs.stages import evaluate_job

    return evaluate_job(load(args.job, "evaluate"))


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
    if name == "train":
        p.add_argument(
            "--init-weights-sha256",
            default="",
            help="the init_weights file's digest as the check read it (the rule's param)",
        )
        p.add_argument(
            "--attempt-log",
            metavar="LINK",
            help="write this job's output to its own log beside LINK "
            "(<dir>/<run>/job-<id>-attempt<n>-<start>.log) and point LINK at it",
        )
    p.set_defaults(func=func)


def cmd_aggregate(args: argparse.Namespace) -> None:
    from imagenet_ddp.report.aggregate import write_aggregate

    write_aggregate(args.run_dirs, args.csv, args.markdown)


def cmd_convert_checkpoint(args: argparse.Namespace) -> None:
    """Rewrite checkpoints or model.pt files of an earlier version as tensors and plain data
    (training.checkpoint.convert_trusted): each is unpickled in full, so only files you trust."""
    from imagenet_ddp.training.checkpoint import convert_trusted

    for path in args.paths:
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        print(f"converted {convert_trusted(path)}: it loads with weights_only=True now")


def cmd_progress(args: argparse.Namespace) -> None:
    from imagenet_ddp.report.progress import write_progress

    write_progress(args.runs, args.run_dirs, args.checkpoint_roots, args.csv, args.markdown)


def cmd_accounting(args: argparse.Namespace) -> None:
    from imagenet_ddp.report.accounting import write_accounting

    write_accounting(args.run_dirs)


def cmd_plots(args: argparse.Namespace) -> None:
    from imagenet_ddp.report.plots import make_plots

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

    p = sub.add_parser(
        "verify", help="check the input layout's structure, counts and files (md5 of archives)"
    )
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
    p = sub.add_parser("data-content", help="record the digests of what trains and evaluates")
    for flag in ("prepared-train", "prepared-val", "split-train", "split-holdout", "classes"):
        p.add_argument(f"--{flag}", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_data_content)

    p = sub.add_parser("check", help="check a run's model, optimizer and weights with torch")
    p.add_argument("--run", required=True, help="the run's settings, as JSON")
    p.add_argument("--num-classes", type=int, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_check)

    _add_job_parser(sub, "train", "stage data on every node and run DDP training", cmd_train)
    _add_job_parser(
        sub,
        "preflight",
        "check a run's placement, network, step and loader speed; project it",
        cmd_preflight,
    )
    _add_job_parser(sub, "evaluate", "top-1/top-5 and per-class accuracy", cmd_evaluate)

    p = sub.add_parser("aggregate", help="one table of all runs")
    p.add_argument("--run-dirs", type=Path, nargs="+", required=True)
    p.add_argument("--csv", type=Path, required=True)
    p.add_argument("--markdown", type=Path, required=True)
    p.set_defaults(func=cmd_aggregate)

    p = sub.add_parser("accounting", help="sacct accounting of each run's training job")
    p.add_argument("--run-dirs", type=Path, nargs="+", required=True)
    p.set_defaults(func=cmd_accounting)

    p = sub.add_parser(
        "convert-checkpoint",
        help="rewrite a checkpoint or model.pt of an earlier version that you trust so that it "
        "loads without running code (it is unpickled in full once, here)",
    )
    p.add_argument("paths", type=Path, nargs="+")
    p.set_defaults(func=cmd_convert_checkpoint)

    p = sub.add_parser(
        "progress", help="the runs so far: finished runs' table, the others' state and ETA"
    )
    p.add_argument("--runs", nargs="+", required=True)
    p.add_argument("--run-dirs", type=Path, nargs="+", required=True)
    p.add_argument("--checkpoint-roots", type=Path, nargs="+", required=True)
    p.add_argument("--csv", type=Path, required=True)
    p.add_argument("--markdown", type=Path, required=True)
    p.set_defaults(func=cmd_progress)

    _add_plots_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except InputError as exc:
        print(f"imagenet-ddp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"imagenet-ddp {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
