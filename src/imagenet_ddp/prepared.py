"""The training-ready copy of a split: pre-resized JPEGs packed into large sequential shards.

Layout of a prepared directory::

    shards/shard-00000.tar ...   POSIX tar files (``shard_samples`` images each) of baseline
                                 JPEGs, members <key>.jpg and <key>.cls (class index) per
                                 sample, WebDataset style (key = sample_id, 10 digits): `tar -t`,
                                 webdataset/wids and DALI's webdataset reader read them as they are
    samples.csv                  sample_id, class_index, shard, offset, length (sample_id order;
                                 offset is that of the JPEG's bytes inside the tar)
    prepared.json                format version, short_side, quality, counts, per-shard bytes
                                 and sha256, skipped images

Why this format (what ``benchmarks/`` measures against reading the archives or an extracted
ImageFolder):

* **Sequential, few files.** 1.28M small files are slow on parallel file systems (one metadata
  lookup per image) and slow to copy to node-local scratch; a few hundred 256 MiB shards copy at
  disk bandwidth (see :mod:`imagenet_ddp.stage`) and are read through the page cache via
  ``np.memmap``. ``samples.csv`` gives each image's (shard, offset, length): random access, no
  tar parsing at train time. The tar framing costs ~1.5 KB per image (headers, padding, the
  .cls member), ~3 % of a 43 KB image.
* **Decoded once, pre-resized.** Every image is decoded once here (PIL, ``convert("RGB")``, so
  grayscale, CMYK and PNG-named-.JPEG all become RGB), resized so its shorter side is
  ``short_side`` and re-encoded as a baseline JPEG. An average ImageNet JPEG is ~400x350; at
  ``short_side`` 160 the per-epoch decode is ~5x cheaper and the data ~4x smaller.
* **Fast decode.** Training decodes with :mod:`imagenet_ddp.jpeg` (libjpeg-turbo through
  simplejpeg) straight into a uint8 tensor, no PIL round trip, drawing the random crop box
  before decoding so that a box much larger than the output is decoded at a reduced DCT scale;
  it augments with ``transforms.v2`` on tensors.

Preparation reads the image bytes straight out of the archives (one ``os.pread`` each at the
offsets the index holds; nothing is extracted or listed again) in sample_id order, converts them
in a process pool of ``workers`` (ordered, bounded in flight), and writes the shards in order.
Which images go to which shard depends on the index alone (:func:`num_shards`), so the output
is byte-identical for any ``workers`` and for any split into independent jobs joined by
:mod:`imagenet_ddp.prepare`. It writes into a temporary directory renamed into place at the
end: an interrupted run leaves nothing that looks complete.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import tarfile
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
from imagenet_ddp.prepared_layout import (  # noqa: F401 (re-exported: the format's names)
    FORMAT,
    FORMAT_VERSION,
    PREPARED_JSON,
    SAMPLES_CSV,
    SHARD_DIR,
)

_TAR_END = bytes(2 * tarfile.BLOCKSIZE)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_CHUNK = 16  # images per task sent to a worker


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.tar"


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


INDEX_COLUMNS = ("sample_id", "class_index", "member", "name", "size", "member_offset", "offset")


def check_index(index: pd.DataFrame, which: str) -> pd.DataFrame:
    """The index sorted by sample_id; a clear error for one written without archive offsets."""
    missing = sorted(set(INDEX_COLUMNS) - set(index.columns))
    if missing:
        raise InputError(
            f"the {which} index lacks columns {missing} (it was written by an older version, "
            "without archive offsets); rebuild it: `imagenet-ddp index` (Snakemake reruns the "
            "index rule by itself)"
        )
    index = index.sort_values("sample_id", kind="stable").reset_index(drop=True)
    index["member"] = index["member"].fillna("").astype(str)
    return index


def _read_items(archive: Path, index: pd.DataFrame, short_side: int, quality: int):
    """Yield (sample_id, raw bytes, short_side, quality) in index order.

    One pread per image at the index's offsets, header included: the header must name the
    same file and size, so an archive changed since indexing fails here, never decodes wrong.
    """
    from imagenet_ddp.archives import header_matches

    block = 512
    fd = os.open(archive, os.O_RDONLY)
    try:
        for sample_id, member, name, size, member_offset, offset in zip(
            *(index[c].tolist() for c in INDEX_COLUMNS if c != "class_index"), strict=True
        ):
            start = member_offset + offset - block
            raw = os.pread(fd, block + size, start) if start >= 0 else b""
            if len(raw) != block + size or not header_matches(raw[:block], name, size):
                raise InputError(
                    f"{archive}: {member + '/' if member else ''}{name} has another size or "
                    "place in the archive than the index says (the archive changed since the "
                    "index was built); rebuild the index (`imagenet-ddp index`)"
                )
            yield sample_id, raw[block:], short_side, quality
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


def sample_key(sample_id: int) -> str:
    """The shard member stem of a sample: ``<key>.jpg`` and ``<key>.cls`` (WebDataset groups
    members by the name up to the first dot)."""
    return f"{sample_id:010d}"


def _tar_member(name: str, data: bytes) -> bytes:
    """One ustar member: 512-byte header, the data, zero padding to a 512-byte boundary.
    Fixed owner, mode and mtime, so that a shard's bytes depend on its samples only."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0
    header = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    return header + data + bytes(-len(data) % tarfile.BLOCKSIZE)


