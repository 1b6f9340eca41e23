"""The demo archives' images in the other input layouts (imagenet_ddp.data.layouts), for tests."""

from __future__ import annotations

import tarfile
from pathlib import Path

from imagenet_ddp.data.archives import TRAIN_ARCHIVE, VAL_ARCHIVE, read_devkit


def extract_demo_layout(archives_dir: Path, out: Path, layout: str) -> None:
    """The demo archives' images, byte for byte, in the ``imagefolder`` or ``kaggle`` layout
    under ``out``: as valprep.sh and Kaggle keep ILSVRC2012.

    Read with tarfile and the devkit's parser, not with the index, so that a test comparing the
    layouts' indexes compares two independent readings. The Kaggle tree carries what Kaggle's
    has beside (a test/ folder, LOC_train_solution.csv), which must be ignored; its val
    solution lists images in another order than their names.
    """
    archives_dir, out = Path(archives_dir), Path(out)
    assert layout in ("imagefolder", "kaggle"), layout
    base = out / "ILSVRC/Data/CLS-LOC" if layout == "kaggle" else out
    devkit = read_devkit(archives_dir)
    with tarfile.open(archives_dir / TRAIN_ARCHIVE) as outer:
        for member in outer:
            wnid = member.name.removesuffix(".tar")
            with tarfile.open(fileobj=outer.extractfile(member)) as inner:
                for image in inner:
                    _write_file(base / "train" / wnid / image.name, inner.extractfile(image).read())
    labels = []
    with tarfile.open(archives_dir / VAL_ARCHIVE) as val:
        names = sorted(m.name for m in val.getmembers())
        for name, class_id in zip(names, devkit.val_ids, strict=True):
            wnid = devkit.idx_to_wnid[class_id]
            folder = base / "val" if layout == "kaggle" else base / "val" / wnid
            _write_file(folder / name, val.extractfile(name).read())
            labels.append((name.removesuffix(".JPEG"), wnid))
    mapping = "".join(f"{w} {devkit.wnid_to_words[w]}\n" for w in devkit.wnids)
    (out / "LOC_synset_mapping.txt").write_text(mapping)
    if layout == "kaggle":
        rows = [f"{image_id},{wnid} 0 0 9 9\n" for image_id, wnid in reversed(labels)]
        (out / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(rows))
        (out / "LOC_train_solution.csv").write_text("ImageId,PredictionString\n")
        _write_file(base / "test" / "ILSVRC2012_test_00000001.JPEG", b"not read")


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
