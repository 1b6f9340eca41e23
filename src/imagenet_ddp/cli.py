"""``imagenet-ddp``: one subcommand per workflow stage. The Snakemake rules call these.

Every stage writes its artifact atomically and a ``*.provenance.json`` beside it. A bad input
raises :class:`InputError`, printed as one line that names the file and what to do (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from imagenet_ddp.errors import InputError
from imagenet_ddp.io import atomic_path, write_csv_atomic, write_json_atomic, write_text_atomic
from imagenet_ddp.provenance import provenance_record, write_provenance


def cmd_demo_data(args: argparse.Namespace) -> None:
    from imagenet_ddp.demo import make_demo_dataset

    with atomic_path(args.out, is_dir=True) as tmp:
        make_demo_dataset(
            tmp,
            num_classes=args.num_classes,
            train_per_class=args.train_per_class,
            val_per_class=args.val_per_class,
            image_size=args.image_size,
            seed=args.seed,
        )


def cmd_verify(args: argparse.Namespace) -> None:
    from imagenet_ddp.archives import verify_archives

    report = verify_archives(args.data_dir, check_md5=args.check_md5)
    write_json_atomic(args.report, report)
    write_provenance(
        Path(str(args.report) + ".provenance.json"),
        "verify",
        {"data_dir": str(args.data_dir), "check_md5": args.check_md5},
    )


def cmd_index(args: argparse.Namespace) -> None:
    from imagenet_ddp.archives import build_index

    classes, train, val = build_index(args.data_dir)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, frame in (("classes", classes), ("train", train), ("val", val)):
        write_csv_atomic(args.out_dir / f"{name}.csv", frame)
    write_provenance(
        args.out_dir / "provenance.json",
        "index",
        {"data_dir": str(args.data_dir)},
        extra={"counts": {"classes": len(classes), "train": len(train), "val": len(val)}},
    )


def cmd_split(args: argparse.Namespace) -> None:
    import pandas as pd

    from imagenet_ddp.split import stratified_split

    train = pd.read_csv(args.index_dir / "train.csv", keep_default_na=False)
    train_part, holdout = stratified_split(train, args.holdout_fraction, args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(args.out_dir / "train.csv", train_part)
    write_csv_atomic(args.out_dir / "holdout.csv", holdout)
    counts = (
        pd.DataFrame(
            {
                "train": train_part.groupby("class_index").size(),
                "holdout": holdout.groupby("class_index").size(),
            }
        )
        .fillna(0)
        .astype(int)
    )
    write_csv_atomic(args.out_dir / "class_counts.csv", counts.reset_index())
    write_provenance(
        args.out_dir / "provenance.json",
        "split",
        {"holdout_fraction": args.holdout_fraction},
        seeds={"split": args.seed},
        extra={"counts": {"train": len(train_part), "holdout": len(holdout)}},
    )


def cmd_prepare(args: argparse.Namespace) -> None:
    """Build the training-ready copy, once, even when several workflows share its directory.

    Writers are excluded by a lock beside the output; the copy appears by an atomic rename, so
    readers never see a partial one. A complete copy made from the same index with the same
    settings is reused instead of rebuilt.
    """
    import hashlib

    import pandas as pd

    from imagenet_ddp.io import exclusive_lock, lock_path_for
    from imagenet_ddp.prepared import FORMAT_VERSION, prepare_split

    index_csv = args.index_dir / f"{args.which}.csv"
    identity = {
        "which": args.which,
        "short_side": args.short_side,
        "quality": args.quality,
        "on_corrupt": args.on_corrupt,
        "index_sha256": hashlib.sha256(index_csv.read_bytes()).hexdigest(),
        # a copy in an older format is rebuilt, not reused
        "format_version": FORMAT_VERSION,
    }
    provenance = Path(str(args.out) + ".provenance.json")
    with exclusive_lock(lock_path_for(args.out)):
        done = (args.out / "prepared.json").is_file() and provenance.is_file()
        if done and json.loads(provenance.read_text()).get("config") == identity:
            print(f"{args.out} is already prepared from the same index and settings; reusing")
            return
        index = pd.read_csv(index_csv, keep_default_na=False)
        summary = prepare_split(
            args.data_dir,
            index,
            args.out,
            which=args.which,
            short_side=args.short_side,
            quality=args.quality,
            workers=args.workers,
            on_corrupt=args.on_corrupt,
        )
        write_provenance(provenance, "prepare", identity, extra={"summary": summary})


def cmd_train(args: argparse.Namespace) -> int:
    from imagenet_ddp.launch import Geometry, run_job

    run_config = json.loads(args.run_config_json)
    geometry = Geometry(args.nodes, args.tasks_per_node, args.cpus_per_task)
    # The worker checks the ranks that started against this geometry and keys checkpoints by it.
    worker_config = {
        **run_config,
        "nodes": args.nodes,
        "tasks_per_node": args.tasks_per_node,
        "cpus_per_task": args.cpus_per_task,
    }
    worker_args = [
        "--config-json",
        json.dumps(worker_config, sort_keys=True),
        "--split-dir",
        str(args.split_dir),
        "--out-dir",
        str(args.run_dir),
        "--checkpoint-root",
        str(args.checkpoint_root),
    ]
    started = time.time()
    code = run_job(
        launcher=args.launcher,
        geometry=geometry,
        prepared_train=args.prepared_train,
        scratch_dir=args.scratch_dir,
        run_dir=args.run_dir,
        stage_verify=args.stage_verify,
        cleanup=args.cleanup,
        worker_args=worker_args,
        srun_extra=args.srun_extra.split() if args.srun_extra else None,
    )
    if code != 0:
        return code
    job = {
        "launcher": args.launcher,
        "nodes": args.nodes,
        "tasks_per_node": args.tasks_per_node,
        "cpus_per_task": args.cpus_per_task,
        "wall_seconds": time.time() - started,
        "provenance": provenance_record(
            "train", run_config, seeds={"train": run_config.get("seed", 0)}
        ),
    }
    write_json_atomic(args.run_dir / "job.json", job)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Start the evaluation's ranks through the training launcher; rank 0 writes the outputs."""
    from imagenet_ddp.launch import Geometry, launch_ranks

    geometry = {
        "nodes": args.nodes,
        "tasks_per_node": args.tasks_per_node,
        "cpus_per_task": args.cpus_per_task,
        "gpus_per_node": args.gpus_per_node,
    }
    rank = [sys.executable, "-m", "imagenet_ddp.launch", "evaluate-worker", "--"]
    for flag in ("model", "prepared_train", "prepared_val", "split_dir", "classes", "out"):
        rank += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    rank += [
        "--per-class",
        str(args.per_class),
        "--geometry-json",
        json.dumps(geometry),
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(args.workers),
        "--device",
        args.device,
    ]
    started = time.time()
    code, _ = launch_ranks(
        args.launcher,
        Geometry(args.nodes, args.tasks_per_node, args.cpus_per_task),
        rank,
        args.srun_extra.split() if args.srun_extra else None,
    )
    if code != 0:
        return code
    result = json.loads(args.out.read_text())
    result["evaluation"]["job_wall_seconds"] = time.time() - started
    write_json_atomic(args.out, result)
    return 0


