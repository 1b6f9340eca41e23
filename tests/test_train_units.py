"""Unit tests of the training worker's building blocks (no data layer, no process group)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.training.checkpoint import load_latest_checkpoint, save_checkpoint
from imagenet_ddp.training.data import EpochSampler, SeededAugmentation
from imagenet_ddp.training.recipe import lr_lambda
from tests.workflow_helpers import train_config


def test_epoch_sampler_skips_exactly_the_steps_already_done():
    full = EpochSampler(100, world_size=2, rank=1, seed=3, batch_size=5)
    full.set_epoch(4)
    resumed = EpochSampler(100, world_size=2, rank=1, seed=3, batch_size=5)
    resumed.set_epoch(4, skip_steps=4)
    assert list(resumed) == list(full)[20:]
    assert len(resumed) == len(full) - 20 == 30
    assert all(epoch == 4 for epoch, _ in full)


def test_ranks_see_disjoint_samples_and_epochs_reshuffle():
    a, b = EpochSampler(64, 2, 0, seed=0), EpochSampler(64, 2, 1, seed=0)
    a.set_epoch(0)
    b.set_epoch(0)
    assert not {i for _, i in a} & {i for _, i in b}
    first = [i for _, i in a]
    a.set_epoch(1)
    assert [i for _, i in a] != first


def steps_by_group(world: int, accumulation: int, skip: int = 0) -> dict:
    """{(step, group): the sample ids of that micro-batch group} over every rank."""
    groups = {}
    for rank in range(world):
        sampler = EpochSampler(103, world, rank, seed=5, batch_size=3, accumulation=accumulation)
        sampler.set_epoch(2, skip_steps=skip)
        ids = [index for _, index in sampler]
        for n, start in enumerate(range(0, len(ids), 3)):
            step, micro = skip + n // accumulation, n % accumulation
            groups[(step, sampler.group(micro))] = ids[start : start + 3]
    return groups


def test_every_step_takes_the_same_samples_in_the_same_groups_on_any_rank_count():
    """Global batch 12 (4 groups of 3) on 4 ranks, 2 ranks x 2 micro-batches, 1 rank x 4: the
    same sample ids in the same groups at every step, from a resume point too; 103 samples
    make 8 steps on every shape (the last 7 left out, whatever the rank count)."""
    reference = steps_by_group(4, 1)
    assert len(reference) == 8 * 4 and {step for step, _ in reference} == set(range(8))
    assert steps_by_group(2, 2) == reference == steps_by_group(1, 4)
    resumed = {k: v for k, v in reference.items() if k[0] >= 5}
    assert steps_by_group(2, 2, skip=5) == resumed == steps_by_group(1, 4, skip=5)
    used = [i for ids in reference.values() for i in ids]
    assert len(set(used)) == len(used) == 96
    # One rank, one micro-batch: the order of earlier versions (DistributedSampler's).
    old = torch.utils.data.DistributedSampler(range(103), 1, 0, shuffle=True, seed=5)
    old.set_epoch(2)
    one = EpochSampler(103, 1, 0, seed=5, batch_size=3)
    one.set_epoch(2)
    assert [i for _, i in one] == list(old)[:102]


def test_augmentation_depends_on_seed_epoch_and_index_only():
    base = [(torch.zeros(1), 0)] * 10
    aug = SeededAugmentation(base, lambda x: x + torch.rand(1), seed=7)
    torch.manual_seed(123)
    first = aug[(2, 5)][0]
    torch.manual_seed(999)  # the global RNG state must not matter
    assert torch.equal(aug[(2, 5)][0], first)
    assert not torch.equal(aug[(3, 5)][0], first)
    assert not torch.equal(aug[(2, 6)][0], first)


def test_lr_schedule_warms_up_then_decays_to_zero():
    cfg = train_config(epochs=4, warmup_epochs=1)
    f = lr_lambda(steps_per_epoch=10, cfg=cfg)
    assert f(0) == 0.0 and f(5) == 0.5 and f(9) == 0.9  # from warmup_start_factor (0)
    assert f(10) == 1.0 and 0 < f(25) < 1.0
    assert abs(f(40)) < 1e-12


def test_fingerprint_ignores_logging_and_worker_count_but_not_lr():
    base = train_config(lr=0.1)
    assert train_config(lr=0.1, workers=8, log_interval=1).fingerprint() == base.fingerprint()
    assert train_config(lr=0.2).fingerprint() != base.fingerprint()


def test_augmentation_knobs_enter_the_fingerprint_except_at_their_defaults():
    """At the defaults the key is the one from before the knobs existed (checkpoints resume);
    the workflow passes the schema's spelling of the defaults."""
    base = train_config().fingerprint()
    schema_defaults = {"crop_scale": [0.08, 1.0], "crop_ratio": [0.75, 1.3333333333333333]}
    assert train_config(**{**schema_defaults, "hflip": 0.5}).fingerprint() == base
    changed = [{"crop_scale": [0.35, 1.0]}, {"crop_ratio": [1.0, 1.0]}, {"hflip": 0.0}]
    keys = {train_config(**c).fingerprint() for c in changed}
    assert len(keys) == 3 and base not in keys