class _ShardWriter:
    """Shards as POSIX (ustar) tar files: per sample ``<key>.jpg`` then ``<key>.cls`` (the class
    index in decimal), ended by the two zero blocks, so ``tar``, ``webdataset``/``wids`` and
    DALI's webdataset reader read them as they are; ``write`` returns the JPEG's offset inside
    the shard for samples.csv. A shard is closed before a sample would take it past
    ``shard_bytes`` (a larger first sample gets a shard of its own)."""

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

    def _append(self, block: bytes) -> None:
        self._file.write(block)
        self._hash.update(block)
        self._offset += len(block)
        self.shards[-1]["bytes"] = self._offset

    def _close(self) -> None:
        if self._file is not None:
            self._append(_TAR_END)
            self._file.close()
            self.shards[-1]["sha256"] = self._hash.hexdigest()
            self._file = None

    def write(self, data: bytes, *, key: str, label: int) -> tuple[int, int]:
        jpg = _tar_member(f"{key}.jpg", data)
        cls = _tar_member(f"{key}.cls", str(int(label)).encode())
        size = len(jpg) + len(cls)
        if self._file is None or (
            self.shards[-1]["samples"] and self._offset + size + len(_TAR_END) > self.shard_bytes
        ):
            self._open()
        offset = self._offset + tarfile.BLOCKSIZE
        self._append(jpg + cls)
        self.shards[-1]["samples"] += 1
        return len(self.shards) - 1, offset

    def close(self) -> None:
        self._close()


