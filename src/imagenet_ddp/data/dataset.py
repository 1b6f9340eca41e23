"""Reading the prepared copy (:mod:`imagenet_ddp.data.prepared_layout`): the dataset (each
sample at its shard, offset and length through ``np.memmap``), the transforms on tensors, and
the normalization of uint8 batches on the device."""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from imagenet_ddp.data.prepared_layout import (
    FORMAT,
    FORMAT_VERSION,
    PREPARED_JSON,
    SAMPLES_CSV,
    SHARD_DIR,
)
from imagenet_ddp.errors import InputError
from imagenet_ddp.models import IMAGENET_MEAN_STD

IMAGENET_MEAN, IMAGENET_STD = IMAGENET_MEAN_STD


def read_prepared_info(root: Path) -> dict:
    path = Path(root) / PREPARED_JSON
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path} not found; run `imagenet-ddp prepare` for this split") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{path} is not valid JSON ({exc}); rerun `imagenet-ddp prepare`"
        ) from None
    if info.get("format") != FORMAT or info.get("format_version") != FORMAT_VERSION:
        raise InputError(
            f"{path}: format {info.get('format')!r} v{info.get('format_version')} is not "
            f"{FORMAT!r} v{FORMAT_VERSION} (written by another version of imagenet-ddp); "
            "rerun `imagenet-ddp prepare` (or the workflow's prepare rule), which rebuilds it"
        )
    return info


class PreparedImageDataset(torch.utils.data.Dataset):
    """(uint8 CHW RGB tensor after ``transform``, class_index) from a prepared directory, for
    ``sample_ids`` in their order (None: all; ids skipped at preparation dropped with a warning,
    unknown ones refused). ``decode=False`` hands ``transform`` the encoded JPEG."""

    def __init__(
        self,
        root: Path,
        sample_ids: Sequence[int] | None = None,
        transform=None,
        *,
        decode: bool = True,
    ) -> None:
        self.root = Path(root)
        self.transform, self.decode = transform, decode
        info = read_prepared_info(self.root)
        self.num_classes = int(info["num_classes"])
        self.shard_paths = [self.root / SHARD_DIR / s["name"] for s in info["shards"]]
        table = pd.read_csv(self.root / SAMPLES_CSV, dtype="int64")
        ids = table["sample_id"].to_numpy()
        if sample_ids is None:
            rows = np.arange(len(ids))
        else:
            wanted = np.asarray(list(sample_ids), dtype=np.int64)
            pos = np.searchsorted(ids, wanted)
            found = pos < len(ids)
            found[found] = ids[pos[found]] == wanted[found]
            if not found.all():
                skipped = {int(s["sample_id"]) for s in info.get("skipped", [])}
                absent = wanted[~found]
                unknown = [int(s) for s in absent if int(s) not in skipped]
                if unknown:
                    raise InputError(
                        f"{self.root / SAMPLES_CSV}: sample ids {unknown[:5]} are not in this "
                        "prepared set; it was prepared from another index: rerun prepare"
                    )
                warnings.warn(
                    f"{self.root}: {len(absent)} requested samples were skipped as corrupt "
                    "at preparation; leaving them out",
                    stacklevel=2,
                )
            rows = pos[found]
        self.sample_ids = ids[rows]
        self.targets = table["class_index"].to_numpy()[rows]
        self._shard = table["shard"].to_numpy()[rows]
        self._offset = table["offset"].to_numpy()[rows]
        self._length = table["length"].to_numpy()[rows]
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return len(self.targets)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def _map(self, shard: int) -> np.memmap:
        mapped = self._maps.get(shard)
        if mapped is None:
            mapped = self._maps[shard] = np.memmap(self.shard_paths[shard], np.uint8, mode="r")
        return mapped

    def read_bytes(self, i: int) -> np.ndarray:
        offset = int(self._offset[i])
        return np.array(self._map(int(self._shard[i]))[offset : offset + int(self._length[i])])

    def __getitem__(self, i: int):
        from imagenet_ddp.data.jpeg import decode_jpeg

        data = self.read_bytes(i)
        image = decode_jpeg(data) if self.decode else data
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[i])


def train_transform(
    crop_size: int,
    *,
    normalize: bool = True,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    interpolation: str = "bilinear",
):
    """Random resized crop (torchvision's and timm's default ranges) and a flip with probability
    ``hflip``, of a decoded uint8 tensor or an encoded JPEG (the crop drawn before the decode:
    ``RandomResizedCropDecode``). ``normalize=False`` keeps uint8 crops (4x fewer bytes through
    the loader), normalized on the device per batch."""
    from torchvision.transforms import v2

    from imagenet_ddp.data.jpeg import RandomResizedCropDecode

    crop = RandomResizedCropDecode(
        crop_size,
        scale=tuple(scale),
        ratio=tuple(ratio),
        interpolation=v2.InterpolationMode(interpolation),
        antialias=True,
    )
    # The flip draws its random number whatever hflip is: the sample's later draws (and so
    # seeded augmentation and resume) do not depend on it.
    steps = [crop, v2.RandomHorizontalFlip(p=hflip)]
    if normalize:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return v2.Compose(steps)


@functools.cache
def _normalization(device: torch.device, mean: tuple, std: tuple) -> tuple:
    """Mean and std on ``device``, made once (per batch, a host sync every step)."""
    shape = (1, 3, 1, 1)
    return (
        torch.tensor(mean, device=device).view(shape),
        torch.tensor(std, device=device).view(shape),
    )


def normalize_batch(
    images: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> torch.Tensor:
    """uint8 NCHW batch -> float, bitwise as ``ToDtype(scale=True)`` then ``Normalize``."""
    mean, std = _normalization(images.device, tuple(mean), tuple(std))
    return images.float().mul_(1.0 / 255).sub_(mean).div_(std)


def eval_transform(
    resize: int, crop_size: int, *, normalize: bool = True, interpolation: str = "bilinear"
):
    """Resize and center crop; ``normalize=False`` keeps uint8 crops (:func:`normalize_batch`)."""
    from torchvision.transforms import v2

    mode = v2.InterpolationMode(interpolation)
    steps = [v2.Resize(resize, interpolation=mode, antialias=True), v2.CenterCrop(crop_size)]
    if normalize:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return v2.Compose(steps)
