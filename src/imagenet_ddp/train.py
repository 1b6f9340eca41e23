"""DDP training worker: one process per device, launched by the launcher (local or srun).

Design choices that matter for users:
- Augmentation is seeded per (seed, epoch, sample), not per worker process, so results do not
  depend on DataLoader worker count and a run resumed mid-epoch replays exactly the same batches.
- Checkpoints are keyed by the run's settings and its geometry (:mod:`imagenet_ddp.checkpoint`):
  a retry or a SLURM requeue resumes; a changed setting or geometry starts fresh.
- A stop signal (SIGTERM, SIGUSR1, SIGINT: time limit, scancel, preemption, Ctrl-C) makes every
  rank stop at the same step; rank 0 writes a checkpoint and the job exits with EXIT_REQUEUE
  (:mod:`imagenet_ddp.signals`).
- Throughput is measured end to end and in a steady-state window per epoch
  (:mod:`imagenet_ddp.epoch_metrics`), without a host sync per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import hashlib
import json
import math
import os
import random
import signal
import sys
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from imagenet_ddp import distributed as D
from imagenet_ddp.checkpoint import (
    checkpoint_dir,
    load_latest_checkpoint,
    other_geometries,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)
from imagenet_ddp.epoch_metrics import EpochMeter, Progress
from imagenet_ddp.evaluate import autocast, evaluate_dataset
from imagenet_ddp.io import atomic_path, write_csv_atomic, write_json_atomic
from imagenet_ddp.monitor import RunMonitor  # [study hook] TensorBoard, NVML, cost
from imagenet_ddp.prepared import (
    PreparedImageDataset,
    eval_transform,
    normalize_batch,
    train_transform,
)
from imagenet_ddp.signals import (
    EXIT_REQUEUE,
    StopFlag,
    ignore_stop_signals,
    loader_context,
    stop_signals_blocked,
)

__all__ = ["EXIT_REQUEUE", "TrainConfig", "train", "main"]

SIGNAL_CHECK_STEPS = 2  # ranks agree on a pending stop signal every this many steps
GEOMETRY_KEYS = ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node")


@dataclass
class TrainConfig:
    """One run's hyperparameters and execution choices (validated by the workflow's schema)."""

    run: str = "run"
    model: str = "resnet18"
    epochs: int = 2
    batch_size: int = 64  # per rank; global batch = batch_size * world size
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-5
    label_smoothing: float = 0.0
    warmup_epochs: float = 0.0
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast)
    crop_size: int = 224
    eval_resize: int = 256
    workers: int | str = "auto"  # DataLoader workers per rank; auto = CPUs per task - 1
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    backend: str = "auto"  # auto | gloo | nccl
    channels_last: bool = False
    compile: bool = False
    deterministic: bool = False
    log_interval: int = 20  # steps between progress lines (rank 0)
    timeout_minutes: float = 60.0  # process-group timeout; must exceed staging time
    synthetic: bool = False  # measure the model alone on a fixed random batch
    keep_checkpoints: int = 2
    throughput_warmup_steps: int = 20  # steps per epoch left out of the steady-state img/s
    # The job's geometry as the workflow asked SLURM for it; None: read from the environment.
    nodes: int | None = None
    tasks_per_node: int | None = None
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        extra = {k: v for k, v in data.items() if k not in known}
        cfg = cls(**{k: v for k, v in data.items() if k in known})
        cfg.extra.update(extra)
        return cfg

    def fingerprint(self) -> str:
        """Hash of everything that changes the trained weights (not logging or geometry: the
        geometry is the checkpoint key's second part)."""
        ignore = {
            "log_interval",
            "workers",
            "timeout_minutes",
            "keep_checkpoints",
            "throughput_warmup_steps",
            "extra",
            *GEOMETRY_KEYS,
        }
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in ignore}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JobGeometry:
    """Where a run's figures were measured: every row of the results states this."""

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int
    workers: int  # DataLoader workers per rank

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def tag(self) -> str:
        return (
            f"n{self.nodes}x{self.tasks_per_node}-c{self.cpus_per_task}"
            f"-g{self.gpus_per_node}-w{self.workers}"
        )


def resolve_geometry(cfg: TrainConfig, info: D.DistInfo, device: torch.device) -> JobGeometry:
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
    return JobGeometry(nodes, tasks, cpus, gpus, loader_workers(cfg.workers, cpus))


# --------------------------------------------------------------------------- data


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 10_000_019 + index) % (2**63 - 1)


