"""The prepare stage split into K independent jobs, and the index it reads images through."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from imagenet_ddp.cli import main
from imagenet_ddp.data.prepare import join_shared, prepare_split
from imagenet_ddp.errors import InputError
from tests.conftest import PREPARE_SETTINGS, prepared_copy


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture()
def index_dir(demo_archives, tmp_path):
    out = tmp_path / "index"
    assert main(["index", "--data-dir", str(demo_archives), "--out-dir", str(out)]) == 0
    return out


def _args(demo_archives, index_dir, which="train"):
    return ["--data-dir", str(demo_archives), "--index-dir", str(index_dir), "--which", which,
            "--short-side", "24", "--shard-samples", "3", "--workers", "2", "--quality", "90",
            "--on-corrupt", "fail"]  # fmt: skip


@pytest.mark.parametrize("which", ["train", "val"])
def test_three_jobs_joined_equal_one_job_byte_for_byte(demo_archives, index_dir, tmp_path, which):
    argv = ["prepare", *_args(demo_archives, index_dir, which), "--manifest", tmp_path / "one"]
    assert main([*map(str, argv), "--prepared-dir", str(tmp_path / "one-dir")]) == 0
    chunks = [tmp_path / "chunks" / f"{k}-of-3" for k in range(3)]
    for k, chunk in enumerate(chunks):
        argv = ["prepare-chunk", *_args(demo_archives, index_dir, which), "--chunk", str(k)]
        assert main([*argv, "--chunks", "3", "--chunk-dir", str(chunk)]) == 0
    argv = ["prepare-join", "--chunk-dirs", *chunks, "--manifest", tmp_path / "joined"]
    assert main([*map(str, argv), "--prepared-dir", str(tmp_path / "joined-dir")]) == 0
    one, joined = prepared_copy(tmp_path / "one"), prepared_copy(tmp_path / "joined")

    info = json.loads((one / "prepared.json").read_text())
    assert len(info["shards"]) >= 3, "a shard per job at least, or the test proves little"
    assert sorted(_tree(joined)) == sorted(_tree(one)) and _tree(joined) == _tree(one)
    provenance = [
        json.loads(n.with_name(n.name + ".provenance.json").read_text()) for n in (one, joined)
    ]
    assert provenance[0]["config"] == provenance[1]["config"]
    assert [p["jobs"] for p in provenance] == [1, 3]
    # The join is reused like a one-job copy: same index and settings, nothing rebuilt.
    assert join_shared(chunks, tmp_path / "again.json", tmp_path / "one-dir") == one
    assert json.loads((tmp_path / "again.json").read_text())["reused"] is True


def test_join_refuses_an_incomplete_or_mixed_set_of_chunks(demo_archives, index_dir, tmp_path):
    chunks = [tmp_path / f"{k}-of-3" for k in range(3)]
    for k in (0, 2):
        argv = ["prepare-chunk", *_args(demo_archives, index_dir), "--chunk", str(k)]
        assert main([*argv, "--chunks", "3", "--chunk-dir", str(chunks[k])]) == 0
    with pytest.raises(InputError, match="not jobs 0..K-1 of one K"):
        join_shared([chunks[0], chunks[2]], tmp_path / "m.json", tmp_path / "out")
    with pytest.raises(InputError, match="not a finished prepare chunk"):
        join_shared(chunks, tmp_path / "m.json", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_index_without_offsets_or_with_wrong_ones_is_never_misread(
    demo_archives, demo_index, index_dir, tmp_path, capsys
):
    old = pd.read_csv(index_dir / "train.csv").drop(columns=["member_offset", "offset"])
    old.to_csv(index_dir / "train.csv", index=False)
    shared, out = tmp_path / "shared", tmp_path / "p"
    argv = [*_args(demo_archives, index_dir), "--manifest", str(out), "--prepared-dir"]
    assert main(["prepare", *argv, str(shared)]) == 2
    err = capsys.readouterr().err
    assert "lacks columns ['member_offset', 'offset']" in err and "rebuild it" in err
    assert not out.exists() and not list(shared.glob("train-*"))

    classes, train, _ = demo_index
    moved = train.copy()
    moved.loc[5, "offset"] += 512  # the next member's place: a real JPEG, the wrong one
    with pytest.raises(InputError, match="has another size or place .*rebuild the index"):
        prepare_split(
            demo_archives, moved, out, which="train", short_side=16, num_classes=4, shard_samples=8,
            **PREPARE_SETTINGS,
        )  # fmt: skip
    assert not out.exists()


def test_chunk_jobs_convert_nothing_where_prepare_dir_holds_the_copy(
    demo_archives, index_dir, tmp_path
):
    """A second workflow sharing prepare.dir with prepare.jobs: K: where the copy of its index
    and settings is there already, its chunk jobs write only a record and the join names that
    copy in the workflow's manifest, unchanged (no K allocations converting ImageNet again)."""
    root, manifest = tmp_path / "shared", tmp_path / "results/prepared/val.json"
    argv = [*_args(demo_archives, index_dir, "val"), "--prepared-dir", str(root)]
    assert main(["prepare", *argv, "--manifest", str(tmp_path / "first.json")]) == 0
    copy = Path(json.loads((tmp_path / "first.json").read_text())["dir"])
    before = _tree(copy)
    chunks = [tmp_path / "chunks" / f"{k}-of-2" for k in range(2)]
    for k, chunk in enumerate(chunks):
        assert main(["prepare-chunk", *argv, "--chunk", str(k), "--chunks", "2",
                     "--chunk-dir", str(chunk)]) == 0  # fmt: skip
        assert sorted(p.name for p in chunk.iterdir()) == ["chunk.json"]
    join = ["prepare-join", "--chunk-dirs", *map(str, chunks), "--prepared-dir", str(root)]
    assert main([*join, "--manifest", str(manifest)]) == 0
    assert json.loads(manifest.read_text())["dir"] == str(copy)
    assert json.loads(manifest.read_text())["reused"] is True and _tree(copy) == before
