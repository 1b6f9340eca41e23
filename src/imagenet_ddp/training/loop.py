"""The step loop: one rank trains from the resume point to the last epoch.

A stop signal (SIGTERM, SIGUSR1, SIGINT: time limit, scancel, preemption, Ctrl-C) makes every
rank stop at the same step; rank 0 writes a checkpoint and the job exits with EXIT_REQUEUE
(:mod:`imagenet_ddp.jobs.signals`). Events: :func:`train_step` (each step), :func:`end_epoch`.
A diverged run (:mod:`imagenet_ddp.training.guard`) stops the same way but writes no checkpoint:
every save asks the guard first.

An epoch's end is kept short: the holdout is evaluated every ``eval_interval`` epochs with a
loader made once (:class:`Holdout`), and rank 0 writes the checkpoint in the
background (:class:`imagenet_ddp.training.checkpoint.CheckpointWriter`). Its times are columns
of history.csv (``eval_seconds``, ``checkpoint_seconds``; metrics.EPOCH_END_NOTE).
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


def run_epochs(
    job: TrainingState,
    loader,
    sampler,
    holdout,
    resume,
    stop,
    stop_after_steps,
    monitor=None,
    profile=None,
) -> int:
    """Train from the resume point to the last epoch: 0, or EXIT_REQUEUE when stopped.
    ``monitor`` (imagenet_ddp.monitoring.monitor.RunMonitor): TensorBoard events on rank 0;
    ``profile`` (training.profile_window.ProfileWindow): the opt-in profiler window."""
    cfg, info = job.cfg, job.info
    steps_per_epoch = sampler.steps  # optimizer steps: global batches, whatever the ranks
    start_epoch, start_step, partial = resume.epoch, resume.step, resume.partial
    steps_done = 0
    for epoch in range(start_epoch, cfg.epochs):
        first = epoch == start_epoch
        skip = start_step if first else 0
        sampler.set_epoch(epoch, skip_steps=skip)
        # a resumed epoch's counts, shared out again if it ran on another rank count
        carried = carried_partial(partial, info.rank, info.world_size) if first else None
        profiler, timer, meter = epoch_instruments(job, profile, epoch, carried)
        progress = Progress(info.is_main, epoch, steps_per_epoch, cfg.log_interval, meter)
        job.step_model.train()
        step = skip
        epoch_batches = batches(job, loader, sampler, holdout.num_classes, epoch, step)
        for micro_batches in timed_steps(epoch_batches, timer, profiler):
            lr, global_step = job.optimizer.param_groups[0]["lr"], job.scheduler.last_epoch
            results = train_step(job, micro_batches, epoch)
            for index, (loss, logits, labels) in enumerate(results):
                meter.update(loss, logits, labels, step_end=index == cfg.accumulation - 1)
            timer.done()
            step += 1
            steps_done += 1
            diverged = watch(job, stop, results, (global_step, epoch, step, lr))
            if steps_done == 1:  # optimizer state exists now
                check_device_discipline(job, "after the first step")
            progress.update(step, meter)
            if job.progress is not None:
                job.progress.mark(epoch, step)
            if monitor is not None:  # TensorBoard every log_interval steps
                monitor.step(epoch, step, meter, job.scheduler.get_last_lr()[0], timer)
            # Every rank polls at the same steps, so the agreement's collectives stay aligned.
            test_stop = stop_after_steps is not None and steps_done >= stop_after_steps
            stopping = (test_stop or stop.poll(steps_done)) and step < steps_per_epoch
            if diverged is None and (stopping or stop.suspected or stop.checkpoint_due):
                diverged = job.guard.agree() if job.guard is not None else None  # a save next
            if diverged is not None:
                progress.close()
                return stop_diverged(job, diverged)
            if stopping:
                progress.close()
                return requeue_mid_epoch(job, stop, epoch, step, meter)
            if stop.checkpoint_due and step < steps_per_epoch:  # checkpoint_interval_minutes
                interval_checkpoint(job, epoch, step, meter)
                stop.checkpointed()
        progress.close()
        if job.guard is not None and (diverged := job.guard.agree()) is not None:
            return stop_diverged(job, diverged)  # before the epoch's checkpoint
        end_epoch(job, epoch, meter, holdout, timer)
        stop.checkpointed()  # end_epoch wrote one
        if monitor is not None:  # TensorBoard epoch scalars
            spike = loss_spike(job.history, job.cfg.divergence_loss_factor)
            monitor.epoch(epoch, job.history[-1], spike)  # spike: progress.json
        if stop.agreed():  # signalled during the epoch: its checkpoint is written
            if job.progress is not None:  # the attempt record's proof of a stop (attempts)
                job.progress.stopped(epoch + 1, 0, stop.signalled)
            settle_checkpoints(job)
            if info.is_main:
                print(
                    f"interrupted{stop.cause()} after epoch {epoch}: checkpoint written; "
                    "rerun to resume"
                )
            return EXIT_REQUEUE
    settle_checkpoints(job)
    return 0


def watch(job: TrainingState, stop, results, where: tuple) -> Divergence | None:
    """The guard's verdict after a step (``where``: global step, epoch, step, LR): a divergence
    every rank reached at this step, or None; a rank's own suspicion goes to the stop flag."""
    if job.guard is None:
        return None
    diverged = job.guard.after_step(results, job.grad_norm, where)
    stop.suspect = job.guard.suspect is not None
    return diverged


