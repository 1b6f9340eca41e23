"""DDP training worker: one process per device, launched by torchrun (local) or srun (SLURM).

Design choices that matter for users:
- Augmentation is seeded per (seed, epoch, sample), not per worker process, so results do not
  depend on DataLoader worker count and a run resumed mid-epoch replays exactly the same batches.
- Checkpoints live in a directory keyed by a hash of the run's configuration, outside the rule's
  declared outputs: Snakemake's cleanup of a failed attempt does not delete them, a retry or a
  SLURM requeue resumes, and a changed configuration never resumes from a stale run.
- SIGTERM/SIGUSR1 (SLURM sends them before preemption or the time limit) make every rank stop at
  the same step; rank 0 writes a checkpoint and the job exits with EXIT_REQUEUE.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
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
from imagenet_ddp.evaluate import autocast, evaluate_dataset
from imagenet_ddp.io import atomic_path, write_csv_atomic, write_json_atomic
from imagenet_ddp.prepared import (
    PreparedImageDataset,
    eval_transform,
    normalize_batch,
    train_transform,
)

EXIT_REQUEUE = 75  # EX_TEMPFAIL: interrupted after writing a checkpoint; rerun to resume
SIGNAL_CHECK_STEPS = 10  # how often ranks agree on a pending SIGTERM/SIGUSR1 (one all-reduce)


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
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        extra = {k: v for k, v in data.items() if k not in known}
        cfg = cls(**{k: v for k, v in data.items() if k in known})
        cfg.extra.update(extra)
        return cfg

    def fingerprint(self) -> str:
        """Hash of everything that changes the trained weights (not logging or worker count)."""
        ignore = {"log_interval", "workers", "timeout_minutes", "keep_checkpoints", "extra"}
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in ignore}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


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


def loader_workers(setting: int | str) -> int:
    """``auto``: one DataLoader worker per CPU of this task but one (the training loop's).

    The launcher exports the task's CPU count as OMP_NUM_THREADS (SLURM_CPUS_PER_TASK inside
    srun), so this follows the job's ``cpus_per_task`` without another knob.
    """
    if setting != "auto":
        return int(setting)
    cpus = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("OMP_NUM_THREADS") or "1"
    return max(0, int(cpus) - 1)


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


# --------------------------------------------------------------------------- checkpoints


def checkpoint_name(epoch: int, step: int) -> str:
    return f"checkpoint-e{epoch:04d}-s{step:07d}.pt"


def save_checkpoint(directory: Path, state: dict[str, Any], keep: int) -> Path:
    path = directory / checkpoint_name(state["epoch"], state["step_in_epoch"])
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    for old in sorted(directory.glob("checkpoint-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_latest_checkpoint(directory: Path) -> dict[str, Any] | None:
    """Newest checkpoint that loads; a torn or corrupt file is reported and skipped."""
    for path in sorted(directory.glob("checkpoint-*.pt"), reverse=True):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            state["path"] = str(path)
            return state
        except Exception as exc:  # noqa: BLE001 - any unreadable file is skipped, not fatal
            print(f"warning: ignoring unreadable checkpoint {path}: {exc}", file=sys.stderr)
    return None


class StopFlag:
    """Set by SIGTERM/SIGUSR1; checked at step boundaries, agreed on by all ranks."""

    def __init__(self) -> None:
        self.signalled = 0

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.signalled = signum

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=device)
        return bool(D.all_reduce_max(flag).item())


# --------------------------------------------------------------------------- training


class Progress:
    """tqdm bar for an interactive rank 0; one plain line per interval in batch logs."""

    def __init__(self, enabled: bool, total: int, epoch: int, interval: int):
        self.enabled, self.interval, self.epoch, self.total = enabled, interval, epoch, total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"epoch {epoch}", unit="step", leave=False)

    def update(self, step: int, loss: float, images_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", img_s=f"{images_per_s:.0f}")
        elif step % self.interval == 0 or step == self.total:
            print(
                f"epoch {self.epoch} step {step}/{self.total} loss {loss:.4f} "
                f"{images_per_s:.1f} img/s (global)",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
    info = D.dist_info_from_env()
    device = D.select_device(cfg.device, info.local_rank)
    D.init_process_group(info, device, cfg.backend, cfg.timeout_minutes)
    stop = StopFlag()
    stop.install()
    try:
        return _train(
            cfg,
            info,
            device,
            train_data,
            split_dir,
            out_dir,
            checkpoint_root,
            stop,
            stop_after_steps,
        )
    finally:
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

    base = PreparedImageDataset(train_data, sample_ids=read_ids(split_dir / "train.csv"))
    holdout = PreparedImageDataset(
        train_data,
        sample_ids=read_ids(split_dir / "holdout.csv"),
        transform=eval_transform(cfg.eval_resize, cfg.crop_size),
    )
    num_classes = base.num_classes
    dataset = SeededAugmentation(base, train_transform(cfg.crop_size, normalize=False), cfg.seed)
    sampler = EpochSampler(len(dataset), info.world_size, info.rank, cfg.seed)
    workers = loader_workers(cfg.workers)
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
        drop_last=True,
    )
    steps_per_epoch = len(sampler) // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"run {cfg.run!r}: batch_size {cfg.batch_size} x {info.world_size} ranks exceeds the "
            f"{len(dataset)} training samples; lower batch_size"
        )

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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(steps_per_epoch, cfg))
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    checkpoint_dir = checkpoint_root / cfg.fingerprint()
    start_epoch, start_step, history, resumed_from = 0, 0, [], None
    state = load_latest_checkpoint(checkpoint_dir) if checkpoint_dir.exists() else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, start_step = state["epoch"], state["step_in_epoch"]
        history, resumed_from = state["history"], state["path"]
        partial = state.get("partial_epoch")
        if info.is_main:
            print(
                f"resuming from {resumed_from} (epoch {start_epoch}, step {start_step})", flush=True
            )
    else:
        partial = None

    ddp_model = (
        DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if D.is_distributed()
        else model
    )
    step_model = torch.compile(ddp_model) if cfg.compile else ddp_model
    synthetic_batch = None
    if cfg.synthetic:
        g = torch.Generator().manual_seed(cfg.seed)
        synthetic_batch = (
            torch.randn(cfg.batch_size, 3, cfg.crop_size, cfg.crop_size, generator=g).to(device),
            torch.randint(0, num_classes, (cfg.batch_size,), generator=g).to(device),
        )

    def checkpoint_state(epoch: int, step: int, partial_epoch: list | None) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch,
            "step_in_epoch": step,
            "partial_epoch": partial_epoch,
            "history": history,
            "config": dataclasses.asdict(cfg),
            "world_size": info.world_size,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
        }

    steps_done_total = 0
    for epoch in range(start_epoch, cfg.epochs):
        skip_steps = start_step if epoch == start_epoch else 0
        sampler.set_epoch(epoch, skip_samples=skip_steps * cfg.batch_size)
        acc = {"loss_sum": 0.0, "correct": 0.0, "samples": 0.0, "seconds": 0.0}
        if partial and epoch == start_epoch:
            acc.update(_partial_for_rank(partial, info))
        progress = Progress(info.is_main, steps_per_epoch, epoch, cfg.log_interval)
        ddp_model.train()
        t_epoch = time.perf_counter()
        t_interval, images_interval = t_epoch, 0
        step = skip_steps
        # Synthetic mode measures the model alone: the loader is not touched at all.
        batches = loader if synthetic_batch is None else repeat(synthetic_batch, len(loader))
        for images, targets in batches:
            if synthetic_batch is None:  # the loader ships uint8 crops; normalize on the device
                images = normalize_batch(images.to(device, non_blocking=True))
                targets = targets.to(device, non_blocking=True)
            if cfg.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with autocast(device, cfg.precision):
                logits = step_model(images)
                loss = criterion(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            steps_done_total += 1
            n = targets.shape[0]
            acc["loss_sum"] += loss.item() * n
            acc["correct"] += (logits.argmax(1) == targets).sum().item()
            acc["samples"] += n
            images_interval += n
            if info.is_main and (step % cfg.log_interval == 0 or step == steps_per_epoch):
                now = time.perf_counter()
                rate = images_interval * info.world_size / max(now - t_interval, 1e-9)
                t_interval, images_interval = now, 0
            else:
                rate = float("nan")
            progress.update(step, loss.item(), rate)
            # Every rank checks at the same steps, so the agreement's collective stays aligned.
            interrupted = (
                stop_after_steps is not None and steps_done_total >= stop_after_steps
            ) or (step % SIGNAL_CHECK_STEPS == 0 and stop.agreed(device))
            if interrupted and step < steps_per_epoch:
                progress.close()
                acc["seconds"] += time.perf_counter() - t_epoch
                partials = D.all_gather_objects(acc)  # each rank's share of the epoch so far
                if info.is_main:
                    path = save_checkpoint(
                        checkpoint_dir,
                        checkpoint_state(epoch, step, partials),
                        cfg.keep_checkpoints,
                    )
                    print(
                        f"interrupted at epoch {epoch} step {step}: wrote {path}; rerun to resume",
                        flush=True,
                    )
                D.barrier()
                return EXIT_REQUEUE
        progress.close()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = acc["seconds"] + time.perf_counter() - t_epoch
        record = _epoch_record(
            cfg, info, device, epoch, acc, seconds, scheduler, ddp_model, holdout, num_classes
        )
        history.append(record)
        if info.is_main:
            print(
                f"epoch {epoch} done: loss {record['train_loss']:.4f} "
                f"train top1 {record['train_top1']:.3f} holdout top1 {record['holdout_top1']:.3f} "
                f"{record['images_per_s']:.1f} img/s ({record['epoch_seconds']:.1f} s)",
                flush=True,
            )
            save_checkpoint(
                checkpoint_dir, checkpoint_state(epoch + 1, 0, None), cfg.keep_checkpoints
            )
        D.barrier()
        if stop.agreed(device):  # signalled during the epoch: its checkpoint is written
            if info.is_main:
                print(
                    f"interrupted after epoch {epoch}: checkpoint written; rerun to resume",
                    flush=True,
                )
            return EXIT_REQUEUE

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
        _write_outputs(
            cfg, info, out_dir, model, num_classes, history, ranks, resumed_from, checkpoint_dir
        )
    D.barrier()
    return 0


def _partial_for_rank(partials: list[dict], info: D.DistInfo) -> dict:
    """This rank's accumulators of an interrupted epoch (all of them on rank 0 if the world
    size changed, so the epoch's totals stay right)."""
    if len(partials) == info.world_size:
        return partials[info.rank]
    if not info.is_main:
        return {"loss_sum": 0.0, "correct": 0.0, "samples": 0.0, "seconds": 0.0}
    return {key: sum(p[key] for p in partials) for key in partials[0]}


