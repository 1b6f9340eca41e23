"""The typed job spec (imagenet_ddp.jobs.spec): one parse, round trips, and errors that name
the file and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from imagenet_ddp.cli import main
from imagenet_ddp.jobs import spec as J
from tests.workflow_helpers import make_job

RUN = {"run": "r", "nodes": 2, "tasks_per_node": 4, "cpus_per_task": 8, "lr": 0.1}


@pytest.mark.parametrize("kind", ["train", "preflight", "evaluate"])
def test_each_kind_round_trips_through_its_file(kind, tmp_path):
    job = make_job(kind, RUN, root=tmp_path, launcher="srun", srun_extra="--x", attempt=3)
    path = J.write_spec(tmp_path / "spec.json", job)
    back = J.read_spec(path, kind)
    assert back == job and type(back) is type(job)
    assert J.load(str(path)) == job == J.load(path.read_text())  # a file, or its JSON text
    data = json.loads(path.read_text())
    assert data["kind"] == kind and data["execution"]["attempt"] == 3
    assert isinstance(back.paths.split_dir, Path)  # paths come back as paths
    assert back.geometry.world_size == 8
    if kind != "evaluate":
        assert back.run == RUN and back.execution.stage.verify == "size"
    if kind == "preflight":
        assert back.paths.run_dir == back.paths.out.parent


def _written(tmp_path, change) -> Path:
    data = J.to_dict(make_job("train", RUN, root=tmp_path))
    change(data)
    path = tmp_path / "job_spec.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["execution"].update(scratch="/x"), "unknown key execution.scratch"),
        (lambda d: d["execution"]["stage"].update(verify_all=1), "unknown key execution.stage."),
        (lambda d: d["paths"].pop("split_dir"), "missing key paths.split_dir"),
        (lambda d: d.pop("execution"), "missing key execution"),
        (lambda d: d["execution"].pop("stage"), "missing key execution.stage"),
        (lambda d: d.update(kind="evaluate"), "key kind is 'evaluate'; expected 'train'"),
        (lambda d: d["execution"].update(launcher="mpirun"), "execution.launcher 'mpirun'"),
        (lambda d: d.update(paths=[]), "paths must be a JSON object"),
    ],
)
def test_a_bad_spec_names_its_file_and_key(tmp_path, change, message):
    path = _written(tmp_path, change)
    with pytest.raises(J.SpecError) as error:
        J.read_spec(path, "train")
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value), error.value
    assert "\n" not in str(error.value)


def test_the_cli_refuses_a_bad_spec_with_one_line_and_writes_nothing(tmp_path, capsys):
    path = _written(tmp_path, lambda d: d["paths"].update(rundir="x"))
    assert main(["train", "--job", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"imagenet-ddp train: error: {path}: unknown key paths.rundir (known: prepared_train, "
        "split_dir, run_dir, checkpoint_root)"
    )
    assert main(["evaluate", "--job", "{not json"]) == 2
    assert "--job: not JSON" in capsys.readouterr().err
    assert main(["preflight", "--job", str(tmp_path / "none.json")]) == 2
    assert "none.json: cannot read the job spec" in capsys.readouterr().err
    assert not (tmp_path / "run_dir").exists()  # no run folder, no spec written


def test_a_job_without_its_geometry_is_refused_by_the_launcher(tmp_path, capsys):
    """A rank started by hand (torchrun) reads the geometry from the ranks that started; the
    launcher cannot: it refuses naming the keys, before anything is written."""
    job = make_job("train", {"run": "r", "nodes": 1}, root=tmp_path)
    assert main(["train", "--job", json.dumps(J.to_dict(job))]) == 2
    assert "the run settings lack tasks_per_node, cpus_per_task" in capsys.readouterr().err
    assert not (tmp_path / "run_dir").exists()


def test_a_compact_spec_reads_back_whole_and_refuses_another_package_version():
    """The rule passes the spec as compact JSON (common.smk job_spec): the run's settings at
    their default left out, filled in again by the job from its package's declarations; a job
    whose package is another version than the workflow's refuses in one line."""
    from imagenet_ddp import __version__
    from imagenet_ddp.jobs.spec import SpecError, compact_spec, load, to_dict
    from imagenet_ddp.settings.kinds import declarations
    from tests.workflow_helpers import make_job, run_settings

    run = run_settings(run="r", nodes=1, tasks_per_node=1, cpus_per_task=1, lr=0.3)
    spec = to_dict(make_job("train", run, attempt=2))
    text = compact_spec(spec)
    sent = json.loads(text)["run"]
    family = {"weight_decay_groups": "torchvision", "normalization": "imagenet",
              "zero_init_residual": False}  # "auto" resolved: no longer the default  # fmt: skip
    assert sent == {"run": "r", "nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1, "lr": 0.3,
                    **family}  # fmt: skip
    assert len(text) < len(json.dumps(spec)) / 2
    read = to_dict(load(text, "train"))
    assert read == {**spec, "run": {**declarations().rank_defaults(), **spec["run"]}}
    other = text.replace(f'"version":"{__version__}"', '"version":"0.0.1"')
    with pytest.raises(SpecError, match="planned this job with imagenet-ddp 0.0.1"):
        load(other, "train")
