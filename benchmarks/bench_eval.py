"""Evaluation cost per image, and the wall time it projects for ImageNet's holdout + test.

    .venv/bin/python benchmarks/bench_eval.py [--quick] [--repeats 3] [--models resnet50 ...]

* **ours**: the product's evaluation, ``python -m imagenet_ddp.cli evaluate --launcher local``
  (the launcher, ``evaluate_dataset``'s sharding and reduction, ``PreparedImageDataset`` +
  ``eval_transform(256, 224)`` on realistic JPEGs prepared at short_side 256), with 1 and 2
  ranks, fp32, ``cpus_per_task`` threads per rank, loader workers ``auto`` (0 at one CPU).
  Cost per image and rank = world size / ``evaluation.images_per_s`` of eval.json, whose
  ``wall_seconds`` excludes process start-up and model loading.
* **baseline**: the bare model forward pass (``torch.no_grad``, a fixed random batch of the
  same size, same threads) in this process: the floor the evaluation can reach.

On a GPU node (``--device auto`` finds CUDA) the ranks run on GPUs (one per rank, at most
2) with bf16 autocast and channels_last, as a GPU run trains, with all cores shared by the
ranks as loader workers; batch 256, 4,096 images.

Models: ResNet-50 and the model config.yaml trains (``train_defaults`` + first run), crop 224
(``--quick``: ResNet-18 at crop 64, a smoke test). The projection multiplies the measured
per-rank cost of the first model by holdout (1,281,167 x ``split.holdout_fraction``) + test
(50,000) images and divides by the ranks of the default evaluation geometry of config.yaml
(``imagenet_ddp.settings.evaluation``). It is only a CPU figure when that geometry has no GPUs.
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

IMAGENET_TRAIN, IMAGENET_TEST = 1_281_167, 50_000


def default_geometry() -> tuple[dict, float, str]:
    """(eval settings of config.yaml's first run, holdout fraction, its model)."""
    import yaml

    from imagenet_ddp.settings.evaluation import eval_settings

    config = yaml.safe_load((C.REPO / "config.yaml").read_text())
    schema = yaml.safe_load((C.REPO / "workflow/schemas/config.schema.yaml").read_text())
    keys = schema["definitions"]["run_settings"]["properties"]
    defaults = {k: v["default"] for k, v in keys.items() if "default" in v}  # the one home
    run = {**defaults, **config["train_defaults"], **config["runs"][0]}
    settings = eval_settings(config.get("evaluate"), run)
    return settings, float(config["split"]["holdout_fraction"]), run["model"]


def make_data(root: Path, count: int, side: int, small: bool = False) -> dict[str, Path]:
    """Prepared train (holdout = its first half) and val (the other half), 1000 classes."""
    import numpy as np
    import pandas as pd

    from imagenet_ddp.data.prepare import convert_image

    rng = np.random.default_rng(0)
    images = [
        convert_image(
            C.realistic_jpeg(rng, *((96, 80) if small else C.realistic_size(rng))), side, 90
        )
        for _ in range(count)
    ]
    half = count // 2
    paths = {"split": root / "split"}
    for name, part in (("train", images[:half]), ("val", images[half:])):
        labels = [i % 1000 for i in range(len(part))]
        paths[name] = C.write_prepared(root / name, part, labels, num_classes=1000, short_side=side)
    paths["split"].mkdir()
    pd.DataFrame({"sample_id": range(half)}).to_csv(paths["split"] / "holdout.csv", index=False)
    classes = pd.DataFrame(
        {"class_index": range(1000), "wnid": [f"n{i:08d}" for i in range(1000)], "words": "x"}
    )
    classes.to_csv(root / "classes.csv", index=False)
    paths["classes"] = root / "classes.csv"
    return paths


def save_model(root: Path, arch: str, args) -> Path:
    from imagenet_ddp.training.model import build_model, save_model

    path = root / f"{arch}.pt"
    config = {
        "run": "bench",
        "crop_size": args.crop,
        "eval_resize": args.resize,
        "precision": args.precision,
        "channels_last": args.device == "cuda",
    }
    save_model(path, build_model(arch, 1000), arch=arch, num_classes=1000, config=config)
    return path


def run_ours(data: dict, model: Path, out: Path, ranks: int, threads: int, args) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(C.REPO / "src"), env.get("PYTHONPATH", "")])
    from imagenet_ddp.jobs.spec import from_dict, to_dict

    gpus = ranks if args.device == "cuda" else 0
    job = {
        "kind": "evaluate",
        "geometry": {"nodes": 1, "tasks_per_node": ranks, "cpus_per_task": threads,
                     "gpus_per_node": gpus},
        "settings": {"batch_size": args.batch, "workers": "auto", "device": args.device},
        "paths": {
            "model": str(model), "prepared_train": str(data["train"]),
            "prepared_val": str(data["val"]), "split_dir": str(data["split"]),
            "classes": str(data["classes"]), "out": str(out / "eval.json"),
            "per_class": str(out / "per_class.csv"),
        },
        "execution": {"launcher": "local", "launch_prefix": "srun", "srun_extra": ""},
    }  # fmt: skip
    spec = json.dumps(to_dict(from_dict(job, "evaluate")))  # checked before anything starts
    argv = [sys.executable, "-m", "imagenet_ddp.cli", "evaluate", "--job", spec]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"evaluate failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads((out / "eval.json").read_text())["evaluation"]