def stop_diverged(job: TrainingState, divergence: Divergence) -> int:
    """Stopped by the guard (collective): no checkpoint of these weights; the last good one is
    complete on disk before any rank goes on. DIVERGED (the worker writes the outputs)."""
    settle_checkpoints(job)
    job.diverged = divergence
    if job.info.is_main:
        print(divergence.line(job.cfg.run), flush=True)
    return DIVERGED


def epoch_instruments(job: TrainingState, profile, epoch: int, carried):
    """The epoch's profiler (or None), step timer (the step-time breakdown) and meter."""
    # Opened before the meter starts: the profiler's start is not the epoch's time.
    profiler = profile.open(epoch, job.device) if profile is not None else None
    window = profile.window(epoch) if profile is not None else 0
    timer = StepTimer(job.device, job.cfg.log_interval, window)
    meter = EpochMeter(job.device, job.cfg.throughput_warmup_steps, carried)
    meter.shape_of(job.geometry.shape)
    return profiler, timer, meter


def requeue_mid_epoch(job: TrainingState, stop, epoch: int, step: int, meter) -> int:
    """Stopped mid-epoch (collective): the checkpoint on disk before any rank exits for
    requeue; EXIT_REQUEUE."""
    if job.progress is not None:  # before the checkpoint: a rank killed after it has said so
        job.progress.stopped(epoch, step, stop.signalled)
    path = save_job(job, epoch, step, D.all_gather_objects(meter.partial()))
    settle_checkpoints(job)
    if job.info.is_main:
        print(
            f"interrupted{stop.cause()} at epoch {epoch} step {step}: wrote {path}; "
            "rerun to resume",
            flush=True,
        )
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


