"""The step loop: one rank trains from the resume point to the last epoch.

A stop signal (time limit, scancel, preemption, Ctrl-C) makes every rank stop at the same
step; rank 0 writes a checkpoint and the job exits EXIT_REQUEUE (imagenet_ddp.jobs.signals).
A diverged run (:mod:`.guard`) stops the same way but writes no checkpoint: every save asks
the guard first.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice, repeat
from typing import Any

import torch
from torch.utils.data import DataLoader

from imagenet_ddp.data.dataset import normalize_batch
from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.jobs.signals import EXIT_REQUEUE, stop_signals_blocked
from imagenet_ddp.precision import autocast
from imagenet_ddp.training import recipe
from imagenet_ddp.training.accuracy import evaluate_loader
from imagenet_ddp.training.checkpoint import save_job, settle_checkpoints
from imagenet_ddp.training.data import batch_seed
from imagenet_ddp.training.discipline import check_device_discipline
from imagenet_ddp.training.guard import DIVERGED, Divergence, gradient_norm
from imagenet_ddp.training.metrics import EpochMeter, Progress, log_epoch, loss_spike
from imagenet_ddp.training.state import TrainingState
from imagenet_ddp.training.step_timing import StepTimer, breakdown_row, timed_steps


@dataclass
class Holdout:
    """The holdout as the epoch ends evaluate it: its class count and this rank's loader of
    its shard, made once (persistent workers) and reused by every evaluation of the job."""

    num_classes: int
    loader: DataLoader


@dataclass
class Loop:
    """What the epochs share: the data, the stop flag and rank 0's monitor (TensorBoard,
    trackers, progress.json: imagenet_ddp.monitoring.monitor) and profiler window
    (training.profile_window). ``stop_after_steps`` (testing): stop as if signalled then."""

    loader: DataLoader
    sampler: Any  # training.data.EpochSampler
    holdout: Holdout
    stop: Any  # imagenet_ddp.jobs.signals.StopFlag
    monitor: Any
    profile: Any
    stop_after_steps: int | None = None
    stop_epoch: int | None = None  # a rung's end (jobs.spec.TrainJob); None: the run's
    first_step: int = 0  # the run's optimizer steps before this job's first


def run_epochs(job: TrainingState, loop: Loop, resume) -> int:
    """Train from the resume point to the last epoch (a rung's ``loop.stop_epoch``: its
    schedule unchanged, stopped there): 0, EXIT_REQUEUE when stopped, DIVERGED when the guard
    stopped the run."""
    loop.first_step = job.scheduler.last_epoch
    last = min(loop.stop_epoch or job.cfg.epochs, job.cfg.epochs)
    for epoch in range(resume.epoch, last):
        first, info = epoch == resume.epoch, job.info
        # a resumed epoch's counts, shared out again if it ran on another rank count
        carried = carried_partial(resume.partial, info.rank, info.world_size) if first else None
        code, meter, timer = train_epoch(job, loop, epoch, resume.step if first else 0, carried)
        if code is None and (diverged := job.guard.agree()) is not None:
            code = stop_diverged(job, diverged)  # before the epoch's checkpoint
        if code is not None:
            return code
        end_epoch(job, epoch, meter, loop.holdout, timer, force_eval=epoch == last - 1)
        loop.stop.checkpointed()  # end_epoch wrote one
        spike = loss_spike(job.history, job.cfg.divergence_loss_factor)  # for progress.json
        loop.monitor.epoch(epoch, job.history[-1], spike)
        if loop.stop.agreed():  # signalled during the epoch: its checkpoint is written
            return requeue(job, loop.stop, epoch + 1, 0)
    settle_checkpoints(job)
    return 0


def train_epoch(job: TrainingState, loop: Loop, epoch: int, step: int, carried):
    """The epoch's steps from ``step`` on: (None, meter, timer) at its end, or (the job's exit
    code, ...) when a stop signal or the guard ended it."""
    cfg, stop, steps_per_epoch = job.cfg, loop.stop, loop.sampler.steps
    loop.sampler.set_epoch(epoch, skip_steps=step)
    # Opened before the meter starts: the profiler's start is not the epoch's time.
    profiler = loop.profile.open(epoch, job.device)
    timer = StepTimer(job.device, cfg.log_interval, loop.profile.window(epoch))
    meter = EpochMeter(job.device, cfg.throughput_warmup_steps, carried)
    meter.shape_of(job.geometry.shape)
    progress = Progress(job.info.is_main, epoch, steps_per_epoch, cfg.log_interval)
    job.step_model.train()
    epoch_batches = batches(job, loop, epoch, step)
    for micro_batches in timed_steps(epoch_batches, timer, profiler):
        where = (job.scheduler.last_epoch, epoch, step + 1, job.optimizer.param_groups[0]["lr"])
        results = train_step(job, micro_batches, epoch)
        for index, (loss, logits, labels) in enumerate(results):
            meter.update(loss, logits, labels, step_end=index == cfg.accumulation - 1)
        timer.done()
        step += 1
        steps_done = job.scheduler.last_epoch - loop.first_step
        diverged = job.guard.after_step(results, job.grad_norm, where)
        stop.suspect = job.guard.suspect is not None  # the ranks agree on it at the next poll
        if steps_done == 1:  # optimizer state exists now
            check_device_discipline(job, "after the first step")
        progress.update(step, meter)
        if job.progress is not None:  # the attempt record's last step of this rank (attempts)
            job.progress.mark(epoch, step)
        loop.monitor.step(epoch, step, meter, job.scheduler.get_last_lr()[0], timer)
        # Every rank polls at the same steps, so the agreement's collectives stay aligned.
        test_stop = loop.stop_after_steps is not None and steps_done >= loop.stop_after_steps
        stopping = (test_stop or stop.poll(steps_done)) and step < steps_per_epoch
        if diverged is None and (stopping or stop.suspected or stop.checkpoint_due):
            diverged = job.guard.agree()  # a save next: never of diverged weights
        if diverged is not None or stopping:
            progress.close()
            if diverged is not None:
                return stop_diverged(job, diverged), meter, timer
            return requeue(job, stop, epoch, step, meter), meter, timer
        if stop.checkpoint_due and step < steps_per_epoch:  # checkpoint_interval_minutes
            interval_checkpoint(job, epoch, step, meter)
            stop.checkpointed()
    progress.close()
    return None, meter, timer


def stop_diverged(job: TrainingState, divergence: Divergence) -> int:
    """Stopped by the guard (collective): no checkpoint of these weights; the last good one is
    complete on disk before any rank goes on. DIVERGED (the worker writes the outputs)."""
    settle_checkpoints(job)
    job.diverged = divergence
    if job.info.is_main:
        print(divergence.line(job.cfg.run), flush=True)
    return DIVERGED


def requeue(job: TrainingState, stop, epoch: int, step: int, meter: EpochMeter | None = None):
    """Stopped by a signal (collective) at (epoch, step), where the next job resumes: mid-epoch
    (``meter``) its checkpoint is written here, at an epoch's end it is; on disk before any
    rank exits. EXIT_REQUEUE."""
    if job.progress is not None:  # before the checkpoint: a rank killed after it has said so
        job.progress.stopped(epoch, step, stop.signalled)
    path = None
    if meter is not None:  # mid-epoch: its checkpoint, with every rank's counts so far
        path = save_job(job, epoch, step, D.all_gather_objects(meter.partial()))
    settle_checkpoints(job)
    if job.info.is_main:
        where = f"at epoch {epoch} step {step}: wrote {path}"
        if meter is None:
            where = f"after epoch {epoch - 1}: checkpoint written"
        print(f"interrupted{stop.cause()} {where}; rerun to resume", flush=True)
    return EXIT_REQUEUE


def interval_checkpoint(job: TrainingState, epoch: int, step: int, meter: EpochMeter) -> None:
    """A mid-epoch checkpoint (collective), as a stop signal writes; training goes on. Its
    time is left out of the epoch's throughput, as epoch-end checkpoints are."""
    began = time.perf_counter()
    path = save_job(job, epoch, step, D.all_gather_objects(meter.partial()))
    meter.pause(time.perf_counter() - began)
    if job.info.is_main:
        print(f"interval checkpoint at epoch {epoch} step {step}: wrote {path}", flush=True)


