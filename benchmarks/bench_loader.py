"""Per-core loader throughput: our prepared format vs ImageFolder + PIL on the original JPEGs.

    .venv/bin/python benchmarks/bench_loader.py [--quick] [--images 240] [--repeats 5]

One process, ``num_workers=0``, ``torch.set_num_threads(1)``: images per CPU-second of the
process (``time.process_time``), the number that decides how many CPU cores a GPU needs. Each
pass reads every image once in a random order and applies the training augmentation; the
median over repetitions is reported; the candidates' order rotates every repetition.

* **ours**: what training runs per image for the v1 recipe: ``SeededAugmentation.of_run``
  over ``PreparedImageDataset(decode=False)`` (``dataset.train_transform(crop, normalize=False)``):
  memmap slice -> crop box drawn from the JPEG header -> ``jpeg.decode_jpeg`` (simplejpeg /
  libjpeg-turbo; at a reduced DCT scale when the box is >= 2x the output) -> resized crop of
  the channels-last view -> flip, uint8; scaling/normalization run per batch on the device.
  Images are pre-resized by ``prepare.convert_image``.
* **before**: the path this replaced, same seeding: ``torchvision.io.decode_jpeg`` of the whole
  image, then ``transforms.v2`` RandomResizedCrop / flip on the uint8 tensor.
* **TorchCodec** (info, when ``torchcodec`` is installed): ``torchcodec.decoders.decode_jpeg``
  in place of torchvision's in the path before.
* **DeiT's recipe** (crop 224, info): ``deit-small``'s training path (timm's RandAugment on the
  PIL image of ``recipe.pil_image``, erasing) beside the same path with torchvision's
  ``v2.ToPILImage()`` as the hand-off (the path before 2026-12-07): the same pixels.
* **DALI CPU** (when DALI, the ``dali`` extra, is installed): ``loader: dali`` on DALI's CPU
  backend, one thread, ``workers`` 0 (``training.dali_loader.DaliLoader``, batches of 8, the
  draws in this process): the same seeded crop windows and flips drawn in Python, the window
  alone decoded by ``fn.decoders.image_slice``, resized, flipped, uint8 CHW; each pass builds its
  pipeline (counted).
* **baseline**: ``torchvision.datasets.ImageFolder`` with its default PIL loader on the
  extracted original JPEGs + ``transforms.RandomResizedCrop`` / ``RandomHorizontalFlip`` /
  ``ToTensor`` / ``Normalize`` (the PyTorch ImageNet example's training pipeline).

Originals are synthetic but ImageNet-sized: 500x375, 375x500, 500x333, ... (ImageNet's average
is ~400x350 / ~110 KB) and textured so the JPEGs are ~110 KB like real photos. Settings:
crop 224 from short_side 256 (the standard recipe) and crop 160 from short_side 176 (fast
low-resolution training, e.g. the first phase of FFCV / progressive resizing), and, for
information, crop 112 from short_side 256 (where the reduced DCT scale applies). Both sides read
from the page cache (files read once before timing). Also reported: ours with the float
conversion and normalization done in the loader on the CPU, as the baseline does.
Target: ours >= 4x baseline at crop 224.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_gpu import recipe_config  # noqa: E402


def make_data(root: Path, count: int, short_sides: list[int]) -> dict:
    import numpy as np

    from imagenet_ddp.data.prepare import convert_image

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
    """CPU seconds of this process (one thread) for one pass: the per-core cost, and less
    disturbed than wall time when other work shares the machine."""
    import time

    started = time.process_time()
    if hasattr(dataset, "batched_pass"):  # DALI: its own threads, counted by process_time
        dataset.batched_pass(order)
        return time.process_time() - started
    for i in order:
        dataset[i]
    return time.process_time() - started


def _has_dali() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvidia.dali") is not None


class _Keys(list):
    """A fixed order as the loader's sampler: epoch 0, nothing skipped."""

    epoch, skip = 0, 0

    def set_epoch(self, epoch: int, skip_steps: int = 0) -> None:
        pass


