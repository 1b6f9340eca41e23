"""Archive checks and the index: error paths, torchvision order, determinism, tar parsing."""

from __future__ import annotations

import gzip
import io
import tarfile

import numpy as np
import pandas as pd
import pytest

from imagenet_ddp.data import archives
from imagenet_ddp.data.archives import (
    DEVKIT_ARCHIVE,
    TRAIN_ARCHIVE,
    VAL_ARCHIVE,
    VAL_GROUND_TRUTH,
    build_index,
    read_devkit,
    verify_archives,
)
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import file_digest, write_csv_atomic


def _rewrite_tar(path, transform, *, gz=False):
    """Rewrite the tar at ``path`` with members (name, bytes) passed through ``transform``."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read() if m.isreg() else None) for m in tar]
    raw = io.BytesIO()
    fileobj = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if gz else raw
    with tarfile.open(fileobj=fileobj, mode="w") as tar:
        for info, data in transform(members):
            if data is None:
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    if gz:
        fileobj.close()
    path.write_bytes(raw.getvalue())


# ----------------------------------------------------------------------------- verify


def test_verify_reports_sizes_md5_and_counts(demo_archives):
    report = verify_archives(demo_archives)
    assert report["counts"] == {"classes": 4, "train_images": 48, "val_images": 8}
    for name in (TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE):
        record = report["files"][name]
        assert record["md5_status"] == "ok" and record["md5"] == record["md5_expected"]
        assert record["size"] == (demo_archives / name).stat().st_size
    skipped = verify_archives(demo_archives, check_md5=False)
    assert {r["md5_status"] for r in skipped["files"].values()} == {"skipped"}


def test_verify_without_md5sums_checks_structure_only(writable_archives):
    (writable_archives / "md5sums").unlink()
    report = verify_archives(writable_archives)
    assert {r["md5_status"] for r in report["files"].values()} == {"no md5sums file"}


@pytest.mark.parametrize("name", [TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE])
def test_missing_archive_is_named(writable_archives, name):
    (writable_archives / name).unlink()
    with pytest.raises(InputError, match=rf"{name} not found; download it"):
        verify_archives(writable_archives)
    with pytest.raises(InputError, match=name):
        build_index(writable_archives)


def test_missing_data_dir(tmp_path):
    with pytest.raises(InputError, match="does not exist; set data.dir"):
        verify_archives(tmp_path / "nowhere")


def _content_end(path):
    """Offset just past the last member's data (where the end-of-archive blocks start)."""
    if path.name.endswith(".gz"):
        return path.stat().st_size
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    return last.offset_data + (last.size + 511) // 512 * 512


@pytest.mark.parametrize("name", [TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE])
@pytest.mark.parametrize("cut", [0.1, 0.5, 0.99, "end+100"])
def test_truncated_archive_is_reported(writable_archives, name, cut):
    path = writable_archives / name
    end = _content_end(path)
    keep = end + 100 if cut == "end+100" else int(end * cut)
    if cut == "end+100" and name == DEVKIT_ARCHIVE:
        keep = end - 5
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(InputError, match=rf"{name}.*(corrupt or truncated|truncated)"):
        verify_archives(writable_archives, check_md5=False)


def test_md5_mismatch_names_file_expected_and_actual(writable_archives):
    sums = writable_archives / "md5sums"
    lines = sums.read_text().splitlines()
    wrong = "0" * 32
    sums.write_text(
        "\n".join(wrong + line[32:] if VAL_ARCHIVE in line else line for line in lines) + "\n"
    )
    actual = file_digest(writable_archives / VAL_ARCHIVE, "md5")
    with pytest.raises(InputError) as info:
        verify_archives(writable_archives)
    message = str(info.value)
    assert VAL_ARCHIVE in message and wrong in message and actual in message
    assert "re-download" in message
    verify_archives(writable_archives, check_md5=False)  # structure alone is fine


def test_malformed_md5sums(writable_archives):
    (writable_archives / "md5sums").write_text("not an md5 line\n")
    with pytest.raises(InputError, match="md5sums:1: not md5sum format"):
        verify_archives(writable_archives)


def test_devkit_without_ground_truth(writable_archives):
    _rewrite_tar(
        writable_archives / DEVKIT_ARCHIVE,
        lambda members: [(m, d) for m, d in members if m.name != VAL_GROUND_TRUTH],
        gz=True,
    )
    with pytest.raises(InputError, match=rf"{DEVKIT_ARCHIVE}.*ground_truth.txt missing"):
        verify_archives(writable_archives, check_md5=False)


def test_ground_truth_must_match_val_count(writable_archives):
    def drop_last_line(members):
        for m, d in members:
            yield (
                m,
                (b"".join(d.splitlines(keepends=True)[:-1]) if m.name == VAL_GROUND_TRUTH else d),
            )

    _rewrite_tar(writable_archives / DEVKIT_ARCHIVE, drop_last_line, gz=True)
    with pytest.raises(InputError, match="holds 8 images but the ground truth .* has 7 lines"):
        verify_archives(writable_archives, check_md5=False)


