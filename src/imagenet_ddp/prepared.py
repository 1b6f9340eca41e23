"""The training-ready copy of a split: pre-resized JPEGs packed into large sequential shards.

Layout of a prepared directory::

    shards/shard-00000.bin ...   concatenated baseline JPEGs (~256 MiB each)
    samples.csv                  sample_id, class_index, shard, offset, length (sample_id order)
    prepared.json                format version, short_side, quality, counts, per-shard bytes
                                 and sha256, skipped images

Why this format (what ``benchmarks/`` measures against reading the archives or an extracted
ImageFolder):

* **Sequential, few files.** 1.28M small files are slow on parallel file systems (one metadata
  lookup per image) and slow to copy to node-local scratch; a few hundred 256 MiB shards copy at
  disk bandwidth (see :mod:`imagenet_ddp.stage`) and are read through the page cache via
  ``np.memmap``. ``samples.csv`` gives each image's (shard, offset, length): random access, no
  tar parsing at train time.
* **Decoded once, pre-resized.** Every image is decoded once here (PIL, ``convert("RGB")``, so
  grayscale, CMYK and PNG-named-.JPEG all become RGB), resized so its shorter side is
  ``short_side`` and re-encoded as a baseline JPEG. An average ImageNet JPEG is ~400x350; at
  ``short_side`` 160 the per-epoch decode is ~5x cheaper and the data ~4x smaller.
* **Fast decode.** Training decodes with ``torchvision.io.decode_jpeg`` (libjpeg-turbo) straight
  into a uint8 CHW tensor, no PIL round trip, and augments with ``transforms.v2`` on tensors.

Preparation reads the image bytes straight out of the archives (``os.pread`` at the offsets
found by :mod:`imagenet_ddp.archives`; nothing is extracted) in sample_id order, converts them in
a process pool of ``workers`` (ordered, bounded in flight), and writes the shards in order, so
the output is byte-identical for any ``workers``. It writes into a temporary directory renamed
into place at the end: an interrupted run leaves nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from PIL import Image

from imagenet_ddp.errors import InputError
from imagenet_ddp.io import atomic_path, write_csv_atomic, write_json_atomic

FORMAT = "imagenet_ddp.prepared"
FORMAT_VERSION = 1
SHARD_DIR = "shards"
SAMPLES_CSV = "samples.csv"
PREPARED_JSON = "prepared.json"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_CHUNK = 16  # images per task sent to a worker


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.bin"


# ----------------------------------------------------------------------------- conversion


def convert_image(data: bytes, short_side: int, quality: int) -> bytes:
    """Decode any image PIL reads, to RGB, shorter side -> ``short_side``, baseline JPEG."""
    with Image.open(io.BytesIO(data)) as image:
        w, h = image.size
        scale = short_side / min(w, h)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        if image.format == "JPEG" and scale < 1:
            image.draft(image.mode, size)  # DCT-domain downscale: decodes big JPEGs much faster
        rgb = image.convert("RGB")
    if rgb.size != size:
        rgb = rgb.resize(size, Image.Resampling.BICUBIC, reducing_gap=None)
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=quality, optimize=False, progressive=False)
    return out.getvalue()


def _convert_one(item: tuple[int, bytes, int, int]) -> tuple[int, bytes | None, str | None]:
    sample_id, data, short_side, quality = item
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Corrupt EXIF data": the pixels are fine
            return sample_id, convert_image(data, short_side, quality), None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return sample_id, None, f"{type(exc).__name__}: {exc}"


def _convert_chunk(items: list) -> list:
    return [_convert_one(item) for item in items]


def _read_items(archive: Path, index: pd.DataFrame, located: dict, short_side: int, quality: int):
    """Yield (sample_id, raw bytes, short_side, quality) in sample_id order."""
    fd = os.open(archive, os.O_RDONLY)
    try:
        for sample_id, member, name, size in zip(
            index["sample_id"].tolist(),
            index["member"].tolist(),
            index["name"].tolist(),
            index["size"].tolist(),
            strict=True,
        ):
            entry = located.get((member, name))
            if entry is None or entry[1] != size:
                raise InputError(
                    f"{archive}: {member + '/' if member else ''}{name} "
                    f"{'is missing' if entry is None else 'has another size'} in the archive "
                    "the index was built from; rebuild the index (`imagenet-ddp index`)"
                )
            data = os.pread(fd, size, entry[2])
            if len(data) != size:
                raise InputError(f"{archive}: truncated at {name}; re-download it")
            yield sample_id, data, short_side, quality
    finally:
        os.close(fd)


def _converted(items: Iterator, workers: int) -> Iterator[tuple[int, bytes | None, str | None]]:
    """Converted images in input order; at most 4 chunks per worker read ahead."""
    if workers <= 1:
        for item in items:
            yield _convert_one(item)
        return
    slots = threading.Semaphore(4 * workers)
    stop = threading.Event()

    def chunks() -> Iterator[list]:  # runs in the pool's feeder thread; blocks when enough ahead
        chunk = []
        for item in items:
            chunk.append(item)
            if len(chunk) == _CHUNK:
                slots.acquire()
                if stop.is_set():
                    return
                yield chunk
                chunk = []
        if chunk:
            slots.acquire()
            if not stop.is_set():
                yield chunk

    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with context.Pool(workers) as pool:
        try:
            for results in pool.imap(_convert_chunk, chunks()):
                slots.release()
                yield from results
        finally:  # unblock the feeder so that the pool can shut down
            stop.set()
            slots.release(4 * workers + 1)


class _ShardWriter:
    def __init__(self, directory: Path, shard_bytes: int):
        self.directory, self.shard_bytes = directory, shard_bytes
        self.shards: list[dict] = []
        self._file = None
        self._hash = None
        self._offset = 0

    def _open(self) -> None:
        self._close()
        name = shard_name(len(self.shards))
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 (closed in _close)
        self._hash = hashlib.sha256()
        self._offset = 0
        self.shards.append({"name": name, "bytes": 0, "samples": 0, "sha256": None})

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self.shards[-1]["sha256"] = self._hash.hexdigest()
            self._file = None

    def write(self, data: bytes) -> tuple[int, int]:
        if self._file is None or (self._offset and self._offset + len(data) > self.shard_bytes):
            self._open()
        offset = self._offset
        self._file.write(data)
        self._hash.update(data)
        self._offset += len(data)
        self.shards[-1]["bytes"] = self._offset
        self.shards[-1]["samples"] += 1
        return len(self.shards) - 1, offset

    def close(self) -> None:
        self._close()


def prepare_split(
    data_dir: Path,
    index: pd.DataFrame,
    out_dir: Path,
    *,
    which: str,
    short_side: int,
    quality: int,
    workers: int,
    on_corrupt: str,
    shard_bytes: int = 256 << 20,
) -> dict:
    """Write the prepared copy of ``index`` (a train/val table from ``build_index``) to out_dir.

    Returns a summary: prepared.json's content plus ``out_dir``. With ``on_corrupt="skip"``
    undecodable images are left out and listed under ``skipped``. ``short_side``, ``quality``,
    ``workers`` and ``on_corrupt`` are the ``prepare`` settings: their defaults and allowed
    values are the workflow schema's, checked there once.
    """
    from imagenet_ddp.archives import locate_images, read_devkit

    if which not in ("train", "val"):
        raise ValueError(f"which must be 'train' or 'val', not {which!r}")
    missing = {"sample_id", "class_index", "member", "name", "size"} - set(index.columns)
    if missing:
        raise InputError(
            f"the {which} index lacks columns {sorted(missing)}; rebuild it (`imagenet-ddp index`)"
        )
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    index = index.sort_values("sample_id", kind="stable").reset_index(drop=True)
    index["member"] = index["member"].fillna("").astype(str)
    num_classes = len(read_devkit(data_dir).wnids)
    archive, located = locate_images(data_dir, which)

    with atomic_path(out_dir, is_dir=True) as tmp:
        (tmp / SHARD_DIR).mkdir()
        writer = _ShardWriter(tmp / SHARD_DIR, shard_bytes)
        class_index = index["class_index"].tolist()
        rows: list[tuple[int, int, int, int, int]] = []
        skipped: list[dict] = []
        items = _read_items(archive, index, located, short_side, quality)
        converted = _converted(items, workers)
        try:
            for position, (sample_id, data, error) in enumerate(converted):
                if data is None:
                    member, name = index.at[position, "member"], index.at[position, "name"]
                    place = f"{archive}:{member + '/' if member else ''}{name}"
                    if on_corrupt == "fail":
                        raise InputError(
                            f"{place} (sample {sample_id}) cannot be decoded ({error}); "
                            "re-download the archive, or set prepare.on_corrupt: skip to leave "
                            "such images out"
                        )
                    skipped.append(
                        {"sample_id": sample_id, "member": member, "name": name, "error": error}
                    )
                    continue
                shard, offset = writer.write(data)
                rows.append((sample_id, class_index[position], shard, offset, len(data)))
        finally:
            converted.close()  # stops the pool now, also on error
            writer.close()
        samples = pd.DataFrame(
            rows, columns=["sample_id", "class_index", "shard", "offset", "length"]
        ).astype("int64")
        write_csv_atomic(tmp / SAMPLES_CSV, samples)
        info = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "which": which,
            "short_side": short_side,
            "quality": quality,
            "num_classes": num_classes,
            "num_samples": len(rows),
            "num_skipped": len(skipped),
            "skipped": skipped,
            "total_bytes": sum(s["bytes"] for s in writer.shards),
            "shard_bytes_target": shard_bytes,
            "shards": writer.shards,
            "samples_csv_sha256": hashlib.sha256((tmp / SAMPLES_CSV).read_bytes()).hexdigest(),
        }
        write_json_atomic(tmp / PREPARED_JSON, info)
    return {**info, "out_dir": str(out_dir)}


# ----------------------------------------------------------------------------- reading


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
            f"{FORMAT!r} v{FORMAT_VERSION}; rerun `imagenet-ddp prepare`"
        )
    return info


class PreparedImageDataset(torch.utils.data.Dataset):
    """(uint8 CHW RGB tensor after ``transform``, class_index) from a prepared directory.

    ``sample_ids`` selects and orders samples (None: all, in sample_id order). Ids skipped at
    preparation (``on_corrupt: skip``) are dropped with a warning; unknown ids are an error.
    Shards are memory-mapped lazily in each DataLoader worker (the dataset pickles without them).
    """

    def __init__(self, root: Path, sample_ids: Sequence[int] | None = None, transform=None) -> None:
        self.root = Path(root)
        self.transform = transform
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
        from torchvision.io import ImageReadMode, decode_jpeg

        data = torch.from_numpy(self.read_bytes(i))
        image = decode_jpeg(data, mode=ImageReadMode.RGB)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[i])


def train_transform(crop_size: int, *, normalize: bool = True):
    """Random crop + flip. ``normalize=False`` keeps uint8 crops (4x fewer bytes through the
    loader and pinned memory); the training loop then normalizes on the device per batch."""
    from torchvision.transforms import v2

    steps = [v2.RandomResizedCrop(crop_size, antialias=True), v2.RandomHorizontalFlip()]
    if normalize:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return v2.Compose(steps)


def normalize_batch(images: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW batch -> float, scaled and normalized like ``train_transform(normalize=True)``."""
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1)
    return (images.float().div_(255) - mean).div_(std)


def eval_transform(resize: int, crop_size: int):
    from torchvision.transforms import v2

    return v2.Compose(
        [
            v2.Resize(resize, antialias=True),
            v2.CenterCrop(crop_size),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
