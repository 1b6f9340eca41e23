"""What one rank measures during a training epoch, and the progress it shows.

Throughput, per epoch and per run: **end to end** (``images_per_s``: the epoch's images over
the slowest rank's epoch time, loader start-up, cold caches and compilation included, holdout
evaluation and checkpoints not) and **steady state** (``steady_images_per_s``: the same after
the first ``warmup_steps`` steps, the device synchronized at both edges of the window). Loss and
correct predictions are summed on the device and read once per log interval and at the
epoch's end: a per-step ``.item()`` would make the CPU wait for the GPU at every step.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from imagenet_ddp.io import write_csv_atomic, write_json_atomic
from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.settings.geometry import global_batch
from imagenet_ddp.training.state import TrainingState
from imagenet_ddp.training.step_timing import BREAKDOWN_COLUMNS, BREAKDOWN_NOTE

BREAKDOWN_SUMMARY = (*BREAKDOWN_COLUMNS, "mfu_pct")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EpochMeter:
    """One rank's counters for one epoch (or for this job's part of a resumed epoch)."""

    def __init__(self, device: torch.device, warmup_steps: int, partial: dict | None = None):
        self.device, self.warmup_steps = device, warmup_steps
        partial = partial or {}
        self.loss_sum = torch.tensor(partial.get("loss_sum", 0.0), dtype=torch.float64).to(device)
        self.correct = torch.tensor(partial.get("correct", 0.0), dtype=torch.float64).to(device)
        self.samples = int(partial.get("samples", 0))
        self.previous_seconds = float(partial.get("seconds", 0.0))  # earlier jobs' share
        self.segments = int(partial.get("segments", 0)) + 1
        self.steps = 0  # steps of this segment
        self.window: tuple[float, int] | None = None  # (start time, samples at start)
        self.shape = partial.get("shape")  # the shape of the epoch so far (see shape_of)
        self.started = time.perf_counter()
        self.mark = (self.started, self.samples, 0, 0.0, 0.0)  # time, samples, steps, loss, rate

    def update(
        self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, step_end=True
    ) -> None:
        """Count one micro-batch; ``step_end``: the last of its optimizer step."""
        n = targets.shape[0]
        self.loss_sum += loss.detach().double() * n
        self.correct += (logits.detach().argmax(1) == targets).sum()
        self.samples += n
        self.steps += step_end
        if step_end and self.steps == self.warmup_steps:
            synchronize(self.device)
            self.window = (time.perf_counter(), self.samples)

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (a mid-epoch checkpoint) out of the epoch's times."""
        self.started += seconds
        self.mark = (self.mark[0] + seconds, *self.mark[1:])
        if self.window is not None:
            self.window = (self.window[0] + seconds, self.window[1])

    def mean_loss(self) -> float:
        """The epoch's mean training loss so far (reads the device: call once per interval)."""
        return float(self.loss_sum.item()) / max(self.samples, 1)

    def interval(self) -> tuple[float, float]:
        """(mean loss, global img/s since the last interval) for the progress line and the
        monitor: measured once per step, so both show one figure. Host time: the CPU runs
        ahead of the GPU by a bounded queue only."""
        if self.mark[2] != self.steps:
            now = time.perf_counter()
            rate = (self.samples - self.mark[1]) * D.world_size() / max(now - self.mark[0], 1e-9)
            self.mark = (now, self.samples, self.steps, self.mean_loss(), rate)
        return self.mark[3], self.mark[4]

    def seconds(self) -> float:
        return self.previous_seconds + time.perf_counter() - self.started

    def partial(self) -> dict[str, Any]:
        """This rank's counters, for a checkpoint written mid-epoch."""
        return {
            "loss_sum": float(self.loss_sum.item()),
            "correct": float(self.correct.item()),
            "samples": self.samples,
            "seconds": self.seconds(),
            "segments": self.segments,
            "shape": self.shape,
        }

    def shape_of(self, shape: str) -> str:
        """The epoch's shape: ``shape`` (this job's nodes x ranks per node), or ``mixed`` when
        an earlier job ran part of it on another shape (an elastic resume): its end-to-end
        figures then mix two shapes and are no shape's (aggregate keeps them apart)."""
        self.shape = shape if self.shape in (None, shape) else "mixed"
        return self.shape

    def reduce(self) -> dict[str, Any]:
        """Close the epoch: every rank's counters combined (collective; call on every rank)."""
        synchronize(self.device)
        end = time.perf_counter()
        seconds = self.previous_seconds + end - self.started
        if self.window is not None and self.samples > self.window[1]:
            steady = (self.samples - self.window[1], end - self.window[0])
        else:
            steady = (0.0, math.nan)
        steady_images = torch.tensor(float(steady[0]), dtype=torch.float64, device=self.device)
        sums = D.all_reduce_sum(torch.stack([self.loss_sum, self.correct, steady_images])).cpu()
        # The slowest rank sets the time; NaN (no steady window) wins over any number.
        times = torch.tensor([seconds, steady[1]], dtype=torch.float64, device=self.device)
        times = D.all_reduce_max(times).cpu()
        samples = self.samples * D.world_size()
        per_rank = D.all_gather_objects(self.samples / max(seconds, 1e-9))
        steady_images, steady_seconds = float(sums[2]), float(times[1])
        has_window = steady_images > 0 and math.isfinite(steady_seconds) and steady_seconds > 0
        return {
            "train_loss": float(sums[0]) / samples,
            "train_top1": float(sums[1]) / samples,
            "images": samples,
            "epoch_seconds": float(times[0]),
            "images_per_s": samples / float(times[0]),
            "images_per_s_per_rank": [float(x) for x in per_rank],
            "steady_images_per_s": steady_images / steady_seconds if has_window else None,
            "steady_images": int(steady_images),
            "steady_seconds": steady_seconds if has_window else None,
            "segments": self.segments,
        }