def num_shards(num_samples: int, shard_samples: int) -> int:
    """Shard ``s`` holds index positions ``[s * shard_samples, (s + 1) * shard_samples)``.

    Fixed by the index alone (not by converted sizes), so any range of shards can be written
    by an independent job and the joined result equals the one-job result byte for byte.
    """
    return -(-num_samples // shard_samples)


def chunk_shards(total_shards: int, chunk: int, chunks: int) -> range:
    """The shards of job ``chunk`` of ``chunks``: contiguous, sizes differ by at most one."""
    return range(total_shards * chunk // chunks, total_shards * (chunk + 1) // chunks)


def archive_of(data_dir: Path, which: str) -> Path:
    """The archive holding the ``which`` images; InputError naming it when it is missing."""
    from imagenet_ddp.archives import TRAIN_ARCHIVE, VAL_ARCHIVE, require_archives

    if which not in ("train", "val"):
        raise ValueError(f"which must be 'train' or 'val', not {which!r}")
    name = TRAIN_ARCHIVE if which == "train" else VAL_ARCHIVE
    require_archives(data_dir, (name,))
    return Path(data_dir) / name


def write_shard_parts(
    data_dir: Path,
    index: pd.DataFrame,
    parts_dir: Path,
    shards: range,
    *,
    which: str,
    short_side: int,
    quality: int,
    shard_samples: int,
    workers: int,
    on_corrupt: str,
) -> tuple[list[tuple[int, int, int, int, int]], list[dict], list[dict]]:
    """Convert the images of ``shards`` (of a ``check_index``-ed index) into ``parts_dir``.

    Each shard is written by its own ``_ShardWriter`` into ``parts_dir/<s>/`` (so the shard
    format stays the writer's business). Returns rows (sample_id, class_index, shard s, offset,
    length), one record per non-empty shard (the writer's, plus ``shard`` s and ``part``: its
    file relative to parts_dir) and the skipped images.
    """
    archive = archive_of(data_dir, which)
    start = shards.start * shard_samples
    part = index.iloc[start : min(len(index), shards.stop * shard_samples)]
    class_index = part["class_index"].tolist()
    rows: list[tuple[int, int, int, int, int]] = []
    skipped: list[dict] = []
    writers: dict[int, _ShardWriter] = {}
    converted = _converted(_read_items(archive, part, short_side, quality), workers)
    try:
        for position, (sample_id, data, error) in enumerate(converted):
            if data is None:
                member, name = part["member"].iat[position], part["name"].iat[position]
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
            shard = (start + position) // shard_samples
            writer = writers.get(shard)
            if writer is None:
                for previous in writers.values():
                    previous.close()
                (parts_dir / f"{shard:05d}").mkdir(parents=True)
                # One shard per writer: a size limit it never reaches.
                writer = writers[shard] = _ShardWriter(parts_dir / f"{shard:05d}", sys.maxsize)
            label = class_index[position]
            _, offset = writer.write(data, key=sample_key(sample_id), label=label)
            rows.append((sample_id, label, shard, offset, len(data)))
    finally:
        converted.close()  # stops the pool now, also on error
        for writer in writers.values():
            writer.close()
    records = [
        {**w.shards[0], "shard": s, "part": f"{s:05d}/{w.shards[0]['name']}"}
        for s, w in sorted(writers.items())
    ]
    return rows, records, skipped


def _place_file(src: Path, dest: Path, *, move: bool) -> None:
    """Move, hard-link (same file system) or copy ``src`` to ``dest``: whole files, any format."""
    if move:
        os.replace(src, dest)
        return
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def finish_prepared(
    tmp: Path,
    parts: list[tuple[Path, dict]],
    rows: list[tuple[int, int, int, int, int]],
    skipped: list[dict],
    settings: dict,
    *,
    move: bool,
) -> dict:
    """Place the shard files as ``shards/shard_name(i)`` (i: position among non-empty shards),
    write samples.csv and prepared.json into ``tmp``; return prepared.json's content.

    ``parts``: (parts_dir, record) per non-empty shard, in shard order; ``rows`` in sample_id
    order with the planned shard number, renumbered here.
    """
    (tmp / SHARD_DIR).mkdir(exist_ok=True)
    position = {}
    shards = []
    for i, (parts_dir, record) in enumerate(parts):
        position[record["shard"]] = i
        name = shard_name(i)
        _place_file(parts_dir / record["part"], tmp / SHARD_DIR / name, move=move)
        shards.append(
            {**{k: v for k, v in record.items() if k not in ("shard", "part")}, "name": name}
        )
    samples = pd.DataFrame(
        rows, columns=["sample_id", "class_index", "shard", "offset", "length"]
    ).astype("int64")
    samples["shard"] = samples["shard"].map(position).astype("int64")
    write_csv_atomic(tmp / SAMPLES_CSV, samples)
    info = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "which": settings["which"],
        "short_side": settings["short_side"],
        "quality": settings["quality"],
        "num_classes": settings["num_classes"],
        "num_samples": len(rows),
        "num_skipped": len(skipped),
        "skipped": skipped,
        "total_bytes": sum(s["bytes"] for s in shards),
        "shard_samples": settings["shard_samples"],
        "shards": shards,
        "samples_csv_sha256": hashlib.sha256((tmp / SAMPLES_CSV).read_bytes()).hexdigest(),
    }
    write_json_atomic(tmp / PREPARED_JSON, info)
    return info


def prepare_split(
    data_dir: Path,
    index: pd.DataFrame,
    out_dir: Path,
    *,
    which: str,
    short_side: int,
    num_classes: int,
    shard_samples: int,
    quality: int,
    workers: int,
    on_corrupt: str,
) -> dict:
    """Write the prepared copy of ``index`` (a train/val table from ``build_index``) to out_dir.

    ``num_classes``: from classes.csv. Returns a summary: prepared.json's content plus
    ``out_dir``. With ``on_corrupt="skip"`` undecodable images are left out and listed under
    ``skipped``. No lock, no reuse: :func:`imagenet_ddp.prepare.prepare` adds those. The
    settings' defaults and allowed values are the workflow schema's, checked there once.
    """
    archive_of(data_dir, which)  # checks ``which``
    index = check_index(index, which)
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    settings = {
        "which": which,
        "short_side": short_side,
        "quality": quality,
        "num_classes": num_classes,
        "shard_samples": shard_samples,
    }
    with atomic_path(out_dir, is_dir=True) as tmp:
        parts_dir = tmp / ".parts"
        rows, records, skipped = write_shard_parts(
            data_dir,
            index,
            parts_dir,
            range(num_shards(len(index), shard_samples)),
            which=which,
            short_side=short_side,
            quality=quality,
            shard_samples=shard_samples,
            workers=workers,
            on_corrupt=on_corrupt,
        )
        info = finish_prepared(
            tmp, [(parts_dir, r) for r in records], rows, skipped, settings, move=True
        )
        shutil.rmtree(parts_dir, ignore_errors=True)
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
            f"{FORMAT!r} v{FORMAT_VERSION} (written by another version of imagenet-ddp); "
            "rerun `imagenet-ddp prepare` (or the workflow's prepare rule), which rebuilds it"
        )
    return info


