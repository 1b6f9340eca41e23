"""The preflight's own cost: its wall time on the demo beside the training it checks, and its
projected time at ImageNet scale on 4 nodes x 8 GPUs.

    .venv/bin/python benchmarks/bench_preflight.py [--quick] [--repeats 3]

* **ours, demo**: ``snakemake --profile profiles/local`` on a copy of the workflow
  (``tests/workflow_helpers.copy_workflow``, the tiny demo, run resnet18-1x2: 2 CPU ranks,
  gloo) with ``preflight: true``: the preflight job's wall time (``preflight.json``
  ``wall_seconds``: staging, rank start-up and every measurement), median over repetitions
  (``-R preflight_run``). **baseline**: the training job that follows (``job.json``
  ``wall_seconds``). Target: the preflight <= the training it checks (on the demo both are
  dominated by process and torch start-up; on ImageNet the preflight is minutes, training days).
* **projected, ImageNet on 4 x 8 GPUs**: the preflight's fixed step counts
  (imagenet_ddp.preflight.rank) at stated rates (ASSUMED below: A100-class, ResNet-50 bf16,
  prepared copy at short side 256), beside the 90-epoch training it checks at the same rates.
  These are arithmetic on stated assumptions, not a GPU measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from imagenet_ddp.preflight.rank import (  # noqa: E402
    ALLREDUCE_OPS,
    MODEL_STEPS,
    SIZE_FACTORS,
    loader_batches,
)

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
ASSUMED = {
    "images": 1_281_167 * 0.9,  # the train split (holdout_fraction 0.1)
    "prepared_bytes": 75e9,  # ~60 KB per image at short side 256, q90
    "staging_bytes_per_s": 2e9,  # per node, parallel file system -> local NVMe
    "startup_seconds": 45,  # srun steps, imports, process group, model build
    "compile_seconds": 90,  # torch.compile of ResNet-50 (0 without compile)
    "gpu_images_per_s": 2500,  # ResNet-50 bf16 channels_last step on one A100, batch 256
    "workers": 15,  # per rank (cpus_per_task 16)
    "loader_images_per_s": 1500,  # per rank with those workers
    "gradient_bytes": 25.6e6 * 4,  # ResNet-50's fp32 gradients
    "busbw_bytes_per_s": 40e9,  # 4 nodes over InfiniBand
    "batch": 256,
    "epochs": 90,
}


def projected_preflight_seconds(a: dict) -> float:
    """The preflight at ImageNet scale: staging, start-up, compile, and its fixed steps."""
    steps = sum(MODEL_STEPS.values()) * a["batch"] / a["gpu_images_per_s"]
    loader = sum(loader_batches(a["workers"]).values()) * a["batch"] / a["loader_images_per_s"]
    world = 32
    per_byte = 2 * (world - 1) / world / a["busbw_bytes_per_s"]
    ops = sum(ALLREDUCE_OPS.values())
    allreduce = sum(ops * a["gradient_bytes"] * f * per_byte for f in SIZE_FACTORS) * 2
    staging = a["prepared_bytes"] / a["staging_bytes_per_s"]
    return staging + a["startup_seconds"] + a["compile_seconds"] + steps + loader + allreduce


def projected_training_seconds(a: dict) -> float:
    rate = 32 * min(a["gpu_images_per_s"], a["loader_images_per_s"])
    return a["epochs"] * a["images"] / rate


def demo_walls(repeats: int, quick: bool) -> tuple[list[float], float]:
    from tests.workflow_helpers import copy_workflow, read_config, write_config

    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        workdir = copy_workflow(Path(tmp))
        config = read_config(workdir)
        config["runs"] = [{"name": "resnet18-1x2", "preflight": True}]
        config["train_defaults"]["epochs"] = 1 if quick else 3
        write_config(workdir, config)
        run = ["--profile", "profiles/local", "--until", "train"]
        walls = []
        for _ in range(repeats):
            subprocess.run([*SNAKEMAKE, *run, "-R", "preflight_run"], cwd=workdir, check=True,
                           capture_output=True)  # fmt: skip
            report = workdir / "results/preflight/resnet18-1x2/preflight.json"
            walls.append(json.loads(report.read_text())["wall_seconds"])
        job = json.loads((workdir / "results/runs/resnet18-1x2/job.json").read_text())
        return walls, job["wall_seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    walls, train = demo_walls(1 if args.quick else args.repeats, args.quick)
    ours = C.median(walls)
    imagenet_pf = projected_preflight_seconds(ASSUMED)
    imagenet_train = projected_training_seconds(ASSUMED)
    rows = [
        {"metric": "demo: preflight vs its training", "ours": ours, "baseline": train,
         "unit": "s", "ratio": train / ours, "target": "preflight <= training",
         "met": ours <= train},
        {"metric": "ImageNet 4x8 GPUs (projected)", "ours": imagenet_pf / 60,
         "baseline": imagenet_train / 60, "unit": "min",
         "ratio": imagenet_train / imagenet_pf, "target": "preflight <= 5 min",
         "met": imagenet_pf <= 300},
    ]  # fmt: skip
    C.report(
        "bench_preflight: the preflight's wall time (demo) and projection (ImageNet, 4 x 8 GPUs)",
        rows,
        notes=[
            "demo: tiny demo, 2 CPU ranks (gloo); the preflight job's wall time incl. staging "
            f"and start-up, median of {len(walls)}; baseline: the training job after it",
            "ImageNet row: arithmetic from the preflight's fixed step counts at ASSUMED rates "
            f"(this script): {ASSUMED}; not measured on a GPU",
        ],
        json_out=args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