def test_newest_valid_checkpoint_wins_and_torn_ones_are_ignored(tmp_path, capsys):
    save_checkpoint(tmp_path, {"epoch": 1, "step_in_epoch": 0, "x": 1}, keep=5)
    save_checkpoint(tmp_path, {"epoch": 2, "step_in_epoch": 0, "x": 2}, keep=5)
    (tmp_path / "checkpoint-e0003-s0000000.pt").write_bytes(b"torn write")
    state = load_latest_checkpoint(tmp_path)
    assert state["x"] == 2
    assert "ignoring unreadable checkpoint" in capsys.readouterr().err


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    for epoch in range(5):
        save_checkpoint(tmp_path, {"epoch": epoch, "step_in_epoch": 0}, keep=2)
    names = sorted(p.name for p in tmp_path.glob("checkpoint-*.pt"))
    assert names == ["checkpoint-e0003-s0000000.pt", "checkpoint-e0004-s0000000.pt"]
    assert not list(tmp_path.glob(".*tmp*")), "temporary files left behind"


def test_auto_loader_workers_follow_the_tasks_cpus(monkeypatch):
    from imagenet_ddp.jobs.distributed import DistInfo, resolve_geometry

    info, cpu = DistInfo(0, 1, 0, 1, "h"), torch.device("cpu")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert resolve_geometry(train_config(), info, cpu).workers == 7
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    assert resolve_geometry(train_config(), info, cpu).workers == 3
    assert resolve_geometry(train_config(cpus_per_task=1), info, cpu).workers == 0
    assert resolve_geometry(train_config(workers=2), info, cpu).workers == 2


def test_geometry_is_checked_against_the_ranks_that_started():
    from imagenet_ddp.jobs.distributed import DistInfo, resolve_geometry

    cfg = train_config(nodes=2, tasks_per_node=4, cpus_per_task=8, gpus_per_node=4)
    geometry = resolve_geometry(cfg, DistInfo(0, 8, 0, 4, "h"), torch.device("cpu"))
    assert geometry.world_size == 8 and geometry.tag == "n2x4-c8-g4-w7"
    with pytest.raises(RuntimeError, match="2 node.* x 4 task.*but 4 ranks started"):
        resolve_geometry(cfg, DistInfo(0, 4, 0, 4, "h"), torch.device("cpu"))


def test_checkpoints_are_keyed_by_settings_and_global_batch_not_rank_count(tmp_path):
    from imagenet_ddp.settings.geometry import Geometry
    from imagenet_ddp.training.checkpoint import checkpoint_dir, checkpoint_tag, other_geometries

    fingerprint = train_config(lr=0.1).fingerprint()
    # Geometry and bookkeeping do not change the settings' hash; a weight-changing key does.
    assert train_config(lr=0.1, nodes=4, workers=3, log_interval=1).fingerprint() == fingerprint
    assert train_config(lr=0.2).fingerprint() != fingerprint
    # The tag: the global batch (batch_size x ranks x accumulation), the order's version and
    # CPU or GPU; not the rank count, nor the loader's CPUs and workers (the same stream).
    cfg, doubled = train_config(batch_size=4), train_config(batch_size=4, accumulation=2)
    two_ranks, one_rank = Geometry(2, 1, 2, 0, 1), Geometry(1, 1, 2, 0, 1)
    assert checkpoint_tag(cfg, two_ranks) == checkpoint_tag(doubled, one_rank) == "b8-o2-cpu"
    assert checkpoint_tag(cfg, one_rank) == "b4-o2-cpu"
    assert checkpoint_tag(doubled, Geometry(1, 1, 4, 0, 3)) == "b8-o2-cpu"
    assert checkpoint_tag(doubled, Geometry(1, 1, 4, 8, 3)) == "b8-o2-gpu"  # device: auto
    assert checkpoint_tag(train_config(batch_size=8, device="cpu"), Geometry(1, 1, 4, 8)) == (
        "b8-o2-cpu"
    )
    # sync_bn's batch statistics span the ranks of a micro-step: keyed by the rank count too.
    synced = train_config(batch_size=4, sync_bn=True)
    assert checkpoint_tag(synced, two_ranks) == "b8-o2-cpu-r2"
    one = checkpoint_dir(tmp_path, fingerprint, "n1x1-c2-g0-w1")  # an earlier version's name
    two = checkpoint_dir(tmp_path, fingerprint, "b8-o2-cpu")
    assert one != two
    save_checkpoint(one, {"epoch": 3, "step_in_epoch": 0}, keep=2)
    assert other_geometries(tmp_path, fingerprint, "b8-o2-cpu") == [one]
    assert other_geometries(tmp_path, fingerprint, "n1x1-c2-g0-w1") == []
    assert other_geometries(tmp_path, train_config(lr=0.2).fingerprint(), "b8-o2-cpu") == []


