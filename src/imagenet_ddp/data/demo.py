"""A small synthetic ILSVRC2012 in exactly the real layout, so the whole workflow runs anywhere:
the three archives (a real-format ``meta.mat`` with non-leaf synsets and ILSVRC2012_IDs not in
wnid order) and ``md5sums``, byte-identical for the same arguments. Images carry a class signal
(per-class hue and stripes) a small CNN learns in a couple of CPU epochs, and the real data's
oddities: grayscale, CMYK and a PNG named .JPEG; inner train tars in numeric, not name, order."""

from __future__ import annotations

import colorsys
import gzip
import io
import math
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from imagenet_ddp.data.archives import (
    DEVKIT_ARCHIVE,
    DEVKIT_ROOT,
    MD5SUMS,
    META_MAT,
    TRAIN_ARCHIVE,
    VAL_ARCHIVE,
    VAL_GROUND_TRUTH,
)
from imagenet_ddp.io import atomic_path, file_digest

_MTIME = 1_335_830_400  # 2012-05-01, any fixed value keeps the archives reproducible
_MAT_HEADER = b"MATLAB 5.0 MAT-file, Platform: GLNXA64, Created on: imagenet_ddp demo"
_JPEG_QUALITY = 90


def _tarinfo(name: str, size: int = 0, *, directory: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)  # uid and gid 0, no user names, mode 0o644
    info.size, info.mtime = size, _MTIME
    if directory:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))


def _tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            _add(tar, name, data)
    return buf.getvalue()


def _wnids(rng: np.random.Generator, count: int, low: int, high: int) -> list[str]:
    numbers = np.sort(rng.choice(high - low, size=count, replace=False)) + low
    return [f"n{int(n):08d}" for n in numbers]


def _meta_mat(synsets: list[dict]) -> bytes:
    import scipy.io as sio

    fields = "ILSVRC2012_ID WNID words gloss num_children children wordnet_height num_train_images"
    fields = fields.split()
    array = np.empty((len(synsets), 1), dtype=[(f, object) for f in fields])
    for i, s in enumerate(synsets):
        array[i, 0] = (
            np.array([[s["id"]]], dtype=np.uint16),
            s["wnid"],
            s["words"],
            s["gloss"],
            np.array([[len(s["children"])]], dtype=np.uint16),
            np.array([s["children"]], dtype=np.uint16).reshape(1, -1),
            np.array([[s["height"]]], dtype=np.uint8),
            np.array([[s["num_train_images"]]], dtype=np.uint32),
        )
    buf = io.BytesIO()
    sio.savemat(buf, {"synsets": array}, format="5", oned_as="row")
    data = bytearray(buf.getvalue())
    data[:116] = _MAT_HEADER.ljust(116)  # scipy writes the current time here
    return bytes(data)


def _class_style(c: int, num_classes: int) -> dict:
    golden = (math.sqrt(5) - 1) / 2
    return {
        "hue": (c / num_classes + 0.05) % 1.0,
        "angle": math.pi * ((c * golden) % 1.0),
        "freq": 2.0 + 4.0 * ((c * 0.37 + 0.11) % 1.0),  # stripe cycles across the short side
    }


def _render(style: dict, image_size: int, rng: np.random.Generator) -> np.ndarray:
    short = max(8, int(round(image_size * rng.uniform(0.85, 1.25))))
    aspect = rng.uniform(0.75, 1.4)
    if rng.random() < 0.5:
        w, h = int(round(short * aspect)), short
    else:
        w, h = short, int(round(short * aspect))
    hue = (style["hue"] + rng.normal(0, 0.015)) % 1.0
    base = np.array(
        colorsys.hsv_to_rgb(hue, rng.uniform(0.55, 0.85), rng.uniform(0.6, 0.9)), dtype=np.float32
    )
    angle = style["angle"] + rng.normal(0, 0.08)
    freq = style["freq"] * rng.uniform(0.85, 1.15) / min(w, h)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    phase = rng.uniform(0, 2 * math.pi)
    wave = np.sin(2 * math.pi * freq * (x * math.cos(angle) + y * math.sin(angle)) + phase)
    shade = 0.55 + 0.45 * np.tanh(2.5 * wave)
    image = 255.0 * base[None, None, :] * shade[:, :, None]
    image += rng.normal(0, 10.0, size=image.shape).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def _encode(pixels: np.ndarray, kind: str = "rgb") -> bytes:
    image = Image.fromarray(pixels, "RGB").convert({"gray": "L", "cmyk": "CMYK"}.get(kind, "RGB"))
    buf = io.BytesIO()
    if kind == "png":
        image.save(buf, format="PNG", optimize=False, compress_level=6)
    else:
        image.save(buf, format="JPEG", quality=_JPEG_QUALITY)
    return buf.getvalue()