def batches(job: TrainingState, loader: DataLoader, sampler, num_classes: int, epoch, step):
    """The epoch's optimizer steps from step ``step`` on: for each, the list of this rank's
    ``accumulation`` micro-batches of it, each (images, targets) as :func:`micro_batches`
    yields them. Fetched together before the step computes, so that the step-time breakdown's
    data wait (training.step_timing, around this generator's next()) holds every fetch of the
    step; the cost is ``accumulation - 1`` more input batches on the device (uint8 crops
    normalized: ~150 MB per 256 images at 224 px), small beside the activations."""
    flat = micro_batches(job, loader, sampler, num_classes, epoch, step)
    for _ in range(len(loader) // job.cfg.accumulation):
        yield list(islice(flat, job.cfg.accumulation))


def micro_batches(job: TrainingState, loader: DataLoader, sampler, num_classes: int, epoch, step):
    """This rank's micro-batches on the device, from step ``step`` on: (images, targets) where
    targets are class indices, or (indices, mixed label distributions) with mixup/cutmix.
    Synthetic mode measures the model alone (one fixed random batch, the loader untouched)."""
    cfg, device = job.cfg, job.device
    if cfg.synthetic:
        g = torch.Generator().manual_seed(cfg.seed)
        crop = cfg.crop_for_epoch(epoch)
        batch = (
            torch.randn(cfg.batch_size, 3, crop, crop, generator=g).to(device),
            torch.randint(0, num_classes, (cfg.batch_size,), generator=g).to(device),
        )
        yield from repeat(batch, len(loader))
        return
    with stop_signals_blocked():  # workers are forked here; see imagenet_ddp.jobs.signals
        iterator = iter(loader)
    for micro, (images, targets) in enumerate(iterator):  # uint8 crops, normalized here
        images = normalize_batch(images.to(device, non_blocking=True), *recipe.mean_std(cfg))
        targets = targets.to(device, non_blocking=True)
        if job.mixer is not None:  # seeded by (seed, epoch, step, group): any rank count
            at_step, group = (
                step + micro // cfg.accumulation,
                sampler.group(micro % cfg.accumulation),
            )
            seed = batch_seed(cfg.seed, epoch, at_step, group)
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
    elif job.guard is not None and job.guard.enabled:  # all-reduced: the same on every rank
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


@dataclass
class Holdout:
    """The holdout as the epoch ends evaluate it: its class count and this rank's loader of
    its shard, made once (persistent workers) and reused by every evaluation of the job."""

    num_classes: int
    loader: DataLoader


def evaluate_holdout(job: TrainingState, model: torch.nn.Module, holdout: Holdout) -> dict:
    return evaluate_loader(
        model,
        holdout.loader,
        num_classes=holdout.num_classes,
        device=job.device,
        precision=job.cfg.precision,
        channels_last=job.cfg.channels_last,
        mean_std=recipe.mean_std(job.cfg),
    )


def evaluate_epoch(job: TrainingState, epoch: int, holdout: Holdout) -> dict[str, Any]:
    """The holdout columns of the epoch's row: raw weights and, when the recipe keeps them,
    the EMA weights; None (NaN in history.csv) on an epoch ``eval_interval`` skips. Evaluation
    draws from no shared random generator (accuracy.shard_loader), so skipping it changes
    neither the weights nor the random streams that follow."""
    ema = job.ema is not None
    if not job.cfg.evaluates(epoch):
        keys = ["holdout_top1", "holdout_top5", "holdout_loss"]
        return dict.fromkeys(keys + (["holdout_ema_top1", "holdout_ema_top5"] if ema else []))
    result = evaluate_holdout(job, job.model, holdout)
    row = {"holdout_top1": result["top1"], "holdout_top5": result["top5"]}
    row["holdout_loss"] = result["loss"]
    if ema:  # the averaged weights, evaluated like the raw ones
        result = evaluate_holdout(job, job.ema.module, holdout)
        row.update(holdout_ema_top1=result["top1"], holdout_ema_top5=result["top5"])
    return row


def end_epoch(
    job: TrainingState, epoch: int, meter: EpochMeter, holdout: Holdout, timer: StepTimer
) -> None:
    """Combine the ranks' counters, evaluate the holdout (every ``eval_interval`` epochs),
    record and checkpoint the epoch."""
    record = {"epoch": epoch, **meter.reduce(), "lr_end": job.scheduler.get_last_lr()[0]}
    steady = record["steady_images_per_s"]  # breakdown: step_timing.BREAKDOWN_NOTE
    record.update(breakdown_row(job, epoch, timer, steady, holdout.num_classes))
    # Every epoch, evaluated or not: every rank continues from the state that is saved.
    D.broadcast_buffers(job.model)
    if job.ema is not None:
        D.broadcast_buffers(job.ema)
    began = time.perf_counter()
    record.update(evaluate_epoch(job, epoch, holdout))
    record["eval_seconds"] = time.perf_counter() - began  # ends with a collective: all ranks
    record["crop_size"] = job.cfg.crop_for_epoch(epoch)
    record["shape"] = meter.shape  # nodes x ranks per node, or mixed (EpochMeter.shape_of)
    record["chance_loss"] = math.log(max(holdout.num_classes, 2))  # a uniform guess's loss
    job.history.append(record)
    save_job(job, epoch + 1, 0, record=record)  # sets checkpoint_seconds on rank 0
    if job.info.is_main:
        log_epoch(record)
