"""The demo data: the real ILSVRC2012 layout, deterministic, parsed by torchvision as real."""

from __future__ import annotations

import io
import os
import re
import shutil
import tarfile

import numpy as np
import pytest
import scipy.io as sio
from PIL import Image

from imagenet_ddp.data.archives import (
    DEVKIT_ARCHIVE,
    META_MAT,
    TRAIN_ARCHIVE,
    VAL_ARCHIVE,
    VAL_GROUND_TRUTH,
    build_index,
)
from imagenet_ddp.data.demo import make_demo_dataset

FILES = (TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE, "md5sums")
SMALL = {"num_classes": 3, "train_per_class": 5, "val_per_class": 2, "image_size": 16}


def test_rerun_is_byte_identical_and_the_seed_matters(tmp_path):
    for name in ("a", "b"):
        make_demo_dataset(tmp_path / name, **SMALL, seed=3)
    make_demo_dataset(tmp_path / "c", **SMALL, seed=4)
    for f in FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert (tmp_path / "a" / TRAIN_ARCHIVE).read_bytes() != (
        tmp_path / "c" / TRAIN_ARCHIVE
    ).read_bytes()


def test_layout_matches_the_real_archives(demo_archives):
    assert sorted(os.listdir(demo_archives)) == sorted(FILES)
    with tarfile.open(demo_archives / TRAIN_ARCHIVE) as outer:
        inner_names = outer.getnames()
        assert inner_names == sorted(inner_names) and len(inner_names) == 4
        assert all(re.fullmatch(r"n\d{8}\.tar", n) for n in inner_names)
        with tarfile.open(fileobj=outer.extractfile(inner_names[0])) as inner:
            names = inner.getnames()
    wnid = inner_names[0][:-4]
    assert len(names) == 12 and all(re.fullmatch(wnid + r"_\d+\.JPEG", n) for n in names)
    assert names != sorted(names), "numeric member order, so the index must sort by name"
    with tarfile.open(demo_archives / VAL_ARCHIVE) as val:
        assert val.getnames() == [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, 9)]
    with tarfile.open(demo_archives / DEVKIT_ARCHIVE) as devkit:
        assert {META_MAT, VAL_GROUND_TRUTH} <= set(devkit.getnames())
        gt = devkit.extractfile(VAL_GROUND_TRUTH).read().decode().split()
        mat = sio.loadmat(io.BytesIO(devkit.extractfile(META_MAT).read()), squeeze_me=True)
    synsets = mat["synsets"]
    assert synsets.dtype.names[:5] == ("ILSVRC2012_ID", "WNID", "words", "gloss", "num_children")
    leaves = [s for s in synsets if s["num_children"] == 0]
    assert sorted(int(s["ILSVRC2012_ID"]) for s in leaves) == [1, 2, 3, 4]
    assert len(synsets) > len(leaves), "non-leaf synsets are there to be filtered out"
    assert len(gt) == 8 and {int(x) for x in gt} == {1, 2, 3, 4}
    md5_lines = (demo_archives / "md5sums").read_text().splitlines()
    assert [line.split("  ")[1] for line in md5_lines] == sorted(FILES[:3])


def _all_images(data_dir):
    with tarfile.open(data_dir / TRAIN_ARCHIVE) as outer:
        for member in outer:
            with tarfile.open(fileobj=outer.extractfile(member)) as inner:
                for m in inner:
                    yield "train", m.name, inner.extractfile(m).read()
    with tarfile.open(data_dir / VAL_ARCHIVE) as val:
        for m in val:
            yield "val", m.name, val.extractfile(m).read()


def test_images_include_real_imagenet_oddities_and_all_load_as_rgb(demo_archives):
    kinds = {}
    for split, name, data in _all_images(demo_archives):
        with Image.open(io.BytesIO(data)) as image:
            kinds.setdefault((split, image.format, image.mode), []).append(name)
            rgb = image.convert("RGB")
            assert rgb.mode == "RGB" and 20 <= min(rgb.size) <= 48
    assert len(kinds[("train", "JPEG", "L")]) == 1
    assert len(kinds[("train", "JPEG", "CMYK")]) == 1
    assert len(kinds[("train", "PNG", "RGB")]) == 1
    assert kinds[("train", "PNG", "RGB")][0].endswith(".JPEG")
    assert len(kinds[("val", "JPEG", "L")]) == 1
    assert len(kinds[("train", "JPEG", "RGB")]) == 48 - 3


def test_classes_are_separable(demo_archives, demo_index):
    """Cheap stand-in for 'a CNN learns it': nearest class-mean colour beats chance by far."""
    _, train, val = demo_index
    images = {(s, n): d for s, n, d in _all_images(demo_archives)}

    def feature(split, name):
        with Image.open(io.BytesIO(images[(split, name)])) as image:
            hsv = np.asarray(image.convert("RGB").convert("HSV"), dtype=np.float64)
        angle = hsv[..., 0] / 255 * 2 * np.pi
        return np.array([np.cos(angle).mean(), np.sin(angle).mean()])

    means = np.stack(
        [
            np.mean([feature("train", n) for n in train.name[train.class_index == c]], axis=0)
            for c in range(4)
        ]
    )
    feats = np.stack([feature("val", n) for n in val.name])
    predicted = np.argmin(((feats[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (predicted == val.class_index.to_numpy()).mean() >= 0.75


@pytest.fixture
def torchvision_without_md5(monkeypatch):
    from torchvision.datasets import imagenet

    monkeypatch.setattr(imagenet, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    return imagenet


def test_torchvision_imagenet_sees_the_same_classes_and_order(
    demo_archives, demo_index, tmp_path, torchvision_without_md5
):
    root = tmp_path / "tv"
    root.mkdir()
    for name in (TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE):
        shutil.copy(demo_archives / name, root / name)
    classes, train, val = demo_index
    for split, ours in (("train", train), ("val", val)):
        dataset = torchvision_without_md5.ImageNet(str(root), split=split)
        assert dataset.wnids == classes.wnid.tolist()
        assert [", ".join(c) for c in dataset.classes] == classes.words.tolist()
        assert [os.path.basename(p) for p, _ in dataset.samples] == ours.name.tolist()
        assert dataset.targets == ours.class_index.tolist()
        image, _ = dataset[0]
        assert image.mode == "RGB"
    assert build_index(demo_archives)[1].equals(train)


def test_full_class_count_devkit(tmp_path):
    """1000 classes (ILSVRC2012_IDs 1..1000) fit the meta.mat field types and parse."""
    from imagenet_ddp.data.archives import read_devkit

    make_demo_dataset(tmp_path, num_classes=1000, train_per_class=1, val_per_class=1, image_size=8)
    devkit = read_devkit(tmp_path)
    assert sorted(devkit.idx_to_wnid) == list(range(1, 1001))
    assert len(devkit.wnids) == 1000 and len(devkit.val_ids) == 1000
    assert all(re.fullmatch(r"n\d{8}", w) for w in devkit.wnids)