def make_demo_dataset(
    out_dir: Path,
    *,
    num_classes: int = 10,
    train_per_class: int = 100,
    val_per_class: int = 10,
    image_size: int = 64,
    seed: int = 0,
) -> None:
    """Write the three ILSVRC2012 archives and ``md5sums`` (deterministic from the arguments;
    their ranges: the config schema's ``demo``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # One generator drawn from in a fixed order (classes, train, val): the same bytes per seed.
    rng = np.random.default_rng([seed, 0])

    # Classes: leaves get ILSVRC2012_IDs 1..n in an order unrelated to the (sorted) wnids.
    wnids = _wnids(rng, num_classes, 1_440_764, 15_075_141)
    ids = rng.permutation(num_classes) + 1
    styles = [_class_style(c, num_classes) for c in range(num_classes)]
    synsets = _synsets(rng, wnids, ids, styles, train_per_class)
    _write_train(out_dir, rng, wnids, styles, train_per_class, image_size, seed)
    val_classes = _write_val(out_dir, rng, styles, val_per_class, image_size, seed)
    ground_truth = "".join(f"{int(ids[c])}\n" for c in val_classes).encode()
    _write_devkit(out_dir, synsets, ground_truth)
    lines = [
        f"{file_digest(out_dir / name, 'md5')}  {name}\n"
        for name in sorted((TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE))
    ]
    (out_dir / MD5SUMS).write_text("".join(lines))


def _synsets(rng, wnids, ids, styles, train_per_class: int) -> list[dict]:
    """The devkit's synsets: the leaves, then two internal nodes (torchvision must drop them)."""
    n = len(wnids)

    def synset(id_, wnid, words, gloss, children, height, images) -> dict:
        return {"id": id_, "wnid": wnid, "words": words, "gloss": gloss, "children": children,
                "height": height, "num_train_images": images}  # fmt: skip

    leaves = [
        synset(int(ids[c]), wnids[c], f"demo class {c}, synthetic {wnids[c]}",
               f"synthetic images: hue {styles[c]['hue']:.2f}, stripes", [], 0, train_per_class)
        for c in range(n)
    ]  # fmt: skip
    parents, half = _wnids(rng, 2, 1_000, 1_000_000), (n + 1) // 2
    return [
        *sorted(leaves, key=lambda s: s["id"]),
        synset(n + 1, parents[0], "demo group", "first half of the demo classes",
               [int(i) for i in sorted(ids[:half])], 1, train_per_class * half),
        synset(n + 2, parents[1], "entity", "root", [n + 1], 2, train_per_class * n),
    ]  # fmt: skip


def _write_train(out_dir, rng, wnids, styles, train_per_class, image_size, seed) -> None:
    """Outer tar of inner per-class tars; inner members in numeric (not name) order; real-data
    oddities (grayscale, CMYK, a PNG named .JPEG) at fixed places."""
    num_classes = len(wnids)
    odd = {
        (0, 1 % train_per_class): "gray",
        (min(1, num_classes - 1), 2 % train_per_class): "cmyk",
        (min(2, num_classes - 1), 3 % train_per_class): "png",
    }
    with tarfile.open(out_dir / TRAIN_ARCHIVE, mode="w", format=tarfile.GNU_FORMAT) as outer:
        for c, wnid in enumerate(wnids):
            numbers = np.sort(rng.choice(np.arange(1, 20_000), train_per_class, replace=False))
            members = []
            for i, number in enumerate(numbers):
                image_rng = np.random.default_rng([seed, 1, c, i])
                pixels = _render(styles[c], image_size, image_rng)
                kind = odd.get((c, i), "rgb")
                members.append((f"{wnid}_{int(number)}.JPEG", _encode(pixels, kind)))
            _add(outer, f"{wnid}.tar", _tar_bytes(members))


def _write_val(out_dir, rng, styles, val_per_class, image_size, seed) -> np.ndarray:
    """Flat, labels shuffled across file numbers (one grayscale image): the class of each."""
    num_classes = len(styles)
    odd = {min(1, num_classes * val_per_class - 1): "gray"}
    val_classes = rng.permutation(np.repeat(np.arange(num_classes), val_per_class))
    members = []
    for j, c in enumerate(val_classes):
        image_rng = np.random.default_rng([seed, 2, j])
        pixels = _render(styles[int(c)], image_size, image_rng)
        members.append((f"ILSVRC2012_val_{j + 1:08d}.JPEG", _encode(pixels, odd.get(j, "rgb"))))
    (out_dir / VAL_ARCHIVE).write_bytes(_tar_bytes(members))
    return val_classes


def _write_devkit(out_dir, synsets, ground_truth: bytes) -> None:
    """The devkit's layout; its ground truth holds ILSVRC2012_IDs."""
    with (
        open(out_dir / DEVKIT_ARCHIVE, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
    ):
        for directory in (DEVKIT_ROOT, f"{DEVKIT_ROOT}/data", f"{DEVKIT_ROOT}/evaluation"):
            tar.addfile(_tarinfo(directory, directory=True))
        _add(tar, f"{DEVKIT_ROOT}/COPYING", b"Synthetic demo devkit (imagenet_ddp).\n")
        _add(
            tar,
            f"{DEVKIT_ROOT}/readme.txt",
            b"Synthetic stand-in for the ILSVRC2012 devkit: same layout, fake classes.\n",
        )
        _add(tar, META_MAT, _meta_mat(synsets))
        _add(tar, VAL_GROUND_TRUTH, ground_truth)


def write_demo_dataset(out: Path, **settings) -> None:
    """The ``demo_data`` stage: :func:`make_demo_dataset` into ``out``, which appears whole."""
    with atomic_path(out, is_dir=True) as tmp:
        make_demo_dataset(tmp, **settings)
