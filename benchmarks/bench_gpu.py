"""Per-GPU ResNet-50 throughput, model and loader measured separately (NVIDIA-reference style).

    .venv/bin/python benchmarks/bench_gpu.py                  # on a GPU node: ResNet-50, 224
    .venv/bin/python benchmarks/bench_gpu.py --compile        # + torch.compile
    .venv/bin/python benchmarks/bench_gpu.py --prepared results/prepared/train   # real data
    .venv/bin/python benchmarks/bench_gpu.py --quick          # CPU smoke: tiny model/batch
    .venv/bin/python benchmarks/bench_gpu.py --loader dali    # training's DALI pipeline instead

Two modes, as NVIDIA's DeepLearningExamples report them:

* **synthetic (model only)**: one fixed random batch already on the device; forward, loss,
  backward, SGD step, with bf16 autocast on GPU (fp32 on CPU) and channels_last (``--precision``,
  ``--no-channels-last``) and optionally ``torch.compile`` (``--compile``). Upper bound of
  training speed on this GPU.
* **training's loader**: the loader a training rank runs, timed by the preflight's own code
  (``imagenet_ddp.preflight.rank.loader_rate``): the prepared copy read with the crop-first
  decode, the recipe's transform and augmentations (``--recipe``: ``none`` is the v1 recipe's,
  or a preset such as ``torchvision-resnet50-v2``, ``deit-small``), uint8 crops, the seeded
  sampler, ``--workers`` forkserver workers (default: the CPUs this process may use), pinned
  copies to the device; no model. ``--loader dali``: training's DALI pipeline
  (``training.dali_loader.DaliLoader``: crop decoded on the GPU, the policy applied there,
  ``--workers`` its threads and draw processes), through the same code. Each of ``--repeats``
  fresh loaders is timed in whole rounds of its workers for at least ``--seconds`` (30 on a GPU)
  after the warm-up rounds that fill its prefetch queues (preflight.rank.LOADER_ROUNDS). The
  loader must deliver at least what the model consumes (ratio >= 1.0). ``--auto-augment``
  replaces the recipe's policy; ``--short-side`` is the synthetic copy's (256; 36 on a CPU
  without ``--short-side``). The per-worker rates of ``settings/loader_rates.py`` are this
  mode's at one worker (its comment has the command). (Before 2026-12-01 this mode decoded whole
  images and normalized to float32 on the CPU over 10 batches: not the path training runs; its
  2026-11-27 figure is withdrawn.)

Anchor printed beside: NVIDIA DeepLearningExamples ResNet-50 v1.5, 2,470 img/s per A100 80GB
with AMP (training, batch 256, DALI), the published number our synthetic mode should approach
on an A100 (more on H100). On a CPU-only machine the script still runs (``--quick``: ResNet-18,
crop 32, batch 4) so the code path is exercised; the anchor comparison is then meaningless.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ANCHOR_IMG_S = 2470.0  # NVIDIA DLE ResNet-50 v1.5, A100 80GB, AMP, per GPU


def synthetic(args, device) -> list[float]:
    import torch
    import torchvision

    from imagenet_ddp.precision import autocast

    model = torchvision.models.get_model(args.model, weights=None, num_classes=1000).to(device)
    memory = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(memory_format=memory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    criterion = torch.nn.CrossEntropyLoss()
    step_model = torch.compile(model) if args.compile else model
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.crop, args.crop, generator=g).to(device)
    images = images.contiguous(memory_format=memory)
    targets = torch.randint(0, 1000, (args.batch,), generator=g).to(device)

    def step() -> None:
        with autocast(device, args.precision):
            loss = criterion(step_model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    rates = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        rates.append(args.batch * args.steps / (time.perf_counter() - started))
    return rates


def recipe_config(recipe: str, crop: int, batch: int, workers: int, loader: str = "pytorch",
                  **settings):  # fmt: skip
    """The worker's TrainConfig of ``recipe`` (a preset, or ``none``: the schema's defaults) at
    this crop and batch with ``loader`` and any other run ``settings`` (``auto_augment``),
    resolved as the workflow resolves a run."""
    from imagenet_ddp.settings.kinds import SCHEMA, TrainConfig, declarations, load_schema
    from imagenet_ddp.settings.runs import resolve_run, run_defaults

    run = {"name": "bench", "crop_size": crop, "batch_size": batch, "workers": workers,
           "loader": loader, **settings}  # fmt: skip
    if recipe != "none":
        run["recipe"] = recipe
    resolved = resolve_run(run_defaults(load_schema(SCHEMA)), {}, run)
    return TrainConfig.from_dict(declarations(SCHEMA).rank_settings(resolved))


def training_loader(base, recipe: str, crop: int, batch: int, workers: int, loader: str):
    """Training's loader of rank 0 of 1 over ``base`` (a create_dataset(train=True)), on the
    CPU, as the preflight builds it: the run's seeded dataset and transform through
    preflight.rank.preflight_loader, endless (a DaliLoader or DataLoader, nothing started)."""
    import torch

    from imagenet_ddp.jobs.distributed import DistInfo
    from imagenet_ddp.preflight.rank import preflight_loader
    from imagenet_ddp.training.data import SeededAugmentation

    cfg = recipe_config(recipe, crop, batch, workers, loader)
    rank = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, host="bench")
    seeded = SeededAugmentation.of_run(base, cfg)
    return preflight_loader(seeded, rank, cfg, workers, torch.device("cpu"), endless=True)


def loader_only(args, device, prepared: Path) -> tuple[list[float], float]:
    """Training's own loader, timed by the preflight's code (imagenet_ddp.preflight.rank
    loader_rate): the run's dataset (crop-first decode), its recipe's transform and
    augmentations, uint8 crops, the seeded sampler, ``workers`` forkserver workers, pinned
    copies to the device; each repeat a fresh loader timed in whole rounds of its workers for at
    least ``--seconds`` after its warm-up rounds. Returns the rates and the seconds timed."""
    from imagenet_ddp.data.reader import create_dataset
    from imagenet_ddp.jobs.distributed import DistInfo
    from imagenet_ddp.preflight.rank import loader_rate

    overrides = {"auto_augment": args.auto_augment} if args.auto_augment else {}
    cfg = recipe_config(args.recipe, args.crop, args.batch, args.workers, args.loader, **overrides)
    base = create_dataset(prepared, None, train=True)  # every sample of the copy
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, host="bench")
    rates, seconds = [], 0.0
    for _ in range(args.repeats):
        figure = loader_rate(cfg, base, info, args.workers, device, min_seconds=args.seconds)
        rates.append(figure["loader_images_per_s"])
        seconds = max(seconds, figure["loader_timed_seconds"])
    return rates, seconds


def job_cpus() -> int:
    """The CPUs this process may use (the SLURM job's cgroup/affinity), not the node's count:
    on a shared 128-core node a job of 16 CPUs would otherwise start 128 loader workers."""
    return len(os.sched_getaffinity(0))


def make_prepared(root: Path, count: int, side: int) -> Path:
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(job_cpus()) as pool:
        images = pool.map(_one_image, [(i, side) for i in range(count)], chunksize=16)
    return C.write_prepared(
        root / "prepared",
        images,
        [i % 1000 for i in range(count)],
        num_classes=1000,
        short_side=side,
    )


def _one_image(item: tuple[int, int]) -> bytes:
    import numpy as np

    from imagenet_ddp.data.prepare import convert_image

    i, side = item
    rng = np.random.default_rng(i)
    return convert_image(C.realistic_jpeg(rng, *C.realistic_size(rng)), side, 90)


def main(argv: list[str] | None = None) -> int:
    parser = C.quick_flag()
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--crop", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"])
    parser.add_argument(
        "--channels-last", action=__import__("argparse").BooleanOptionalAction, default=True
    )
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--workers", type=int, default=job_cpus())
    parser.add_argument("--prepared", type=Path, default=None, help="a real prepared dir")
    parser.add_argument("--images", type=int, default=None, help="synthetic prepared images")
    parser.add_argument(
        "--recipe", default="none", help="the loader's recipe: none (v1's), a preset's name"
    )
    parser.add_argument("--auto-augment", default=None, help="the recipe's policy replaced")
    parser.add_argument("--short-side", type=int, default=None, help="synthetic (GPU: 256)")
    parser.add_argument("--seconds", type=float, default=None, help="loader window (GPU: 30)")
    parser.add_argument("--loader", default="pytorch", choices=["pytorch", "dali"])
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    small = args.quick or not cuda
    args.model = args.model or ("resnet18" if small else "resnet50")
    args.batch = args.batch or (4 if small else 256)
    args.crop = args.crop or (32 if small else 224)
    args.steps = args.steps or (3 if small else 30)
    args.warmup = args.warmup or (1 if small else 10)
    args.repeats = args.repeats or (2 if small else 5)
    args.short_side = args.short_side or (36 if small else 256)
    args.seconds = args.seconds if args.seconds is not None else (0.0 if small else 30.0)
    args.precision = args.precision or ("bf16" if cuda else "fp32")  # CPU bf16: emulated, slow
    if args.quick:
        args.workers = min(args.workers, 1)
    if cuda:
        torch.backends.cudnn.benchmark = True

    model_rates = synthetic(args, device)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        prepared = args.prepared or make_prepared(
            Path(tmp), args.images or (16 if args.quick else 2048), args.short_side
        )
        loader_rates, loader_seconds = loader_only(args, device, prepared)

    model_img_s, loader_img_s = C.median(model_rates), C.median(loader_rates)
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({C.cpu_model()})"
    on_gpu = cuda and args.model == "resnet50" and args.crop == 224
    recipe = args.recipe + (f", auto_augment {args.auto_augment}" if args.auto_augment else "")
    rows = [
        {
            "metric": f"{args.model} synthetic, img/s/GPU",
            "ours": model_img_s,
            "baseline": ANCHOR_IMG_S,
            "unit": "img/s",
            "ratio": model_img_s / ANCHOR_IMG_S,
            "target": ">= 1.0x A100 anchor" if on_gpu else "n/a on CPU (smoke)",
            "met": model_img_s >= ANCHOR_IMG_S if on_gpu else None,
        },
        {
            "metric": f"training's loader ({args.loader}, {args.workers} workers, {recipe}), img/s",
            "ours": loader_img_s,
            "baseline": model_img_s,
            "unit": "img/s",
            "ratio": loader_img_s / model_img_s,
            "target": ">= 1.0x model (keeps up)",
            "met": loader_img_s >= model_img_s if cuda else None,
        },
    ]
    C.report(
        f"bench_gpu: {name}",
        rows,
        notes=[
            f"{args.model}, batch {args.batch}, crop {args.crop}, {args.precision} autocast, "
            f"channels_last {args.channels_last}, compile {args.compile}; "
            f"median of {args.repeats} x {args.steps} steps after {args.warmup} warm-up",
            "baseline column: row 1 = NVIDIA DLE ResNet-50 v1.5 AMP, 2,470 img/s per A100 80GB;"
            " row 2 = our synthetic model img/s (loader must keep up)",
            "loader data: "
            + (
                str(args.prepared)
                if args.prepared
                else f"synthetic ImageNet-size JPEGs prepared at short side {args.short_side}"
            )
            + f"; training's loader ({args.loader}) with recipe {recipe}: crop-first"
            f" decode, uint8 crops, seeded sampler, on {device.type}; median of {args.repeats}"
            f" fresh loaders, each timed {loader_seconds:.1f} s in whole rounds of its workers"
            " after the warm-up rounds that fill its prefetch queues",
        ],
        json_out=args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