class DaliCPU:
    """``loader: dali`` on DALI's CPU backend over the prepared copy, as training reads it."""

    BATCH = 8

    def __init__(self, root: Path, crop: int):
        from types import SimpleNamespace

        from imagenet_ddp.data.dataset import PreparedImageDataset
        from imagenet_ddp.training.data import SeededAugmentation

        self.seeded = SeededAugmentation(PreparedImageDataset(root, decode=False), None, 0)
        self.cfg = SimpleNamespace(
            loader="dali", crop_scale=(0.08, 1.0), crop_ratio=(3 / 4, 4 / 3),
            hflip=0.5, interpolation="bilinear", seed=0, crop_for_epoch=lambda epoch: crop,
            model="resnet50", normalization="imagenet", auto_augment="none",
        )  # fmt: skip

    def _loader(self, order: list[int]):
        import torch

        from imagenet_ddp.training.dali_loader import DaliLoader

        keys = _Keys([(0, i) for i in order][: len(order) // self.BATCH * self.BATCH])
        return DaliLoader(self.seeded, keys, self.cfg, self.BATCH, 0, torch.device("cpu"))

    def batched_pass(self, order: list[int]) -> None:
        for _ in self._loader(order):
            pass

    def __getitem__(self, i: int):
        images, labels = next(iter(self._loader([i] * self.BATCH)))
        return images[0], labels[0]


def keyed(seeded):
    """Index a SeededAugmentation like EpochSampler does, with (epoch 0, index) keys."""

    class Keyed:
        def __getitem__(self, i):
            return seeded[(0, i)]

    return Keyed()


def deit_path(root: Path, crop: int, hand_off=None):
    """Training's sample path for DeiT's recipe (``deit-small``: timm's RandAugment on PIL,
    erasing), seeded as training seeds it; ``hand_off``: what turns the crop into the PIL image
    timm's ops take in place of ``recipe.pil_image`` (the path before: ``v2.ToPILImage()``)."""
    from imagenet_ddp.data.dataset import PreparedImageDataset
    from imagenet_ddp.training import recipe
    from imagenet_ddp.training.data import SeededAugmentation

    seeded = SeededAugmentation.of_run(
        PreparedImageDataset(root, decode=False), recipe_config("deit-small", crop, 8, 0)
    )
    if hand_off is not None:
        steps = seeded.transform(0).transforms[1].transforms  # crop, [pil_image, timm's, tensor]
        assert steps[0] is recipe.pil_image
        steps[0] = hand_off
    return keyed(seeded)


def previous_transform(crop: int, v2):
    """train_transform(crop, normalize=False) before the crop-first decode."""
    return v2.Compose([v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip()])


class TorchvisionDecoded:
    """PreparedImageDataset decoding with torchvision.io.decode_jpeg (the path before) or
    another whole-image decoder with its signature."""

    def __init__(self, root: Path, decode=None):
        import warnings

        from torchvision.io import ImageReadMode, decode_jpeg

        from imagenet_ddp.data.dataset import PreparedImageDataset

        self.base = PreparedImageDataset(root, decode=False)
        self.rgb = ImageReadMode.RGB if decode is None else "RGB"
        if decode is None:
            warnings.filterwarnings("ignore", "The image decoding", DeprecationWarning)
        self.decode = decode or decode_jpeg

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        import torch

        data, label = self.base[i]
        return self.decode(torch.from_numpy(data), mode=self.rgb), label


def loader_rows(crop: int, rate: dict) -> list[dict]:
    base = rate["baseline"]
    rows = [
        {
            "metric": f"decode+RRC{crop}+flip, img/s/core",
            "ours": rate["ours"],
            "baseline": base,
            "unit": "img/s",
            "ratio": rate["ours"] / base,
            "target": ">= 4x ImageFolder+PIL" if crop == 224 else "(info)",
            "met": rate["ours"] / base >= 4.0 if crop == 224 else None,
        },
        {
            "metric": f"  vs before (torchvision decode) {crop}",
            "ours": rate["ours"],
            "baseline": rate["current"],
            "unit": "img/s",
            "ratio": rate["ours"] / rate["current"],
            "target": "(info)",
            "met": None,
        },
        {
            "metric": f"  before vs ImageFolder+PIL {crop}",
            "ours": rate["current"],
            "baseline": base,
            "unit": "img/s",
            "ratio": rate["current"] / base,
            "target": "(info)",
            "met": None,
        },
    ]
    if "deit" in rate:
        rows.append(
            {
                "metric": f"  DeiT's recipe vs its ToPILImage hand-off {crop}",
                "ours": rate["deit"],
                "baseline": rate["deit_topil"],
                "unit": "img/s",
                "ratio": rate["deit"] / rate["deit_topil"],
                "target": "(info)",
                "met": None,
            }
        )
    if "torchcodec" in rate:
        rows.append(
            {
                "metric": f"  TorchCodec vs torchvision {crop}",
                "ours": rate["torchcodec"],
                "baseline": rate["current"],
                "unit": "img/s",
                "ratio": rate["torchcodec"] / rate["current"],
                "target": "(info)",
                "met": None,
            }
        )
    if "dali_cpu" in rate:
        for name, other in (("ours", "ours"), ("ImageFolder+PIL", "baseline")):
            rows.append(
                {
                    "metric": f"  DALI CPU vs {name} {crop}",
                    "ours": rate["dali_cpu"],
                    "baseline": rate[other],
                    "unit": "img/s",
                    "ratio": rate["dali_cpu"] / rate[other],
                    "target": "(info)",
                    "met": None,
                }
            )
    rows.append(
        {
            "metric": f"  ours, CPU normalize {crop}",
            "ours": rate["cpu_norm"],
            "baseline": base,
            "unit": "img/s",
            "ratio": rate["cpu_norm"] / base,
            "target": "(info)",
            "met": None,
        }
    )
    return rows


def candidates_for(data: dict, crop: int, side: int, torchcodec_decode) -> dict:
    """name -> dataset indexed by int, for one (crop, short_side) setting."""
    from torchvision import datasets, transforms
    from torchvision.transforms import v2

    from imagenet_ddp.data.dataset import (
        IMAGENET_MEAN,
        IMAGENET_STD,
        PreparedImageDataset,
        train_transform,
    )
    from imagenet_ddp.training.data import SeededAugmentation

    root = data["prepared"][side]["dir"]
    candidates = {
        # The training path, as the worker builds it for the v1 recipe: encoded JPEG -> crop box
        # drawn -> decode (simplejpeg, at a reduced DCT scale when the box allows) -> resized
        # crop -> flip, uint8; scaling and normalization run per batch on the device.
        "ours": keyed(
            SeededAugmentation.of_run(
                PreparedImageDataset(root, decode=False), recipe_config("none", crop, 8, 0)
            )
        ),
        # The path before: torchvision.io.decode_jpeg of the whole image, then
        # v2.RandomResizedCrop + flip on the tensor, seeded as ours (torch's RNG alone).
        "current": keyed(
            SeededAugmentation(
                TorchvisionDecoded(root), previous_transform(crop, v2), 0, python_numpy=False
            )
        ),
        "baseline": datasets.ImageFolder(
            data["imagefolder"],
            transform=transforms.Compose(
                [
                    transforms.RandomResizedCrop(crop),
                    transforms.RandomHorizontalFlip(),
                    transforms.ToTensor(),
                    transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                ]
            ),
        ),
        "cpu_norm": PreparedImageDataset(root, transform=train_transform(crop), decode=False),
    }
    if crop == 224:  # DeiT's crop
        candidates["deit"] = deit_path(root, crop)
        candidates["deit_topil"] = deit_path(root, crop, v2.ToPILImage())
    if _has_dali():
        candidates["dali_cpu"] = DaliCPU(root, crop)
    if torchcodec_decode is not None:
        candidates["torchcodec"] = keyed(
            SeededAugmentation(
                TorchvisionDecoded(root, torchcodec_decode),
                previous_transform(crop, v2),
                0,
                python_numpy=False,
            )
        )
    return candidates


def main(argv: list[str] | None = None) -> int:
    parser = C.quick_flag()
    parser.add_argument("--images", type=int, default=None)
    args = parser.parse_args(argv)
    count = args.images or (40 if args.quick else 240)
    repeats = args.repeats or (3 if args.quick else 5)

    import torch

    try:
        from torchcodec.decoders import decode_jpeg as torchcodec_decode
    except ImportError:
        torchcodec_decode = None

    torch.set_num_threads(1)
    # (crop, prepared short_side); crop 112 from 256 (e.g. an early progressive-resizing phase)
    # is where a box can be >= 2x the output and the reduced DCT scale applies
    settings = [(224, 256), (160, 176), (112, 256)]
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        data = make_data(Path(tmp), count, sorted({side for _, side in settings}))
        for crop, side in settings:
            candidates = candidates_for(data, crop, side, torchcodec_decode)
            for ds in candidates.values():  # warm the page cache and lazy imports
                for i in range(min(count, 8)):
                    ds[i]
            for path in data["imagefolder"].rglob("*.JPEG"):
                path.read_bytes()
            shapes = {tuple(ds[0][0].shape) for ds in candidates.values()}
            assert shapes == {(3, crop, crop)}, shapes
            times: dict[str, list[float]] = {k: [] for k in candidates}
            names = list(candidates)
            for rep in range(repeats):
                order = list(range(count))
                random.Random(rep).shuffle(order)
                turn = rep % len(names)
                for name in names[turn:] + names[:turn]:
                    times[name].append(one_pass(candidates[name], order))
            rate = {k: count / C.median(v) for k, v in times.items()}
            rows += loader_rows(crop, rate)
            notes.append(
                f"crop {crop}: prepared short_side {side}, "
                f"{data['prepared'][side]['mean_kb']:.0f} KB/image vs original "
                f"{data['original_kb']:.0f} KB/image"
            )
    if torchcodec_decode is None:
        notes.append("torchcodec not installed: its row is left out")
    if not _has_dali():
        notes.append("DALI not installed (the dali extra): its rows are left out")
    else:
        notes.append(f"DALI CPU: batches of {DaliCPU.BATCH}, a pass's tail under one left out")
    notes.append(
        f"{count} images, 1 process, 1 thread, num_workers=0, warm page cache, "
        f"median of {repeats} passes"
    )
    C.report("bench_loader: images/s per core", rows, notes=notes, json_out=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