def bare_forward_ms(arch: str, args, threads: int) -> float:
    import torch

    from imagenet_ddp.precision import autocast
    from imagenet_ddp.training.model import build_model

    torch.set_num_threads(threads)
    device = torch.device(args.device)
    memory = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    model = build_model(arch, 1000).eval().to(device, memory_format=memory)
    shape = (args.batch, 3, args.crop, args.crop)
    images = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    images = images.contiguous(memory_format=memory)

    def forward() -> None:
        with torch.no_grad(), autocast(device, args.precision):
            model(images).float().cpu()  # the evaluation also brings its results to the host

    forward()  # warm-up
    times = [C.timed(forward) for _ in range(max(args.repeats, 3 if device.type == "cuda" else 1))]
    return 1000 * C.median(times) / args.batch


def measure(args, data: dict, root: Path, arch: str, threads: int) -> dict:
    """Median per-rank ms/img of ours (per rank count) and of the bare forward pass."""
    model = save_model(root, arch, args)
    ours = {}
    for ranks in args.ranks:
        per_image = []
        for rep in range(args.repeats):
            out = root / f"{arch}-{ranks}-{rep}"
            evaluation = run_ours(data, model, out, ranks, threads, args)
            per_image.append(1000 * ranks / evaluation["images_per_s"])
        ours[ranks] = C.median(per_image)
    bare = bare_forward_ms(arch, args, threads)
    return {"ours": ours, "bare": bare}


def rows_for(arch: str, crop: int, result: dict) -> list[dict]:
    rows = []
    for ranks, ms in result["ours"].items():
        rows.append(
            {
                "metric": f"{arch} crop{crop}, {ranks} rank(s), ms/img/rank",
                "ours": ms,
                "baseline": result["bare"],
                "unit": "ms",
                "ratio": result["bare"] / ms,
                "target": ">= 0.8x bare forward",
                "met": result["bare"] / ms >= 0.8,
            }
        )
    return rows


def projection(ms_per_image: float, settings: dict, fraction: float, device: str):
    holdout = round(IMAGENET_TRAIN * fraction)
    images = holdout + IMAGENET_TEST
    ranks = settings["nodes"] * settings["tasks_per_node"]
    hours = images * ms_per_image / ranks / 3.6e6
    note = (
        f"projection: ({holdout:,} holdout = 1,281,167 x holdout_fraction {fraction} + "
        f"{IMAGENET_TEST:,} test) x {ms_per_image:.1f} ms/img / {ranks} rank(s) of the default "
        f"eval geometry ({settings['nodes']} node x {settings['tasks_per_node']} task(s), "
        f"{settings['cpus_per_task']} CPU(s)/task, {settings['gpus_per_node']} GPU(s)/node) = "
        f"{hours:.2f} h; assumes this machine's per-core speed, ranks that do not slow each "
        "other (a node with a core per thread) and the measured crop/model"
    )
    if settings["gpus_per_node"] > 0 and device != "cuda":
        note += "; NOT a GPU figure: the default geometry has GPUs, measure there"
    elif device == "cuda" and settings["gpus_per_node"] == 0:
        note += "; measured on a GPU, but the default geometry has none"
    return hours, note


def main(argv: list[str] | None = None) -> int:
    parser = C.quick_flag()
    parser.add_argument("--models", nargs="*", default=None, help="default: resnet50 + config's")
    parser.add_argument("--ranks", type=int, nargs="*", default=None, help="default: 1 2")
    parser.add_argument("--images", type=int, default=None, help="holdout + test images")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args(argv)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.precision = "bf16" if args.device == "cuda" else "fp32"  # as a GPU run would train
    settings, fraction, config_model = default_geometry()
    args.crop, args.resize = (64, 72) if args.quick else (224, 256)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.batch = args.batch or (4 if args.quick else 16 if args.device == "cpu" else 256)
    count = args.images or (8 if args.quick else 48 if args.device == "cpu" else 4096)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    args.ranks = args.ranks or ([2] if args.quick else [1, 2][: max(1, gpus)])  # quick: 1 launch
    models = args.models or (["resnet18"] if args.quick else ["resnet50", config_model])
    cores_per_rank = (os.cpu_count() or 1) // max(args.ranks)
    # CPU: the config's threads per rank; GPU: all cores (loader workers) shared by the ranks.
    threads = max(
        1,
        cores_per_rank if args.device == "cuda" else min(settings["cpus_per_task"], cores_per_rank),
    )
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        root = Path(tmp)
        data = make_data(root, count, args.resize, small=args.quick)
        for arch in dict.fromkeys(models):
            results[arch] = measure(args, data, root, arch, threads)
            rows += rows_for(arch, args.crop, results[arch])
    first = models[0]
    ms = results[first]["ours"][min(args.ranks)]
    hours, note = projection(ms, settings, fraction, args.device)
    rows.append(
        {"metric": f"projected holdout+test, {first}, h", "ours": hours, "unit": "h", "met": None}
    )
    notes = [
        f"{count} images per evaluation (holdout + test), batch {args.batch} per rank, "
        f"{threads} thread(s) per rank, device {args.device}, {args.precision}, loader workers "
        f"auto, median of {args.repeats}",
        "ms/img/rank = ranks / images_per_s of eval.json (loader start-up, decode, forward, "
        "reduction; no process start-up or model loading)",
        note,
    ]
    C.report("bench_eval: evaluation cost per image", rows, notes=notes, json_out=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
