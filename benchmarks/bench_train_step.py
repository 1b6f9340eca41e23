"""DDP training throughput: our worker (imagenet_ddp.training.worker) vs two baselines.

    .venv/bin/python benchmarks/bench_train_step.py [--quick] [--repeats 3] [--workers 1]
        [--only-reference] [--ablations]

All run 2 gloo ranks on this machine with ``torch.distributed.run --standalone
--nproc-per-node 2``, the same model (ResNet-18), the same prepared data (crop 64 from
short_side 72 by default: ImageNet-size crops are too slow on 2 CPU cores to repeat), the same
per-rank batch (16).

* **ours**: the real worker, ``python -m imagenet_ddp.training.worker`` (SeededAugmentation,
  EpochSampler, DDP, LambdaLR, GradScaler, the divergence guard, the asynchronous
  ``StopFlag.poll`` every 2 steps, on-device step metrics, progress), in the environment the
  product's launcher gives a rank (``launchers.worker_env``: every thread count set to the
  task's CPUs, here 1 + its loader workers); its epoch and steady throughput read from
  ``train_metrics.json`` (epoch time excludes holdout evaluation and checkpointing).
* **reference w1**: ``benchmarks/_reference_loop.py``: torchvision's
  ``references/classification/train.py`` loop (per-step ``.item()``s of loss and top-1/top-5,
  MetricLogger-like meters) and DataLoader (DistributedSampler, ``--workers`` per rank, fork
  context, default prefetch, workers started again each epoch), over our data path, under
  torchrun's own ``OMP_NUM_THREADS=1``. Against ours at the same ``--workers`` (default 1).
* **baseline w0**: ``benchmarks/_ddp_baseline.py``: DistributedSampler + plain loop,
  ``num_workers=0``, against ours at workers 0 (skipped with ``--only-reference``).

Images/s = images of all ranks / slowest rank's epoch time; steady: after the first 5 steps of
each epoch. The first epoch (warm-up) is dropped, the median over the remaining epochs and
repetitions is reported; the variants' order rotates per repetition. ``--ablations`` also runs
the plain baseline with our per-sample ``fork_rng`` and with a synchronous per-step all-reduce
(the stop check before ``StopFlag.poll``) added, to attribute a gap. Target: ours >= 1.0x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

HERE = Path(__file__).resolve().parent


def make_data(root: Path, count: int, holdout: int, side: int) -> tuple[Path, Path]:
    import numpy as np
    import pandas as pd

    from imagenet_ddp.data.prepare import convert_image

    rng = np.random.default_rng(0)
    classes = 10
    images = [
        convert_image(C.realistic_jpeg(rng, 2 * side + 8, int(1.5 * side)), side, 90)
        for _ in range(count + holdout)
    ]
    labels = [i % classes for i in range(count + holdout)]
    prepared = C.write_prepared(
        root / "prepared", images, labels, num_classes=classes, short_side=side
    )
    split = root / "split"
    split.mkdir()
    pd.DataFrame({"sample_id": range(count)}).to_csv(split / "train.csv", index=False)
    pd.DataFrame({"sample_id": range(count, count + holdout)}).to_csv(
        split / "holdout.csv", index=False
    )
    return prepared, split


def torchrun(args: list[str], cwd: Path, cpus: int = 1) -> subprocess.CompletedProcess:
    """Run ``args`` as 2 ranks; ``cpus`` per rank as the product's launcher exports them
    (every thread count: launchers.worker_env), 1 as torchrun's own default."""
    from imagenet_ddp.jobs.launchers import worker_env
    from imagenet_ddp.settings.geometry import Geometry

    env = worker_env(Geometry(1, 2, cpus))
    env["PYTHONPATH"] = os.pathsep.join([str(C.REPO / "src"), env.get("PYTHONPATH", "")])
    env.pop("SLURM_PROCID", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            "--nproc-per-node=2",
            *args,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"torchrun {args[:2]} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        )
    return out


def run_ours(tmp: Path, prepared: Path, split: Path, cfg: dict, tag: str) -> list[float]:
    from imagenet_ddp.jobs.spec import from_dict, write_spec
    from tests.workflow_helpers import run_settings

    out_dir = tmp / f"ours-{tag}"
    job = {
        "kind": "train",
        "run": run_settings(**cfg),
        "paths": {
            "prepared_train": str(prepared),  # read directly: --train-data below
            "split_dir": str(split),
            "run_dir": str(out_dir),
            "checkpoint_root": str(tmp / f"ckpt-{tag}"),  # fresh: never resume
        },
        "execution": {
            "launcher": "local",
            "launch_prefix": "srun",
            "srun_extra": "",
            "stage": {"scratch_dir": "", "verify": "size", "cleanup": True},
        },  # fmt: skip
    }
    spec = write_spec(tmp / f"spec-{tag}.json", from_dict(job, "train"))
    worker = ["-m", "imagenet_ddp.training.worker", "--spec", str(spec)]
    # the task's CPUs: one for the rank's loop, one per loader worker (what a site allocates)
    torchrun([*worker, "--train-data", str(prepared)], tmp, cpus=1 + cfg["workers"])
    metrics = json.loads((out_dir / "train_metrics.json").read_text())
    epochs = metrics["epochs"]
    return [e["images_per_s"] for e in epochs], [e["steady_images_per_s"] for e in epochs]


def run_baseline(
    tmp: Path, prepared: Path, split: Path, cfg: dict, extra: list[str] = ()
) -> list[float]:
    out = torchrun(
        [
            str(HERE / "_ddp_baseline.py"),
            "--train-data",
            str(prepared),
            "--split-dir",
            str(split),
            "--model",
            cfg["model"],
            "--epochs",
            str(cfg["epochs"]),
            "--batch-size",
            str(cfg["batch_size"]),
            "--crop-size",
            str(cfg["crop_size"]),
            "--workers",
            str(cfg["workers"]),
            *extra,
        ],
        tmp,
    )
    line = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    return line["images_per_s"], line.get("steady_images_per_s")


def run_reference(tmp: Path, prepared: Path, split: Path, cfg: dict) -> tuple[list, list]:
    """torchvision's reference loop and loader settings (``_reference_loop.py``)."""
    out = torchrun(
        [
            str(HERE / "_reference_loop.py"),
            "--train-data", str(prepared), "--split-dir", str(split),
            "--model", cfg["model"], "--epochs", str(cfg["epochs"]),
            "--batch-size", str(cfg["batch_size"]), "--crop-size", str(cfg["crop_size"]),
            "--workers", str(cfg["workers"]), "--lr", str(cfg["lr"]),
            "--warmup-steps", str(cfg["throughput_warmup_steps"]),
        ],
        tmp,
    )  # fmt: skip
    line = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    return line["images_per_s"], line["steady_images_per_s"]


def main(argv: list[str] | None = None) -> int:
    parser = C.quick_flag()
    parser.add_argument("--ablations", action="store_true")
    parser.add_argument("--crop", type=int, default=None)
    parser.add_argument("--images", type=int, default=None)
    parser.add_argument("--workers", type=int, default=1, help="of ours and the reference")
    parser.add_argument("--only-reference", action="store_true", help="skip the w0 pair")
    args = parser.parse_args(argv)
    crop = args.crop or (32 if args.quick else 64)
    side = crop + crop // 8
    count = args.images or (128 if args.quick else 640)
    repeats = args.repeats or (1 if args.quick else 3)
    epochs = 2 if args.quick else 3
    cfg = {
        "run": "bench",
        "model": "resnet18",
        "epochs": epochs,
        "batch_size": 16,
        "lr": 0.05,
        "crop_size": crop,
        "eval_resize": side,
        "workers": 0,
        "device": "cpu",
        "backend": "gloo",
        "log_interval": 1000,
        "seed": 0,
        "throughput_warmup_steps": 1 if args.quick else 5,
    }
    w = dict(cfg, workers=args.workers)
    runners = {
        f"ours w{args.workers}": lambda tmp, p, s, r: run_ours(tmp, p, s, w, str(r)),
        f"reference w{args.workers}": lambda tmp, p, s, r: run_reference(tmp, p, s, w),
    }
    if not args.only_reference:
        runners["ours w0"] = lambda tmp, p, s, r: run_ours(tmp, p, s, cfg, f"{r}w0")
        runners["baseline w0"] = lambda tmp, p, s, r: run_baseline(tmp, p, s, cfg)
    if args.ablations:
        for name, flag in (("fork_rng", "--fork-rng"), ("agreed", "--agreed")):
            runners[f"baseline+{name} w0"] = lambda tmp, p, s, r, f=flag: run_baseline(
                tmp, p, s, cfg, [f]
            )
    rates = {k: [] for k in runners}
    steady = {k: [] for k in runners}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        tmp = Path(tmp)
        prepared, split = make_data(tmp, count, 32, side)
        names = list(runners)
        for rep in range(repeats):  # the order rotated: each variant sees each load position
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                epoch_rates, steady_rates = runners[name](tmp, prepared, split, rep)
                rates[name].extend(epoch_rates[1:])  # drop the warm-up epoch
                steady[name].extend(x for x in (steady_rates or [])[1:] if x)
    C.report(
        "bench_train_step: DDP training throughput (2 gloo ranks on this machine)",
        _rows(rates, steady, crop, args.workers),
        notes=[
            f"{count} train images, per-rank batch 16, {epochs} epochs per run (first dropped), "
            f"{repeats} runs each, order rotated; median over epochs x runs; steady: after "
            f"{cfg['throughput_warmup_steps']} steps of each epoch",
            "epoch img/s per variant: "
            + ", ".join(f"{k} {[round(x, 1) for x in v]}" for k, v in rates.items()),
            "steady img/s per variant: "
            + ", ".join(f"{k} {[round(x, 1) for x in v]}" for k, v in steady.items()),
        ],
        json_out=args.json,
    )
    return 0


def _rows(rates: dict, steady: dict, crop: int, workers: int) -> list[dict]:
    """Ours against the reference loop (epoch and steady img/s) and the plain loop."""
    pairs = [(f"ours w{workers}", f"reference w{workers}", "torchvision reference loop")]
    pairs += [("ours w0", "baseline w0", "plain DDP loop")] if "ours w0" in rates else []
    pairs += [(k, "baseline w0", "(ablation)") for k in rates if k.startswith("baseline+")]
    rows = []
    for ours, base, what in pairs:
        for label, figures in (("epoch", rates), ("steady", steady)):
            if not figures[ours] or not figures[base]:
                continue
            a, b = C.median(figures[ours]), C.median(figures[base])
            ablation = what == "(ablation)"
            rows.append(
                {
                    "metric": f"{ours} vs {base}, crop{crop}, {label} img/s",
                    "ours": a,
                    "baseline": b,
                    "unit": "img/s",
                    "ratio": a / b,
                    "target": what if ablation else f">= 1.0x {what}",
                    "met": None if ablation else a / b >= 1.0,
                }
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
