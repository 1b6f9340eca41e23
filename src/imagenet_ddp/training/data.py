"""What each rank reads: per-sample seeded augmentation and a sampler that resumes mid-epoch.

Augmentation is seeded per (seed, epoch, sample), not per worker process, so results do not
depend on the DataLoader's worker count and a run resumed mid-epoch replays exactly the same
batches.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from imagenet_ddp.signals import ignore_stop_signals, loader_context


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 10_000_019 + index) % (2**63 - 1)


def batch_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """Seed of one rank's batch-level augmentation (mixup/cutmix); never a sample's seed."""
    return sample_seed(seed, epoch, 2**40 + (step << 16) + rank)


class SeededAugmentation(Dataset):
    """Apply ``transform`` with an RNG seeded by (seed, epoch, index) given by the sampler.

    ``transform`` is one transform, or a function of the epoch returning that epoch's transform
    (progressive resizing changes the crop size per epoch): pass ``per_epoch=True``."""

    def __init__(self, base: Dataset, transform, seed: int, *, per_epoch: bool = False):
        self.base, self.transform, self.seed = base, transform, seed
        self.per_epoch = per_epoch

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        image, label = self.base[index]
        transform = self.transform(epoch) if self.per_epoch else self.transform
        with torch.random.fork_rng(devices=[]):
            # Not torch.manual_seed: on CUDA builds it also queues lazy seeding of every device
            # type and costs ~10x more per call; only the CPU generator drives these transforms.
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            image = transform(image)
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


def read_ids(path: Path) -> list[int]:
    return pd.read_csv(path, usecols=["sample_id"])["sample_id"].astype(int).tolist()


def train_loader(
    dataset: Dataset, sampler: EpochSampler, batch_size: int, workers: int, pin: bool
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
        drop_last=True,
        worker_init_fn=ignore_stop_signals,
        multiprocessing_context=loader_context() if workers > 0 else None,
    )


def shutdown_loader_workers(loader: DataLoader) -> None:
    """Loader workers ignore stop signals (imagenet_ddp.signals), so the terminate() that
    multiprocessing sends its daemons at exit cannot end persistent ones: stop them here."""
    iterator = getattr(loader, "_iterator", None)  # persistent workers live in it
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None
