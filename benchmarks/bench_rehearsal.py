"""Full-scale rehearsal of the data path: 1,000 classes in the real ILSVRC2012 layout.

    .venv/bin/python benchmarks/bench_rehearsal.py                  # 20 train + 2 val per class
    .venv/bin/python benchmarks/bench_rehearsal.py --per-class 4    # while developing
    .venv/bin/python benchmarks/bench_rehearsal.py --quick          # smoke (50 classes, ~1 min)
    [--compare-pools] [--jobs K] [--workers N] [--cores 32] [--short-side 256] [--workdir DIR]

Generates (seeded) the three archives + md5sums with 1,000 wnids, a devkit meta.mat and val
ground truth, and ImageNet-like JPEGs (500x375 and the other common sizes, ~110 KB: a pool of
distinct photo-like images reused across samples, so generation stays cheap; decoding cost
depends on the size and entropy, not on which image it is). Then runs the real workflow
(Snakefile, config.yaml with data.dir pointing at the archives) through Snakemake up to
prepare, and stages the prepared train copy with the function the train job calls.

Prints per stage: wall time (Snakemake's benchmark directive), images/s, peak RSS (the
directive's max_rss and max_uss over the job's processes), bytes written, and the projection
to ILSVRC2012's 1,281,167 + 50,000 images on --cores cores. The workflow runs at two sizes (2
and --per-class images per class) so that each stage's fixed cost (start-up, imports) and its
cost per image are separated: projection = fixed + per image x real images, the per-image part
divided by --cores / --workers only for prepare (the other stages are one process each).
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from _common import REPO, machine_line, quick_flag, realistic_jpeg, realistic_size, report

REAL_TRAIN, REAL_VAL = 1_281_167, 50_000
STAGES = ("verify", "index", "split", "prepare_train", "prepare_val")


def _generate(out: Path, *, classes: int, per_class: int, val_per_class: int, pool: int, seed):
    """The archives in the real layout; returns (train images, val images, bytes written)."""
    import numpy as np

    from imagenet_ddp.data import demo
    from imagenet_ddp.data.archives import (
        DEVKIT_ARCHIVE,
        META_MAT,
        TRAIN_ARCHIVE,
        VAL_ARCHIVE,
        VAL_GROUND_TRUTH,
    )

    rng = np.random.default_rng(seed)
    images = []
    for _ in range(pool):
        width, height = realistic_size(rng)
        images.append(realistic_jpeg(rng, width, height))
    wnids = demo._wnids(rng, classes, 1_440_764, 15_075_141)
    ids = rng.permutation(classes) + 1
    synsets = [
        {
            "id": int(ids[c]),
            "wnid": wnids[c],
            "words": f"class {c}",
            "gloss": "rehearsal",
            "children": [],
            "height": 0,
            "num_train_images": per_class,
        }
        for c in range(classes)
    ]
    synsets.sort(key=lambda s: s["id"])
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / TRAIN_ARCHIVE, mode="w", format=tarfile.GNU_FORMAT) as outer:
        for wnid in wnids:
            numbers = rng.choice(np.arange(1, 20_000), per_class, replace=False)
            members = [(f"{wnid}_{int(n)}.JPEG", images[int(rng.integers(pool))]) for n in numbers]
            demo._add(outer, f"{wnid}.tar", demo._tar_bytes(members))
    val_classes = rng.permutation(np.repeat(np.arange(classes), val_per_class))
    val = [
        (f"ILSVRC2012_val_{j + 1:08d}.JPEG", images[int(rng.integers(pool))])
        for j in range(len(val_classes))
    ]
    (out / VAL_ARCHIVE).write_bytes(demo._tar_bytes(val))
    truth = "".join(f"{int(ids[c])}\n" for c in val_classes).encode()
    with tarfile.open(out / DEVKIT_ARCHIVE, mode="w:gz", format=tarfile.GNU_FORMAT) as tar:
        demo._add(tar, META_MAT, demo._meta_mat(synsets))
        demo._add(tar, VAL_GROUND_TRUTH, truth)
    names = (TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE)
    (out / "md5sums").write_text("".join(f"{demo._md5(out / n)}  {n}\n" for n in names))
    average = sum(len(i) for i in images) / len(images)
    return classes * per_class, len(val), sum((out / n).stat().st_size for n in names), average


def _pool_kinds(jpegs: list[bytes], *, workers: int, short_side: int, repeats: int) -> list[dict]:
    """prepare's process pool (the product) vs a thread pool over the same conversion."""
    from concurrent.futures import ThreadPoolExecutor

    from _common import median

    from imagenet_ddp.data import prepare as P

    items = [(i, data, short_side, 90) for i, data in enumerate(jpegs)]

    def processes():
        return sum(1 for _ in P._converted(iter(items), workers))

    def threads():
        with ThreadPoolExecutor(workers) as pool:
            return sum(1 for _ in pool.map(P._convert_one, items, chunksize=16))

    def one():
        return sum(1 for _ in P._converted(iter(items), 1))

    times = {"processes": [], "threads": [], "one": []}
    for _ in range(repeats):
        for name, fn in (("processes", processes), ("threads", threads), ("one", one)):
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    rate = {k: len(items) / median(v) for k, v in times.items()}
    return [
        {
            "metric": f"prepare convert, {workers} processes img/s",
            "ours": rate["processes"],
            "baseline": rate["threads"],
            "ratio": rate["processes"] / rate["threads"],
            "target": "info (vs threads)",
            "met": None,
        },
        {
            "metric": "prepare convert, 1 process img/s",
            "ours": rate["one"],
            "met": None,
            "target": "info",
        },
    ]


