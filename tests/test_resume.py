"""Preemption safety: training interrupted mid-epoch resumes to bitwise-identical weights.

Two gloo ranks under torchrun, deterministic mode on CPU, with the GPU recipe's bf16 autocast,
channels_last and EMA (every rank's state checked on its device after setup and first step).
The interruption uses the worker's ``--stop-after-steps`` (the same code path as
SIGTERM/SIGUSR1: all ranks agree to stop, rank 0 writes a checkpoint, exit 75); one test also
sends a real SIGTERM.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from imagenet_ddp.jobs.signals import EXIT_REQUEUE
from imagenet_ddp.jobs.spec import to_dict, write_spec
from imagenet_ddp.training.model import read_model_file
from tests.conftest import DEMO_KWARGS
from tests.workflow_helpers import make_job, output_within, run_settings

CONFIG = {
    "run": "resume",
    "model": "resnet18",
    "epochs": 2,
    "batch_size": 4,
    "lr": 0.05,
    "crop_size": 16,
    "eval_resize": 20,
    "workers": 0,
    "seed": 3,
    "deterministic": True,
    "log_interval": 1,
    # The GPU path's numerics, run by the CPU (issue 18): bf16 autocast, channels_last.
    "precision": "bf16",
    "channels_last": True,
    # Every recipe component that draws random numbers or keeps state is on (sync_bn needs
    # GPUs): a resumed run must still be bitwise identical.
    "auto_augment": "trivialaugment",
    "random_erasing": 0.5,
    "mixup_alpha": 0.2,
    "cutmix_alpha": 1.0,
    "label_smoothing": 0.1,
    "ema_decay": 0.9,
    "ema_steps": 2,
    "warmup_epochs": 0.5,
    "grad_clip_norm": 1.0,
    "norm_weight_decay": 0.0,
    "zero_init_residual": True,
    "progressive_min_crop": 8,
    "progressive_start_epoch": 0,
    "progressive_end_epoch": 1,
    "progressive_multiple": 8,
    "crop_scale": [0.25, 1.0],
    "crop_ratio": [0.5, 2.0],
    "hflip": 0.3,
}


@pytest.fixture(scope="module")
def split_dir(demo_split) -> Path:
    return demo_split


def torchrun(
    prepared: Path,
    split: Path,
    out: Path,
    ckpt: Path,
    *extra: str,
    config: dict | None = None,
    popen: bool = False,
    nproc: int = 2,
    threads: int = 1,
):
    spec = make_job(
        "train", run_settings(**(config or CONFIG)), split_dir=split, run_dir=out,
        checkpoint_root=ckpt, prepared_train=prepared,
    )  # fmt: skip
    spec_path = write_spec(out.parent / f"{out.name}-job_spec.json", spec)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "imagenet_ddp.training.worker",
        "--spec",
        str(spec_path),
        "--train-data",
        str(prepared),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if popen:
        return subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # output_within can signal the whole group on a hang
        )
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def weights(out: Path) -> dict[str, torch.Tensor]:
    """The trained weights and their EMA (keys prefixed ``ema.``)."""
    state = read_model_file(out / "model.pt")
    return {**state["model"], **{f"ema.{k}": v for k, v in state["ema"].items()}}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


@pytest.fixture(scope="module")
def uninterrupted(prepared_demo, split_dir, module_tmp) -> Path:
    root = module_tmp / "uninterrupted"
    root.mkdir()
    result = torchrun(prepared_demo["train"], split_dir, root / "out", root / "ckpt")
    assert result.returncode == 0, result.stdout + result.stderr
    return root / "out"


def test_resume_after_two_interruptions_is_bitwise_identical(
    prepared_demo, split_dir, uninterrupted, tmp_path
):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = torchrun(prepared_demo["train"], split_dir, out, ckpt, "--stop-after-steps", "2")
    assert first.returncode != 0, "an interrupted run must not look successful"
    assert "interrupted at epoch 0 step 2" in first.stdout + first.stderr
    assert not (out / "model.pt").exists()
    # Second attempt resumes mid-epoch 0 and is interrupted again in epoch 1.
    second = torchrun(prepared_demo["train"], split_dir, out, ckpt, "--stop-after-steps", "4")
    assert "resuming from" in second.stdout + second.stderr
    assert "interrupted at epoch 1" in second.stdout + second.stderr
    third = torchrun(prepared_demo["train"], split_dir, out, ckpt)
    assert third.returncode == 0, third.stdout + third.stderr
    assert_bitwise_equal(weights(out), weights(uninterrupted))
    resumed = json.loads((out / "train_metrics.json").read_text())
    reference = json.loads((uninterrupted / "train_metrics.json").read_text())
    for a, b in zip(resumed["epochs"], reference["epochs"], strict=True):
        assert a["train_loss"] == b["train_loss"]
        assert a["holdout_top1"] == b["holdout_top1"]
    assert resumed["resumed_from"]
    # TensorBoard: the three jobs' event files hold each step once, with the same running loss
    # as the uninterrupted run (rank 0 only: one writer).
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 3
    assert scalars(out, "train/loss") == scalars(uninterrupted, "train/loss")
    assert scalars(out, "epoch/holdout_top1") == scalars(uninterrupted, "epoch/holdout_top1")


def test_evaluating_only_the_last_epoch_changes_neither_the_weights_nor_a_resume(
    prepared_demo, split_dir, uninterrupted, tmp_path
):
    """eval_interval 2 of 2 epochs skips epoch 0's holdout evaluation; interrupted before it and
    resumed, the run ends bit for bit where the uninterrupted run evaluating every epoch ends."""
    out, ckpt, config = tmp_path / "out", tmp_path / "ckpt", {**CONFIG, "eval_interval": 2}
    first = torchrun(prepared_demo["train"], split_dir, out, ckpt, "--stop-after-steps", "2",
                     config=config)  # fmt: skip
    assert first.returncode != 0  # torchrun's own code; the rank's 75 is in its report
    assert "interrupted at epoch 0 step 2" in first.stdout + first.stderr
    second = torchrun(prepared_demo["train"], split_dir, out, ckpt, config=config)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "holdout top1 not evaluated" in second.stdout
    assert_bitwise_equal(weights(out), weights(uninterrupted))
    resumed = json.loads((out / "train_metrics.json").read_text())["epochs"]
    reference = json.loads((uninterrupted / "train_metrics.json").read_text())["epochs"]
    assert [e["train_loss"] for e in resumed] == [e["train_loss"] for e in reference]
    assert resumed[0]["holdout_top1"] is None and resumed[0]["holdout_ema_top1"] is None
    assert resumed[1]["holdout_top1"] == reference[1]["holdout_top1"]
    assert resumed[1]["holdout_ema_top1"] == reference[1]["holdout_ema_top1"]
    history = pd.read_csv(out / "history.csv")
    assert history["eval_seconds"].iloc[0] < history["eval_seconds"].iloc[1]
    assert (history["checkpoint_seconds"] > 0).all()
    work = history["eval_seconds"] + history["checkpoint_seconds"]
    assert np.allclose(history["epoch_end_share"], work / history["epoch_seconds"])
    # a uniform guess's loss, ln(classes): what aggregate.loss_spike judges each epoch against
    assert np.allclose(history["chance_loss"], math.log(DEMO_KWARGS["num_classes"]))


# Models beyond the torchvision presets (issue 34), each with its own options and another
# optimizer, the two timm ones under the values of timm's and DeiT's presets (issue 43) but
# their sizes: timm's ResNet under timm-resnet50-a1 (LAMB with its max_grad_norm, BCE with its
# target threshold, timm's RandAugment with magnitude noise, bicubic, timm's weight-decay
# groups, repeated augmentation, drop_path, zero_init_last), timm's ViT at a 16-pixel img_size
# under deit-small (AdamW betas/eps, random erasing, repeated augmentation, drop_path), a
# torchvision model outside the presets (MobileNetV3 dropout, SGD).
SIZES = ("crop_size", "eval_resize", "eval_crop_size", "batch_size", "epochs", "model_kwargs")


def preset_values(name: str) -> dict:
    from imagenet_ddp.settings.presets import PRESETS

    return {"recipe": name, **{k: v for k, v in PRESETS[name].items() if k not in SIZES}}


NON_PRESET_MODELS = {
    "timm-resnet": {
        **preset_values("timm-resnet50-a1"),
        "model": "timm/resnet18.a1_in1k",
        "model_kwargs": {"drop_path_rate": 0.1},
        "optimizer_kwargs": {"max_grad_norm": 2.0},
        "lr": 0.01,
    },
    "timm-vit": {
        **preset_values("deit-small"),
        "model": "timm/vit_tiny_patch16_224",
        "model_kwargs": {"img_size": 16, "patch_size": 8, "drop_path_rate": 0.1},
        "optimizer_kwargs": {"betas": [0.9, 0.95], "eps": 1.0e-6},
        "lr": 0.001,
        "zero_init_residual": False,
        "progressive_min_crop": 0,  # a ViT's img_size is fixed
    },
    "torchvision-mobilenet": {
        "model": "mobilenet_v3_small",
        "model_kwargs": {"dropout": 0.3},
        "zero_init_residual": False,
    },
}


@pytest.mark.parametrize("name", list(NON_PRESET_MODELS))
def test_timm_and_torchvision_models_beyond_the_presets_resume_bitwise(
    prepared_demo, split_dir, tmp_path, name
):
    """Each trains on 2 ranks with the recipe above (bf16, channels_last, EMA, mixup, ...),
    and stopped mid-epoch then resumed, ends bit for bit where the uninterrupted run ends;
    model.pt rebuilds through the factory with its model_kwargs; FLOPs are counted."""
    config = {**CONFIG, "epochs": 1, **NON_PRESET_MODELS[name]}
    prepared = prepared_demo["train"]
    reference = torchrun(prepared, split_dir, tmp_path / "ref", tmp_path / "ref-ckpt",
                         config=config)  # fmt: skip
    assert reference.returncode == 0, reference.stdout + reference.stderr
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = torchrun(prepared, split_dir, out, ckpt, "--stop-after-steps", "2", config=config)
    assert "interrupted at epoch 0 step 2" in first.stdout + first.stderr
    second = torchrun(prepared, split_dir, out, ckpt, config=config)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from" in second.stdout + second.stderr
    assert_bitwise_equal(weights(out), weights(tmp_path / "ref"))
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["config"]["model"] == config["model"]
    assert metrics["config"]["model_kwargs"] == config["model_kwargs"]
    assert metrics["flops_per_image"] > 0
    from imagenet_ddp.training.model import load_model

    model, state = load_model(out / "model.pt")
    model.eval()
    assert state["arch"] == config["model"]
    assert model(torch.zeros(1, 3, 16, 16)).shape == (1, state["num_classes"])


def scalars(out: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_events_and_cost_block_of_a_cpu_run(uninterrupted):
    steps = [step for step, _ in scalars(uninterrupted, "train/loss")]
    assert steps == sorted(set(steps)) and len(steps) == 2 * 4  # every step of 2 epochs x 4
    assert [s for s, _ in scalars(uninterrupted, "epoch/images_per_s")] == [4, 8]
    metrics = json.loads((uninterrupted / "train_metrics.json").read_text())
    cost = metrics["cost"]
    assert cost["gpus"] == 0 and cost["gpu_hours"] == 0 and cost["cores"] == 2
    assert 0 < cost["wall_seconds"] < 300
    assert cost["core_hours"] == pytest.approx(2 * cost["wall_seconds"] / 3600)
    assert cost["gpu_telemetry"] == {
        "available": False,
        "reason": "no GPUs in this run (gpus_per_node is 0)",
    }


def test_a_torn_newest_checkpoint_is_ignored(prepared_demo, split_dir, uninterrupted, tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    torchrun(prepared_demo["train"], split_dir, out, ckpt, "--stop-after-steps", "3")
    (fingerprint_dir,) = ckpt.iterdir()
    (fingerprint_dir / "checkpoint-e0009-s0000000.pt").write_bytes(b"\0" * 100)  # torn write
    result = torchrun(prepared_demo["train"], split_dir, out, ckpt)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ignoring unreadable checkpoint" in result.stdout + result.stderr
    assert_bitwise_equal(weights(out), weights(uninterrupted))


def test_sigterm_writes_a_checkpoint_and_exits_for_requeue(prepared_demo, split_dir, tmp_path):
    config = {**CONFIG, "epochs": 200}  # long enough to be signalled mid-training
    proc = torchrun(
        prepared_demo["train"],
        split_dir,
        tmp_path / "out",
        tmp_path / "ckpt",
        config=config,
        popen=True,
    )
    lines = []
    for line in proc.stdout:  # wait until training really runs
        lines.append(line)
        if "epoch 1 step" in line:
            break
    workers = subprocess.run(
        ["pgrep", "-f", "-P", str(proc.pid), "imagenet_ddp.training.worker"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(workers) == 2, lines
    for pid in workers:  # what SLURM does before preemption: signal every task
        os.kill(int(pid), signal.SIGTERM)
    output = output_within(proc, 180, head="".join(lines))
    assert "interrupted" in output and "checkpoint" in output, output
    checkpoints = list((tmp_path / "ckpt").rglob("checkpoint-*.pt"))
    assert checkpoints
    assert f"exitcode  : {EXIT_REQUEUE}" in output or proc.returncode != 0


def test_synthetic_mode_trains_on_a_fixed_batch(prepared_demo, split_dir, tmp_path):
    """The model-only throughput mode (the GPU path's benchmark mode) runs end to end on CPU."""
    config = {**CONFIG, "epochs": 1, "synthetic": True}
    result = torchrun(
        prepared_demo["train"], split_dir, tmp_path / "out", tmp_path / "ckpt", config=config
    )
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = json.loads((tmp_path / "out" / "train_metrics.json").read_text())
    assert metrics["config"]["synthetic"] is True and metrics["epochs"][0]["images_per_s"] > 0


def launch(
    prepared: Path, split: Path, work: Path, config: dict, *, tasks: int, cpus: int, attempt=1
):
    """The real launcher (`imagenet-ddp train --job`, launcher local), in its own process
    group; ``attempt``: Snakemake's attempt number of this job."""
    geometry = {"nodes": 1, "tasks_per_node": tasks, "cpus_per_task": cpus}
    job = make_job(
        "train", run_settings(**config, **geometry), prepared_train=prepared, split_dir=split,
        run_dir=work / "run", checkpoint_root=work / "ckpt", scratch_dir=str(work / "scratch"),
        attempt=attempt,
    )  # fmt: skip
    argv = [sys.executable, "-m", "imagenet_ddp.cli", "train", "--job", json.dumps(to_dict(job))]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def lines_until(proc: subprocess.Popen, text: str) -> list[str]:
    """The output lines of ``proc`` up to the first that contains ``text`` (or its end)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            break
    return lines


@pytest.fixture(scope="module")
def eight_epochs(prepared_demo, split_dir, module_tmp) -> tuple[dict, Path]:
    # 8 steps per epoch: room for an interval checkpoint inside an epoch (polled every 2 steps).
    # fp32: bf16 resumes are proven above; deterministic CPU bf16 runs without oneDNN, ~25x
    # slower per step, too slow for this fixture's three runs.
    config = {**CONFIG, "epochs": 4, "batch_size": 2, "precision": "fp32"}
    root = module_tmp / "eight-epochs"
    root.mkdir()
    result = torchrun(prepared_demo["train"], split_dir, root / "out", root / "ckpt", config=config)
    assert result.returncode == 0, result.stdout + result.stderr
    return config, root / "out"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_every_process_checkpoints_exits_75_and_resumes_bitwise(
    prepared_demo, split_dir, eight_epochs, tmp_path, sig
):
    """What SLURM does at the time limit, on scancel and on preemption (SIGTERM), and a terminal
    on Ctrl-C (SIGINT): the signal reaches the launcher, both ranks and their loader workers."""
    config, reference = eight_epochs
    # One loader worker per rank; one thread per rank, as in the reference (the thread count
    # changes the order of float sums, so it must match for bitwise equality).
    # SIGINT's run also checkpoints every 2 steps (checkpoint_interval_minutes), which must not
    # change the weights either.
    config = {**config, "workers": 1}
    if sig == signal.SIGINT:
        config["checkpoint_interval_minutes"] = 1e-6
    proc = launch(prepared_demo["train"], split_dir, tmp_path, config, tasks=2, cpus=1)
    lines = lines_until(proc, "epoch 1 step 1/")
    children = subprocess.run(
        ["pgrep", "-g", str(proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert len(children) >= 1 + 2 + 2, lines  # launcher, 2 ranks, 2 loader workers (at least)
    os.killpg(proc.pid, sig)
    output = output_within(proc, 180, head="".join(lines))
    assert proc.returncode == EXIT_REQUEUE, output[-3000:]
    assert "interrupted" in output and "killed by signal" not in output, output[-3000:]
    assert not (tmp_path / "run" / "model.pt").exists()

    allocations = 2
    if sig == signal.SIGINT:  # and a SIGKILL to one rank: no warning, no checkpoint of its own
        allocations = 3
        killed = launch(prepared_demo["train"], split_dir, tmp_path, config, tasks=2, cpus=1)
        lines = lines_until(killed, "interval checkpoint at epoch 2")
        ranks = subprocess.run(
            ["pgrep", "-f", "-g", str(killed.pid), "imagenet_ddp.training.worker"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(ranks) >= 2, "".join(lines)[-3000:]
        rank = ranks[-1]
        os.kill(int(rank), signal.SIGKILL)
        began = time.monotonic()
        output = output_within(killed, 120, head="".join(lines))
        assert killed.returncode == 128 + signal.SIGKILL, output[-3000:]
        assert time.monotonic() - began < 60  # the launcher stops the other rank at once

    again = launch(prepared_demo["train"], split_dir, tmp_path, config, tasks=2, cpus=1)
    output = output_within(again, 300)
    assert again.returncode == 0, output[-3000:]
    assert "resuming from" in output
    assert_bitwise_equal(weights(tmp_path / "run"), weights(reference))
    metrics = json.loads((tmp_path / "run" / "train_metrics.json").read_text())
    assert metrics["geometry"]["workers"] == 1 and metrics["world_size"] == 2
    cost = metrics["cost"]  # every local attempt counted (imagenet_ddp.jobs.attempts)
    assert cost["allocations"] == allocations and not cost["slurm_job_ids"]
    assert cost["wall_seconds"] == pytest.approx(sum(a["wall_seconds"] for a in cost["attempts"]))
    assert cost["core_hours"] == pytest.approx(2 * cost["wall_seconds"] / 3600)
    assert [a["outcome"] for a in cost["attempts"]][-1] == "running"  # this one, until now
    if sig == signal.SIGINT:
        dead = cost["attempts"][1]
        assert dead["outcome"] == "failed" and dead["last_checkpoint"]["epoch"] >= 2
        # resumed from that interval checkpoint: lost only the work after it
        assert cost["attempts"][2]["start"] == dead["last_checkpoint"]
        assert 0 < dead["lost_seconds"] < dead["wall_seconds"]


def test_a_finished_run_under_a_new_global_batch_trains_afresh(
    prepared_demo, split_dir, uninterrupted, tmp_path
):
    """1 rank finished; the same settings on 2 ranks (twice the global batch) must not
    re-emit the 1-rank history."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    one = torchrun(prepared_demo["train"], split_dir, out, ckpt, nproc=1)
    assert one.returncode == 0, one.stdout + one.stderr
    two = torchrun(prepared_demo["train"], split_dir, out, ckpt)
    output = two.stdout + two.stderr
    assert two.returncode == 0, output
    assert "resuming from" not in output
    assert "not resuming" in output and "another global batch" in output and "(b4-o2-cpu)" in output
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_batch"] == 8
    assert_bitwise_equal(weights(out), weights(uninterrupted))  # a true 2-rank run


def test_an_interrupted_run_is_not_resumed_under_another_global_batch(
    prepared_demo, split_dir, tmp_path
):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = torchrun(prepared_demo["train"], split_dir, out, ckpt, "--stop-after-steps", "3")
    assert first.returncode != 0 and "interrupted at epoch 0 step 3" in first.stdout + first.stderr
    single = torchrun(prepared_demo["train"], split_dir, out, ckpt, nproc=1)
    output = single.stdout + single.stderr
    assert single.returncode == 0, output
    assert "resuming from" not in output and "not resuming" in output
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["world_size"] == 1 and [e["epoch"] for e in metrics["epochs"]] == [0, 1]
    assert all(e["segments"] == 1 for e in metrics["epochs"])


# Elastic resume (issue 28): fp32, deterministic, the recipe's random and stateful parts on.
# Compared bitwise (tolerance zero): between 2 ranks x 1 micro-batch and 1 rank x 2 the only
# difference is where each step's two half-gradients are added (DDP's all-reduce, or autograd
# accumulating into .grad), and a + b == b + a exactly; halving (the loss / 2, DDP's division by
# the world size) is exact in binary floating point. With 3 or more micro-batches per step the
# additions associate differently: the weights then differ by rounding (docs/reliability.md).
ELASTIC = {**CONFIG, "precision": "fp32", "channels_last": False}


@pytest.fixture(scope="module")
def elastic_reference(prepared_demo, split_dir, module_tmp) -> Path:
    root = module_tmp / "elastic-reference"
    root.mkdir()
    result = torchrun(prepared_demo["train"], split_dir, root / "out", root / "ckpt",
                      config=ELASTIC)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return root / "out"


def test_a_run_resumes_from_2_ranks_on_1_and_from_1_rank_on_2_with_the_same_global_batch(
    prepared_demo, split_dir, elastic_reference, tmp_path
):
    """Stopped mid-epoch 0 on 2 ranks, resumed on 1 rank (accumulation 2: the same global
    batch, 8), stopped again mid-epoch 1 and finished on 2 ranks: both directions of an
    elastic resume. The 1-rank job also changes the loader (1 worker, 2 CPUs), which keeps
    the stream. The weights (BatchNorm's running statistics included), their EMA and every
    epoch's training loss are the uninterrupted 2-rank run's, bitwise (see ELASTIC); which
    samples each step took, by sample id: tests/test_train_units.py."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def run(nproc: int, *extra: str) -> str:
        config = {**ELASTIC, "accumulation": 2 // nproc}
        if nproc == 1:  # a loader change after an OOM or the preflight's advice resumes
            config.update(workers=1, cpus_per_task=2)
        result = torchrun(prepared_demo["train"], split_dir, out, ckpt, *extra, nproc=nproc,
                          config=config)  # fmt: skip
        return result.stdout + result.stderr

    output = run(2, "--stop-after-steps", "2")
    assert "interrupted at epoch 0 step 2" in output, output[-3000:]
    output = run(1, "--stop-after-steps", "3")
    assert "written on 2 ranks, now 1 with accumulation 2" in output, output[-3000:]
    assert "interrupted at epoch 1 step 1" in output, output[-3000:]
    output = run(2)
    assert "written on 1 ranks, now 2 with accumulation 1" in output, output[-3000:]
    metrics = json.loads((out / "train_metrics.json").read_text())
    reference = json.loads((elastic_reference / "train_metrics.json").read_text())
    assert [p.name for p in ckpt.iterdir() if p.is_dir()] == [
        f"{reference['fingerprint']}-b8-o2-cpu"
    ]
    assert_bitwise_equal(weights(out), weights(elastic_reference))
    assert [e["train_loss"] for e in metrics["epochs"]] == [
        e["train_loss"] for e in reference["epochs"]
    ]
    # Both epochs span two shapes: in no shape's throughput (never averaged across shapes).
    assert [e["shape"] for e in metrics["epochs"]] == ["mixed", "mixed"]
    assert metrics["throughput_by_shape"] == {} and metrics["images_per_s"] is None
    assert reference["throughput_by_shape"]["1x2"]["epochs"] == 2


def test_the_profiler_window_writes_a_trace_and_changes_no_weight(
    prepared_demo, split_dir, uninterrupted, tmp_path
):
    """profile: {epoch: 1, steps: 2, ranks: per_node}: a trace per node (one here) that
    parses as torch.profiler's Chrome-trace JSON, and weights bitwise those of the run without
    it. Also the step-time breakdown of a real 2-rank run (training.step_timing): no part
    exceeds the step time, the parts account for it within 10 %, and the steps for the
    epoch's time."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    config = {**CONFIG, "profile": {"epoch": 1, "steps": 2, "ranks": "per_node"}}
    result = torchrun(prepared_demo["train"], split_dir, out, ckpt, config=config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_bitwise_equal(weights(out), weights(uninterrupted))
    (trace,) = (out / "tensorboard").glob("*-rank0.*.pt.trace.json")  # rank 0's node only
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}  # step 0: the profiler's warm-up
    history = pd.read_csv(out / "history.csv")
    assert history["profiled_steps"].tolist() == [0, 3]
    steps_per_epoch = history["images"] / (2 * CONFIG["batch_size"])
    for _, row in history.iterrows():
        # Each figure is the maximum over ranks on its own: on one rank data + compute (+ the
        # loop's bookkeeping) is the step, so no part exceeds the step and the step exceeds
        # the parts by at most the bookkeeping. The parts may add up to more than the step
        # (DDP: the rank that waited for data waits less in the all-reduce).
        parts = row["data_wait_ms"] + row["compute_ms"]
        assert max(row["data_wait_ms"], row["compute_ms"]) <= row["step_ms"], row
        assert row["step_ms"] <= 1.1 * parts, row
        assert 0 <= row["input_bound_pct"] <= 100
        assert row["flops_per_image"] > 0 and np.isnan(row["mfu_pct"])  # CPU: no known peak
    accounted = history["step_ms"] * steps_per_epoch / 1e3
    assert ((accounted - history["epoch_seconds"]).abs() <= 0.1 * history["epoch_seconds"]).all()


def test_a_diverged_run_stops_at_once_keeps_its_last_good_checkpoint_and_is_not_retried(
    prepared_demo, split_dir, tmp_path
):
    """The divergence guard end to end, on a real divergence: 2 gloo ranks through the real
    launcher, an absurd lr (100, unscaled) reached at the end of a one-epoch warm-up. Epoch 0
    (the warm-up, where a high loss does not count) ends with its checkpoint; epoch 1's first
    step has a loss far above 2 x ln(classes), a suspicion the ranks agree on through the stop
    flag's all-reduce: both stop within its polls (a few steps), mid-epoch; no checkpoint of
    the bad weights is written, model.pt holds the last good checkpoint's weights, the job
    exits 0 with its outputs marked diverged (nothing retries it) and its attempt is recorded
    `diverged`. (A non-finite gradient, agreed by every rank without a collective, is
    tests/test_train_units.py's.)"""
    from imagenet_ddp.jobs import attempts
    from imagenet_ddp.training.checkpoint import load_checkpoint
    from imagenet_ddp.training.worker import SIGNAL_CHECK_STEPS

    config = {**CONFIG, "epochs": 3, "precision": "fp32", "batch_size": 2, "lr": 100.0,
              "lr_scaling": "none", "warmup_epochs": 1, "divergence_window_steps": 1}  # fmt: skip
    proc = launch(prepared_demo["train"], split_dir, tmp_path, config, tasks=2, cpus=1)
    output = output_within(proc, 280)  # fp32: see eight_epochs
    assert proc.returncode == 0, output
    assert "diverged at epoch 1 step 1 (rank 0): loss above 2.77 (divergence_loss_factor" in output
    assert "What to change: lower lr" in output
    last = [int(n) for n in re.findall(r"^epoch 1 step (\d+)/9 ", output, re.MULTILINE)][-1]
    assert last <= 1 + 2 * SIGNAL_CHECK_STEPS < 9, output  # stopped mid-epoch, at a poll
    (folder,) = (tmp_path / "ckpt").glob("*-b4-*")
    names = sorted(p.name for p in folder.glob("checkpoint-*.pt"))
    assert names[-1] == "checkpoint-e0001-s0000000.pt", names  # epoch 0's: the last good one
    good = load_checkpoint(folder / names[-1])["model"]
    model = read_model_file(tmp_path / "run" / "model.pt")
    assert model["diverged"]["step"] == 1 and model["diverged"]["reason"].startswith("loss above")
    assert all(torch.equal(model["model"][k], v) for k, v in good.items())  # its weights
    assert all(torch.isfinite(v).all() for v in good.values() if v.is_floating_point())
    metrics = json.loads((tmp_path / "run" / "train_metrics.json").read_text())
    assert metrics["diverged"]["epoch"] == 1 and len(metrics["epochs"]) == 1
    (entry,) = attempts.load(tmp_path / "ckpt")
    assert entry["outcome"] == "diverged" and "diverged at epoch 1 step 1" in entry["error"]
    assert "not retrying" in attempts.refusal_ahead(
        tmp_path / "ckpt", run_settings(**config, nodes=1, tasks_per_node=2, cpus_per_task=1), 2
    )
