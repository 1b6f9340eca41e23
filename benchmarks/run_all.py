"""Run the eight CPU benchmarks one after another and print one summary table.

    .venv/bin/python benchmarks/run_all.py            # ~10 min on 2 cores
    .venv/bin/python benchmarks/run_all.py --quick    # ~1.5 min, tiny sizes
    .venv/bin/python benchmarks/run_all.py --gpu      # also bench_gpu.py (on a GPU node)

Each script's own table is printed as it finishes; the summary repeats every row with a
target. Always exits 0 unless a script crashed (a MISS is a measurement, not a failure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CPU = [
    "staging", "loader", "index_split", "train_step", "workflow", "eval", "monitor", "epoch_end",
    "breakdown",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="also run bench_gpu.py")
    parser.add_argument("--only", nargs="*", default=None, help=f"subset of {CPU + ['gpu']}")
    args = parser.parse_args(argv)
    names = args.only or (CPU + (["gpu"] if args.gpu else []))
    summary, crashed = [], []
    with tempfile.TemporaryDirectory(prefix="bench-all-") as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, str(HERE / f"bench_{name}.py"), "--json", str(out)]
            if args.quick:
                cmd.append("--quick")
            started = time.perf_counter()
            code = subprocess.run(cmd).returncode
            seconds = time.perf_counter() - started
            if code != 0 or not out.exists():
                crashed.append(name)
                summary.append((name, {"metric": "CRASHED", "ours": float("nan")}, seconds))
                continue
            for row in json.loads(out.read_text())["rows"]:
                summary.append((name, row, seconds))
    print("\n== summary ==")
    print(
        f"{'bench':<12} {'metric':<36} {'ours':>12} {'baseline':>12} {'ratio':>7}  "
        f"{'target':<24} result"
    )
    for name, row, _ in summary:
        if row.get("met") is None and row["metric"] != "CRASHED":
            continue
        ratio = row.get("ratio", float("nan"))
        result = "CRASH" if row["metric"] == "CRASHED" else ("PASS" if row["met"] else "MISS")
        print(
            f"{name:<12} {row['metric'].strip():<36} {row['ours']:>12.4g} "
            f"{row.get('baseline', float('nan')):>12.4g} "
            f"{'n/a' if ratio != ratio else f'{ratio:.2f}x':>7}  {row.get('target', ''):<24} "
            f"{result}"
        )
    times = {}
    for name, _, seconds in summary:
        times[name] = seconds
    print("wall time per script: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
