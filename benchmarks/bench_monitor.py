"""What the study features cost: rank 0's monitor per training step, and planning a sweep.

    .venv/bin/python benchmarks/bench_monitor.py [--quick] [--repeats 5] [--steps 2000]

* **monitor per step**: ``RunMonitor.step`` (TensorBoard scalars every ``log_interval`` steps,
  NVML sampler thread running against a fake NVML: no GPU here) over ``--steps`` steps with
  ``log_interval`` 20 (the default) and 1 (worst case). Baseline: ``Progress.update``, the
  progress line every rank-0 step already pays, at the same interval. Both read the meter's
  interval, its loss from a CPU tensor (on a GPU that read waits for the device in either;
  it is not the monitor's cost). Per-step microseconds, median of the repetitions.
* **sweep dry-run**: ``snakemake -n --profile profiles/local`` with 48 runs written as one
  sweep (grid nodes x precision x lr) against the same 48 runs written by hand.

Ratio = baseline / ours (1.0: no extra cost). Targets: monitor <= 50 us per step at
interval 20; sweep dry-run within 10 % of hand-written runs.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def per_step_us(make, steps: int, torch) -> float:
    from imagenet_ddp.training.metrics import EpochMeter

    hook = make()
    meter = EpochMeter(torch.device("cpu"), warmup_steps=0)  # counted by hand: no update()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        meter.steps, meter.samples = step, step * 32
        meter.loss_sum += 2.0 * 32
        hook(step, meter)
    elapsed = time.perf_counter() - started
    return elapsed / steps * 1e6


def bench_monitor(steps: int, interval: int, repeats: int, tmp: Path) -> tuple[float, float]:
    import torch

    from imagenet_ddp.monitoring.monitor import RunMonitor
    from imagenet_ddp.monitoring.telemetry import GpuSampler
    from imagenet_ddp.training.metrics import Progress
    from tests.test_telemetry import FakeNvml

    geometry = {"nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1, "gpus_per_node": 1}
    monitors = []

    def monitor():
        sampler = GpuSampler(1, interval=1.0, nvml=FakeNvml(gpus=1))
        m = RunMonitor(
            active=True, run_dir=tmp / f"m{len(monitors)}", geometry=geometry,
            steps_per_epoch=steps, log_interval=interval, resumed=False, sampler=sampler,
        )  # fmt: skip
        monitors.append(m)
        return lambda step, meter: m.step(0, step, meter, 0.1)

    def progress():
        import contextlib
        import io

        p = Progress(True, 0, steps, interval)
        sink = io.StringIO()

        def update(step, meter):
            with contextlib.redirect_stdout(sink):
                p.update(step, meter)

        return update

    ours = [per_step_us(monitor, steps, torch) for _ in range(repeats)]
    for m in monitors:
        m.close()
    base = [per_step_us(progress, steps, torch) for _ in range(repeats)]
    return C.median(ours), C.median(base)


def dry_run(workdir: Path) -> float:
    started = time.perf_counter()
    result = subprocess.run(
        [*SNAKEMAKE, "-n", "--profile", "profiles/local"], cwd=workdir, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-2000:] + result.stderr[-2000:])
    return time.perf_counter() - started


def bench_sweep(repeats: int, tmp: Path) -> tuple[float, float]:
    from imagenet_ddp.settings.runs import expand_runs
    from tests.workflow_helpers import copy_workflow, read_config, write_config

    sweep = {
        "name": "{model}-n{nodes}-{precision}-lr{lr}",
        "grid": {"nodes": [1, 2, 4, 8], "precision": ["fp32", "bf16"],
                 "lr": [0.01, 0.02, 0.05, 0.1, 0.2, 0.4]},
    }  # fmt: skip
    swept = copy_workflow(tmp / "sweep")
    config = read_config(swept)
    config.pop("runs")
    config["sweep"] = [sweep]
    write_config(swept, config)
    by_hand = copy_workflow(tmp / "by-hand", runs=expand_runs(config))
    dry_run(swept), dry_run(by_hand)  # warm-up
    ours = [dry_run(swept) for _ in range(repeats)]
    base = [dry_run(by_hand) for _ in range(repeats)]
    return C.median(ours), C.median(base)


def main(argv: list[str] | None = None) -> int:
    parser = C.quick_flag()
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    steps = args.steps or (200 if args.quick else 2000)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-monitor-") as tmp:
        tmp = Path(tmp)
        for interval in (20, 1):
            ours, base = bench_monitor(steps, interval, repeats, tmp)
            rows.append({
                "metric": f"monitor per step, interval {interval}", "ours": ours,
                "baseline": base, "unit": "us", "ratio": base / ours,
                "target": "<= 50 us" if interval == 20 else "-",
                "met": ours <= 50 if interval == 20 else None,
            })  # fmt: skip
        if not args.quick:
            ours, base = bench_sweep(repeats, tmp)
            rows.append({
                "metric": "snakemake -n, 48-run sweep, s", "ours": ours, "baseline": base,
                "unit": "s", "ratio": base / ours, "target": "<= 1.1x hand-written",
                "met": ours <= 1.1 * base,
            })  # fmt: skip
    C.report(
        "bench_monitor: TensorBoard/NVML monitor per step; sweep planning",
        rows,
        notes=[
            f"median of {repeats}; {steps} steps; baseline per step = Progress.update (the "
            "progress line); sweep baseline = the same 48 runs written under runs:",
            "NVML: a fake module (no GPU here); on a GPU node the sampler thread reads NVML "
            "every 5 s, outside the step loop",
        ],
        json_out=args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