def _epoch_record(
    cfg, info, device, epoch, acc, seconds, scheduler, ddp_model, holdout, num_classes
) -> dict[str, Any]:
    # Sum over ranks: loss, correct, samples; the slowest rank's time sets the epoch time.
    sums = D.all_reduce_sum(
        torch.tensor(
            [acc["loss_sum"], acc["correct"], acc["samples"]], dtype=torch.float64, device=device
        )
    ).cpu()
    per_rank = D.all_gather_objects(acc["samples"] / max(seconds, 1e-9))
    epoch_seconds = float(
        D.all_reduce_max(torch.tensor([seconds], dtype=torch.float64, device=device)).item()
    )
    module = ddp_model.module if isinstance(ddp_model, DistributedDataParallel) else ddp_model
    result = evaluate_dataset(
        module,
        holdout,
        num_classes=num_classes,
        device=device,
        batch_size=cfg.batch_size,
        workers=0,
        precision=cfg.precision,
        channels_last=cfg.channels_last,
        rank=info.rank,
        world_size=info.world_size,
    )
    samples = float(sums[2])
    return {
        "epoch": epoch,
        "train_loss": float(sums[0]) / samples,
        "train_top1": float(sums[1]) / samples,
        "images": int(samples),
        "epoch_seconds": epoch_seconds,
        "images_per_s": samples / epoch_seconds,
        "images_per_s_per_rank": [float(x) for x in per_rank],
        "lr_end": scheduler.get_last_lr()[0],
        "holdout_top1": result["top1"],
        "holdout_top5": result["top5"],
        "holdout_loss": result["loss"],
    }


