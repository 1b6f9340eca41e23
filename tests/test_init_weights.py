"""Starting a run from a local weights file (``init_weights``, ``init_weights_exclude``).

The file formats users have load to the same weights; the file's digest is cached by its
identity and is the run's weights setting (its path is not); each bad file is refused at the
dry-run with one line; a fresh start takes the file's weights before EMA and DDP, a resume
never reads it (two gloo ranks, a real torchrun).
"""

from __future__ import annotations

import json

import pytest
import torch

from imagenet_ddp import models as M
from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.settings import init_weights as IW
from imagenet_ddp.settings.geometry import Geometry
from imagenet_ddp.settings.kinds import declarations
from imagenet_ddp.settings.runs import RunsError, resolve_runs
from imagenet_ddp.training.model import save_model
from imagenet_ddp.training.worker import build_job
from tests.test_resume import CONFIG, torchrun
from tests.workflow_helpers import (
    copy_workflow,
    read_config,
    snakemake,
    train_config,
    write_config,
)


def trained_like(num_classes: int, seed: int = 7) -> torch.nn.Module:
    """A resnet18 whose every tensor differs from a fresh one (BatchNorm gammas included,
    which zero_init_residual would zero)."""
    torch.manual_seed(seed)
    model = M.build_model("resnet18", num_classes)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.rand_like(tensor))
    return model


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_every_format_users_have_gives_the_same_state_dict(tmp_path):
    from safetensors.torch import save_file

    model = trained_like(4)
    state = model.state_dict()
    files = {
        "plain.pth": lambda p: torch.save(state, p),
        "ddp.pt": lambda p: torch.save({"model": {f"module.{k}": v for k, v in state.items()}}, p),
        "lightning.ckpt": lambda p: torch.save({"state_dict": state, "epoch": 3}, p),
        "model.safetensors": lambda p: save_file({k: v.contiguous() for k, v in state.items()}, p),
        "model.pt": lambda p: save_model(p, model, arch="resnet18", num_classes=4, config={}),
    }
    for name, write in files.items():
        path = tmp_path / name
        write(path)
        assert_same(M.read_init_weights(path, IW.file_digest(path, "sha256")), state)
        assert M.weights_file_shapes(path) == {k: tuple(v.shape) for k, v in state.items()}
    with pytest.raises(M.WeightsFileError, match="changed after the dry-run"):
        M.read_init_weights(tmp_path / "plain.pth", "0" * 64)


def test_the_digest_is_the_files_and_a_gone_file_keeps_the_digest_its_run_had(tmp_path):
    """The check's digest (train's param): the file's; where the file is gone (a purge), the
    pinned one, else the one the run's last job started from; else one line, for that run."""
    path, run_dir = tmp_path / "w.pth", tmp_path / "run"
    path.write_bytes(b"one")
    run = {"run": "r", "init_weights": str(path), "init_weights_sha256": None}
    digest = IW.file_digest(path, "sha256")
    assert IW.weights_digest(run, run_dir) == (digest, None)
    assert IW.weights_digest({**run, "init_weights": ""}, run_dir) == ("", None)
    pinned = {**run, "init_weights_sha256": "0" * 64}
    assert "pins" in IW.weights_digest(pinned, run_dir)[1]
    path.unlink()
    assert IW.weights_digest(pinned, run_dir) == ("0" * 64, None)  # pinned: goes on
    kept, problem = IW.weights_digest(run, run_dir)
    assert kept == "" and "cannot be read" in problem and "init_weights_sha256" in problem
    run_dir.mkdir()  # its last job started from the file: resumes, the digest it had
    (run_dir / "job_spec.json").write_text(json.dumps({"run": {"init_weights_sha256": digest}}))
    assert IW.weights_digest(run, run_dir) == (digest, None)