class SeededAugmentation(Dataset):
    """Apply ``transform`` with an RNG seeded by (seed, epoch, index) given by the sampler."""

    def __init__(self, base: Dataset, transform, seed: int):
        self.base, self.transform, self.seed = base, transform, seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        image, label = self.base[index]
        with torch.random.fork_rng(devices=[]):
            # Not torch.manual_seed: on CUDA builds it also queues lazy seeding of every device
            # type and costs ~10x more per call; only the CPU generator drives these transforms.
            torch.default_generator.manual_seed(_sample_seed(self.seed, epoch, index))
            image = self.transform(image)
        return image, label


class EpochSampler(Sampler):
    """DistributedSampler that yields (epoch, index) and can skip the steps already done."""

    def __init__(self, length: int, world_size: int, rank: int, seed: int):
        self.inner = DistributedSampler(
            range(length),
            num_replicas=world_size,
            rank=rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip_samples: int = 0) -> None:
        self.inner.set_epoch(epoch)
        self.epoch, self.skip = epoch, skip_samples

    def __iter__(self):
        for position, index in enumerate(self.inner):
            if position >= self.skip:
                yield (self.epoch, index)

    def __len__(self) -> int:
        return len(self.inner) - self.skip


def loader_workers(setting: int | str, cpus_per_task: int) -> int:
    """``auto``: one DataLoader worker per CPU of this task but one (the training loop's)."""
    if setting != "auto":
        return int(setting)
    return max(0, cpus_per_task - 1)


def read_ids(path: Path) -> list[int]:
    return pd.read_csv(path, usecols=["sample_id"])["sample_id"].astype(int).tolist()


# --------------------------------------------------------------------------- model/optim


def build_model(name: str, num_classes: int) -> torch.nn.Module:
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def lr_lambda(steps_per_epoch: int, cfg: TrainConfig):
    """Linear warm-up then cosine decay to zero, per optimizer step."""
    warmup = int(cfg.warmup_epochs * steps_per_epoch)
    total = max(1, cfg.epochs * steps_per_epoch)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