def test_a_run_resumes_checkpoints_an_earlier_version_named_by_the_loader(tmp_path):
    """Earlier versions named the directory by the loader as well (``-c16-g8-w15``): a run
    upgraded mid-training, under new loader settings too, resumes the newest checkpoint of
    any of them; another global batch, CPU/GPU or sync_bn rank count does not."""
    from imagenet_ddp.settings.geometry import Geometry
    from imagenet_ddp.training.checkpoint import agreed_checkpoint, checkpoint_dir, loader_named

    cfg, geometry = train_config(batch_size=4), Geometry(2, 1, 4, 0, 3)
    fingerprint = cfg.fingerprint()
    old = checkpoint_dir(tmp_path, fingerprint, "b8-o2-c2-g0-w1")
    older = checkpoint_dir(tmp_path, fingerprint, "b8-o2-c1-g0-w0")
    for name in ("b16-o2-c2-g0-w1", "b8-o2-c2-g8-w1", "b8-o2-c2-g0-w1-r2"):
        save_checkpoint(checkpoint_dir(tmp_path, fingerprint, name),
                        {"epoch": 9, "step_in_epoch": 0}, keep=2)  # fmt: skip
    save_checkpoint(old, {"epoch": 2, "step_in_epoch": 5}, keep=2)
    save_checkpoint(older, {"epoch": 1, "step_in_epoch": 0}, keep=2)
    found = loader_named(tmp_path, fingerprint, cfg, geometry)
    assert found == [older, old]
    mine = checkpoint_dir(tmp_path, fingerprint, "b8-o2-cpu")
    state = agreed_checkpoint(mine, found)
    assert (state["epoch"], state["step_in_epoch"], Path(state["path"]).parent) == (2, 5, old)
    save_checkpoint(mine, {"epoch": 2, "step_in_epoch": 5}, keep=2)  # the same point: its own
    assert Path(agreed_checkpoint(mine, found)["path"]).parent == mine


def test_a_resumed_epochs_counts_are_shared_out_on_another_rank_count():
    from imagenet_ddp.training.loop import carried_partial

    same = {"segments": 1, "shape": "1x2"}
    two = [
        {"loss_sum": 3.0, "correct": 2.0, "samples": 8, "seconds": 5.0, **same},
        {"loss_sum": 5.0, "correct": 4.0, "samples": 8, "seconds": 6.0, **same},
    ]
    assert carried_partial(two, 1, 2) == two[1]
    assert carried_partial(None, 0, 1) is None
    one = carried_partial(two, 0, 1)
    assert one == {"loss_sum": 8.0, "correct": 6.0, "samples": 16, "seconds": 6.0,
                   "segments": 1, "shape": "1x2"}  # fmt: skip
    four = [carried_partial(two, rank, 4) for rank in range(4)]
    assert sum(p["samples"] for p in four) == 16 and sum(p["loss_sum"] for p in four) == 8.0


def test_steady_state_window_leaves_out_the_warmup_steps():
    from imagenet_ddp.training.metrics import EpochMeter

    meter = EpochMeter(torch.device("cpu"), warmup_steps=3)
    for _ in range(10):
        logits = torch.tensor([[2.0, 0.0]] * 4)
        meter.update(torch.tensor(0.5), logits, torch.tensor([0, 0, 1, 1]))
    record = meter.reduce()
    assert record["images"] == 40 and record["steady_images"] == 28  # steps 4..10
    assert record["train_loss"] == 0.5 and record["train_top1"] == 0.5
    assert record["steady_images_per_s"] > 0 and record["steady_seconds"] > 0
    short = EpochMeter(torch.device("cpu"), warmup_steps=3)
    for _ in range(3):
        short.update(torch.tensor(0.5), torch.tensor([[2.0, 0.0]]), torch.tensor([0]))
    assert short.reduce()["steady_images_per_s"] is None  # no step after the warm-up


