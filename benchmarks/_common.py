"""Shared helpers for the benchmark scripts (not a test module, not product code).

Every benchmark measures ours and a baseline in the same run, repeats, and reports medians.
"""

from __future__ import annotations

import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))


def baseline_parser(workers: int):
    """The command line both DDP baselines (_ddp_baseline.py, _reference_loop.py) share."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--train-data", type=Path, required=True)
    parser.add_argument("--split-dir", type=Path, required=True)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--crop-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=workers)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def drop_page_cache() -> bool:
    """Drop the Linux page cache (needs root); False when not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    busy = (
        "  (BUSY: other load on this machine, expect noise)"
        if load > 0.5 * (os.cpu_count() or 1)
        else ""
    )
    return (
        f"machine: {os.cpu_count()} cores, {cpu_model()}, python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load avg (1 min, incl. this run) {load:.2f}{busy}"
    )


def fmt(value: float, unit: str = "") -> str:
    if value != value:  # NaN
        return "n/a"
    if abs(value) >= 1000:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    elif abs(value) >= 1:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3g}"
    return f"{text} {unit}".strip()


def report(
    title: str,
    rows: list[dict],
    *,
    notes: Sequence[str] = (),
    json_out: str | None = None,
) -> None:
    """Print the table. Each row: metric, ours, baseline, unit, ratio, target (str), met (bool).

    ``ratio`` is always "ours relative to baseline, higher is better for us" as described in
    ``target``; the PASS/MISS column compares against the target.
    """
    print()
    print(f"== {title} ==")
    print(machine_line())
    header = f"{'metric':<34} {'ours':>14} {'baseline':>14} {'ratio':>8}  {'target':<22} result"
    print(header)
    print("-" * len(header))
    for row in rows:
        ratio = row.get("ratio", float("nan"))
        ratio_text = "n/a" if ratio != ratio else f"{ratio:.2f}x"
        result = {True: "PASS", False: "MISS", None: "-"}[row.get("met")]
        print(
            f"{row['metric']:<34} {fmt(row['ours'], row.get('unit', '')):>14} "
            f"{fmt(row.get('baseline', float('nan')), row.get('unit', '')):>14} "
            f"{ratio_text:>8}  {row.get('target', ''):<22} {result}"
        )
    for note in notes:
        print(f"note: {note}")
    if json_out:
        Path(json_out).write_text(json.dumps({"title": title, "rows": rows}, indent=2) + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- synthetic data


def realistic_jpeg(rng, width: int = 500, height: int = 375, quality: int = 90) -> bytes:
    """A photo-like JPEG: smooth shapes + gradients + fine texture, ~100-130 KB at 500x375 q90.

    Pure noise compresses far worse and flat colour far better than photos; the size (hence
    entropy-decoding work) is what matters for decode speed, so the texture is tuned so that
    the file size matches ImageNet's average (~110 KB for ~400x350 to 500x375 images).
    """
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.zeros((height, width, 3), np.float32)
    for c in range(3):
        image[..., c] = 128 + 60 * np.sin(x / rng.uniform(20, 80) + rng.uniform(0, 6)) * np.cos(
            y / rng.uniform(20, 80) + rng.uniform(0, 6)
        )
    for _ in range(12):  # blobs
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(15, 90)
        mask = ((x - cx) ** 2 + (y - cy) ** 2) < r * r
        image[mask] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 30, image.shape).astype(np.float32)
    pixels = np.clip(image, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="JPEG", quality=quality)
    return out.getvalue()


def realistic_size(rng) -> tuple[int, int]:
    """ImageNet-like sizes: mostly 500x375 / 375x500 / 500x333, some smaller."""
    choices = [(500, 375), (375, 500), (500, 333), (500, 400), (400, 300), (333, 500)]
    return choices[int(rng.integers(len(choices)))]


def write_prepared(
    out_dir: Path,
    images: Sequence[bytes],
    labels: Sequence[int],
    *,
    num_classes: int,
    short_side: int,
    quality: int = 90,
    shard_bytes: int = 256 << 20,
) -> Path:
    """Write a prepared directory (imagenet_ddp.data.prepared_layout) from already-converted JPEGs,
    using the product's shard writer, so PreparedImageDataset and stage_dataset accept it."""
    import hashlib

    import pandas as pd

    from imagenet_ddp.data import prepare as P
    from imagenet_ddp.io import write_csv_atomic, write_json_atomic

    out_dir = Path(out_dir)
    (out_dir / P.SHARD_DIR).mkdir(parents=True, exist_ok=True)
    # A new shard before a sample would take one past shard_bytes (3072: at most its headers,
    # label, padding and the tar end).
    writers, rows = [], []
    for sample_id, (data, label) in enumerate(zip(images, labels, strict=True)):
        if not writers or writers[-1].record["bytes"] + len(data) + 3072 > shard_bytes:
            if writers:
                writers[-1].close()
            writers.append(P._ShardWriter(out_dir / P.SHARD_DIR / P.shard_name(len(writers))))
        offset = writers[-1].write(data, key=P.sample_key(sample_id), label=int(label))
        rows.append((sample_id, int(label), len(writers) - 1, offset, len(data)))
    writers[-1].close()
    samples = pd.DataFrame(rows, columns=["sample_id", "class_index", "shard", "offset", "length"])
    write_csv_atomic(out_dir / P.SAMPLES_CSV, samples)
    info = {
        "format": P.FORMAT,
        "format_version": P.FORMAT_VERSION,
        "which": "train",
        "short_side": short_side,
        "quality": quality,
        "num_classes": num_classes,
        "num_samples": len(rows),
        "num_skipped": 0,
        "skipped": [],
        "total_bytes": sum(w.record["bytes"] for w in writers),
        "shard_bytes_target": shard_bytes,
        "shards": [w.record for w in writers],
        "samples_csv_sha256": hashlib.sha256((out_dir / P.SAMPLES_CSV).read_bytes()).hexdigest(),
    }
    write_json_atomic(out_dir / P.PREPARED_JSON, info)
    return out_dir


def quick_flag(argv: Sequence[str] | None = None):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="tiny sizes (~30 s), for smoke tests")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (median reported)")
    parser.add_argument("--json", default=None, help="also write the table as JSON here")
    return parser
