"""Input layouts (imagenet_ddp.data.layouts): the same images in the archives, an ImageFolder
tree and Kaggle's ILSVRC tree give the same index, split and prepared copy; each bad layout is
refused with one line naming its path."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from imagenet_ddp.data import layouts
from imagenet_ddp.data.layouts import SAME_COLUMNS, dry_run_layout, find_layout
from imagenet_ddp.data.prepare import prepare_shared
from imagenet_ddp.data.split import split_index
from imagenet_ddp.errors import InputError
from tests.conftest import prepared_copy
from tests.demo_layouts import extract_demo_layout

KAGGLE_VAL = "ILSVRC/Data/CLS-LOC/val"


@pytest.fixture(scope="module")
def trees(demo_archives, tmp_path_factory) -> dict[str, Path]:
    """{layout: data dir}: the demo's images in each layout."""
    root = tmp_path_factory.mktemp("layouts")
    out = {"archives": demo_archives}
    for layout in ("imagefolder", "kaggle"):
        out[layout] = root / layout
        extract_demo_layout(demo_archives, out[layout], layout)
    return out


@pytest.fixture
def copy_of(trees, tmp_path):
    """A private copy of one layout's tree, for tests that damage it."""
    return lambda layout: Path(shutil.copytree(trees[layout], tmp_path / layout))


def _digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- the same data


def test_same_images_give_same_index_split_and_prepared_copy(trees, tmp_path):
    """classes.csv, the split files and the prepared copy byte for byte; the index equal in
    its sample columns (SAME_COLUMNS), only the location columns differing (the stated
    normalisation)."""
    results = {}
    for layout, data_dir in trees.items():
        assert find_layout(data_dir).name == layout
        assert dry_run_layout(str(data_dir)).name == layout
        report = find_layout(data_dir).verify(data_dir, check_files=True)
        assert report["counts"] == {"classes": 4, "train_images": 48, "val_images": 8}
        work = tmp_path / layout
        layouts.write_index(data_dir, work / "index")
        split_index(work / "index", work / "split", 0.25, seed=0)
        for which in ("train", "val"):
            prepare_shared(
                data_dir,
                work / "index",
                which,
                work / f"{which}.json",
                work / "prepared",
                short_side=24,
                quality=90,
                on_corrupt="fail",
                shard_samples=16,
                workers=1,
            )
            assert not json.loads((work / f"{which}.json").read_text())["reused"]
        results[layout] = work
    first = results.pop("archives")
    for layout, work in results.items():
        assert _digests(work / "split") == _digests(first / "split"), layout
        for which in ("train", "val"):  # the copies (their provenance beside them differs)
            prepared = _digests(prepared_copy(work / f"{which}.json"))
            assert prepared == _digests(prepared_copy(first / f"{which}.json")), layout
            assert "shards/shard-00000.tar" in prepared
        same = _digests(work / "index")["classes.csv"] == _digests(first / "index")["classes.csv"]
        assert same, layout
        for which in ("train", "val"):
            ours = pd.read_csv(work / "index" / f"{which}.csv", keep_default_na=False)
            theirs = pd.read_csv(first / "index" / f"{which}.csv", keep_default_na=False)
            pd.testing.assert_frame_equal(ours[SAME_COLUMNS], theirs[SAME_COLUMNS])
            assert (ours["offset"] == 0).all() and (theirs["offset"] > 0).all()
    split = pd.read_csv(first / "split" / "holdout.csv")
    assert list(split.columns) == SAME_COLUMNS


def test_any_labelled_folder_any_class_count(tmp_path):
    """Class names that are not wnids, a count that is not 1,000: the data says both."""
    for split, per_class in (("train", 3), ("val", 1)):
        for name in ("cat", "dog", "zebra fish"):
            for i in range(per_class):
                (tmp_path / split / name).mkdir(parents=True, exist_ok=True)
                (tmp_path / split / name / f"{i}.png").write_bytes(b"\x89PNG whatever")
    assert dry_run_layout(str(tmp_path)).name == "imagefolder"
    layouts.write_index(tmp_path, tmp_path / "index")
    classes = pd.read_csv(tmp_path / "index" / "classes.csv")
    assert classes.to_dict("list") == {
        "class_index": [0, 1, 2],
        "wnid": ["cat", "dog", "zebra fish"],
        "words": ["cat", "dog", "zebra fish"],
    }
    val = pd.read_csv(tmp_path / "index" / "val.csv")
    assert val["class_index"].tolist() == [0, 1, 2]


# ----------------------------------------------------------------------------- finding one


