"""The prepared format: written once from the archives, read by PreparedImageDataset."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import tarfile

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from imagenet_ddp.archives import VAL_ARCHIVE, build_index
from imagenet_ddp.errors import InputError
from imagenet_ddp.prepared import (
    IMAGENET_MEAN,
    PreparedImageDataset,
    eval_transform,
    prepare_split,
    train_transform,
)
from tests.conftest import PREPARE_SETTINGS

# torchvision 0.29 deprecates torchvision.io decoding in favour of TorchCodec (still works).
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_layout_and_metadata(prepared_demo, demo_index):
    _, train, _ = demo_index
    root = prepared_demo["train"]
    info = json.loads((root / "prepared.json").read_text())
    assert info["format_version"] == 1 and info["which"] == "train"
    assert info["short_side"] == 24 and info["quality"] == 90
    assert info["num_classes"] == 4 and info["num_samples"] == 48 and info["skipped"] == []
    assert len(info["shards"]) > 1, "small shard_bytes must produce several shards"
    for shard in info["shards"]:
        data = (root / "shards" / shard["name"]).read_bytes()
        assert len(data) == shard["bytes"] and hashlib.sha256(data).hexdigest() == shard["sha256"]
    assert info["total_bytes"] == sum(s["bytes"] for s in info["shards"])
    samples = pd.read_csv(root / "samples.csv")
    assert samples.columns.tolist() == ["sample_id", "class_index", "shard", "offset", "length"]
    assert samples.sample_id.tolist() == train.sample_id.tolist()
    assert samples.class_index.tolist() == train.class_index.tolist()
    assert sorted(p.name for p in root.iterdir()) == ["prepared.json", "samples.csv", "shards"]
    assert not list(root.parent.glob(".*tmp-*")), "no temporary directory is left behind"


def test_images_are_rgb_baseline_jpegs_with_the_short_side(prepared_demo):
    for which in ("train", "val"):
        dataset = PreparedImageDataset(prepared_demo[which])
        for i in range(len(dataset)):
            image, label = dataset[i]
            assert image.dtype == torch.uint8 and image.shape[0] == 3
            assert min(image.shape[1:]) == 24 and 0 <= label < 4
            with Image.open(io.BytesIO(dataset.read_bytes(i).tobytes())) as pil:
                assert pil.format == "JPEG" and pil.mode == "RGB"
                assert not pil.info.get("progressive")


def test_output_is_identical_for_any_worker_count(demo_archives, demo_index, tmp_path):
    _, train, _ = demo_index
    for workers in (1, 2):
        prepare_split(
            demo_archives,
            train,
            tmp_path / f"w{workers}",
            which="train",
            short_side=20,
            quality=90,
            workers=workers,
            on_corrupt="fail",
            shard_bytes=8 << 10,
        )
    assert _tree(tmp_path / "w1") == _tree(tmp_path / "w2")


def test_dataset_selects_ids_in_the_given_order(prepared_demo, demo_index):
    _, train, _ = demo_index
    full = PreparedImageDataset(prepared_demo["train"])
    assert len(full) == 48 and list(full.targets) == train.class_index.tolist()
    ids = [40, 3, 17]
    subset = PreparedImageDataset(prepared_demo["train"], ids)
    assert len(subset) == 3 and list(subset.targets) == train.class_index[ids].tolist()
    for k, i in enumerate(ids):
        assert torch.equal(subset[k][0], full[i][0])
    with pytest.raises(InputError, match="sample ids \\[999\\] are not in this prepared set"):
        PreparedImageDataset(prepared_demo["train"], [1, 999])


def test_dataset_pickles_without_open_maps_and_works_in_loader_workers(prepared_demo):
    dataset = PreparedImageDataset(prepared_demo["val"], transform=eval_transform(24, 16))
    dataset[0]
    assert dataset._maps
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone._maps == {} and torch.equal(clone[1][0], dataset[1][0])
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2)
    batches = list(loader)
    assert [tuple(b[0].shape) for b in batches] == [(4, 3, 16, 16), (4, 3, 16, 16)]
    assert torch.cat([b[1] for b in batches]).tolist() == list(dataset.targets)


def test_transforms(prepared_demo):
    image, _ = PreparedImageDataset(prepared_demo["train"])[0]
    torch.manual_seed(0)
    out = train_transform(16)(image)
    assert out.shape == (3, 16, 16) and out.dtype == torch.float32
    out = eval_transform(20, 16)(image)
    assert out.shape == (3, 16, 16) and out.dtype == torch.float32
    gray = torch.full((3, 30, 40), 255 // 2, dtype=torch.uint8)
    normalized = eval_transform(30, 30)(gray)
    expected = (127 / 255 - IMAGENET_MEAN[0]) / 0.229
    assert normalized[0].mean().item() == pytest.approx(expected, abs=1e-4)


def _corrupt_val_member(data_dir, position=3):
    """Overwrite one val JPEG with garbage of the same size (so the index still matches)."""
    path = data_dir / VAL_ARCHIVE
    with tarfile.open(path) as tar:
        member = tar.getmembers()[position]
    data = bytearray(path.read_bytes())
    data[member.offset_data : member.offset_data + member.size] = b"\x42" * member.size
    path.write_bytes(bytes(data))
    return member.name


def test_corrupt_image_fails_by_default_and_leaves_nothing(writable_archives, tmp_path):
    name = _corrupt_val_member(writable_archives)
    _, _, val = build_index(writable_archives)
    out = tmp_path / "prepared-val"
    for workers in (1, 2):
        with pytest.raises(InputError) as info:
            prepare_split(
                writable_archives, val, out, which="val", short_side=16, quality=90,
                workers=workers, on_corrupt="fail",
            )  # fmt: skip
        assert name in str(info.value) and "prepare.on_corrupt: skip" in str(info.value)
        assert list(tmp_path.iterdir()) == [writable_archives]


def test_corrupt_image_can_be_skipped(writable_archives, tmp_path):
    name = _corrupt_val_member(writable_archives)
    _, _, val = build_index(writable_archives)
    bad_id = int(val.sample_id[val.name == name].iloc[0])
    summary = prepare_split(
        writable_archives, val, tmp_path / "p", which="val", short_side=16, quality=90,
        workers=1, on_corrupt="skip",
    )  # fmt: skip
    assert summary["num_samples"] == 7 and summary["num_skipped"] == 1
    assert [(s["sample_id"], s["name"]) for s in summary["skipped"]] == [(bad_id, name)]
    info = json.loads((tmp_path / "p" / "prepared.json").read_text())
    assert info["skipped"] == summary["skipped"]
    assert len(PreparedImageDataset(tmp_path / "p")) == 7
    with pytest.warns(UserWarning, match="skipped as corrupt"):
        dataset = PreparedImageDataset(tmp_path / "p", list(range(8)))
    assert len(dataset) == 7 and bad_id not in dataset.sample_ids


def test_stale_index_and_bad_options(demo_archives, demo_index, tmp_path):
    _, train, _ = demo_index
    stale = train.copy()
    stale.loc[5, "size"] += 1
    with pytest.raises(InputError, match="has another size .*rebuild the index"):
        prepare_split(
            demo_archives, stale, tmp_path / "p", which="train", short_side=16,
            **PREPARE_SETTINGS,
        )  # fmt: skip
    # A bad on_corrupt is refused by the schema (tests/test_single_default.py).
    assert not (tmp_path / "p").exists()


def test_missing_prepared_dir_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="prepared.json not found; run `imagenet-ddp prepare`"):
        PreparedImageDataset(tmp_path)


def test_rgb_conversion_of_the_odd_images(prepared_demo):
    """Grayscale, CMYK and PNG sources come out as colour-consistent RGB."""
    dataset = PreparedImageDataset(prepared_demo["train"])
    means = np.array([dataset[i][0].float().mean(dim=(1, 2)).numpy() for i in range(len(dataset))])
    assert np.isfinite(means).all() and means.min() > 5 and means.max() < 250