def test_the_content_is_the_weights_setting_the_path_is_not():
    settings = declarations()
    run = {"name": "r", "lr": 0.1, "init_weights": "", "init_weights_exclude": []}
    run["init_weights_sha256"] = ""
    assert settings.rerun_settings(run) == {"lr": 0.1}  # at x-earlier: as before the setting
    one = {**run, "init_weights": "a.pth", "init_weights_sha256": "1" * 64}
    moved = {**one, "init_weights": "/elsewhere/a.pth"}
    other = {**one, "init_weights_sha256": "2" * 64}
    keys = [settings.rerun_settings(r) for r in (one, moved, other)]
    assert keys[0] == keys[1] != keys[2] and "init_weights" not in keys[0]
    fingerprints = [train_config(**settings.rank_settings(r)).fingerprint() for r in (one, moved)]
    assert fingerprints[0] == fingerprints[1]


def _config(**run):
    from tests.test_run_checks import demo_config

    return demo_config(**run)


def test_bad_files_are_refused_by_the_check_one_line_each(tmp_path):
    from imagenet_ddp.errors import InputError
    from imagenet_ddp.settings.run_checks import write_check
    from imagenet_ddp.settings.runs import written_settings

    good = tmp_path / "good.pth"
    torch.save(trained_like(10).state_dict(), good)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a weights file" * 20)
    vit = tmp_path / "vit.pth"
    torch.save({"model": {"head.weight": torch.zeros(10, 4)}}, vit)
    schema = "workflow/schemas/config.schema.yaml"

    def problems(**run) -> list[str]:
        config = _config(**run)
        try:
            runs = resolve_runs(config, written_settings(config), schema)
        except RunsError as error:  # what the config alone shows: at the dry-run
            return str(error).splitlines()
        settings = json.dumps(declarations().rank_settings(runs["r"]))
        try:
            write_check(settings, 4, tmp_path / "run", tmp_path / "check.json")
        except InputError as error:
            return str(error).splitlines()
        return []

    [missing] = problems(init_weights=str(tmp_path / "nope.pth"))
    assert missing.startswith(f"config.yaml: run 'r': init_weights '{tmp_path}/nope.pth' ")
    [pinned] = problems(init_weights=str(good), init_weights_sha256="0" * 64)
    assert "pins" in pinned
    [stray] = problems(init_weights_exclude=["fc."])
    assert "without init_weights" in stray
    [unreadable] = problems(init_weights=str(garbage))
    assert f"init_weights {garbage}: not a readable torch or safetensors" in unreadable
    [other] = problems(init_weights=str(vit))
    assert "keys the file lacks: conv1.weight" in other and "keys the model lacks: head" in other
    [head] = problems(init_weights=str(good))  # 10 classes, data 4
    assert "fc.weight [10, 512] in the file, [4, 512] in the model" in head
    assert "init_weights_exclude" in head
    assert problems(init_weights=str(good), init_weights_exclude=["fc."]) == []
    assert json.loads((tmp_path / "check.json").read_text())["init_weights_sha256"] == (
        IW.file_digest(good, "sha256")
    )
    [typo] = problems(init_weights=str(good), init_weights_exclude=["fc.", "head."])
    assert "prefixes matching no key of the model: head." in typo


def _job(state, **settings):
    cfg = train_config(model="resnet18", batch_size=2, ema_decay=0.99, epochs=2, **settings)
    info = D.DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, host="h")
    geometry = Geometry(1, 1, 1, 0, 0)
    device = torch.device("cpu")
    return build_job(cfg, info, device, geometry, 4, steps_per_epoch=3, init_weights=state)


def test_loaded_weights_win_over_zero_init_and_reach_the_ema_the_head_stays_at_init():
    file = trained_like(10).state_dict()
    torch.manual_seed(0)
    fresh = _job(None, zero_init_residual=True).model.state_dict()
    torch.manual_seed(0)
    job = _job(file, zero_init_residual=True, init_weights="w.pth", init_weights_exclude=["fc."])
    loaded, averaged = job.model.state_dict(), job.ema.module.state_dict()
    for key, value in loaded.items():
        expected = fresh[key] if key.startswith("fc.") else file[key]
        assert torch.equal(value, expected), key
        assert torch.equal(averaged[key], value), key
    assert fresh["layer1.0.bn2.weight"].eq(0).all()  # zero-init, which the file's weights beat
    assert not loaded["layer1.0.bn2.weight"].eq(0).any()