def test_named_layout_must_be_there_and_be_the_one_found(trees, tmp_path):
    with pytest.raises(InputError) as excinfo:
        find_layout(trees["kaggle"], "folders")
    assert "data.layout 'folders' is not one of auto, archives, imagefolder, kaggle" in (
        _one_line(excinfo)
    )
    with pytest.raises(InputError) as excinfo:
        find_layout(trees["imagefolder"], "kaggle")
    assert "data.layout: kaggle" in _one_line(excinfo)
    assert "ILSVRC/Data/CLS-LOC/train" in str(excinfo.value)
    # torchvision's ImageNet class extracts train/ and val/ beside the archives: read first.
    both = Path(shutil.copytree(trees["archives"], tmp_path / "both"))
    for folder in ("train", "val"):
        shutil.copytree(trees["imagefolder"] / folder, both / folder)
    assert find_layout(both).name == "archives"
    assert dry_run_layout(str(both), "archives").name == "archives"
    with pytest.raises(InputError) as excinfo:
        dry_run_layout(str(both), "imagefolder")
    assert "the jobs read archives first" in _one_line(excinfo)


def test_no_layout_recognised_says_what_it_expected(tmp_path):
    with pytest.raises(InputError) as excinfo:
        find_layout(tmp_path / "nowhere")
    assert f"data.dir {tmp_path / 'nowhere'} does not exist" in _one_line(excinfo)
    (tmp_path / "train").mkdir()
    with pytest.raises(InputError) as excinfo:
        find_layout(tmp_path)
    assert "holds part of an ImageFolder tree" in _one_line(excinfo)
    assert f"{tmp_path / 'val'} not found; extract both" in str(excinfo.value)
    (tmp_path / "LOC_val_solution.csv").touch()  # part of two layouts: which one is meant?
    with pytest.raises(InputError) as excinfo:
        find_layout(tmp_path)
    message = _one_line(excinfo)
    assert f"data.dir {tmp_path}: no input layout recognised" in message
    for layout in layouts.LAYOUTS.values():
        assert layout.summary in message


# ----------------------------------------------------------------------------- bad layouts


def _remove_val_class(data_dir: Path) -> str:
    victim = sorted((data_dir / "val").iterdir())[0]
    shutil.rmtree(victim)
    return "class folders differ"


def _unlabelled_in_imagefolder(data_dir: Path) -> str:
    (data_dir / "val" / "ILSVRC2012_val_00000099.JPEG").write_bytes(b"\xff\xd8\xff")
    return f"{data_dir / 'val' / 'ILSVRC2012_val_00000099.JPEG'}: an unlabelled validation image"


def _unlabelled_in_kaggle(data_dir: Path) -> str:
    (data_dir / KAGGLE_VAL / "ILSVRC2012_val_00000099.JPEG").write_bytes(b"\xff\xd8\xff")
    return f"{data_dir / KAGGLE_VAL / 'ILSVRC2012_val_00000099.JPEG'}: no label in"


def _empty_class_folder(data_dir: Path) -> str:
    victim = sorted((data_dir / "train").iterdir())[1]
    for image in victim.iterdir():
        image.unlink()
    return f"{victim} is empty"


def _missing_kaggle_val_image(data_dir: Path) -> str:
    sorted((data_dir / KAGGLE_VAL).iterdir())[0].unlink()
    return "labelled in LOC_val_solution.csv) not found"


@pytest.mark.parametrize(
    ("layout", "damage"),
    [
        ("imagefolder", _remove_val_class),
        ("imagefolder", _unlabelled_in_imagefolder),
        ("kaggle", _unlabelled_in_kaggle),
        ("kaggle", _missing_kaggle_val_image),
        ("imagefolder", _empty_class_folder),
    ],
)
def test_bad_layout_refused_at_the_dry_run_with_one_line(copy_of, layout, damage):
    data_dir = copy_of(layout)
    expected = damage(data_dir)
    with pytest.raises(InputError) as excinfo:
        dry_run_layout(str(data_dir))
    assert expected in _one_line(excinfo)


def test_kaggle_missing_train_class_refused(copy_of):
    data_dir = copy_of("kaggle")
    victim = sorted((data_dir / "ILSVRC/Data/CLS-LOC/train").iterdir())[2]
    shutil.rmtree(victim)
    with pytest.raises(InputError) as excinfo:
        dry_run_layout(str(data_dir))
    assert f"missing ['{victim.name}']" in _one_line(excinfo)


