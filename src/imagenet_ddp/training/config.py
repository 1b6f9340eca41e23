"""A run's settings (:class:`TrainConfig`) and the geometry of the job that trains it.

Every key of :class:`TrainConfig` is a key of ``train_defaults``/``runs`` in config.yaml. Its
default has one home, the schema (workflow/schemas/config.schema.yaml): the workflow resolves
every run over it and passes every key, so the class states none (tests/test_single_default.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from imagenet_ddp import distributed as D
from imagenet_ddp.epoch_end import evaluates
from imagenet_ddp.geometry import Geometry, loader_workers
from imagenet_ddp.setting_kinds import digest, weight_settings


@dataclass
class TrainConfig:
    """One run's hyperparameters and execution choices (validated by the workflow's schema).
    Every setting is required: its default is the schema's (the workflow fills it in)."""

    run: str
    model: str
    epochs: int
    batch_size: int  # per rank; global batch = batch_size * world size
    lr: float
    momentum: float
    weight_decay: float
    label_smoothing: float
    warmup_epochs: float
    precision: str  # fp32 | bf16 | fp16 (autocast)
    crop_size: int
    eval_resize: int
    workers: int | str  # DataLoader workers per rank; auto = CPUs per task - 1
    seed: int
    device: str  # auto | cpu | cuda
    backend: str  # auto | gloo | nccl
    channels_last: bool
    compile: bool
    deterministic: bool
    log_interval: int  # steps between progress lines (rank 0)
    timeout_minutes: float  # process-group timeout: how long a hung rank holds the job
    max_allocations: int  # jobs one run may use (the launcher enforces it, the preflight checks)
    checkpoint_interval_minutes: float  # mid-epoch checkpoints; 0: epoch ends only
    eval_interval: int | str  # holdout evaluated every this many epochs (and the last); auto
    synthetic: bool  # measure the model alone on a fixed random batch
    keep_checkpoints: int  # newest checkpoints kept per run (older ones are deleted)
    throughput_warmup_steps: int  # steps per epoch left out of the steady-state img/s
    # --- recipe (docs/configuration.md "Recipes"; training/recipe.py); extras off by default.
    recipe: str  # a preset's name (training/presets.py); resolved by the workflow
    optimizer: str  # sgd | adamw
    nesterov: bool  # SGD with momentum > 0 only
    lr_scaling: str  # linear: lr per 256 images x global batch | none: lr as given
    norm_weight_decay: float | None  # None: weight_decay; e.g. 0: no decay on norms
    bias_weight_decay: float | None  # None: weight_decay (biases of other layers)
    grad_clip_norm: float  # max global gradient norm; 0: no clipping
    lr_schedule: str  # cosine | linear | step | constant, per step, after warm-up
    lr_min_ratio: float  # cosine/linear end at lr x this
    lr_step_epochs: list[int]  # step: milestones (epochs)
    lr_step_gamma: float  # step: LR factor at each milestone
    warmup_start_factor: float  # warm-up rises linearly from lr x this
    # RandomResizedCrop's area share and aspect ranges, flip probability (torchvision's, timm's)
    crop_scale: list[float]
    crop_ratio: list[float]
    hflip: float
    auto_augment: str  # none | randaugment | trivialaugment | autoaugment
    random_erasing: float  # probability per image
    mixup_alpha: float  # 0: off
    cutmix_alpha: float  # 0: off (both on: one of the two per batch)
    ema_decay: float  # model EMA decay per update (torchvision's convention); 0: off
    ema_steps: int  # optimizer steps between EMA updates
    sync_bn: bool  # SyncBatchNorm across ranks (GPUs only)
    zero_init_residual: bool  # last BN of each residual block starts at 0 (ResNets)
    progressive_min_crop: int  # 0: off; else the crop rises from this to crop_size
    progressive_start_epoch: int  # ... from this epoch
    progressive_end_epoch: int  # ... to this one
    progressive_multiple: int  # crop sizes in between are rounded to multiples of this
    eval_crop_size: int  # 0: crop_size; evaluation's centre crop (after eval_resize)
    gpu_type: str  # the GPU type SLURM was asked for (gres gpu:<type>:<n>); "": any
    mlflow_uri: str  # rank 0 also logs to this MLflow file store (imagenet_ddp.mlflow_log)
    wandb_project: str  # rank 0 also logs to this W&B project (imagenet_ddp.wandb_log)
    wandb_mode: str  # offline (no network needed) or online
    # The job's geometry as the workflow asked SLURM for it; None: read from the environment.
    nodes: int | None = None
    tasks_per_node: int | None = None
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """The run of ``data`` (a job spec's ``run``: every setting, the workflow passes them);
        unknown keys are kept in ``extra``."""
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        missing = [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in data
        ]
        if missing:
            raise ValueError(
                f"run {data.get('run')!r}: the run settings lack {', '.join(missing)}; the "
                "workflow passes every setting (the schema's defaults filled in), and a job "
                "spec written by hand must too"
            )
        extra = {k: v for k, v in data.items() if k not in known}
        cfg = cls(**{k: v for k, v in data.items() if k in known})
        cfg.extra.update(extra)
        return cfg

    def fingerprint(self) -> str:
        """Hash of everything that changes the trained weights (not logging or geometry: the
        geometry is the checkpoint key's second part)."""
        return digest(weight_settings(dataclasses.asdict(self)))

    def evaluates(self, epoch: int) -> bool:
        """Whether the holdout is evaluated after ``epoch`` (0-based; imagenet_ddp.epoch_end)."""
        return evaluates(epoch, self.epochs, self.eval_interval)

    @property
    def eval_crop(self) -> int:
        return self.eval_crop_size or self.crop_size

    def crop_for_epoch(self, epoch: int) -> int:
        """Training crop of ``epoch``: progressive resizing as FFCV's ResNet recipes do it
        (the minimum until the start epoch, linear to crop_size at the end epoch, in between
        rounded to a multiple of ``progressive_multiple``)."""
        low, start = self.progressive_min_crop, self.progressive_start_epoch
        end = self.progressive_end_epoch
        if not low or epoch >= end:
            return self.crop_size
        if epoch <= start:
            return low
        size = low + (self.crop_size - low) * (epoch - start) / (end - start)
        return int(round(size / self.progressive_multiple)) * self.progressive_multiple


def resolve_geometry(cfg: TrainConfig, info: D.DistInfo, device: torch.device) -> Geometry:
    """The configured geometry, checked against the ranks that actually started."""
    tasks = cfg.tasks_per_node or info.local_world_size
    nodes = cfg.nodes or max(1, info.world_size // tasks)
    if nodes * tasks != info.world_size:
        raise RuntimeError(
            f"run {cfg.run!r}: configured {nodes} node(s) x {tasks} task(s) per node, but "
            f"{info.world_size} ranks started; check the launcher's geometry"
        )
    cpus = cfg.cpus_per_task or int(
        os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("OMP_NUM_THREADS") or 1
    )
    gpus = cfg.gpus_per_node
    if gpus is None:
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    return Geometry(nodes, tasks, cpus, gpus, loader_workers(cfg.workers, cpus))
