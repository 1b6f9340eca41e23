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

from imagenet_ddp.data.archives import VAL_ARCHIVE, build_index
from imagenet_ddp.data.dataset import (
    IMAGENET_MEAN,
    PreparedImageDataset,
    eval_transform,
    train_transform,
)
from imagenet_ddp.data.prepare import prepare_split
from imagenet_ddp.errors import InputError
from tests.conftest import PREPARE_SETTINGS, prepared_copy

SMALL = {"num_classes": 4, "shard_samples": 8}  # the demo's classes; several shards


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_layout_and_metadata(prepared_demo, demo_index):
    _, train, _ = demo_index
    root = prepared_demo["train"]
    info = json.loads((root / "prepared.json").read_text())
    assert info["format_version"] == 2 and info["which"] == "train"
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


def test_shards_are_tar_files_with_webdataset_names_and_the_index_points_into_them(
    prepared_demo,
):
    import subprocess

    root = prepared_demo["train"]
    samples = pd.read_csv(root / "samples.csv")
    names, payloads = [], {}
    for shard in json.loads((root / "prepared.json").read_text())["shards"]:
        path = root / "shards" / shard["name"]
        with tarfile.open(path) as tar:  # raises on anything that is not a valid tar
            members = tar.getmembers()
            assert all(m.isfile() and m.mode == 0o444 and m.mtime == 0 for m in members)
            shard_names = [m.name for m in members]
            payloads.update({m.name: (path.name, m.offset_data, tar.extractfile(m).read())
                             for m in members})  # fmt: skip
        listed = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True)
        assert listed.returncode == 0 and listed.stdout.split() == shard_names
        names += shard_names
    keys = [f"{i:010d}" for i in samples.sample_id]
    assert names == [f"{k}.{ext}" for k in keys for ext in ("jpg", "cls")]
    for row, key in zip(samples.itertuples(), keys, strict=True):
        shard_file, offset, jpg = payloads[f"{key}.jpg"]
        assert shard_file == f"shard-{row.shard:05d}.tar" and offset == row.offset
        assert len(jpg) == row.length and jpg[:2] == b"\xff\xd8"
        assert payloads[f"{key}.cls"][2] == str(row.class_index).encode()
    # webdataset reads a prepared copy as it is: one sample per key, same bytes and labels
    import webdataset as wds

    urls = sorted(str(p) for p in (root / "shards").glob("shard-*.tar"))
    read = list(wds.WebDataset(urls, shardshuffle=False))
    assert [r["__key__"] for r in read] == keys
    assert [int(r["cls"]) for r in read] == samples.class_index.tolist()
    assert all(r["jpg"] == payloads[f"{k}.jpg"][2] for r, k in zip(read, keys, strict=True))


def test_an_old_format_copy_is_rebuilt_not_misread(demo_archives, tmp_path):
    from imagenet_ddp.cli import main

    index_dir, manifest = tmp_path / "index", tmp_path / "val.json"
    assert main(["index", "--data-dir", str(demo_archives), "--out-dir", str(index_dir)]) == 0
    args = ["prepare", "--data-dir", str(demo_archives), "--index-dir", str(index_dir),
            "--which", "val", "--manifest", str(manifest), "--prepared-dir",
            str(tmp_path / "prepared"), "--short-side", "16", "--shard-samples", "8",
            "--quality", "90", "--workers", "1", "--on-corrupt", "fail"]  # fmt: skip
    assert main(args) == 0
    out = prepared_copy(manifest)
    new = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}
    # Turn it into what format 1 wrote: bare concatenated JPEGs in .bin shards, no tar framing,
    # and a provenance identity without the format version.
    samples = pd.read_csv(out / "samples.csv")
    dataset = PreparedImageDataset(out)
    jpegs = [bytes(dataset.read_bytes(i)) for i in range(len(dataset))]
    for path in (out / "shards").iterdir():
        path.unlink()
    (out / "shards" / "shard-00000.bin").write_bytes(b"".join(jpegs))
    samples["shard"], samples["offset"] = 0, np.cumsum([0] + [len(j) for j in jpegs[:-1]])
    samples.to_csv(out / "samples.csv", index=False)
    info = json.loads((out / "prepared.json").read_text())
    info.update(format_version=1, shards=[{"name": "shard-00000.bin"}])
    (out / "prepared.json").write_text(json.dumps(info))
    provenance = out.with_name(out.name + ".provenance.json")
    record = json.loads(provenance.read_text())
    del record["config"]["format_version"]
    provenance.write_text(json.dumps(record))
    with pytest.raises(InputError, match=r"v1 is not .* v2 .*rerun `imagenet-ddp prepare`"):
        PreparedImageDataset(out)
    assert main(args) == 0
    assert json.loads(manifest.read_text())["reused"] is False
    assert {p.name: p.read_bytes() for p in (out / "shards").iterdir()} == new
    assert len(PreparedImageDataset(out)) == len(jpegs)


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
            **SMALL,
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