def test_files_that_are_no_image_are_skipped_as_torchvision_does_and_counted(
    copy_of, tmp_path, capsys
):
    """A class folder's README or .DS_Store is left out (torchvision's ImageFolder keeps
    IMG_EXTENSIONS only), not refused; the listing says how many; a folder of none is refused."""
    data_dir = copy_of("imagefolder")
    layout = find_layout(data_dir)
    before = layout.verify(data_dir, check_files=True)["counts"]
    first, second = sorted((data_dir / "train").iterdir())[:2]
    (first / "notes.txt").write_text("x")
    (first / ".DS_Store").write_bytes(b"\0")
    (sorted((data_dir / "val").iterdir())[0] / "Thumbs.db").write_bytes(b"\0")
    capsys.readouterr()
    assert layout.verify(data_dir, check_files=True)["counts"] == before
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"data.dir {data_dir}: skipped 3 file(s) that are no image")
    layouts.write_index(data_dir, tmp_path / "index")
    index = (tmp_path / "index").rglob("*.csv")
    assert not any("notes.txt" in p.read_text() or "Thumbs.db" in p.read_text() for p in index)
    for image in second.iterdir():
        image.unlink()
    (second / "README").write_text("x")
    dry_run_layout(str(data_dir))  # not empty: the dry-run lists no train file
    with pytest.raises(InputError) as excinfo:
        layout.verify(data_dir, check_files=False)
    assert f"{second} is empty (no .jpg" in _one_line(excinfo)


def test_verify_names_a_truncated_jpeg_the_dry_run_does_not_open(copy_of):
    data_dir = copy_of("imagefolder")
    victim = sorted(sorted((data_dir / "train").iterdir())[0].iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:-40])
    dry_run_layout(str(data_dir))  # structure only: no image is opened at the dry-run
    with pytest.raises(InputError) as excinfo:
        find_layout(data_dir).verify(data_dir, check_files=True)
    assert f"{victim}: a truncated JPEG" in _one_line(excinfo)
    assert find_layout(data_dir).verify(data_dir, check_files=False)["check_files"] is False