# --------------------------------------------------------------------------- training


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Job:
    """One rank's view of the run: settings, placement and what it trains."""

    cfg: TrainConfig
    info: D.DistInfo
    device: torch.device
    geometry: JobGeometry
    model: torch.nn.Module
    step_model: torch.nn.Module  # DDP (and compiled) wrapper that runs the training step
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    criterion: torch.nn.Module
    checkpoint_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)

    def checkpoint_state(self, epoch: int, step: int, partial: list | None) -> dict[str, Any]:
        """Collective (every rank's RNG state is gathered); rank 0 saves the result."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": epoch,
            "step_in_epoch": step,
            "partial_epoch": partial,
            "history": self.history,
            "config": dataclasses.asdict(self.cfg),
            "geometry": dataclasses.asdict(self.geometry),
            "world_size": self.info.world_size,
            "rng": D.all_gather_objects(rng_state(self.device)),
        }

    def save(self, epoch: int, step: int, partial: list | None = None) -> Path | None:
        state = self.checkpoint_state(epoch, step, partial)
        path = None
        if self.info.is_main:
            path = save_checkpoint(self.checkpoint_dir, state, self.cfg.keep_checkpoints)
        D.barrier()
        return path


def train(
    cfg: TrainConfig,
    *,
    train_data: Path,
    split_dir: Path,
    out_dir: Path,
    checkpoint_root: Path,
    stop_after_steps: int | None = None,
) -> int:
    """Run training in this process (one rank). Returns the process exit code."""
    if cfg.deterministic:  # cuBLAS reads it when its first handle is created
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    info = D.dist_info_from_env()
    device = D.select_device(cfg.device, info.local_rank, cfg.gpus_per_node)
    D.init_process_group(info, device, cfg.backend, cfg.timeout_minutes)
    stop = StopFlag(SIGNAL_CHECK_STEPS)
    stop.install()
    try:
        return _train(
            cfg, info, device, train_data, split_dir, out_dir, checkpoint_root, stop,
            stop_after_steps,
        )  # fmt: skip
    finally:
        stop.settle()
        D.destroy_process_group()


def _train(
    cfg, info, device, train_data, split_dir, out_dir, checkpoint_root, stop, stop_after_steps
) -> int:
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    seed_everything(cfg.seed)
    geometry = resolve_geometry(cfg, info, device)
    # decode=False: train_transform decodes, after drawing its crop box (imagenet_ddp.jpeg)
    base = PreparedImageDataset(
        train_data, sample_ids=read_ids(split_dir / "train.csv"), decode=False
    )
    holdout = PreparedImageDataset(
        train_data,
        sample_ids=read_ids(split_dir / "holdout.csv"),
        transform=eval_transform(cfg.eval_resize, cfg.crop_size),
    )
    dataset = SeededAugmentation(base, train_transform(cfg.crop_size, normalize=False), cfg.seed)
    sampler = EpochSampler(len(dataset), info.world_size, info.rank, cfg.seed)
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=geometry.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=geometry.workers > 0,
        prefetch_factor=4 if geometry.workers > 0 else None,
        drop_last=True,
        worker_init_fn=ignore_stop_signals,
        multiprocessing_context=loader_context() if geometry.workers > 0 else None,
    )
    steps_per_epoch = len(sampler) // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"run {cfg.run!r}: batch_size {cfg.batch_size} x {info.world_size} ranks exceeds the "
            f"{len(dataset)} training samples; lower batch_size"
        )
    job = _build_job(
        cfg, info, device, geometry, base.num_classes, steps_per_epoch, checkpoint_root
    )
    resume = _resume(job)
    # [study hook] rank 0: TensorBoard events, NVML sampler thread, wall clock for the cost.
    monitor = RunMonitor.for_job(job, out_dir, steps_per_epoch, resumed=resume[3] is not None)
    try:
        code = _run_epochs(job, loader, sampler, holdout, resume, stop, stop_after_steps, monitor)
    finally:
        monitor.close()  # [study hook] idempotent; finish() below already closed it on success
        # Loader workers ignore stop signals (imagenet_ddp.signals), so the terminate() that
        # multiprocessing sends its daemons at exit cannot end persistent ones: stop them here.
        _shutdown_loader_workers(loader)
    if code != 0:
        return code
    ranks = D.all_gather_objects(
        {
            "rank": info.rank,
            "local_rank": info.local_rank,
            "host": info.host,
            "device": str(device),
            "pid": os.getpid(),
        }
    )
    if info.is_main:
        cost = monitor.finish(job.history)  # [study hook] the cost block of train_metrics.json
        _write_outputs(job, out_dir, base.num_classes, ranks, resumed_from=resume[3], cost=cost)
    D.barrier()
    return 0


def _run_epochs(
    job: Job, loader, sampler, holdout, resume, stop, stop_after_steps, monitor=None
) -> int:
    """Train from the resume point to the last epoch: 0, or EXIT_REQUEUE when stopped."""
    cfg, info = job.cfg, job.info
    steps_per_epoch = len(sampler) // cfg.batch_size
    start_epoch, start_step, partial, _ = resume
    steps_done = 0
    for epoch in range(start_epoch, cfg.epochs):
        first = epoch == start_epoch
        skip = start_step if first else 0
        sampler.set_epoch(epoch, skip_samples=skip * cfg.batch_size)
        carried = partial[info.rank] if first and partial else None  # a resumed epoch's counts
        meter = EpochMeter(job.device, cfg.throughput_warmup_steps, carried)
        progress = Progress(info.is_main, epoch, steps_per_epoch, cfg.log_interval, meter)
        job.step_model.train()
        step = skip
        for images, targets in _batches(job, loader, holdout.num_classes):
            loss, logits = _train_step(job, images, targets)
            meter.update(loss, logits, targets)
            step += 1
            steps_done += 1
            progress.update(step, meter)
            if monitor is not None:  # [study hook] TensorBoard every log_interval steps
                monitor.step(epoch, step, meter, job.scheduler.get_last_lr()[0])
            # Every rank polls at the same steps, so the agreement's collectives stay aligned.
            test_stop = stop_after_steps is not None and steps_done >= stop_after_steps
            if (test_stop or stop.poll(steps_done)) and step < steps_per_epoch:
                progress.close()
                path = job.save(epoch, step, D.all_gather_objects(meter.partial()))
                if info.is_main:
                    print(
                        f"interrupted at epoch {epoch} step {step}: wrote {path}; rerun to resume",
                        flush=True,
                    )
                return EXIT_REQUEUE
        progress.close()
        _end_epoch(job, epoch, meter, holdout, holdout.num_classes)
        if monitor is not None:  # [study hook] TensorBoard epoch scalars
            monitor.epoch(epoch, job.history[-1])
        if stop.agreed():  # signalled during the epoch: its checkpoint is written
            if info.is_main:
                print(f"interrupted after epoch {epoch}: checkpoint written; rerun to resume")
            return EXIT_REQUEUE
    return 0


def _shutdown_loader_workers(loader: DataLoader) -> None:
    iterator = getattr(loader, "_iterator", None)  # persistent workers live in it
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None


def _build_job(cfg, info, device, geometry, num_classes, steps_per_epoch, checkpoint_root) -> Job:
    model = build_model(cfg.model, num_classes).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        nesterov=cfg.momentum > 0,
    )
    ddp_model = (
        DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if D.is_distributed()
        else model
    )
    return Job(
        cfg=cfg,
        info=info,
        device=device,
        geometry=geometry,
        model=model,
        step_model=torch.compile(ddp_model) if cfg.compile else ddp_model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(steps_per_epoch, cfg)),
        scaler=torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16"),
        criterion=torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing),
        checkpoint_dir=checkpoint_dir(checkpoint_root, cfg.fingerprint(), geometry.tag),
    )


def _resume(job: Job) -> tuple[int, int, list | None, str | None]:
    """Load the newest checkpoint of this run and geometry: (epoch, step, partial, path)."""
    state = load_latest_checkpoint(job.checkpoint_dir)
    if state is None:
        root, tag = job.checkpoint_dir.parent, job.geometry.tag
        others = other_geometries(root, job.cfg.fingerprint(), tag)
        if others and job.info.is_main:
            print(
                f"not resuming {others[-1]}: written under another geometry "
                f"({others[-1].name.split('-', 1)[1]}), this job is {job.geometry.tag}; the "
                "batch order, LR schedule and measured figures would mix; starting fresh",
                flush=True,
            )
        return 0, 0, None, None
    job.model.load_state_dict(state["model"])
    job.optimizer.load_state_dict(state["optimizer"])
    job.scheduler.load_state_dict(state["scheduler"])
    job.scaler.load_state_dict(state["scaler"])
    job.history = state["history"]
    restore_rng_state(state["rng"][job.info.rank], job.device)
    if job.info.is_main:
        print(
            f"resuming from {state['path']} (epoch {state['epoch']}, step "
            f"{state['step_in_epoch']})",
            flush=True,
        )
    return state["epoch"], state["step_in_epoch"], state["partial_epoch"], state["path"]


def _batches(job: Job, loader: DataLoader, num_classes: int):
    """The epoch's batches on the device; synthetic mode measures the model alone (one fixed
    random batch, the loader untouched)."""
    cfg, device = job.cfg, job.device
    if cfg.synthetic:
        g = torch.Generator().manual_seed(cfg.seed)
        batch = (
            torch.randn(cfg.batch_size, 3, cfg.crop_size, cfg.crop_size, generator=g).to(device),
            torch.randint(0, num_classes, (cfg.batch_size,), generator=g).to(device),
        )
        yield from repeat(batch, len(loader))
        return
    with stop_signals_blocked():  # workers are forked here; see imagenet_ddp.signals
        batches = iter(loader)
    for images, targets in batches:  # uint8 crops from the loader; normalized on the device
        yield (
            normalize_batch(images.to(device, non_blocking=True)),
            targets.to(device, non_blocking=True),
        )


def _train_step(job: Job, images: torch.Tensor, targets: torch.Tensor):
    if job.cfg.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    with autocast(job.device, job.cfg.precision):
        logits = job.step_model(images)
        loss = job.criterion(logits, targets)
    job.optimizer.zero_grad(set_to_none=True)
    job.scaler.scale(loss).backward()
    job.scaler.step(job.optimizer)
    job.scaler.update()
    job.scheduler.step()
    return loss, logits


def _end_epoch(job: Job, epoch: int, meter: EpochMeter, holdout, num_classes: int) -> None:
    """Combine the ranks' counters, evaluate the holdout, record and checkpoint the epoch."""
    record = {"epoch": epoch, **meter.reduce(), "lr_end": job.scheduler.get_last_lr()[0]}
    D.broadcast_buffers(job.model)  # every rank evaluates the model that is saved
    result = evaluate_dataset(
        job.model,
        holdout,
        num_classes=num_classes,
        device=job.device,
        batch_size=job.cfg.batch_size,
        workers=job.geometry.workers,
        precision=job.cfg.precision,
        channels_last=job.cfg.channels_last,
        rank=job.info.rank,
        world_size=job.info.world_size,
    )
    record.update(
        holdout_top1=result["top1"], holdout_top5=result["top5"], holdout_loss=result["loss"]
    )
    job.history.append(record)
    if job.info.is_main:
        steady = record["steady_images_per_s"]
        print(
            f"epoch {epoch} done: loss {record['train_loss']:.4f} "
            f"train top1 {record['train_top1']:.3f} holdout top1 {record['holdout_top1']:.3f} "
            f"{record['images_per_s']:.1f} img/s end to end, "
            f"{'n/a' if steady is None else f'{steady:.1f}'} img/s steady "
            f"({record['epoch_seconds']:.1f} s)",
            flush=True,
        )
    job.save(epoch + 1, 0)