class Progress:
    """tqdm bar for an interactive rank 0; one plain line per interval in batch logs."""

    def __init__(self, enabled: bool, epoch: int, total: int, interval: int):
        self.enabled, self.interval, self.epoch, self.total = enabled, interval, epoch, total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"epoch {epoch}", unit="step", leave=False)

    def update(self, step: int, meter: EpochMeter) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
        if step % self.interval and step != self.total:
            return
        loss, rate = meter.interval()
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", img_s=f"{rate:.0f}")
        else:
            print(
                f"epoch {self.epoch} step {step}/{self.total} loss {loss:.4f} "
                f"{rate:.1f} img/s (global)",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def log_epoch(record: dict[str, Any]) -> None:
    """One line per epoch (rank 0): loss, accuracies, throughput."""
    steady, top1 = record["steady_images_per_s"], record["holdout_top1"]
    print(
        f"epoch {record['epoch']} done: loss {record['train_loss']:.4f} "
        f"train top1 {record['train_top1']:.3f} holdout top1 "
        f"{'not evaluated' if top1 is None else f'{top1:.3f}'} "
        f"{record['images_per_s']:.1f} img/s end to end, "
        f"{'n/a' if steady is None else f'{steady:.1f}'} img/s steady "
        f"({record['epoch_seconds']:.1f} s; epoch end: evaluation {record['eval_seconds']:.1f} s, "
        f"checkpoint {record.get('checkpoint_seconds', 0.0):.1f} s)",
        flush=True,
    )


EPOCH_END_NOTE = (
    "eval_seconds: the epoch end's holdout evaluation (raw and EMA weights; 0 on epochs "
    "eval_interval skips); checkpoint_seconds: how long rank 0 was held by the checkpoint (RNG "
    "gather, copy to the CPU, a previous write still under way; the write itself runs in the "
    "background); epoch_end_share: their sum / epoch_seconds (training time)."
)


def epoch_end_share(history: list[dict[str, Any]]) -> float | None:
    """Epoch-end work (evaluation, checkpoint hold) over training time, the whole run."""
    train = sum(h["epoch_seconds"] for h in history)
    work = sum(h.get("eval_seconds", 0.0) + (h.get("checkpoint_seconds") or 0.0) for h in history)
    return work / train if history and train > 0 else None


def history_frame(history: list[dict[str, Any]]) -> pd.DataFrame:
    """history.csv: one row per epoch, ``epoch_end_share`` derived (EPOCH_END_NOTE). A run the
    divergence guard stopped in its first epoch has none: the header alone (what the plots
    read)."""
    if not history:
        return pd.DataFrame(columns=["epoch", "train_loss", "train_top1", "holdout_top1",
                                     "holdout_top5", "holdout_loss", "epoch_seconds"])  # fmt: skip
    frame = pd.DataFrame([{k: v for k, v in h.items() if not isinstance(v, list)} for h in history])
    if "eval_seconds" in frame:  # absent in a history from before these columns
        work = frame["eval_seconds"].fillna(0) + frame.get("checkpoint_seconds", 0.0)
        frame["epoch_end_share"] = work / frame["epoch_seconds"]
    return frame


THROUGHPUT_NOTE = (
    "images_per_s: images of the epoch / slowest rank's epoch time, median over epochs; "
    "includes loader start-up and warm-up, excludes holdout evaluation and checkpoints. "
    "steady_images_per_s: the same without the first throughput_warmup_steps steps of each "
    "epoch, device synchronized at the window's edges. Node-local staging is in staging/."
)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def throughput_by_shape(history: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per shape (nodes x ranks per node) the run's epochs ran on: their count and median
    throughputs. An epoch of a mixed shape (begun on one, finished on another) is in none."""
    shapes: dict[str, list[dict[str, Any]]] = {}
    for row in history:
        shapes.setdefault(row.get("shape", "mixed"), []).append(row)
    return {
        shape: {
            "epochs": len(rows),
            "images_per_s": _median([h["images_per_s"] for h in rows]),
            "steady_images_per_s": _median([h.get("steady_images_per_s") for h in rows]),
        }
        for shape, rows in shapes.items()
        if shape != "mixed"
    }


def recorded_settings(job: TrainingState) -> dict[str, Any]:
    """The run's settings and geometry, as recorded beside its results and in model.pt."""
    return {**dataclasses.asdict(job.cfg), **dataclasses.asdict(job.geometry)}


def write_run_metrics(job, out_dir: Path, ranks: list, resumed_from, cost=None, diverged=None):
    """history.csv (one row per epoch) and train_metrics.json (the run's summary; ``diverged``:
    why and where the divergence guard stopped the run, training.guard)."""
    cfg, history, world = job.cfg, job.history, job.info.world_size
    write_csv_atomic(out_dir / "history.csv", history_frame(history))
    epoch_seconds = [h["epoch_seconds"] for h in history]
    by_shape = throughput_by_shape(history)
    # The run's figures are those of this job's shape: never averaged across shapes.
    mine = by_shape.get(job.geometry.shape, {})
    images_per_s, steady = mine.get("images_per_s"), mine.get("steady_images_per_s")
    write_json_atomic(
        out_dir / "train_metrics.json",
        {
            "run": cfg.run,
            "config": recorded_settings(job),
            "geometry": {**dataclasses.asdict(job.geometry), "tag": job.geometry.tag},
            "fingerprint": cfg.fingerprint(),
            "world_size": world,
            "nodes": len({r["host"] for r in ranks}),
            "hosts": sorted({r["host"] for r in ranks}),
            "ranks": ranks,
            "global_batch": global_batch(vars(cfg), world),
            "accumulation": cfg.accumulation,
            "shape": job.geometry.shape,
            "throughput_by_shape": by_shape,
            "lr_used": job.optimizer.defaults["lr"],  # lr after lr_scaling (the peak)
            "epochs": history,
            "mean_epoch_seconds": float(np.mean(epoch_seconds)) if epoch_seconds else None,
            "images_per_s": images_per_s,
            "images_per_s_per_worker": None if images_per_s is None else images_per_s / world,
            "steady_images_per_s": steady,
            "steady_images_per_s_per_worker": None if steady is None else steady / world,
            "throughput_warmup_steps": cfg.throughput_warmup_steps,
            "throughput_note": THROUGHPUT_NOTE,
            "epoch_end_share": epoch_end_share(history),
            "eval_interval": cfg.eval_interval,
            "epoch_end_note": EPOCH_END_NOTE,
            # The step-time breakdown: the median over epochs of each (per-epoch columns).
            **{k: _median([h.get(k) for h in history]) for k in BREAKDOWN_SUMMARY},
            "flops_per_image": history[-1].get("flops_per_image") if history else None,
            "breakdown_note": BREAKDOWN_NOTE,
            "resumed_from": resumed_from,
            "diverged": diverged,
            "cost": cost,  # imagenet_ddp.monitoring.cost: wall, GPU-/core-hours, NVML telemetry
            "checkpoint_dir": str(job.checkpoint_dir),
            "torch": torch.__version__,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        },
    )


def loss_spike(epochs: list[dict[str, Any]], factor: float = 2.0) -> str:
    """The epoch whose mean training loss was highest above ``factor`` (the run's
    divergence_loss_factor) x its ``chance_loss``, ln(classes), the loss of a uniform guess:
    "loss spiked to 7.4 at epoch 0 (chance 2.3; last epoch 0.05)", even when the run recovered
    (the divergence guard stops only a spike that lasts); "" if none or not recorded."""
    over = [
        (e["train_loss"], e["epoch"], e["chance_loss"])
        for e in epochs
        if e.get("chance_loss") and (e.get("train_loss") or 0) > factor * e["chance_loss"]
    ]
    if not over:
        return ""
    loss, epoch, chance = max(over)
    return (
        f"loss spiked to {loss:.3g} at epoch {epoch} (chance {chance:.2g}; last epoch "
        f"{epochs[-1]['train_loss']:.3g})"
    )