def _workflow(
    workdir: Path, data_dir: Path, *, workers: int, short_side: int, jobs: int, per_class: int
):
    import yaml

    shutil.copy(REPO / "Snakefile", workdir / "Snakefile")
    for name in ("workflow", "profiles"):
        shutil.copytree(REPO / name, workdir / name, ignore=shutil.ignore_patterns("__pycache__"))
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["demo"] = {**config.get("demo", {}), "enabled": False}
    config["data"] = {**config.get("data", {}), "dir": str(data_dir)}
    # A stratified split needs a holdout image per class: at a few images per class the
    # configured fraction may be too small (ImageNet itself has ~1,300 per class).
    fraction = max(config["split"]["holdout_fraction"], 1 / per_class)
    config["split"] = {**config["split"], "holdout_fraction": fraction}
    config["prepare"] = {
        **config.get("prepare", {}),
        "short_side": short_side,
        "workers": workers,
        "jobs": jobs,
    }
    (workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _benchmark_tsv(path: Path) -> dict:
    with open(path) as f:
        row = next(csv.DictReader(f, delimiter="\t"))
    return {k: float(row[k]) for k in ("s", "max_rss", "max_uss")}


def main(argv: list[str] | None = None) -> int:
    parser = quick_flag()
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--per-class", type=int, default=20, help="train images per class")
    parser.add_argument("--val-per-class", type=int, default=2)
    parser.add_argument("--pool", type=int, default=64, help="distinct JPEGs generated")
    parser.add_argument("--short-side", type=int, default=256, help="prepare.short_side")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="prepare.workers")
    parser.add_argument("--jobs", type=int, default=1, help="prepare.jobs")
    parser.add_argument("--cores", type=int, default=32, help="cores of the projection")
    parser.add_argument("--workdir", type=Path, default=None, help="keep everything here")
    parser.add_argument(
        "--compare-pools", action="store_true", help="also: prepare's processes vs threads"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.classes, args.per_class, args.val_per_class, args.pool = 50, 4, 2, 4
    print(
        f"== bench_rehearsal: {args.classes} classes x {args.per_class} train "
        f"+ {args.val_per_class} val images =="
    )
    print(machine_line(), flush=True)
    keep = args.workdir is not None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rehearsal-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, workdir)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _rehearse(args, workdir: Path, per_class: int, val_per_class: int) -> dict:
    """Generate the archives, run the workflow's data rules, stage; per-stage measurements."""
    from imagenet_ddp.data.prepared_layout import resolve_prepared
    from imagenet_ddp.data.stage import stage_dataset

    data_dir = workdir / "ILSVRC2012"
    started = time.perf_counter()
    train_n, val_n, archive_bytes, average = _generate(
        data_dir,
        classes=args.classes,
        per_class=per_class,
        val_per_class=val_per_class,
        pool=args.pool,
        seed=0,
    )
    print(
        f"generated {train_n} + {val_n} images, {archive_bytes / 1e9:.2f} GB of archives, "
        f"{average / 1e3:.0f} KB per JPEG, in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    _workflow(
        workdir,
        data_dir,
        workers=args.workers,
        short_side=args.short_side,
        jobs=args.jobs,
        per_class=per_class,
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    targets = ["results/split/train.csv", *(f"results/prepared/{w}.json" for w in ("train", "val"))]
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", str(args.workers), *targets],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"snakemake failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}")
    bench = workdir / "results/benchmarks"
    copies = {w: resolve_prepared(workdir / f"results/prepared/{w}.json") for w in ("train", "val")}
    staged = stage_dataset(copies["train"], workdir / "scratch", verify="size")
    both = train_n + val_n
    stages = {
        "verify": (both, "results/verify"),
        "index": (both, "results/index"),
        "split": (train_n, "results/split"),
        "prepare_train": (train_n, copies["train"]),
        "prepare_val": (val_n, copies["val"]),
    }
    measured = {}
    for stage, (images, output) in stages.items():
        tsvs = [bench / f"{stage}.tsv"]
        if stage.startswith("prepare") and args.jobs > 1:  # the chunk jobs, then the join
            tsvs += sorted(bench.glob(f"{stage}_*.tsv"))
        rows = [_benchmark_tsv(t) for t in tsvs]
        measured[stage] = {
            "s": sum(r["s"] for r in rows),
            "max_rss": max(r["max_rss"] for r in rows),
            "max_uss": max(r["max_uss"] for r in rows),
            "images": images,
            "bytes": _du(workdir / output),
        }
    measured["stage"] = {
        "s": staged["seconds"],
        "max_rss": float("nan"),
        "max_uss": float("nan"),
        "images": train_n,
        "bytes": staged["bytes"],
    }
    return measured