THROUGHPUT_NOTE = (
    "images_per_s: images of the epoch / slowest rank's epoch time, median over epochs; "
    "includes loader start-up and warm-up, excludes holdout evaluation and checkpoints. "
    "steady_images_per_s: the same without the first throughput_warmup_steps steps of each "
    "epoch, device synchronized at the window's edges. Node-local staging is in staging/."
)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def _write_outputs(
    job: Job, out_dir: Path, num_classes: int, ranks, resumed_from, cost=None
) -> None:
    cfg, history, world = job.cfg, job.history, job.info.world_size
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**dataclasses.asdict(cfg), **dataclasses.asdict(job.geometry)}
    with atomic_path(out_dir / "model.pt") as tmp:
        torch.save(
            {"model": job.model.state_dict(), "arch": cfg.model, "num_classes": num_classes,
             "config": config},
            tmp,
        )  # fmt: skip
    write_csv_atomic(
        out_dir / "history.csv",
        pd.DataFrame([{k: v for k, v in h.items() if not isinstance(v, list)} for h in history]),
    )
    epoch_seconds = [h["epoch_seconds"] for h in history]
    images_per_s = _median([h["images_per_s"] for h in history])
    steady = _median([h.get("steady_images_per_s") for h in history])
    write_json_atomic(
        out_dir / "train_metrics.json",
        {
            "run": cfg.run,
            "config": config,
            "geometry": {**dataclasses.asdict(job.geometry), "tag": job.geometry.tag},
            "fingerprint": cfg.fingerprint(),
            "world_size": world,
            "nodes": len({r["host"] for r in ranks}),
            "hosts": sorted({r["host"] for r in ranks}),
            "ranks": ranks,
            "global_batch": cfg.batch_size * world,
            "epochs": history,
            "mean_epoch_seconds": float(np.mean(epoch_seconds)) if epoch_seconds else None,
            "images_per_s": images_per_s,
            "images_per_s_per_worker": images_per_s / world,
            "steady_images_per_s": steady,
            "steady_images_per_s_per_worker": None if steady is None else steady / world,
            "throughput_warmup_steps": cfg.throughput_warmup_steps,
            "throughput_note": THROUGHPUT_NOTE,
            "resumed_from": resumed_from,
            "cost": cost,  # [study hook] imagenet_ddp.cost: wall, GPU-/core-hours, NVML
            "checkpoint_dir": str(job.checkpoint_dir),
            "torch": torch.__version__,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        },
    )