def _write_outputs(
    cfg, info, out_dir, model, num_classes, history, ranks, resumed_from, checkpoint_dir
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "model.pt") as tmp:
        torch.save(
            {
                "model": model.state_dict(),
                "arch": cfg.model,
                "num_classes": num_classes,
                "config": dataclasses.asdict(cfg),
            },
            tmp,
        )
    write_csv_atomic(
        out_dir / "history.csv",
        pd.DataFrame([{k: v for k, v in h.items() if not isinstance(v, list)} for h in history]),
    )
    epoch_seconds = [h["epoch_seconds"] for h in history]
    write_json_atomic(
        out_dir / "train_metrics.json",
        {
            "run": cfg.run,
            "config": dataclasses.asdict(cfg),
            "fingerprint": cfg.fingerprint(),
            "world_size": info.world_size,
            "nodes": len({r["host"] for r in ranks}),
            "hosts": sorted({r["host"] for r in ranks}),
            "ranks": ranks,
            "global_batch": cfg.batch_size * info.world_size,
            "epochs": history,
            "mean_epoch_seconds": float(np.mean(epoch_seconds)) if epoch_seconds else None,
            "images_per_s": float(np.median([h["images_per_s"] for h in history])),
            "images_per_s_per_worker": float(
                np.median([h["images_per_s"] for h in history]) / info.world_size
            ),
            "resumed_from": resumed_from,
            "checkpoint_dir": str(checkpoint_dir),
            "torch": torch.__version__,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DDP training worker (one per device)")
    parser.add_argument("--config-json", required=True, help="run configuration as JSON")
    parser.add_argument("--train-data", type=Path, required=True, help="prepared train dir")
    parser.add_argument("--split-dir", type=Path, required=True, help="train.csv/holdout.csv dir")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-root", type=Path, required=True)
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        default=None,
        help="testing: behave as if signalled after this many steps",
    )
    args = parser.parse_args(argv)
    cfg = TrainConfig.from_dict(json.loads(args.config_json))
    return train(
        cfg,
        train_data=args.train_data,
        split_dir=args.split_dir,
        out_dir=args.out_dir,
        checkpoint_root=args.checkpoint_root,
        stop_after_steps=args.stop_after_steps,
    )


if __name__ == "__main__":
    sys.exit(main())
