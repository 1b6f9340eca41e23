"""One rank's training state, built by the worker; its own module so that the loop,
checkpoints and metrics import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.settings.geometry import Geometry
from imagenet_ddp.settings.kinds import TrainConfig


@dataclass
class TrainingState:
    """One rank's training state: the run's settings, this rank's placement, what it trains
    (model, its DDP wrapper, optimizer, schedule, scaler, loss, EMA) and its history."""

    cfg: TrainConfig
    info: D.DistInfo
    device: torch.device
    geometry: Geometry
    model: torch.nn.Module
    step_model: torch.nn.Module  # DDP (and compiled) wrapper that runs the training step
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    criterion: torch.nn.Module
    checkpoint_dir: Path
    ema: torch.optim.swa_utils.AveragedModel | None = None  # model EMA (recipe), or None
    mixer: Any = None  # mixup/cutmix on each batch (recipe), or None
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_writer: Any = None  # checkpoint.CheckpointWriter (rank 0, from its first save)
    progress: Any = None  # attempts.RankProgress: this rank's last step, for the watchdog line
    guard: Any = None  # guard.Guard: stops a diverged run (None: off)
    grad_norm: Any = None  # the last step's gradient norm on the device (clipped or guarded)
    diverged: Any = None  # guard.Divergence: why run_epochs returned DIVERGED
