"""Index + split at full ImageNet scale: 1,281,167 train samples, 1000 classes (732..1300 each).

    .venv/bin/python benchmarks/bench_index_split.py [--quick] [--repeats 3]

Every measurement runs in a fresh subprocess, so its peak RSS (``ru_maxrss``, which includes
the interpreter and pandas/sklearn imports) is its own. Phases:

* **index table**: what ``archives.build_index`` does after listing the tars: build the
  1.28M-row DataFrame (sample_id, class_index, wnid, member, name, size) from the listing, sort
  it, write ``train.csv`` with ``io.write_csv_atomic`` (the listing itself is synthetic here;
  reading real tar headers is I/O bound and measured by the product's own tests).
* **split step**: exactly ``imagenet-ddp split`` (``split.split_index``): read the index CSV,
  ``split.stratified_split``, write train/holdout/class_counts CSVs and provenance.
* **stratified_split** alone on the in-memory table.
* **baseline**: the common recipe alone,
  ``train_test_split(np.arange(n), train_size=.., test_size=.., random_state=RandomState(0),
  shuffle=True, stratify=targets)``: the floor any stratified split pays.

Targets (issue): the split step <= 10 s and <= 2 GB peak RSS. The ratio column is
baseline time / our time (1.0 = no overhead over the bare recipe).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

IMAGENET_TRAIN = 1_281_167
IMAGENET_CLASSES = 1000


def class_counts(num_classes: int, total: int):
    """ImageNet-like class sizes: most 1300, one 732, a few dozen in between; sums to total."""
    import numpy as np

    rng = np.random.default_rng(0)
    counts = np.full(num_classes, 1300, dtype=np.int64)
    deficit = 1300 * num_classes - total
    if deficit < 0:
        raise ValueError("total exceeds 1300 per class")
    counts[0] = max(732, 1300 - deficit)
    deficit -= 1300 - counts[0]
    k = 1
    while deficit > 0:
        cut = int(min(deficit, rng.integers(50, 568)))
        counts[k % num_classes] -= cut
        deficit -= cut
        k += 1
    return counts


def _listing(num_classes: int, total: int):
    """What list_train_archive gives build_index: wnids, per-class member, names, sizes."""
    import numpy as np

    counts = class_counts(num_classes, total)
    wnids = [f"n{1440764 + 13 * c:08d}" for c in range(num_classes)]
    members = [f"{w}.tar" for w in wnids]
    names = [f"{w}_{i}.JPEG" for w, n in zip(wnids, counts, strict=True) for i in range(int(n))]
    sizes = np.random.default_rng(1).integers(2_000, 400_000, len(names))
    return counts, wnids, members, names, sizes


def child(phase: str, workdir: Path, num_classes: int, total: int) -> dict:
    import numpy as np

    result: dict = {"phase": phase}
    if phase == "index":
        import pandas as pd

        from imagenet_ddp.io import write_csv_atomic

        counts, wnids, members, names, sizes = _listing(num_classes, total)
        started = time.perf_counter()
        class_of_sample = np.repeat(np.arange(num_classes, dtype=np.int64), counts)
        train = pd.DataFrame(
            {
                "sample_id": np.arange(len(names), dtype=np.int64),
                "class_index": class_of_sample,
                "wnid": np.asarray(wnids, dtype=object)[class_of_sample],
                "member": np.asarray(members, dtype=object)[class_of_sample],
                "name": names,
                "size": sizes,
            }
        )
        train = train.sort_values(["class_index", "name"], kind="stable").reset_index(drop=True)
        train["sample_id"] = np.arange(len(train), dtype=np.int64)
        write_csv_atomic(workdir / "index" / "train.csv", train)
        result["seconds"] = time.perf_counter() - started
    elif phase == "split":
        from imagenet_ddp.data.split import split_index

        started = time.perf_counter()
        split_index(workdir / "index", workdir / "split", holdout_fraction=0.1, seed=0)
        result["seconds"] = time.perf_counter() - started
    elif phase == "stratified_split":
        import pandas as pd

        from imagenet_ddp.data.split import stratified_split

        train = pd.read_csv(workdir / "index" / "train.csv", keep_default_na=False)
        started = time.perf_counter()
        stratified_split(train, 0.1, 0)
        result["seconds"] = time.perf_counter() - started
    elif phase == "baseline":
        from sklearn.model_selection import train_test_split

        targets = np.repeat(
            np.arange(num_classes, dtype=np.int64), class_counts(num_classes, total)
        )
        n = len(targets)
        n_valid = int(round(n * 0.1))
        started = time.perf_counter()
        train_test_split(
            np.arange(n),
            train_size=n - n_valid,
            test_size=n_valid,
            random_state=np.random.RandomState(0),
            shuffle=True,
            stratify=targets,
        )
        result["seconds"] = time.perf_counter() - started
    else:
        raise ValueError(phase)
    result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def run_child(phase: str, workdir: Path, num_classes: int, total: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            phase,
            "--workdir",
            str(workdir),
            "--classes",
            str(num_classes),
            "--total",
            str(total),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{phase} child failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = C.quick_flag()
    parser.add_argument("--child", default=None, help=argparse_hidden())
    parser.add_argument("--workdir", type=Path, default=None, help=argparse_hidden())
    parser.add_argument("--classes", type=int, default=None)
    parser.add_argument("--total", type=int, default=None)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.workdir, args.classes, args.total)))
        return 0
    num_classes = args.classes or (100 if args.quick else IMAGENET_CLASSES)
    total = args.total or (num_classes * IMAGENET_TRAIN // IMAGENET_CLASSES)
    repeats = args.repeats or (1 if args.quick else 3)

    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-index-split-") as tmp:
        workdir = Path(tmp)
        for _ in range(repeats):
            for phase in ("index", "split", "stratified_split", "baseline"):
                results.setdefault(phase, []).append(run_child(phase, workdir, num_classes, total))
        index_mb = (workdir / "index" / "train.csv").stat().st_size / 1e6

    sec = {p: C.median([r["seconds"] for r in rs]) for p, rs in results.items()}
    rss = {p: max(r["max_rss_mb"] for r in rs) for p, rs in results.items()}
    scale = "" if total == IMAGENET_TRAIN else f" (scaled: {total:,})"
    rows = [
        {
            "metric": "split step (split_index), s",
            "ours": sec["split"],
            "baseline": sec["baseline"],
            "unit": "s",
            "ratio": sec["baseline"] / sec["split"],
            "target": "<= 10 s",
            "met": sec["split"] <= 10.0,
        },
        {
            "metric": "split step peak RSS, MB",
            "ours": rss["split"],
            "baseline": rss["baseline"],
            "unit": "MB",
            "ratio": rss["baseline"] / rss["split"],
            "target": "<= 2048 MB",
            "met": rss["split"] <= 2048,
        },
        {
            "metric": "stratified_split alone, s",
            "ours": sec["stratified_split"],
            "baseline": sec["baseline"],
            "unit": "s",
            "ratio": sec["baseline"] / sec["stratified_split"],
            "target": "(info)",
            "met": None,
        },
        {
            "metric": "index table build+sort+CSV, s",
            "ours": sec["index"],
            "baseline": sec["baseline"],
            "unit": "s",
            "ratio": sec["baseline"] / sec["index"],
            "target": "<= 10 s",
            "met": sec["index"] <= 10.0,
        },
        {
            "metric": "index table peak RSS, MB",
            "ours": rss["index"],
            "baseline": rss["baseline"],
            "unit": "MB",
            "ratio": rss["baseline"] / rss["index"],
            "target": "<= 2048 MB",
            "met": rss["index"] <= 2048,
        },
    ]
    C.report(
        f"bench_index_split: {total:,} samples, {num_classes} classes{scale}",
        rows,
        notes=[
            f"median of {repeats} fresh subprocesses per phase; RSS = max ru_maxrss "
            "(includes interpreter + imports, ~100-200 MB)",
            f"index train.csv is {index_mb:.0f} MB; holdout_fraction 0.1, seed 0",
            "ratio = baseline/ours (time or RSS); baseline = train_test_split(stratify=) alone",
        ],
        json_out=args.json,
    )
    return 0


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
