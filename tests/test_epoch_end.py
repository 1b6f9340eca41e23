"""An epoch's end: which epochs evaluate the holdout, evaluation that leaves the training's random
streams alone, checkpoints written in the background, and one resume point for every rank.

Fast units on CPU; the bitwise resume with skipped evaluations is in tests/test_resume.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from imagenet_ddp.training.accuracy import evaluate_dataset, evaluate_loader, shard_loader
from imagenet_ddp.training.checkpoint import (
    CheckpointWriteError,
    CheckpointWriter,
    ResumeDisagreement,
    agreed_checkpoint,
    checkpoint_name,
    cpu_copy,
    load_latest_checkpoint,
    save_checkpoint,
)
from tests.workflow_helpers import train_config

CPU = torch.device("cpu")


def evaluated_epochs(**settings) -> list[int]:
    cfg = train_config(**settings)
    return [epoch for epoch in range(cfg.epochs) if cfg.evaluates(epoch)]


def test_eval_interval_chooses_the_epochs_and_always_the_last():
    assert evaluated_epochs(epochs=7, eval_interval=3) == [2, 5, 6]
    assert evaluated_epochs(epochs=6, eval_interval=3) == [2, 5]
    assert evaluated_epochs(epochs=3, eval_interval=1) == [0, 1, 2]
    # auto: about 20 evaluations; short runs evaluate every epoch
    assert evaluated_epochs(epochs=3, eval_interval="auto") == [0, 1, 2]
    assert evaluated_epochs(epochs=600, eval_interval="auto") == list(range(29, 600, 30))
    assert len(evaluated_epochs(epochs=90, eval_interval="auto")) == 18


def test_eval_interval_does_not_key_the_checkpoints():
    """Which epochs are evaluated does not change the weights: a changed eval_interval
    resumes the run's checkpoints (tests/test_resume.py proves the weights equal)."""
    assert (
        train_config(eval_interval=1).fingerprint() == train_config(eval_interval=7).fingerprint()
    )


def tiny_set(n: int = 10, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.arange(n) % classes)


@pytest.mark.parametrize("workers", [0, 1])
def test_evaluation_draws_from_no_shared_random_generator(workers):
    """A DataLoader's iterator draws its workers' base seed from torch's global generator
    unless it has its own: evaluating would then shift every random number drawn after it
    (dropout, anything unseeded), and eval_interval would change the weights."""
    model = torch.nn.Linear(4, 3)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    result = evaluate_dataset(model, tiny_set(), num_classes=3, device=CPU, batch_size=4,
                              workers=workers)  # fmt: skip
    assert result["samples"] == 10
    assert torch.equal(torch.get_rng_state(), before)


def test_the_holdout_loader_is_made_once_and_its_workers_serve_every_evaluation():
    model = torch.nn.Linear(4, 3)
    loader = shard_loader(tiny_set(), device=CPU, batch_size=4, workers=1, persistent=True)
    try:
        first = evaluate_loader(model, loader, num_classes=3, device=CPU)
        workers = [w.pid for w in loader._iterator._workers]
        second = evaluate_loader(model, loader, num_classes=3, device=CPU)
        assert [w.pid for w in loader._iterator._workers] == workers  # not started again
        assert first == second
    finally:
        loader._iterator._shutdown_workers()


def test_the_checkpoint_copy_shares_nothing_with_the_live_state():
    live = {"w": torch.zeros(3), "groups": [{"lr": 0.1}], "rng": (torch.ones(2), 5)}
    copy = cpu_copy(live)
    live["w"].add_(1.0)
    live["groups"][0]["lr"] = 0.2
    assert copy["w"].tolist() == [0.0] * 3 and copy["groups"][0]["lr"] == 0.1
    assert isinstance(copy["rng"], tuple) and copy["rng"][1] == 5


def test_a_background_write_is_complete_after_wait_and_a_failed_one_raises_there(tmp_path):
    writer = CheckpointWriter()
    path = writer.submit(tmp_path, {"epoch": 1, "step_in_epoch": 0, "x": 1}, keep=2)
    assert path == tmp_path / checkpoint_name(1, 0)
    writer.wait()
    assert load_latest_checkpoint(tmp_path)["x"] == 1
    assert writer.path == path and writer.write_seconds >= 0
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the checkpoint directory should be")
    writer.submit(blocked, {"epoch": 2, "step_in_epoch": 0}, keep=2)  # returns at once
    with pytest.raises(CheckpointWriteError, match="not written"):
        writer.wait()
    writer.wait()  # reported once; the writer is usable again


# ------------------------------------------------------------------ one resume point, 2 ranks