def cmd_aggregate(args: argparse.Namespace) -> None:
    from imagenet_ddp.aggregate import aggregate_runs, to_markdown

    table = aggregate_runs(args.run_dirs)
    write_csv_atomic(args.csv, table)
    write_text_atomic(args.markdown, to_markdown(table))
    write_provenance(
        Path(str(args.csv) + ".provenance.json"),
        "aggregate",
        {"run_dirs": [str(d) for d in args.run_dirs]},
    )


def _add_evaluate_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="top-1/top-5 and per-class accuracy")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prepared-train", type=Path, required=True)
    p.add_argument("--prepared-val", type=Path, required=True)
    p.add_argument("--split-dir", type=Path, required=True)
    p.add_argument("--classes", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--per-class", type=Path, required=True)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", default="auto", help="loader workers per rank; auto = cpus - 1")
    p.add_argument("--device", default="auto")
    p.add_argument("--launcher", choices=["local", "srun"], default="local")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=1)
    p.add_argument("--cpus-per-task", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--srun-extra", default="", help="extra srun flags, space separated")
    p.set_defaults(func=cmd_evaluate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="imagenet-ddp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-data", help="write a small synthetic ILSVRC2012 in the real layout")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--train-per-class", type=int, default=100)
    p.add_argument("--val-per-class", type=int, default=10)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo_data)

    p = sub.add_parser("verify", help="check the archives' structure and md5")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--report", type=Path, required=True)
    p.add_argument("--check-md5", action=argparse.BooleanOptionalAction, default=True)
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

    p = sub.add_parser("prepare", help="decode once into training-ready shards")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--index-dir", type=Path, required=True)
    p.add_argument("--which", choices=["train", "val"], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--short-side", type=int, required=True)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--on-corrupt", choices=["fail", "skip"], default="fail")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("train", help="stage data on every node and run DDP training")
    p.add_argument("--launcher", choices=["local", "srun"], required=True)
    p.add_argument("--run-config-json", required=True)
    p.add_argument("--prepared-train", type=Path, required=True)
    p.add_argument("--split-dir", type=Path, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--checkpoint-root", type=Path, required=True)
    p.add_argument("--scratch-dir", type=Path, required=True)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=1)
    p.add_argument("--cpus-per-task", type=int, default=1)
    p.add_argument("--stage-verify", choices=["size", "sha256"], default="size")
    p.add_argument("--cleanup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--srun-extra", default="", help="extra srun flags, space separated")
    p.set_defaults(func=cmd_train)

    _add_evaluate_parser(sub)

    p = sub.add_parser("aggregate", help="one table of all runs")
    p.add_argument("--run-dirs", type=Path, nargs="+", required=True)
    p.add_argument("--csv", type=Path, required=True)
    p.add_argument("--markdown", type=Path, required=True)
    p.set_defaults(func=cmd_aggregate)
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
