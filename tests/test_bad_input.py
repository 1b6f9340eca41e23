"""The bad-input table of docs/reliability.md ("Bad input"), row by row, through the command a
rule runs.

Each row: a clear one-line error naming the file (or key) and what to do, exit code 2, and no
artifact under its final name. Function-level details live in test_archives/test_prepared/
test_split/test_stage; this file proves the user-facing behaviour of the CLI and the workflow.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pandas as pd
import pytest

from imagenet_ddp.cli import main
from imagenet_ddp.data.archives import TRAIN_ARCHIVE, VAL_ARCHIVE
from tests.conftest import prepared_copy
from tests.workflow_helpers import copy_workflow, read_config, snakemake, write_config


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_missing_archive(writable_archives, tmp_path, capsys):
    (writable_archives / VAL_ARCHIVE).unlink()
    report = tmp_path / "report.json"
    code, err = run_cli(
        capsys,
        "verify",
        "--data-dir",
        str(writable_archives),
        "--report",
        str(report),
        "--check-md5",
    )
    assert code == 2 and VAL_ARCHIVE in err and "download" in err
    assert not report.exists()


def test_truncated_archive(writable_archives, tmp_path, capsys):
    path = writable_archives / TRAIN_ARCHIVE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    report = tmp_path / "report.json"
    code, err = run_cli(
        capsys,
        "verify",
        "--data-dir",
        str(writable_archives),
        "--report",
        str(report),
        "--check-md5",
    )
    assert code == 2 and TRAIN_ARCHIVE in err and "download" in err.lower()
    assert not report.exists()


def test_md5_mismatch(writable_archives, tmp_path, capsys):
    sums = writable_archives / "md5sums"
    sums.write_text(
        "\n".join(
            f"{'0' * 32}  {line.split()[1]}" if VAL_ARCHIVE in line else line
            for line in sums.read_text().splitlines()
        )
        + "\n"
    )
    code, err = run_cli(
        capsys,
        "verify",
        "--data-dir",
        str(writable_archives),
        "--report",
        str(tmp_path / "r.json"),
        "--check-md5",
    )
    assert code == 2 and VAL_ARCHIVE in err and "0" * 32 in err


def test_devkit_without_val_ground_truth(writable_archives, tmp_path, capsys):
    devkit = writable_archives / "ILSVRC2012_devkit_t12.tar.gz"
    with tarfile.open(devkit) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar]
    with tarfile.open(devkit, "w:gz") as tar:
        for member, data in members:
            if not member.name.endswith("ILSVRC2012_validation_ground_truth.txt"):
                tar.addfile(member, io.BytesIO(data) if data is not None else None)
    code, err = run_cli(
        capsys,
        "verify",
        "--data-dir",
        str(writable_archives),
        "--check-md5",
        "--report",
        str(tmp_path / "r.json"),
    )
    code_no_md5, err_no_md5 = run_cli(
        capsys,
        "verify",
        "--data-dir",
        str(writable_archives),
        "--no-check-md5",
        "--report",
        str(tmp_path / "r.json"),
    )
    assert code == 2 and code_no_md5 == 2
    assert "ground_truth" in err_no_md5 and "devkit" in err_no_md5.lower()


def _corrupt_one_train_image(data_dir: Path) -> str:
    """Replace one JPEG inside the first class tar by garbage; return its member name."""
    outer_path = data_dir / TRAIN_ARCHIVE
    with tarfile.open(outer_path) as outer:
        inner_members = [(m, outer.extractfile(m).read()) for m in outer]
    first, data = inner_members[0]
    with tarfile.open(fileobj=io.BytesIO(data)) as inner:
        images = [(m, inner.extractfile(m).read()) for m in inner]
    victim = images[1][0].name
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as inner:
        for member, payload in images:
            if member.name == victim:
                payload = b"\xff\xd8 not really a jpeg"
                member.size = len(payload)
            inner.addfile(member, io.BytesIO(payload))
    inner_members[0] = (first, buffer.getvalue())
    with tarfile.open(outer_path, "w") as outer:
        for member, payload in inner_members:
            member.size = len(payload)
            outer.addfile(member, io.BytesIO(payload))
    return victim


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_corrupt_jpeg_in_a_class_tar(writable_archives, tmp_path, capsys, mode):
    victim = _corrupt_one_train_image(writable_archives)
    index_dir = tmp_path / "index"
    assert main(["index", "--data-dir", str(writable_archives), "--out-dir", str(index_dir)]) == 0
    out = tmp_path / "prepared"
    code, err = run_cli(
        capsys,
        "prepare",
        "--data-dir",
        str(writable_archives),
        "--index-dir",
        str(index_dir),
        "--which",
        "train",
        "--manifest",
        str(tmp_path / "train.json"),
        "--prepared-dir",
        str(out),
        "--short-side",
        "24",
        "--shard-samples",
        "16",
        "--quality",
        "90",
        "--workers",
        "1",
        "--on-corrupt",
        mode,
    )
    if mode == "fail":
        assert code == 2 and victim in err and "on_corrupt" in err
        assert not (tmp_path / "train.json").exists() and not list(out.glob("train-*"))
    else:
        assert code == 0
        assert victim in (prepared_copy(tmp_path / "train.json") / "prepared.json").read_text()


def test_class_with_too_few_images_for_a_stratified_split(tmp_path, capsys):
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    rows = [(i, 0, "n00000001") for i in range(10)] + [(10, 1, "n00000002")]
    pd.DataFrame(rows, columns=["sample_id", "class_index", "wnid"]).assign(
        member="", name="x.JPEG", size=1
    ).to_csv(index_dir / "train.csv", index=False)
    out = tmp_path / "split"
    code, err = run_cli(
        capsys,
        "split",
        "--index-dir",
        str(index_dir),
        "--holdout-fraction",
        "0.2",
        "--seed",
        "0",
        "--out-dir",
        str(out),
    )
    assert code == 2 and "n00000002" in err
    assert not (out / "train.csv").exists()


def test_scratch_too_small(prepared_demo, tmp_path, monkeypatch):
    import shutil

    from imagenet_ddp.data import stage
    from imagenet_ddp.errors import InputError

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(stage.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(InputError, match="scratch_dir|SLURM_TMPDIR"):
        stage.stage_dataset(prepared_demo["train"], tmp_path / "scratch", verify="size")
    assert not list((tmp_path / "scratch").rglob("*.tar"))


def test_odd_real_imagenet_images_load_as_rgb(prepared_demo):
    from imagenet_ddp.data.dataset import PreparedImageDataset

    dataset = PreparedImageDataset(prepared_demo["train"])
    for i in range(len(dataset)):
        image, _ = dataset[i]
        assert image.shape[0] == 3


# ---------------------------------------------------------------- through snakemake


@pytest.fixture
def workflow_copy(tmp_path):
    return copy_workflow(tmp_path / "wf")


def test_config_that_fails_the_schema_names_the_key(workflow_copy):
    config = read_config(workflow_copy)
    config["split"]["holdout_fraction"] = 1.5
    write_config(workflow_copy, config)
    result = snakemake(workflow_copy, "-n", check=False)
    assert result.returncode != 0
    assert "holdout_fraction" in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("where", "key", "value", "expected"),
    [
        ("evaluate", "tasks_per_node", 0, "evaluate.tasks_per_node 0"),
        ("evaluate", "workers", "many", "evaluate.workers 'many'"),
        ("evaluate", "gpus", 1, "'gpus' was unexpected"),
        ("run", "cpus_per_task", 0, "run 'resnet18-1x2': evaluate.cpus_per_task 0"),
    ],
)
def test_bad_evaluation_geometry_is_rejected_naming_the_key(
    workflow_copy, where, key, value, expected
):
    config = read_config(workflow_copy)
    block = config["runs"][0].setdefault("evaluate", {}) if where == "run" else config["evaluate"]
    block[key] = value
    write_config(workflow_copy, config)
    result = snakemake(workflow_copy, "-n", check=False)
    assert result.returncode != 0
    [line] = (result.stdout + result.stderr).splitlines()  # one line, naming the key
    assert expected in line and line.startswith("config.yaml: "), line


@pytest.mark.parametrize("name", ["my run", "a;touch pwned", "$(touch pwned)", "../escape"])
def test_run_names_with_spaces_or_shell_metacharacters_are_rejected(workflow_copy, name):
    config = read_config(workflow_copy)
    config["runs"][0]["name"] = name
    write_config(workflow_copy, config)
    result = snakemake(workflow_copy, "-n", check=False)
    assert result.returncode != 0 and "name" in result.stdout + result.stderr
    assert not (workflow_copy / "pwned").exists()


def test_data_dir_with_spaces_and_metacharacters_is_quoted_not_executed(
    workflow_copy, demo_archives
):
    import shutil

    hostile = workflow_copy / "my data; touch pwned $(touch pwned2)"
    shutil.copytree(demo_archives, hostile)
    config = read_config(workflow_copy)
    config["demo"]["enabled"] = False
    config["data"]["dir"] = str(hostile)
    write_config(workflow_copy, config)
    # verify runs beside index (it no longer waits for verify): both targets
    snakemake(workflow_copy, "--profile", "profiles/local", "results/index/train.csv",
              "results/verify/report.json")  # fmt: skip
    assert not (workflow_copy / "pwned").exists() and not (workflow_copy / "pwned2").exists()
    assert (workflow_copy / "results/index/train.csv").is_file()
    report = (workflow_copy / "results/verify/report.json").read_text()
    assert hashlib.md5((hostile / VAL_ARCHIVE).read_bytes()).hexdigest() in report


def test_concurrent_writers_of_one_prepared_dataset_are_excluded(demo_archives, tmp_path):
    """Two workflows preparing into one shared directory at once: one builds, one reuses."""
    import subprocess
    import sys

    index_dir = tmp_path / "index"
    assert main(["index", "--data-dir", str(demo_archives), "--out-dir", str(index_dir)]) == 0

    def prepare_args(manifest: Path, prepared_dir: Path) -> list[str]:
        return ["prepare", "--data-dir", str(demo_archives), "--index-dir", str(index_dir),
                "--which", "train", "--manifest", str(manifest), "--prepared-dir",
                str(prepared_dir), "--short-side", "24", "--quality", "90", "--workers", "1",
                "--on-corrupt", "fail", "--shard-samples", "16"]  # fmt: skip

    manifests = [tmp_path / f"workflow{i}" / "train.json" for i in range(2)]
    writers = [
        subprocess.Popen(
            [sys.executable, "-m", "imagenet_ddp.cli", *prepare_args(m, tmp_path / "shared")]
        )
        for m in manifests
    ]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    assert sorted(json.loads(m.read_text())["reused"] for m in manifests) == [False, True]
    shared = prepared_copy(manifests[0])
    assert prepared_copy(manifests[1]) == shared
    assert main(prepare_args(tmp_path / "reference.json", tmp_path / "reference")) == 0
    reference = prepared_copy(tmp_path / "reference.json")
    for path in sorted(reference.rglob("*")):
        if path.is_file():
            assert (shared / path.relative_to(reference)).read_bytes() == path.read_bytes()
    assert not [p for p in shared.parent.iterdir() if ".tmp-" in p.name]