def test_a_fresh_start_takes_the_file_on_every_rank_and_a_resume_never_reads_it(
    prepared_demo, demo_split, tmp_path
):
    path = tmp_path / "pretrained.pth"
    file = trained_like(10).state_dict()  # another class count than the demo's 4
    torch.save({"model": {f"module.{k}": v for k, v in file.items()}}, path)
    config = {**CONFIG, "epochs": 1, "lr": 1e-9, "weight_decay": 0.0, "ema_decay": 0.0}
    config |= {"init_weights": str(path), "init_weights_exclude": ["fc."]}
    config["init_weights_sha256"] = IW.file_digest(path, "sha256")
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = torchrun(prepared_demo["train"], demo_split, out, ckpt, "--stop-after-steps", "1",
                     config=config)  # fmt: skip
    assert "started from its 122 tensors" in first.stdout, first.stdout + first.stderr
    [saved] = ckpt.glob("*/checkpoint-*.pt")
    weights = torch.load(saved, weights_only=True)["model"]
    # one step at lr 1e-9 away from the file: its weights (random ones differ by ~0.1)
    for key in ("conv1.weight", "layer4.1.conv2.weight", "layer1.0.bn2.weight"):
        assert torch.allclose(weights[key], file[key], atol=1e-6), key
    assert not torch.allclose(weights["fc.weight"][:, :4], file["fc.weight"][:4, :4])
    path.unlink()  # a resume must not need it
    second = torchrun(prepared_demo["train"], demo_split, out, ckpt, config=config)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from" in second.stdout and "started from" not in second.stdout
    recorded = json.loads((out / "train_metrics.json").read_text())["config"]
    assert recorded["init_weights_sha256"] == config["init_weights_sha256"]


def test_a_fresh_start_whose_weights_file_is_gone_is_refused_by_its_rank_in_one_line(tmp_path):
    """A scratch purge took the file: a resume never reads it (above); a fresh start's rank
    says what is missing where, and what to do, with or without the digest."""
    import dataclasses

    from imagenet_ddp.training.worker import initial_weights

    gone = str(tmp_path / "purged.pth")
    for digest in ("ab" * 32, ""):
        cfg = train_config(init_weights=gone, init_weights_sha256=digest)
        with pytest.raises(M.WeightsFileError) as error:
            initial_weights(dataclasses.replace(cfg, run="fresh"))
        line = str(error.value)
        assert "\n" not in line and line.startswith("rank 0 (of 1 failing): run 'fresh': ")
        assert f"init_weights {gone} not found on" in line and "put the file back" in line


def test_the_workflow_refuses_a_head_that_does_not_fit_and_passes_the_digest(tmp_path):
    """A real workflow: the run's local check (before any of its GPU jobs) refuses the data's
    class count (the demo's 6) against the file's 10, with one line in its log; with the head
    excluded it passes and records the file's digest, which train's rerun key holds."""
    workdir = copy_workflow(tmp_path / "wf")
    torch.save(trained_like(10).state_dict(), workdir / "in1k.pth")
    config = read_config(workdir)
    run = config["runs"][0]["name"]
    config["runs"] = [{**config["runs"][0], "init_weights": "in1k.pth"}]
    write_config(workdir, config)
    target = f"results/checks/{run}.json"
    refused = snakemake(workdir, "-c1", target, check=False)
    assert refused.returncode != 0
    log = (workdir / f"logs/check/{run}.log").read_text().splitlines()
    [line] = [x for x in log if "init_weights" in x]
    assert line.startswith(f"imagenet-ddp check: error: config.yaml: run '{run}': init_weights")
    assert "[10, 512] in the file, [6, 512] in the model" in line
    config["runs"][0]["init_weights_exclude"] = ["fc."]
    write_config(workdir, config)
    snakemake(workdir, "-c1", target)
    result = snakemake(workdir, "-n", "-p", f"results/runs/{run}/model.pt")
    digest = IW.file_digest(workdir / "in1k.pth", "sha256")
    # the check's record holds it, which train's rerun key takes (jobs.plan RerunKeys.key) once
    # data_content has run: the dry-run decides train after it
    assert json.loads((workdir / target).read_text())["init_weights_sha256"] == digest
    assert "checkpoint data_content:" in result.stdout