def test_an_index_replaces_an_earlier_one_whole_and_never_a_folder_of_other_files(trees, tmp_path):
    out = tmp_path / "index"
    layouts.write_index(trees["imagefolder"], out)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(first) == {"classes.csv", "train.csv", "val.csv", "provenance.json"}
    layouts.write_index(trees["imagefolder"], out)  # a rerun: the same files, whole
    assert {p.name for p in out.iterdir()} == set(first)
    assert (out / "train.csv").read_bytes() == first["train.csv"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(InputError, match="holds files that are no index's"):
        layouts.write_index(trees["imagefolder"], tmp_path / "mine")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_prepare_refuses_a_file_changed_since_the_index(copy_of, tmp_path):
    data_dir = copy_of("kaggle")
    layouts.write_index(data_dir, tmp_path / "index")
    victim = sorted((data_dir / KAGGLE_VAL).iterdir())[0]
    victim.write_bytes(victim.read_bytes() + b"\0")
    with pytest.raises(InputError) as excinfo:
        prepare_shared(
            data_dir,
            tmp_path / "index",
            "val",
            tmp_path / "val.json",
            tmp_path / "prepared",
            short_side=24,
            quality=90,
            on_corrupt="fail",
            shard_samples=16,
            workers=1,
        )
    assert f"{victim} has" in _one_line(excinfo)
    assert not (tmp_path / "val.json").exists() and not list(tmp_path.glob("prepared/val-*"))


def test_ilsvrc2012_counts_checked_only_for_its_classes(monkeypatch):
    names = [f"n{i:08d}" for i in range(1000)]
    train = dict.fromkeys(names, 1281)
    val = dict.fromkeys(names, 50)
    layouts.check_imagenet_counts("d", train, val)  # other classes: no published counts
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
    monkeypatch.setattr(layouts, "ILSVRC2012_WNIDS_SHA256", digest)
    with pytest.raises(InputError, match="1281000 train images, ILSVRC2012 has 1281167"):
        layouts.check_imagenet_counts("d", train, val)
    with pytest.raises(InputError, match="class n00000007 has 49 validation images"):
        layouts.check_imagenet_counts("d", train, {**val, "n00000007": 49})
    with pytest.raises(InputError, match="class n00000003 has 700 train images"):
        layouts.check_imagenet_counts("d", {**train, "n00000003": 700}, val)


# ----------------------------------------------------------------------------- the workflow


def _rename_classes(tree: Path) -> list[str]:
    """Class folders named as any labelled folder may be (spaces, no wnid), order kept."""
    names = []
    for split in ("train", "val"):
        for i, folder in enumerate(sorted((tree / split).iterdir())):
            folder.rename(folder.with_name(f"class {i}"))
            names.append(f"class {i}")
    return sorted(set(names))


@pytest.mark.e2e
def test_folder_layouts_train_and_evaluate_in_the_local_workflow(tmp_path):
    """An ImageFolder tree of 6 classes named freely trains and evaluates end to end (one run,
    one rank, one epoch); Kaggle's tree of the same images goes through verify, index, split
    and prepare in the same workdir to the byte-identical prepared copy that trained; a data.dir
    with no layout is refused by the dry-run with one line naming it."""
    from imagenet_ddp.data.demo import make_demo_dataset
    from tests.workflow_helpers import copy_workflow, read_config, snakemake, write_config

    archives = tmp_path / "archives"
    make_demo_dataset(archives, num_classes=6, train_per_class=20, val_per_class=2, image_size=40)
    extract_demo_layout(archives, tmp_path / "folder", "imagefolder")
    (tmp_path / "folder" / "LOC_synset_mapping.txt").unlink()
    names = _rename_classes(tmp_path / "folder")
    extract_demo_layout(archives, tmp_path / "kaggle", "kaggle")
    workdir = copy_workflow(tmp_path / "work", runs=[{"name": "tiny", "tasks_per_node": 1}])
    config = read_config(workdir)
    config["demo"]["enabled"] = False
    config["data"] = {"dir": str(tmp_path / "folder"), "layout": "imagefolder"}
    config["train_defaults"]["epochs"] = 1
    write_config(workdir, config)

    # Training and evaluation; the report stages read no class count and the demo's e2e runs
    # them (tests/test_workflow_local.py).
    result = snakemake(workdir, "--profile", "profiles/local", "results/runs/tiny/eval.json")
    found = (
        f"data: an ImageFolder tree (train/<class>/*, val/<class>/*) found in data.dir {tmp_path}"
    )
    assert found in result.stderr
    assert json.loads((workdir / "results/verify/report.json").read_text())["layout"] == (
        "imagefolder"
    )
    classes = pd.read_csv(workdir / "results/index/classes.csv")
    assert classes["wnid"].tolist() == names and len(names) == 6
    evaluation = json.loads((workdir / "results/runs/tiny/eval.json").read_text())
    assert evaluation["test"]["samples"] == 12 and evaluation["holdout"]["samples"] == 12
    per_class = pd.read_csv(workdir / "results/runs/tiny/per_class.csv")
    assert per_class["wnid"].tolist() == names and (per_class["test_total"] == 2).all()
    trained = {w: _digests(workdir / "results/prepared" / w) for w in ("train", "val")}

    config["data"] = {"dir": str(tmp_path / "kaggle")}
    write_config(workdir, config)
    snakemake(workdir, "--profile", "profiles/local", "--until", "prepare", "split", "verify")
    report = json.loads((workdir / "results/verify/report.json").read_text())
    assert report["layout"] == "kaggle"
    for which in ("train", "val"):
        assert _digests(workdir / "results/prepared" / which) == trained[which]
    # The same images from another layout (other class names): the model trained on the
    # ImageFolder tree's copy stands (the copy is the same bytes); only the evaluation, which
    # names the classes, runs again (by content: the data_content checkpoint's digests).
    model, evaluation = (workdir / f"results/runs/tiny/{n}" for n in ("model.pt", "eval.json"))
    trained_at, evaluated_at = model.stat().st_mtime_ns, evaluation.stat().st_mtime_ns
    ran = snakemake(workdir, "--profile", "profiles/local", "results/runs/tiny/eval.json")
    assert model.stat().st_mtime_ns == trained_at, ran.stdout[-3000:]
    assert evaluation.stat().st_mtime_ns > evaluated_at

    # Other images (one train image fewer): another copy, and the run retrains in the same
    # invocation that prepares it.
    next(iter(sorted((tmp_path / "folder" / "train").glob("*/*")))).unlink()
    config["data"] = {"dir": str(tmp_path / "folder")}
    write_config(workdir, config)
    snakemake(workdir, "--profile", "profiles/local", "results/runs/tiny/eval.json")
    assert model.stat().st_mtime_ns > trained_at
    assert json.loads(evaluation.read_text())["holdout"]["samples"] == 12
    planned = snakemake(workdir, "-n", "--profile", "profiles/local", "results/runs/tiny/eval.json")
    assert "Nothing to be done" in planned.stdout + planned.stderr

    config["data"] = {"dir": str(tmp_path / "archives"), "layout": "kaggle"}
    write_config(workdir, config)
    refused = snakemake(workdir, "-n", "--profile", "profiles/local", check=False)
    assert refused.returncode != 0
    line = f"data.dir {tmp_path / 'archives'} (data.layout: kaggle) lacks ILSVRC/Data/CLS-LOC"
    output = refused.stdout + refused.stderr
    assert line in output and "Job stats" not in output