def test_the_progress_line_and_the_monitor_read_one_interval_since_the_last():
    """EpochMeter.interval: the same (loss, img/s) for each reader at a step; the rate counts
    the images since the previous interval, not since the epoch's start."""
    from imagenet_ddp.training.metrics import EpochMeter

    meter = EpochMeter(torch.device("cpu"), warmup_steps=0)
    batch = (torch.tensor(0.5), torch.tensor([[2.0, 0.0]] * 4), torch.tensor([0, 0, 1, 1]))
    for _ in range(8):
        meter.update(*batch)
    first = meter.interval()
    assert meter.interval() == first and first[0] == 0.5  # the monitor after the progress line
    time.sleep(0.1)
    meter.update(*batch)
    assert meter.interval()[1] <= 4 / 0.1  # 4 images in >= 0.1 s (36 since the start)


def test_a_resumed_epochs_counters_continue_exactly():
    from imagenet_ddp.training.metrics import EpochMeter

    meter = EpochMeter(torch.device("cpu"), warmup_steps=0)
    meter.update(torch.tensor(0.3), torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    resumed = EpochMeter(torch.device("cpu"), warmup_steps=0, partial=meter.partial())
    resumed.update(torch.tensor(0.7), torch.tensor([[1.0, 0.0]]), torch.tensor([1]))
    record = resumed.reduce()
    assert record["images"] == 2 and record["segments"] == 2
    assert record["train_loss"] == pytest.approx(0.5)
    assert record["train_top1"] == 0.5


def test_gpus_asked_but_cuda_unusable_is_an_error_naming_the_host(monkeypatch):
    import socket

    from imagenet_ddp.jobs.distributed import select_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=f"host {socket.gethostname()}: gpus_per_node is 4"):
        select_device("auto", 0, gpus_per_node=4)
    assert select_device("auto", 0, gpus_per_node=0).type == "cpu"
    assert select_device("cpu", 0, gpus_per_node=4).type == "cpu"