def _projection(small: dict, big: dict, real: int, scale: float) -> tuple[float, float, bool]:
    """(per-image s, projected s, two_point) from two sizes: fixed cost + per-image cost x real
    images; ``scale``: cores used here / cores of the projection, for stages that use all cores.

    On a shared machine the small run may be slowed more than the big one; where the two points
    give no positive per-image cost, the big run's wall / images (fixed cost included) is used:
    an upper bound, flagged by two_point False.
    """
    upper = big["s"] / big["images"]
    per_image = (big["s"] - small["s"]) / (big["images"] - small["images"])
    two_point = 0.0 < per_image <= upper
    if not two_point:
        per_image = upper
    fixed = big["s"] - per_image * big["images"]
    return per_image, fixed + per_image * real * scale, two_point


def _run(args, workdir: Path) -> int:
    real = {
        "verify": REAL_TRAIN + REAL_VAL,
        "index": REAL_TRAIN + REAL_VAL,
        "split": REAL_TRAIN,
        "prepare_train": REAL_TRAIN,
        "prepare_val": REAL_VAL,
        "stage": REAL_TRAIN,
    }
    # Two sizes give each stage's fixed cost (start-up, imports) and its cost per image.
    small = _rehearse(args, workdir / "small", 2, 1)
    big = _rehearse(args, workdir / "big", args.per_class, args.val_per_class)
    rows = _compare_pools(args, workdir / "big") if args.compare_pools else []
    total = 0.0
    for stage, m in big.items():
        parallel = stage.startswith("prepare")
        scale = args.workers / args.cores if parallel else 1.0
        per_image, projected, two_point = _projection(small[stage], m, real[stage], scale)
        total += projected
        info = {"met": None, "target": "info"}
        rows += [
            {"metric": f"{stage}: wall s", "ours": m["s"], "unit": "s", **info},
            {"metric": f"{stage}: images/s", "ours": m["images"] / m["s"], **info},
            {
                "metric": f"{stage}: ms per image" + (" (2 sizes)" if two_point else " (bound)"),
                "ours": per_image * 1e3,
                **info,
            },
            {"metric": f"{stage}: peak RSS MB", "ours": m["max_rss"], **info},
            {"metric": f"{stage}: peak USS MB", "ours": m["max_uss"], **info},
            {"metric": f"{stage}: MB written", "ours": m["bytes"] / 1e6, **info},
            {
                "metric": f"{stage}: projected h" + (f", {args.cores} cores" if parallel else ""),
                "ours": projected / 3600,
                "unit": "h",
                **info,
            },
        ]
    # The one ratio: the projected data path against a budget of one day.
    rows.append(
        {
            "metric": "projected data path h",
            "ours": total / 3600,
            "baseline": 24.0,
            "unit": "h",
            "ratio": 24.0 / (total / 3600),
            "met": total / 3600 <= 24.0,
            "target": "<= 24 h",
        }
    )
    report(
        f"bench_rehearsal ({args.classes} classes, {big['prepare_train']['images']} + "
        f"{big['prepare_val']['images']} images)",
        rows,
        notes=[
            f"prepare ran with {args.workers} workers here; its projection assumes linear "
            f"scaling to {args.cores} cores; the other stages are one process each",
            "projection: fixed cost + per-image cost (from 2 and "
            f"{args.per_class} images per class) x 1,281,167 train (+ 50,000 val); '(bound)': "
            "the two sizes gave no positive per-image cost (load changed between them), so "
            "wall / images of the big run is used, an upper bound",
            "peak RSS: Snakemake's benchmark max_rss, summed over the job's processes (shared "
            "pages counted once per process); USS: memory unique to them",
            "stage: stage_dataset (what each train job runs per node), page cache warm",
        ],
        json_out=args.json,
    )
    return 0


def _compare_pools(args, workdir: Path) -> list[dict]:
    import random

    from imagenet_ddp.data.archives import TRAIN_ARCHIVE, list_train_archive

    data_dir = workdir / "ILSVRC2012"
    listing = list_train_archive(data_dir)
    entries = [e for class_entries in listing.entries[:100] for e in class_entries]
    random.Random(0).shuffle(entries)
    with open(data_dir / TRAIN_ARCHIVE, "rb") as f:
        jpegs = [os.pread(f.fileno(), size, offset) for _, size, offset in entries[:240]]
    return _pool_kinds(
        jpegs, workers=args.workers, short_side=args.short_side, repeats=args.repeats or 3
    )


if __name__ == "__main__":
    sys.exit(main())