def carried_partial(partial: list | None, rank: int, world: int) -> dict | None:
    """This rank's share of a resumed epoch's counts (checkpoint ``partial_epoch``: one entry
    per rank that wrote it). Written on another rank count (an elastic resume), the sums are
    shared out evenly and the time is the slowest rank's, so the epoch's totals stay true."""
    if not partial:
        return None
    if len(partial) == world:
        return partial[rank]
    total = {key: sum(p[key] for p in partial) for key in ("loss_sum", "correct", "samples")}
    return {
        "loss_sum": total["loss_sum"] / world,
        "correct": total["correct"] / world,
        "samples": total["samples"] // world,  # whole global batches: divisible
        "seconds": max(p["seconds"] for p in partial),
        "segments": max(p["segments"] for p in partial),
        "shape": partial[0].get("shape"),
    }


def batches(job: TrainingState, loop: Loop, epoch: int, step: int):
    """The epoch's optimizer steps from ``step`` on, each the list of this rank's
    ``accumulation`` micro-batches (:func:`micro_batches`), fetched before the step computes so
    that the breakdown's data wait (training.step_timing) holds every fetch of the step."""
    flat = micro_batches(job, loop, epoch, step)
    for _ in range(len(loop.loader) // job.cfg.accumulation):
        yield list(islice(flat, job.cfg.accumulation))


def micro_batches(job: TrainingState, loop: Loop, epoch: int, step: int):
    """This rank's micro-batches on the device, from step ``step`` on: (images, targets) where
    targets are class indices, or (indices, mixed label distributions) with mixup/cutmix.
    Synthetic mode measures the model alone (one fixed random batch, the loader untouched)."""
    cfg, device = job.cfg, job.device
    if cfg.synthetic:
        g, crop = torch.Generator().manual_seed(cfg.seed), cfg.crop_for_epoch(epoch)
        images = torch.randn(cfg.batch_size, 3, crop, crop, generator=g).to(device)
        targets = torch.randint(0, loop.holdout.num_classes, (cfg.batch_size,), generator=g)
        yield from repeat((images, targets.to(device)), len(loop.loader))
        return
    with stop_signals_blocked():  # workers are forked here; see imagenet_ddp.jobs.signals
        iterator = iter(loop.loader)
    for micro, (images, targets) in enumerate(iterator):  # uint8 crops, normalized here
        images = normalize_batch(images.to(device, non_blocking=True), *recipe.mean_std(cfg))
        targets = targets.to(device, non_blocking=True)
        if job.mixer is not None:  # seeded by (seed, epoch, step, group): any rank count
            group = loop.sampler.group(micro % cfg.accumulation)
            seed = batch_seed(cfg.seed, epoch, step + micro // cfg.accumulation, group)
            images, mixed = recipe.mix_batch(job.mixer, images, targets, seed)
            targets = (targets, mixed)
        yield images, targets


def train_step(job: TrainingState, micro_batches, epoch: int) -> list[tuple]:
    """One optimizer step over this rank's micro-batches (targets: see :func:`micro_batches`);
    returns (loss, logits, class targets) of each. DDP all-reduces the gradients after the
    last one only (``no_sync`` before it), and each loss is divided by their count: the
    gradient is the mean over the global batch, as with one micro-batch per rank on more
    ranks (float summation order apart). BatchNorm's running statistics keep the first
    micro-batch's update only: on more ranks, DDP broadcasts rank 0's buffers (group 0's
    update) at each step's first forward, so they match whatever the rank count."""
    cfg, count = job.cfg, job.cfg.accumulation
    job.optimizer.zero_grad(set_to_none=True)
    results, kept = [], None
    for index, (images, targets) in enumerate(micro_batches):
        sync = index == count - 1 or not hasattr(job.step_model, "no_sync")
        with nullcontext() if sync else job.step_model.no_sync():
            results.append(forward_backward(job, images, targets, count))
        if index == 0 and count > 1:
            kept = [buffer.detach().clone() for buffer in job.model.buffers()]
    if kept is not None:
        with torch.no_grad():
            for buffer, value in zip(job.model.buffers(), kept, strict=True):
                buffer.copy_(value)
    job.grad_norm = None
    if cfg.grad_clip_norm > 0:
        job.scaler.unscale_(job.optimizer)  # clip the true gradients, not the scaled ones
        job.grad_norm = torch.nn.utils.clip_grad_norm_(job.model.parameters(), cfg.grad_clip_norm)
    elif job.guard.enabled:  # all-reduced: the same on every rank
        job.grad_norm = gradient_norm(job.model)
    job.scaler.step(job.optimizer)
    job.scaler.update()
    job.scheduler.step()
    recipe.update_ema(cfg, job.ema, job.model, job.scheduler.last_epoch, epoch)
    return results


def forward_backward(job: TrainingState, images: torch.Tensor, targets, count: int):
    """One micro-batch's forward and backward, its loss divided by ``count`` (micro-batches
    per step) for the gradient; returns the undivided loss, logits and class targets."""
    hard, soft = targets if isinstance(targets, tuple) else (targets, targets)
    if job.cfg.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    with autocast(job.device, job.cfg.precision):
        logits = job.step_model(images)
        loss = job.criterion(logits, soft)
    job.scaler.scale(loss / count if count > 1 else loss).backward()
    return loss, logits, hard


def evaluate_epoch(job: TrainingState, epoch: int, holdout: Holdout, force=False) -> dict:
    """The holdout columns of the epoch's row: raw weights and, when the recipe keeps them,
    the EMA weights; None (NaN in history.csv) on an epoch ``eval_interval`` skips. Evaluation
    draws from no shared random generator (accuracy.shard_loader), so skipping it changes
    neither the weights nor the random streams that follow."""
    cfg, row = job.cfg, {}
    models = {"holdout": job.model} | ({"holdout_ema": job.ema.module} if job.ema else {})
    for prefix, model in models.items():
        result = (
            evaluate_loader(
                model,
                holdout.loader,
                num_classes=holdout.num_classes,
                device=job.device,
                precision=cfg.precision,
                channels_last=cfg.channels_last,
                mean_std=recipe.mean_std(cfg),
            )
            if force or cfg.evaluates(epoch)
            else {}
        )
        keys = ("top1", "top5", "loss") if prefix == "holdout" else ("top1", "top5")
        row.update({f"{prefix}_{key}": result.get(key) for key in keys})
    return row


def end_epoch(
    job: TrainingState,
    epoch: int,
    meter: EpochMeter,
    holdout: Holdout,
    timer: StepTimer,
    force_eval: bool = False,
) -> None:
    """Combine the ranks' counters, evaluate the holdout (every ``eval_interval`` epochs, and
    ``force_eval``: a job's last, which a rung's decision reads),
    record and checkpoint the epoch. Its times are history.csv's ``eval_seconds`` and
    ``checkpoint_seconds`` (metrics.EPOCH_END_NOTE)."""
    record = {"epoch": epoch, **meter.reduce(), "lr_end": job.scheduler.get_last_lr()[0]}
    steady = record["steady_images_per_s"]  # breakdown: step_timing.BREAKDOWN_NOTE
    record.update(breakdown_row(job, epoch, timer, steady, holdout.num_classes))
    # Every epoch, evaluated or not: every rank continues from the state that is saved.
    D.broadcast_buffers(job.model)
    if job.ema is not None:
        D.broadcast_buffers(job.ema)
    began = time.perf_counter()
    record.update(evaluate_epoch(job, epoch, holdout, force_eval))
    record["eval_seconds"] = time.perf_counter() - began  # ends with a collective: all ranks
    record["crop_size"] = job.cfg.crop_for_epoch(epoch)
    record["shape"] = meter.shape  # nodes x ranks per node, or mixed (EpochMeter.shape_of)
    record["chance_loss"] = math.log(max(holdout.num_classes, 2))  # a uniform guess's loss
    job.history.append(record)
    save_job(job, epoch + 1, 0, record=record)  # sets checkpoint_seconds on rank 0
    if job.info.is_main:
        log_epoch(record)