def test_crop_scale_ratio_and_flip_probability():
    """scale = ratio = the whole image: the crop is the image resized; hflip 1 always flips,
    0 never; the same random draws either way (seeded augmentation does not shift)."""
    image = torch.arange(3 * 20 * 30, dtype=torch.float32).reshape(3, 20, 30).to(torch.uint8)
    whole = {"scale": (1.0, 1.0), "ratio": (1.5, 1.5), "normalize": False}
    resized = torch.nn.functional.interpolate(
        image[None].float(), size=(10, 10), mode="bilinear", antialias=True
    )[0]
    for hflip, expected in ((0.0, resized), (1.0, resized.flip(-1))):
        torch.manual_seed(0)
        out = train_transform(10, hflip=hflip, **whole)(image)
        assert torch.allclose(out.float(), expected.round(), atol=1), hflip
        after = torch.rand(1)
        torch.manual_seed(0)
        train_transform(10, **whole)(image)
        assert torch.equal(torch.rand(1), after)


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


def _jpeg(height: int, width: int) -> np.ndarray:
    """Ramps (red along x, green along y) plus mild noise: where a region lies shows in its
    mean colour, and the crop/scale arithmetic can be checked against it."""
    y, x = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(0).integers(0, 24, (height, width))
    pixels = np.stack([x * 230 // width + noise, y * 230 // height + noise, noise], axis=-1)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, "JPEG", quality=90)
    return np.frombuffer(out.getvalue(), np.uint8).copy()


def test_decoder_matches_pil_and_the_crop_first_path_matches_decode_then_crop():
    from torchvision.transforms import v2

    from imagenet_ddp.data.jpeg import RandomResizedCropDecode, decode_jpeg

    data = _jpeg(64, 96)
    image = decode_jpeg(data)
    pil = np.array(Image.open(io.BytesIO(data.tobytes())).convert("RGB"))
    assert torch.equal(image, torch.from_numpy(pil).permute(2, 0, 1))
    # Output 40 from 64x96: no box is 2x the output, so the crop-first path decodes the whole
    # image and must give exactly the decode-then-v2.RandomResizedCrop result, seed for seed.
    for seed in range(6):
        torch.manual_seed(seed)
        ours = RandomResizedCropDecode(40, antialias=True)(data)
        after = torch.rand(1)
        torch.manual_seed(seed)
        plain = v2.RandomResizedCrop(40, antialias=True)(image.contiguous())
        assert torch.equal(ours, plain) and torch.equal(after, torch.rand(1))


def test_crop_first_decode_uses_a_reduced_dct_scale_when_the_box_allows(monkeypatch):
    from torchvision.transforms import v2

    from imagenet_ddp.data import jpeg

    data = _jpeg(256, 384)
    decode = jpeg.decode_jpeg
    full = decode(data).contiguous()
    requested = []

    def spy(data, min_size=None):
        requested.append(min_size)
        return decode(data, min_size)

    monkeypatch.setattr(jpeg, "decode_jpeg", spy)
    crop = jpeg.RandomResizedCropDecode(16, scale=(0.5, 1.0), antialias=True)
    for seed in range(4):
        torch.manual_seed(seed)
        ours = crop(data)
        torch.manual_seed(seed)
        plain = v2.RandomResizedCrop(16, scale=(0.5, 1.0), antialias=True)(full)
        assert ours.shape == plain.shape == (3, 16, 16)
        # another decode scale, same region: close, not equal
        assert (ours.float() - plain.float()).abs().mean() < 4
        torch.manual_seed(seed)
        assert torch.equal(crop(data), ours), "seeded, so bitwise repeatable"
    # boxes >= 181 px for a 16 px output: every decode is at 1/8 scale (32x48)
    assert set(requested) == {(32, 48)}
    assert decode(data, (32, 48)).shape == (3, 32, 48)


def test_train_transform_takes_encoded_images_and_pickles(prepared_demo):
    dataset = PreparedImageDataset(prepared_demo["train"], decode=False)
    data, label = dataset[0]
    assert (
        isinstance(data, np.ndarray)
        and data.dtype == np.uint8
        and data[:2].tolist()
        == [
            0xFF,
            0xD8,
        ]
    )
    transform = pickle.loads(pickle.dumps(train_transform(16, normalize=False)))
    out = transform(data)
    assert out.shape == (3, 16, 16) and out.dtype == torch.uint8
    assert train_transform(16)(data).dtype == torch.float32


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
                workers=workers, on_corrupt="fail", **SMALL,
            )  # fmt: skip
        assert name in str(info.value) and "prepare.on_corrupt: skip" in str(info.value)
        assert list(tmp_path.iterdir()) == [writable_archives]


def test_corrupt_image_can_be_skipped(writable_archives, tmp_path):
    name = _corrupt_val_member(writable_archives)
    _, _, val = build_index(writable_archives)
    bad_id = int(val.sample_id[val.name == name].iloc[0])
    summary = prepare_split(
        writable_archives, val, tmp_path / "p", which="val", short_side=16, quality=90,
        workers=1, on_corrupt="skip", **SMALL,
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
            **PREPARE_SETTINGS, **SMALL,
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


def test_the_data_content_record_follows_content_not_paths(tmp_path):
    """What train and evaluate take as params (the data_content checkpoint): the same content
    through another manifest or path gives the same digests; another copy, split or classes
    file gives another, each only for the jobs that read it."""
    from imagenet_ddp.data.prepared_layout import content_record, write_manifest
    from imagenet_ddp.errors import InputError

    copies = {}
    for name, samples in (("a", 3), ("a2", 3), ("b", 4)):
        copies[name] = tmp_path / "prepare.dir" / name
        copies[name].mkdir(parents=True)
        (copies[name] / "prepared.json").write_text(json.dumps({"num_samples": samples}))
    files = {}
    texts = {"train": "sample_id,wnid\n1,a\n2,b\n", "holdout": "sample_id,wnid\n3,a\n",
             "classes": "x\n"}  # fmt: skip
    for name, text in texts.items():
        files[name] = tmp_path / f"{name}.csv"
        files[name].write_text(text)
    manifest = tmp_path / "results/prepared/train.json"
    manifest.parent.mkdir(parents=True)
    write_manifest(manifest, copies["a"], {"which": "train", "n": "a"}, reused=False)

    def record(copy, val=None, **changed):
        paths = {**files, **changed}
        return content_record(
            copy, val or copies["b"], paths["train"], paths["holdout"], paths["classes"]
        )

    first = record(manifest)
    assert record(copies["a"]) == first  # the manifest or the copy it names
    assert record(copies["a2"]) == first  # the same content in another copy
    other = record(copies["b"])
    assert other["train"] != first["train"] and other["evaluate"] != first["evaluate"]
    renamed = tmp_path / "renamed.csv"  # the same images, other class names: no retraining
    renamed.write_text("sample_id,wnid\n1,q\n2,r\n")
    assert record(manifest, train=renamed)["train"] == first["train"]
    moved = tmp_path / "moved.csv"
    moved.write_text(files["classes"].read_text())
    assert record(manifest, classes=moved) == first
    moved.write_text("y\n")  # other classes: what evaluate reads, not what trains
    changed = record(manifest, classes=moved)
    assert changed["train"] == first["train"] and changed["evaluate"] != first["evaluate"]
    with pytest.raises(InputError, match="prepared_val: no prepared copy to read"):
        record(manifest, tmp_path / "nowhere")