def test_ground_truth_with_unknown_class_id(writable_archives):
    def bad_id(members):
        for m, d in members:
            yield m, (d.replace(d.splitlines()[0], b"999", 1) if m.name == VAL_GROUND_TRUTH else d)

    _rewrite_tar(writable_archives / DEVKIT_ARCHIVE, bad_id, gz=True)
    with pytest.raises(InputError, match=r"class ids \[999\]"):
        build_index(writable_archives)


def test_unexpected_members_are_rejected(writable_archives):
    def add_readme(members):
        yield from members
        yield tarfile.TarInfo("README.txt"), b"hello"

    _rewrite_tar(writable_archives / TRAIN_ARCHIVE, add_readme)
    with pytest.raises(InputError, match=r"unexpected member 'README.txt'.*nXXXXXXXX.tar"):
        verify_archives(writable_archives, check_md5=False)
    _rewrite_tar(writable_archives / VAL_ARCHIVE, add_readme)
    with pytest.raises(InputError, match=r"unexpected member 'README.txt'"):
        build_index(writable_archives)


def test_missing_class_tar_disagrees_with_devkit(writable_archives):
    _rewrite_tar(writable_archives / TRAIN_ARCHIVE, lambda members: members[:-1])
    with pytest.raises(InputError, match="disagree on the classes .*3 vs 4"):
        build_index(writable_archives)


# ----------------------------------------------------------------------------- index


def test_index_follows_torchvision_conventions(demo_archives, demo_index):
    classes, train, val = demo_index
    devkit = read_devkit(demo_archives)
    assert classes.columns.tolist() == ["class_index", "wnid", "words"]
    assert classes.wnid.tolist() == sorted(classes.wnid) == devkit.wnids
    assert classes.class_index.tolist() == list(range(4))
    for table in (train, val):
        assert table.columns.tolist() == archives.SAMPLE_COLUMNS
        assert table.sample_id.tolist() == list(range(len(table)))
        key = list(zip(table.class_index, table.name, strict=True))
        assert key == sorted(key)
        assert (table.wnid == classes.wnid.to_numpy()[table.class_index]).all()
    assert len(train) == 48 and (train.groupby("class_index").size() == 12).all()
    assert (train.member == train.wnid + ".tar").all()
    assert (train.name.str.split("_").str[0] == train.wnid).all()
    # val labels: the i-th line of the ground truth labels the i-th val file by name
    names = sorted(val.name)
    expected = {n: devkit.idx_to_wnid[i] for n, i in zip(names, devkit.val_ids, strict=True)}
    assert (val.member == "").all()
    assert val.wnid.tolist() == [expected[n] for n in val.name]
    # the demo's ILSVRC2012_IDs are not in wnid order, as in the real devkit
    assert [i for i, _ in sorted(devkit.idx_to_wnid.items(), key=lambda kv: kv[1])] != [1, 2, 3, 4]


def test_index_sizes_are_member_sizes(demo_archives, demo_index):
    _, train, val = demo_index
    with tarfile.open(demo_archives / VAL_ARCHIVE) as tar:
        sizes = {m.name: m.size for m in tar}
    assert val["size"].tolist() == [sizes[n] for n in val.name]
    row = train.iloc[17]
    with (
        tarfile.open(demo_archives / TRAIN_ARCHIVE) as outer,
        tarfile.open(fileobj=outer.extractfile(row.member)) as inner,
    ):
        assert inner.getmember(row["name"]).size == row["size"]


def test_index_csvs_are_identical_when_rebuilt(demo_archives, demo_index, tmp_path):
    again = build_index(demo_archives)
    for name, first, second in zip(("classes", "train", "val"), demo_index, again, strict=True):
        write_csv_atomic(tmp_path / f"a-{name}.csv", first)
        write_csv_atomic(tmp_path / f"b-{name}.csv", second)
        assert (tmp_path / f"a-{name}.csv").read_bytes() == (
            tmp_path / f"b-{name}.csv"
        ).read_bytes()
    read = pd.read_csv(tmp_path / "a-val.csv", keep_default_na=False)
    assert (read.member == "").all()


def test_every_tar_format_lists_the_same(tmp_path):
    """Long names (GNU 'L' records) and pax headers give the same names, sizes and offsets."""
    path = tmp_path / "x.tar"
    payloads = {"a" * 150 + ".JPEG": b"x" * 700, "b.JPEG": b"y" * 3, "c.JPEG": b""}
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT):
        names = list(payloads) if fmt != tarfile.USTAR_FORMAT else list(payloads)[1:]
        with tarfile.open(path, "w", format=fmt) as tar:
            for name in names:
                info = tarfile.TarInfo(name)
                info.size = len(payloads[name])
                tar.addfile(info, io.BytesIO(payloads[name]))
        entries = archives._list_flat_tar(path)
        data = path.read_bytes()
        assert [e[0] for e in entries] == names
        assert all(data[o : o + s] == payloads[n] for n, s, o in entries)


def test_a_listing_of_many_headers_points_at_each_members_data(tmp_path):
    """~20k headers."""
    path = tmp_path / "many.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(20_000):
            info = tarfile.TarInfo(f"n00000001_{i}.JPEG")
            info.size = 10
            tar.addfile(info, io.BytesIO(b"0123456789"))
    entries = archives._list_flat_tar(path)
    assert len(entries) == 20_000 and entries[5][1] == 10
    assert np.all(np.diff([o for _, _, o in entries]) == 1024)