def _buffers_after_broadcast(rank: int, init_file: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
        model[1].running_mean.fill_(rank + 1.0)  # each rank's own last-batch statistics
        model[1].num_batches_tracked.fill_(10 * (rank + 1))
        D.broadcast_buffers(model)
        results[rank] = (model[1].running_mean.tolist(), model[1].num_batches_tracked.item())
    finally:
        dist.destroy_process_group()


def test_every_rank_evaluates_rank_0s_batchnorm_statistics(tmp_path):
    """In-training evaluation is sharded over ranks: each must use the buffers that are saved."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_buffers_after_broadcast, args=(str(tmp_path / "init"), results), nprocs=2)
    assert results[0] == results[1] == ([1.0] * 4, 10)


def test_model_file_round_trips_and_refuses_a_newer_format(tmp_path):
    import torchvision

    from imagenet_ddp.training.model import (
        MODEL_FORMAT_VERSION,
        build_model,
        load_model,
        read_model_file,
        save_model,
    )

    torch.manual_seed(0)
    model = build_model("resnet18", 3)
    path = tmp_path / "model.pt"
    save_model(path, model, arch="resnet18", num_classes=3, config={"channels_last": False})
    loaded, state = load_model(path)
    assert state["format_version"] == MODEL_FORMAT_VERSION
    assert all(
        torch.equal(a, b)
        for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True)
    )
    # What docs/results.md "Loading a trained model" tells users to do, without this package.
    plain = torchvision.models.get_model(state["arch"], num_classes=state["num_classes"])
    plain.load_state_dict(torch.load(path, weights_only=False)["model"])
    with pytest.raises(ValueError, match="no 'ema' weights"):
        load_model(path, weights="ema")
    torch.save({**state, "format_version": MODEL_FORMAT_VERSION + 1}, tmp_path / "new.pt")
    with pytest.raises(ValueError, match="newer than this version"):
        read_model_file(tmp_path / "new.pt")


def guard_rule(**given):
    from imagenet_ddp.training.guard import GuardRule, GuardSettings

    settings = {"enabled": True, "loss_limit": 2 * 2.3, "window": 3, "fp16_skips": 4,
                "warmup_steps": 5, "scaler": False, **given}  # fmt: skip
    return GuardRule(GuardSettings(**settings))


def decisions(rule, losses, norms=None):
    """The step (0-based) at which ``rule`` stops, its reason and whether every rank agrees."""
    for step, loss in enumerate(losses):
        reason, agreed = rule.step(step, loss, 1.0 if norms is None else norms[step])
        if reason is not None:
            return step, reason, agreed
    return None


def test_the_guard_stops_a_non_finite_step_at_once_every_rank_agreeing_from_the_gradient():
    nan, inf = float("nan"), float("inf")
    # A non-finite all-reduced gradient: the same on every rank, agreed without a collective.
    assert decisions(guard_rule(), [2.0, 2.0, 2.0], [1.0, nan, 1.0])[:3:2] == (1, True)
    assert decisions(guard_rule(), [2.0, inf], [1.0, 1.0])[::2] == (1, False)  # this rank only
    assert "gradient norm nan" in decisions(guard_rule(), [nan], [nan])[1]  # inside the warm-up
    assert decisions(guard_rule(enabled=False), [nan] * 10, [nan] * 10) is None


def test_a_loss_spike_that_recovers_or_lies_in_the_warm_up_does_not_stop_the_run():
    high, low = 9.0, 1.0  # above and below 2 x ln(10)
    # The warm-up (steps 0-4) may spike for as long as it likes; after it, a window of 3.
    assert decisions(guard_rule(), [high] * 5 + [high, high, low] + [low] * 5) is None
    assert decisions(guard_rule(), [high] * 5 + [high, low, high, high, low]) is None
    step, reason, agreed = decisions(guard_rule(), [low] * 5 + [high] * 3)
    assert step == 7 and "for 3 steps in a row after the warm-up" in reason and not agreed


def test_fp16_overflow_skips_are_divergence_only_when_they_repeat():
    nan = float("nan")
    rule = guard_rule(scaler=True)  # GradScaler's calibration skips a few steps: not divergence
    assert decisions(rule, [2.0] * 8, [nan, nan, nan, 1.0, nan, nan, nan, 1.0]) is None
    step, reason, agreed = decisions(guard_rule(scaler=True), [2.0] * 6, [1.0] + [nan] * 5)
    assert step == 4 and reason.startswith("4 fp16 steps in a row skipped") and agreed


def test_the_guard_reads_a_step_one_step_late_and_at_once_before_a_save():
    from imagenet_ddp.training.guard import Guard, GuardSettings

    settings = GuardSettings(True, 4.6, 3, 4, 0, False)
    guard = Guard(settings, torch.device("cpu"), rank=1)
    step = [(torch.tensor(2.0), None, None)]
    assert guard.after_step(step, torch.tensor(1.0), (0, 0, 1, 0.1)) is None
    # step 2's gradient is NaN: judged when step 3 is queued (no host sync per step) ...
    assert guard.after_step(step, torch.tensor(float("nan")), (1, 0, 2, 0.1)) is None
    found = guard.after_step(step, torch.tensor(1.0), (2, 0, 3, 0.1))
    assert (found.epoch, found.step, found.rank, found.lr) == (0, 2, 1, 0.1)
    assert "lower lr" in found.line("r") and "diverged at epoch 0 step 2" in found.line("r")
    # ... or at once where the loop synchronizes anyway (a checkpoint next)
    guard = Guard(settings, torch.device("cpu"), rank=0)
    guard.after_step([(torch.tensor(float("inf")), None, None)], None, (0, 0, 1, 0.1))
    found = guard.agree()  # reads the last step at once, then agrees (one process: its own)
    assert guard.suspect.reason.startswith("loss inf") and found == guard.suspect
    assert guard.suspect.record()["loss"] == "inf"  # JSON-safe


def test_warm_up_in_steps_and_sqrt_lr_scaling():
    from imagenet_ddp.optimizers import scaled_lr
    from tests.workflow_helpers import run_settings

    f = lr_lambda(steps_per_epoch=10, cfg=train_config(epochs=4, warmup_steps=4))
    assert f(2) == 0.5 and f(4) == 1.0
    run = run_settings(lr=0.1, batch_size=256, tasks_per_node=4, lr_scaling="sqrt")
    assert scaled_lr(run, 1024) == pytest.approx(0.2)  # sqrt(1024 / 256) = 2


class _Payload:
    """Unpickling it runs a command (what a planted checkpoint in a shared results dir does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_with_a_pickle_payload_is_refused_without_running_it(tmp_path):
    from imagenet_ddp.training.checkpoint import UnsafeCheckpoint, checkpoint_name, load_checkpoint
    from imagenet_ddp.training.model import read_model_file

    marker = tmp_path / "ran"
    path = tmp_path / checkpoint_name(1, 0)
    torch.save({"model": {}, "epoch": 1, "x": _Payload(marker)}, path)
    for load in (load_checkpoint, read_model_file):
        with pytest.raises(UnsafeCheckpoint, match="refused: it needs arbitrary unpickling"):
            load(path)
    # A resume refuses it too, rather than skipping to an older checkpoint.
    with pytest.raises(UnsafeCheckpoint):
        load_latest_checkpoint(tmp_path)
    assert not marker.exists()


def test_a_checkpoint_of_an_earlier_version_is_refused_until_converted(tmp_path):
    """Before: numpy's RNG state as an ndarray (and numpy scalars) in the pickle."""
    import random

    import numpy as np

    from imagenet_ddp import cli
    from imagenet_ddp.training.checkpoint import (
        UnsafeCheckpoint,
        checkpoint_name,
        load_checkpoint,
        restore_rng_state,
        rng_state,
    )

    np.random.seed(5)
    old_rng = {**rng_state(torch.device("cpu")), "numpy": np.random.get_state()}
    expected = np.random.rand(3)
    path = tmp_path / checkpoint_name(2, 0)
    torch.save({"epoch": 2, "history": [{"loss": np.float64(1.5)}], "rng": [old_rng]}, path)
    with pytest.raises(UnsafeCheckpoint, match="imagenet-ddp convert-checkpoint"):
        load_checkpoint(path)
    assert cli.main(["convert-checkpoint", str(path)]) == 0
    state = load_checkpoint(path)
    assert state["history"] == [{"loss": 1.5}]
    random.seed(0)
    restore_rng_state(state["rng"][0], torch.device("cpu"))  # the same stream as before
    assert np.array_equal(np.random.rand(3), expected)


def test_the_guards_gradient_norm_needs_no_torch_api_newer_than_the_packages_floor(monkeypatch):
    """pyproject allows torch 2.4 (an NGC 24.x container): the guard's norm of a run without
    grad_clip_norm must not call 2.6's get_total_norm (every step raised there)."""
    import math
    import re
    from pathlib import Path

    from imagenet_ddp.training.guard import gradient_norm

    floor = re.search(r'"torch>=([\d.]+)"', Path("pyproject.toml").read_text()).group(1)
    assert floor == "2.4", "a new floor: check the APIs this test removes against it"
    for name in ("get_total_norm", "clip_grads_with_norm_"):  # new in torch 2.6
        monkeypatch.delattr(torch.nn.utils, name, raising=False)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    model[1].to(torch.bfloat16)  # mixed dtypes, as under a bf16 model's fp32 norms
    model[0].weight.grad = torch.tensor([[1.0, -7.5, 2.0], [0.0, 3.0, 1.0]])
    model[1].weight.grad = torch.tensor([[4.0, -2.0]], dtype=torch.bfloat16)
    assert gradient_norm(model).item() == 7.5
    model[1].weight.grad[0, 1] = math.inf
    assert not math.isfinite(gradient_norm(model).item())
    model[1].weight.grad[0, 1] = -math.inf
    assert not math.isfinite(gradient_norm(model).item())
    model[1].weight.grad[0, 1] = 0.0
    model[0].weight.grad[1, 1] = math.nan  # NaN beside larger finite elements: still seen
    assert math.isnan(gradient_norm(model).item())
    assert gradient_norm(torch.nn.Linear(2, 2)).item() == 0.0  # no gradients yet


def test_a_cpu_rank_runs_its_tasks_cpus_less_its_loader_workers_as_threads():
    """2 ranks with 1 worker each on a 2-CPU task: 1 intra-op thread, not the exported 2
    (oversubscribed: benchmarks/README.md "Train step"); never raised above the environment."""
    from imagenet_ddp.settings.geometry import Geometry
    from imagenet_ddp.training.worker import rank_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert rank_threads(Geometry(1, 2, 2, workers=1)) == 1
        assert rank_threads(Geometry(1, 2, 8, workers=0)) == 1  # kept: not raised
        torch.set_num_threads(2)
        assert rank_threads(Geometry(1, 2, 2, workers=0)) == 2
        assert rank_threads(Geometry(1, 2, 2, workers=5)) == 1  # at least one
    finally:
        torch.set_num_threads(before)
