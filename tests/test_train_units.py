"""Unit tests of the training worker's building blocks (no data layer, no process group)."""

from __future__ import annotations

import torch

from imagenet_ddp.train import (
    EpochSampler,
    SeededAugmentation,
    TrainConfig,
    load_latest_checkpoint,
    lr_lambda,
    save_checkpoint,
)


def test_epoch_sampler_skips_exactly_the_steps_already_done():
    full = EpochSampler(100, world_size=2, rank=1, seed=3)
    full.set_epoch(4)
    resumed = EpochSampler(100, world_size=2, rank=1, seed=3)
    resumed.set_epoch(4, skip_samples=20)
    assert list(resumed) == list(full)[20:]
    assert len(resumed) == len(full) - 20
    assert all(epoch == 4 for epoch, _ in full)


def test_ranks_see_disjoint_samples_and_epochs_reshuffle():
    a, b = EpochSampler(64, 2, 0, seed=0), EpochSampler(64, 2, 1, seed=0)
    a.set_epoch(0)
    b.set_epoch(0)
    assert not {i for _, i in a} & {i for _, i in b}
    first = [i for _, i in a]
    a.set_epoch(1)
    assert [i for _, i in a] != first


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
    cfg = TrainConfig(epochs=4, warmup_epochs=1)
    f = lr_lambda(steps_per_epoch=10, cfg=cfg)
    assert f(0) == 0.1 and f(9) == 1.0
    assert f(10) == 1.0 and 0 < f(25) < 1.0
    assert abs(f(40)) < 1e-12


def test_fingerprint_ignores_logging_and_worker_count_but_not_lr():
    base = TrainConfig(lr=0.1)
    assert TrainConfig(lr=0.1, workers=8, log_interval=1).fingerprint() == base.fingerprint()
    assert TrainConfig(lr=0.2).fingerprint() != base.fingerprint()


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
    from imagenet_ddp.train import loader_workers

    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert loader_workers("auto") == 7
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    assert loader_workers("auto") == 3
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert loader_workers("auto") == 0
    assert loader_workers(2) == 2
