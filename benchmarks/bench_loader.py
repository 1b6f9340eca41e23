"""Per-core loader throughput: our prepared format vs ImageFolder + PIL on the original JPEGs.

    .venv/bin/python benchmarks/bench_loader.py [--quick] [--images 240] [--repeats 5]

One process, ``num_workers=0``, ``torch.set_num_threads(1)``: images/s per core, the number that
decides how many CPU cores a GPU needs. Each pass reads every image once in a random order and
applies the training augmentation; the median over repetitions is reported.

* **ours**: what training runs per image: ``train.SeededAugmentation`` over
  ``PreparedImageDataset`` + ``prepared.train_transform(crop, normalize=False)`` (memmap slice
  -> ``torchvision.io.decode_jpeg`` -> ``transforms.v2`` RandomResizedCrop / flip on the uint8
  tensor); scaling/normalization run per batch on the device. Images are pre-resized by
  ``prepared.convert_image``.
* **baseline**: ``torchvision.datasets.ImageFolder`` with its default PIL loader on the
  extracted original JPEGs + ``transforms.RandomResizedCrop`` / ``RandomHorizontalFlip`` /
  ``ToTensor`` / ``Normalize`` (the PyTorch ImageNet example's training pipeline).

Originals are synthetic but ImageNet-sized: 500x375, 375x500, 500x333, ... (ImageNet's average
is ~400x350 / ~110 KB) and textured so the JPEGs are ~110 KB like real photos. Two settings:
crop 224 from short_side 256 (the standard recipe) and crop 160 from short_side 176 (fast
low-resolution training, e.g. the first phase of FFCV / progressive resizing). Both sides read
from the page cache (files read once before timing). Also reported: ours with the float
conversion and normalization done in the loader on the CPU, as the baseline does.
Target: ours >= 3x baseline.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def make_data(root: Path, count: int, short_sides: list[int]) -> dict:
    import numpy as np

    from imagenet_ddp.prepared import convert_image

    rng = np.random.default_rng(0)
    classes = 10
    originals, labels = [], []
    for i in range(count):
        label = i % classes
        data = C.realistic_jpeg(rng, *C.realistic_size(rng))
        folder = root / "imagefolder" / f"n{label:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"n{label:08d}_{i}.JPEG").write_bytes(data)
        originals.append(data)
        labels.append(label)
    prepared = {}
    for side in short_sides:
        converted = [convert_image(d, side, 90) for d in originals]
        prepared[side] = {
            "dir": C.write_prepared(
                root / f"prepared-{side}",
                converted,
                labels,
                num_classes=classes,
                short_side=side,
            ),
            "mean_kb": sum(map(len, converted)) / len(converted) / 1000,
        }
    return {
        "imagefolder": root / "imagefolder",
        "original_kb": sum(map(len, originals)) / len(originals) / 1000,
        "prepared": prepared,
    }


def one_pass(dataset, order: list[int]) -> float:
    def run() -> None:
        for i in order:
            dataset[i]

    return C.timed(run)


def main(argv: list[str] | None = None) -> int:
    parser = C.quick_flag()
    parser.add_argument("--images", type=int, default=None)
    args = parser.parse_args(argv)
    count = args.images or (40 if args.quick else 240)
    repeats = args.repeats or (3 if args.quick else 5)

    import torch
    from torchvision import datasets, transforms

    from imagenet_ddp.prepared import (
        IMAGENET_MEAN,
        IMAGENET_STD,
        PreparedImageDataset,
        train_transform,
    )
    from imagenet_ddp.training.data import SeededAugmentation

    torch.set_num_threads(1)
    settings = [(224, 256), (160, 176)]  # (crop, prepared short_side)
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        data = make_data(Path(tmp), count, [side for _, side in settings])
        for crop, side in settings:
            baseline = datasets.ImageFolder(
                data["imagefolder"],
                transform=transforms.Compose(
                    [
                        transforms.RandomResizedCrop(crop),
                        transforms.RandomHorizontalFlip(),
                        transforms.ToTensor(),
                        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                    ]
                ),
            )
            # The training path: seeded per-sample augmentation to uint8 crops; scaling and
            # normalization run per batch on the device (train.py), not in the loader.
            seeded = SeededAugmentation(
                PreparedImageDataset(data["prepared"][side]["dir"]),
                train_transform(crop, normalize=False),
                0,
            )

            class Keyed:  # SeededAugmentation takes (epoch, index) keys from EpochSampler
                def __getitem__(self, i, _s=seeded):
                    return _s[(0, i)]

            cpu_normalized = PreparedImageDataset(
                data["prepared"][side]["dir"], transform=train_transform(crop)
            )
            candidates = {"ours": Keyed(), "baseline": baseline, "cpu_norm": cpu_normalized}
            for ds in candidates.values():  # warm the page cache and lazy imports
                for i in range(min(count, 8)):
                    ds[i]
            for path in data["imagefolder"].rglob("*.JPEG"):
                path.read_bytes()
            assert cpu_normalized[0][0].shape == baseline[0][0].shape == (3, crop, crop)
            times: dict[str, list[float]] = {k: [] for k in candidates}
            for rep in range(repeats):
                order = list(range(count))
                random.Random(rep).shuffle(order)
                names = list(candidates)
                for name in names[rep % 3 :] + names[: rep % 3]:
                    times[name].append(one_pass(candidates[name], order))
            rate = {k: count / C.median(v) for k, v in times.items()}
            rows.append(
                {
                    "metric": f"decode+RRC{crop}+flip, img/s/core",
                    "ours": rate["ours"],
                    "baseline": rate["baseline"],
                    "unit": "img/s",
                    "ratio": rate["ours"] / rate["baseline"],
                    "target": ">= 3x ImageFolder+PIL",
                    "met": rate["ours"] / rate["baseline"] >= 3.0,
                }
            )
            rows.append(
                {
                    "metric": f"  same, normalizing on the CPU {crop}",
                    "ours": rate["cpu_norm"],
                    "baseline": rate["baseline"],
                    "unit": "img/s",
                    "ratio": rate["cpu_norm"] / rate["baseline"],
                    "target": "(info)",
                    "met": None,
                }
            )
            notes.append(
                f"crop {crop}: prepared short_side {side}, "
                f"{data['prepared'][side]['mean_kb']:.0f} KB/image vs original "
                f"{data['original_kb']:.0f} KB/image"
            )
    notes.append(
        f"{count} images, 1 process, 1 thread, num_workers=0, warm page cache, "
        f"median of {repeats} passes"
    )
    C.report("bench_loader: images/s per core", rows, notes=notes, json_out=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