def _resume_point(rank: int, init_file: str, dirs: list[str], results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        state = agreed_checkpoint(Path(dirs[rank]))
        results[rank] = None if state is None else os.path.basename(state["path"])
    except ResumeDisagreement as error:
        results[rank] = f"error: {error}"
    finally:
        dist.destroy_process_group()


def resume_points(tmp_path, views: list[dict[int, bytes | None]]) -> list:
    """Each rank's resume point when rank r's directory holds ``views[r]`` (epoch -> None:
    a valid checkpoint of that epoch; bytes: a torn file)."""
    import torch.multiprocessing as mp

    dirs = []
    for rank, view in enumerate(views):
        directory = tmp_path / f"rank{rank}"
        directory.mkdir()
        for epoch, torn in view.items():
            save_checkpoint(directory, {"epoch": epoch, "step_in_epoch": 0}, keep=10)
            if torn is not None:
                (directory / checkpoint_name(epoch, 0)).write_bytes(torn)
        dirs.append(str(directory))
    results = mp.Manager().dict()
    mp.spawn(_resume_point, args=(str(tmp_path / "init"), dirs, results), nprocs=2)
    return [results[0], results[1]]


E1, E2, E3 = (checkpoint_name(e, 0) for e in (1, 2, 3))


def test_every_rank_resumes_from_rank_0s_choice_when_one_sees_a_newer_file(tmp_path):
    # Alone, rank 1 would resume from e3, which rank 0 does not see (a stale listing there).
    assert chosen_alone(tmp_path, [1, 2, 3]) == E3
    assert resume_points(tmp_path, [{1: None, 2: None}, {1: None, 2: None, 3: None}]) == [E2, E2]


def test_rank_0s_torn_newest_file_makes_every_rank_resume_from_the_one_before(tmp_path):
    assert resume_points(tmp_path, [{1: None, 2: b"torn"}, {1: None, 2: None}]) == [E1, E1]


def test_a_rank_that_cannot_read_rank_0s_choice_fails_every_rank_with_one_line(tmp_path):
    results = resume_points(tmp_path, [{1: None, 2: None}, {1: None}])
    for result in results:  # both ranks raise: neither waits for the other at a collective
        assert result.startswith("error: rank 1 (of 1 failing) cannot read ")
        assert E2 in result and "\n" not in result


def test_no_checkpoint_anywhere_is_a_fresh_start_on_every_rank(tmp_path):
    assert resume_points(tmp_path, [{}, {}]) == [None, None]


def chosen_alone(tmp_path, epochs: list[int]) -> str:
    """What a rank seeing checkpoints of ``epochs`` chooses by itself (each rank did so)."""
    directory = tmp_path / "alone"
    directory.mkdir()
    for epoch in epochs:
        save_checkpoint(directory, {"epoch": epoch, "step_in_epoch": 0}, keep=10)
    return os.path.basename(load_latest_checkpoint(directory)["path"])


# ------------------------------------------------------------------ the preflight's projection


def test_the_projection_counts_evaluations_passes_and_a_write_that_outlasts_an_epoch():
    from imagenet_ddp.settings.epoch_end import projection

    base = dict(epochs=10, eval_interval=5, holdout_images=1600, world=4, eval_images_per_s=100.0,
                epoch_seconds=20.0, checkpoint_hold_seconds=0.5)  # fmt: skip
    p = projection(ema=True, checkpoint_write_seconds=5.0, **base)
    assert p["evaluations"] == 2 and p["passes_per_evaluation"] == 2
    assert p["seconds_per_evaluation"] == pytest.approx(2 * 1600 / 4 / 100)  # 8 s
    assert p["epoch_end_seconds"] == pytest.approx(2 * 8 + 10 * 0.5)
    assert p["epoch_end_share"] == pytest.approx(21 / 200)
    slow = projection(ema=False, checkpoint_write_seconds=26.0, **base)  # holds the next save
    assert slow["checkpoint_seconds_per_epoch"] == pytest.approx(0.5 + 6.0)
    assert slow["eval_seconds"] == pytest.approx(2 * 4)


def test_the_preflight_projects_the_epoch_ends_from_what_its_ranks_measured():
    from imagenet_ddp.preflight.report import build_report, collective_figures, table
    from tests.test_preflight import RUN, STAGING, ranks

    measured = ranks(
        r0={"eval_images_per_s": 400.0, "checkpoint_hold_seconds": 0.2,
            "checkpoint_write_seconds": 1.0},
        r1={"eval_images_per_s": 200.0}, r2={"eval_images_per_s": 400.0},
        r3={"eval_images_per_s": 400.0},
    )  # fmt: skip
    run = {**RUN, "eval_interval": 10, "ema_decay": 0.9}
    out = build_report(
        run, measured, collective_figures(measured, 1600), STAGING,
        {"train": 128_000, "holdout": 12_800},
        {"train_runtime_minutes": None, "max_allocations": 10},
    )  # fmt: skip
    p, end = out["projection"], out["projection"]["epoch_end"]
    assert end["basis"].startswith("measured")
    assert end["evaluations"] == 9  # of 90 epochs, every 10th
    assert end["seconds_per_evaluation"] == pytest.approx(2 * 12_800 / 4 / 200)  # slowest rank
    assert p["total_seconds"] == pytest.approx(10 + 90 * 320 + 9 * 32 + 90 * 0.2)
    assert "9 holdout evaluation(s) x 32.0 s (2 pass(es))" in table(out)
    assert "(measured)" in table(out)
