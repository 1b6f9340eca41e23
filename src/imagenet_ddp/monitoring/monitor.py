"""Rank 0's watch over a training job: TensorBoard (MLflow with ``mlflow_uri``, W&B with
``wandb_project``), NVML telemetry, progress.json and the cost block. Its methods do nothing on
other ranks (no rank test in the loop, no collective here). A sink that fails (not installed,
a full disk, an unreachable store) is named once and switched off: it never ends a training."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from imagenet_ddp.io import write_json_atomic
from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.jobs.spec import PROGRESS
from imagenet_ddp.monitoring.cost import cost_block
from imagenet_ddp.monitoring.mlflow_log import MlflowLog
from imagenet_ddp.monitoring.telemetry import GpuSampler, unavailable
from imagenet_ddp.monitoring.tensorboard_log import TensorBoardLog
from imagenet_ddp.monitoring.wandb_log import WandbLog

# What progress.json keeps of an epoch's record (imagenet_ddp.report.progress reads it).
PROGRESS_KEYS = ("epoch", "images_per_s", "epoch_seconds", "eval_seconds", "checkpoint_seconds",
                 "train_loss", "holdout_top1", "loss_spike")  # fmt: skip

# The sinks: (attribute of RunMonitor, name in messages, class); each imports its library
# when made.
SINKS = (
    ("board", "TensorBoard", TensorBoardLog),
    ("tracker", "MLflow", MlflowLog),
    ("wandb", "W&B", WandbLog),
)
EPOCH_TAGS = ("train_loss", "train_top1", "holdout_top1", "holdout_top5", "holdout_loss",
              "images_per_s", "steady_images_per_s",
              *("data_wait_ms", "compute_ms", "step_ms", "input_bound_pct", "mfu_pct"))  # fmt: skip


class RunMonitor:
    """Inactive (every method a no-op) unless ``active``; see the module docstring."""

    def __init__(
        self, *, active: bool, run_dir: Path, geometry: dict[str, int], steps_per_epoch: int,
        log_interval: int, resumed: bool, sampler: GpuSampler | None = None, tensorboard=True,
        mlflow: dict[str, Any] | None = None, wandb: dict[str, Any] | None = None,
    ):  # fmt: skip
        self.active, self.geometry, self.resumed = active, geometry, resumed
        self.steps_per_epoch, self.interval = steps_per_epoch, log_interval
        self.started = time.monotonic()
        self.sampler = self.board = self.tracker = self.wandb = None
        self.progress: Path | None = run_dir / PROGRESS if active else None
        if not active:
            return
        if not resumed:  # a run trained afresh: an earlier run's epochs are not its own
            self.progress.unlink(missing_ok=True)
        self.sampler = (sampler or GpuSampler(geometry["gpus_per_node"])).start()
        board = {"log_dir": run_dir / "tensorboard"} if tensorboard else None
        for (attribute, name, sink), options in zip(SINKS, (board, mlflow, wandb), strict=True):
            if options:  # the sink's keyword arguments
                try:
                    setattr(self, attribute, sink(**options, fresh=not resumed))
                except Exception as error:  # e.g. not installed: train without it
                    print(f"{name} off: {type(error).__name__}: {error}", flush=True)

    @classmethod
    def for_job(cls, job, run_dir: Path, steps_per_epoch: int, *, resumed: bool) -> RunMonitor:
        """The monitor of a rank's training (training.state.TrainingState); active on rank 0.
        The trackers' run ids are kept beside the job's checkpoints: a resumed job continues."""
        cfg = job.cfg
        params = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"}
        run = {"run_name": cfg.run, "state_dir": job.checkpoint_dir, "params": params}
        mlflow = {"uri": cfg.mlflow_uri, **run} if cfg.mlflow_uri else None
        wandb = {"project": cfg.wandb_project, "mode": cfg.wandb_mode, "run_dir": run_dir, **run}
        # The GPUs of rank 0's node by UUID (NVML indices ignore CUDA_VISIBLE_DEVICES).
        uuids = D.node_gpu_uuids(job.info, job.device)
        return cls(
            active=job.info.is_main, run_dir=run_dir, geometry=dataclasses.asdict(job.geometry),
            steps_per_epoch=steps_per_epoch, log_interval=cfg.log_interval, resumed=resumed,
            mlflow=mlflow, wandb=wandb if cfg.wandb_project else None,
            sampler=GpuSampler(job.geometry.gpus_per_node, uuids=uuids),
        )  # fmt: skip

    def _write(self, method: str, *args, close: bool = False, **kwargs) -> None:
        """``method`` of each sink, each switched off on its own failure (or with ``close``)."""
        for attribute, name, _ in SINKS:
            sink = getattr(self, attribute)
            if sink is None:
                continue
            try:
                getattr(sink, method)(*args, **kwargs)
            except Exception as error:
                print(f"{name} off: {type(error).__name__}: {error}", flush=True)
                setattr(self, attribute, None)
            if close:
                setattr(self, attribute, None)

    def step(self, epoch: int, step: int, meter, lr: float, timer=None) -> None:
        """Every step; logs every ``log_interval`` steps the meter's interval (EpochMeter.interval:
        the progress line's figures). ``timer`` (training.step_timing.StepTimer): rank 0's
        step-time breakdown since the last line (on a GPU, of the steps whose CUDA events had
        completed)."""
        idle = self.board is None and self.tracker is None and self.wandb is None
        if idle or (step % self.interval and step != self.steps_per_epoch):
            return
        loss, rate = meter.interval()
        values = {"loss": loss, "images_per_s": rate, "lr": lr}
        if timer is not None:
            values.update(timer.read_interval())
        global_step = epoch * self.steps_per_epoch + step
        self._write("scalars", "train", values, global_step)
        self._gpu(global_step)

    def epoch(self, epoch: int, record: dict[str, Any], spike: str = "") -> None:
        """``spike``: the run's worst loss spike so far (training.metrics.loss_spike)."""
        global_step = (epoch + 1) * self.steps_per_epoch
        values = {tag: record.get(tag) for tag in EPOCH_TAGS} | {"lr": record.get("lr_end")}
        self._write("scalars", "epoch", values, global_step)
        self._gpu(global_step)
        self._progress({**record, "loss_spike": spike})

    def _progress(self, record: dict[str, Any]) -> None:
        """<run dir>/progress.json: the last epoch's figures, for the runs table while the run
        trains (imagenet_ddp.report.progress). A failure to write it never ends training."""
        if self.progress is None:
            return
        kept = {k: record.get(k) for k in PROGRESS_KEYS}
        try:
            write_json_atomic(self.progress, {**kept, "written": time.time()})
        except OSError as error:
            print(f"progress.json off: {error}", flush=True)
            self.progress = None

    def _gpu(self, global_step: int) -> None:
        latest = self.sampler.latest() if self.sampler else None
        if latest:
            self._write("scalars", "gpu", latest, global_step)

    def finish(self, epochs: list[dict[str, Any]]) -> dict[str, Any]:
        """The cost block (rank 0); stops sampling and closes the event file."""
        telemetry = self.sampler.stop() if self.sampler else unavailable("not rank 0")
        self.close(finished=True)
        wall = time.monotonic() - self.started
        job_id = os.environ.get("SLURM_JOB_ID")
        return cost_block(self.geometry, wall, epochs, telemetry, resumed=self.resumed,
                          slurm_job_id=job_id)  # fmt: skip

    def close(self, *, finished: bool = False) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        self._write("close", finished=finished, close=True)  # each, even if another fails