class PreparedImageDataset(torch.utils.data.Dataset):
    """(uint8 CHW RGB tensor after ``transform``, class_index) from a prepared directory.

    ``sample_ids`` selects and orders samples (None: all, in sample_id order). Ids skipped at
    preparation (``on_corrupt: skip``) are dropped with a warning; unknown ids are an error.
    Shards are memory-mapped lazily in each DataLoader worker (the dataset pickles without them).
    ``decode=False`` hands the encoded JPEG (a uint8 numpy array) to ``transform`` instead, for
    ``train_transform``, which then decodes only what its random crop needs.
    """

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
        from imagenet_ddp.jpeg import decode_jpeg

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
):
    """Random resized crop (area ``scale`` and aspect ``ratio`` ranges, torchvision's and timm's
    defaults) + horizontal flip with probability ``hflip``. ``normalize=False`` keeps uint8
    crops (4x fewer bytes through the loader and pinned memory); the training loop then
    normalizes on the device per batch.

    Takes a decoded uint8 CHW tensor, or the encoded JPEG (``PreparedImageDataset(...,
    decode=False)``): then the crop box is drawn before decoding and the decode is reduced to
    what the box needs (``RandomResizedCropDecode``). Further tensor augmentations go after
    the first step."""
    from torchvision.transforms import v2

    from imagenet_ddp.jpeg import RandomResizedCropDecode

    crop = RandomResizedCropDecode(
        crop_size, scale=tuple(scale), ratio=tuple(ratio), antialias=True
    )
    # The flip draws its random number whatever hflip is: the sample's later draws (and so
    # seeded augmentation and resume) do not depend on it.
    steps = [crop, v2.RandomHorizontalFlip(p=hflip)]
    if normalize:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return v2.Compose(steps)


@functools.cache
def _normalization(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std on ``device``, made once: ``torch.tensor(..., device=cuda)`` per batch is a
    host-to-device copy from pageable memory, i.e. a host sync every step."""
    shape = (1, 3, 1, 1)
    return (
        torch.tensor(IMAGENET_MEAN, device=device).view(shape),
        torch.tensor(IMAGENET_STD, device=device).view(shape),
    )


def normalize_batch(images: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW batch -> float, scaled and normalized as torchvision's ``ToDtype(scale=True)``
    and ``Normalize`` do (the same operations in the same order: bitwise the same values)."""
    mean, std = _normalization(images.device)
    return images.float().mul_(1.0 / 255).sub_(mean).div_(std)


def eval_transform(resize: int, crop_size: int, *, normalize: bool = True):
    """Resize and center crop. ``normalize=False`` keeps uint8 crops, normalized on the
    device by :func:`normalize_batch` (4x fewer bytes through the loader, as in training)."""
    from torchvision.transforms import v2

    steps = [v2.Resize(resize, antialias=True), v2.CenterCrop(crop_size)]
    if normalize:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return v2.Compose(steps)