def main(argv: list[str] | None = None) -> int:
    """One rank of a training job: all it needs is in the job spec (imagenet_ddp.job_spec)."""
    from imagenet_ddp.job_spec import read_spec, staged_copy

    parser = argparse.ArgumentParser(description="DDP training worker (one per device)")
    parser.add_argument("--spec", type=Path, required=True, help="the job spec file")
    parser.add_argument(
        "--train-data",
        type=Path,
        default=None,
        help="prepared train dir (default: the copy this host staged for the run)",
    )
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        default=None,
        help="testing: behave as if signalled after this many steps",
    )
    args = parser.parse_args(argv)
    # `kill -USR2 <pid>` (or `scancel --signal=USR2 <job>`) prints every thread's traceback:
    # where a rank of a job that seems stuck is waiting, without stopping it.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    spec = read_spec(args.spec, "train")
    paths = spec["paths"]
    return train(
        TrainConfig.from_dict(spec["run"]),
        train_data=args.train_data or staged_copy(paths["run_dir"], D.dist_info_from_env().host),
        split_dir=Path(paths["split_dir"]),
        out_dir=Path(paths["run_dir"]),
        checkpoint_root=Path(paths["checkpoint_root"]),
        stop_after_steps=args.stop_after_steps,
    )


if __name__ == "__main__":
    sys.exit(main())
