"""Staging throughput: prepared dataset -> node-local scratch, vs `cp -r` and `tar -x`.

    .venv/bin/python benchmarks/bench_staging.py [--quick] [--size-mb 1024] [--repeats 5]

Ours is ``imagenet_ddp.data.stage.stage_dataset`` (lock, fingerprint, free-space check, one
``shutil.copyfile`` per shard, size verification, marker, atomic rename): everything a training
job pays before its first step. Baselines, on the same bytes in the same run:

* ``cp -r <prepared> <scratch>`` (what a job script would do by hand);
* ``tar -xf <prepared>.tar -C <scratch>`` (the other common recipe: ship one tar, extract it).

Cache state is the same for all three: the page cache is dropped (``sync; echo 3 >
/proc/sys/vm/drop_caches``, needs root) before every measurement, so each reads its source from
disk. Without root the script pre-reads every source instead (all warm) and says so. The order
of the three is rotated every repetition; the median of the repetitions is reported.
Target: ours >= 0.9x the bytes/s of `cp -r`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from imagenet_ddp.data.stage import stage_dataset  # noqa: E402


def make_source(root: Path, size_mb: int, shard_mb: int) -> tuple[Path, int, int]:
    """A prepared dir of ``size_mb`` MiB (incompressible bytes; content does not matter here)."""
    import numpy as np

    rng = np.random.default_rng(0)
    chunk = 1 << 20
    images = [rng.bytes(chunk) for _ in range(size_mb)]
    src = C.write_prepared(
        root / "train",
        images,
        [i % 10 for i in range(size_mb)],
        num_classes=10,
        short_side=160,
        shard_bytes=shard_mb << 20,
    )
    files = [p for p in src.rglob("*") if p.is_file()]
    return src, sum(p.stat().st_size for p in files), len(files)


def warm(paths: list[Path]) -> None:
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for f in files:
            with open(f, "rb") as handle:
                while handle.read(8 << 20):
                    pass


def main(argv: list[str] | None = None) -> int:
    parser = C.quick_flag()
    parser.add_argument("--size-mb", type=int, default=None)
    parser.add_argument("--shard-mb", type=int, default=64)
    args = parser.parse_args(argv)
    size_mb = args.size_mb or (48 if args.quick else 1024)
    shard_mb = min(args.shard_mb, 16) if args.quick else args.shard_mb
    repeats = args.repeats or (3 if args.quick else 5)

    with tempfile.TemporaryDirectory(prefix="bench-staging-") as tmp:
        tmp = Path(tmp)
        src, total, nfiles = make_source(tmp / "shared", size_mb, shard_mb)
        tarball = tmp / "shared" / "train.tar"
        subprocess.run(["tar", "-cf", str(tarball), "-C", str(src.parent), src.name], check=True)
        cold = C.drop_page_cache()

        def prepare_cache() -> None:
            if cold:
                C.drop_page_cache()
            else:
                warm([src, tarball])

        def ours(dest: Path) -> None:
            report = stage_dataset(src, dest, verify="size")
            assert not report["reused"]

        def cp(dest: Path) -> None:
            dest.mkdir(parents=True)
            subprocess.run(["cp", "-r", str(src), str(dest)], check=True)

        def untar(dest: Path) -> None:
            dest.mkdir(parents=True)
            subprocess.run(["tar", "-xf", str(tarball), "-C", str(dest)], check=True)

        methods = {"ours": ours, "cp -r": cp, "tar -x": untar}
        times: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        for rep in range(repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                dest = tmp / "scratch" / f"{name.replace(' ', '_')}-{rep}"
                prepare_cache()
                times[name].append(C.timed(lambda fn=methods[name], d=dest: fn(d)))
                shutil.rmtree(dest)

    rate = {name: total / C.median(t) for name, t in times.items()}
    mib = 1 << 20
    rows = [
        {
            "metric": "staging vs cp -r (MiB/s)",
            "ours": rate["ours"] / mib,
            "baseline": rate["cp -r"] / mib,
            "unit": "MiB/s",
            "ratio": rate["ours"] / rate["cp -r"],
            "target": ">= 0.9x cp -r",
            "met": rate["ours"] / rate["cp -r"] >= 0.9,
        },
        {
            "metric": "staging vs tar -x (MiB/s)",
            "ours": rate["ours"] / mib,
            "baseline": rate["tar -x"] / mib,
            "unit": "MiB/s",
            "ratio": rate["ours"] / rate["tar -x"],
            "target": "(info)",
            "met": None,
        },
    ]
    C.report(
        "bench_staging: prepared dir -> scratch",
        rows,
        notes=[
            f"{total / mib:.0f} MiB in {nfiles} files ({shard_mb} MiB shards), "
            f"median of {repeats}; page cache "
            + ("dropped before each copy (cold source)" if cold else "WARM for all (no root)"),
            "seconds per copy (median): "
            + ", ".join(f"{k} {C.median(v):.3f}" for k, v in times.items()),
        ],
        json_out=args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
