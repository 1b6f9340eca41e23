"""What each rank reads: per-sample seeded augmentation and a sampler that resumes mid-epoch.

Augmentation is seeded per (seed, epoch, sample), not per worker process, and the sample order
is one permutation of (seed, epoch) cut into fixed micro-batch groups that the ranks share out
(:class:`EpochSampler`): every step sees the same samples in the same groups whatever the
worker or rank count, so a run resumed mid-epoch, on another rank count too, replays exactly
the same batches (docs/reliability.md, "Elastic resume").
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from imagenet_ddp.jobs.signals import ignore_stop_signals, loader_context
from imagenet_ddp.settings.geometry import global_batch
from imagenet_ddp.settings.node_memory import PREFETCH_BATCHES
from imagenet_ddp.training.recipe import (
    EpochTransforms,
    dali_problem,
    draws_python_numpy,
    seeded_draws,
    transform_problems,
)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 10_000_019 + index) % (2**63 - 1)


def batch_seed(seed: int, epoch: int, step: int, group: int) -> int:
    """Seed of one micro-batch group's batch-level augmentation (mixup/cutmix); never a
    sample's seed. By group, not rank: the same on any rank count (with one micro-batch per
    rank, group = rank, the seed of earlier versions)."""
    return sample_seed(seed, epoch, 2**40 + (step << 16) + group)


class SeededAugmentation(Dataset):
    """Apply ``transform`` with an RNG seeded by (seed, epoch, index) given by the sampler.

    ``transform`` is one transform, or a function of the epoch returning that epoch's transform
    (progressive resizing changes the crop size per epoch): pass ``per_epoch=True``. Python's and
    NumPy's RNGs are seeded too unless ``python_numpy`` is false (recipe.seeded_draws)."""

    def __init__(self, base: Dataset, transform, seed: int, *, per_epoch: bool = False,
                 python_numpy: bool = True):  # fmt: skip
        self.base, self.transform, self.seed = base, transform, seed
        self.per_epoch, self.python_numpy = per_epoch, python_numpy

    @classmethod
    def of_run(cls, base: Dataset, cfg) -> SeededAugmentation:
        """A run's training samples (training, the preflight, bench_gpu.py): its transform of
        each epoch seeded by its seed, Python's and NumPy's RNGs only where its recipe draws
        from them (saving and restoring NumPy's state is ~70 us of a ~900 us sample)."""
        return cls(base, EpochTransforms(cfg), cfg.seed, per_epoch=True,
                   python_numpy=draws_python_numpy(cfg))  # fmt: skip

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int, ...]):
        """``key``: (epoch, index), or (epoch, index, repeat) from
        :class:`RepeatedAugmentationSampler`: each repeat its own seed (repeat 0: the
        sample's)."""
        epoch, index, *_ = key
        image, label = self.base[index]
        transform = self.transform(epoch) if self.per_epoch else self.transform
        with seeded_draws(self.key_seed(key), self.python_numpy):
            image = transform(image)
        return image, label

    def key_seed(self, key: tuple[int, ...]) -> int:
        """The seed of a sampler's key (the DALI loader draws from it too)."""
        epoch, index, *repeat = key
        return sample_seed(self.seed, epoch, index + (repeat[0] << 34 if repeat else 0))


class EpochSampler(Sampler):
    """This rank's (epoch, index) keys, micro-batch after micro-batch, from a given step on.

    The epoch's order is ``torch.randperm`` seeded by seed + epoch (DistributedSampler's, so a
    one-rank run keeps the order of earlier versions). Optimizer step ``s`` takes positions
    ``[s * G, (s + 1) * G)`` of it, G the global batch (``batch_size`` x ranks x
    ``accumulation``), cut into G / batch_size groups; micro-batch ``a`` of the step on rank
    ``r`` is group ``a * world_size + r``. The tail of an epoch shorter than a global batch is
    left out (drop_last), whatever the rank count: :attr:`steps` is ``length // G``."""

    def __init__(
        self, length: int, world_size: int, rank: int, seed: int, batch_size=1, accumulation=1
    ):
        self.length, self.world_size, self.rank, self.seed = length, world_size, rank, seed
        self.batch_size, self.accumulation = batch_size, accumulation
        self.global_batch = global_batch(
            {"batch_size": batch_size, "accumulation": accumulation}, world_size
        )
        self.steps = length // self.global_batch  # optimizer steps per epoch
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip_steps: int = 0) -> None:
        self.epoch, self.skip = epoch, skip_steps

    def order(self) -> list[int]:
        """The epoch's permutation: a function of (seed, epoch) only."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def group(self, micro: int) -> int:
        """The micro-batch group of this rank's ``micro``-th micro-batch of a step."""
        return micro * self.world_size + self.rank

    def __iter__(self):
        order, size = self.order(), self.batch_size
        for step in range(self.skip, self.steps):
            for micro in range(self.accumulation):
                first = step * self.global_batch + self.group(micro) * size
                for index in order[first : first + size]:
                    yield (self.epoch, index)

    def __len__(self) -> int:
        return (self.steps - self.skip) * self.accumulation * self.batch_size


class RepeatedAugmentationSampler(EpochSampler):
    """Repeated augmentation (Hoffer et al. 2020; DeiT's RASampler, timm's RepeatAugSampler):
    the epoch's permutation with each index ``repeats`` times in a row, cut to the epoch's
    length (an epoch keeps its steps, seeing ~1/``repeats`` of the images). In step ``s``'s G
    positions, group ``g`` of ``n = G / batch_size`` takes ``g, g + n, g + 2n, ...``: an
    image's repeats land in other ranks' batches of the step; with one micro-batch per rank,
    DeiT's split (``indices[rank::world_size]``, its permutation ours at seed 0). The same
    groups on any rank count; keys (epoch, index, repeat), each repeat its own seed."""

    def __init__(self, *args, repeats: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.repeats = repeats

    def order(self) -> list[tuple[int, int]]:
        """The epoch's (index, repeat) sequence: a function of (seed, epoch) only."""
        repeated = [(i, r) for i in super().order() for r in range(self.repeats)]
        return repeated[: self.length]

    def __iter__(self):
        order, groups = self.order(), self.global_batch // self.batch_size
        for step in range(self.skip, self.steps):
            chunk = order[step * self.global_batch : (step + 1) * self.global_batch]
            for micro in range(self.accumulation):
                for index, repeat in chunk[self.group(micro) :: groups]:
                    yield (self.epoch, index, repeat)


def read_ids(path: Path) -> list[int]:
    return pd.read_csv(path, usecols=["sample_id"])["sample_id"].astype(int).tolist()


def train_loader(
    dataset: Dataset, sampler, batch_size: int, workers: int, pin: bool, persistent: bool = True,
    *, cfg=None, device=None,
):  # fmt: skip
    """A rank's DataLoader: the training's, or with no ``sampler`` the holdout's in order
    (accuracy.shard_loader). Its workers ignore stop signals (the rank's to handle). Its own
    generator: without one, each iterator draws its workers' base seed from the global RNG, so
    a resumed job (a new iterator mid-epoch, after the RNG is restored) would draw once more
    than the unbroken run, and the training's streams would depend on how often the holdout is
    evaluated: a model that draws while it trains (dropout, stochastic depth) would differ.
    Augmentation seeds itself per sample. ``persistent``: workers outlive a pass. A run's
    ``cfg`` with ``loader: dali``: the same batches through DALI on ``device``
    (training.dali_loader; the holdout's: its ``eval_resize``, ``eval_crop`` and
    ``interpolation``), ``workers`` its threads."""
    if cfg is not None and cfg.loader == "dali":
        from imagenet_ddp.training import dali_loader

        if sampler is None:
            return dali_loader.DaliEvalLoader(
                dataset, cfg, batch_size, workers, device, persistent)  # fmt: skip
        return dali_loader.DaliLoader(dataset, sampler, cfg, batch_size, workers, device)
    forks = workers > 0
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=persistent and forks,
        prefetch_factor=PREFETCH_BATCHES if forks else None,
        drop_last=sampler is not None,
        worker_init_fn=ignore_stop_signals,
        multiprocessing_context=loader_context() if forks else None,
        generator=torch.Generator().manual_seed(0),
    )


def write_check(run_json: str, num_classes: int, run_dir, out) -> None:
    """The ``check`` stage: settings.run_checks.write_check, and the run's loader at its extreme
    draws: its transforms (training.recipe.transform_problems) and, with ``loader: dali``,
    DALI's pipeline (training.dali_loader.extreme_problems) where it imports."""
    from imagenet_ddp.settings import run_checks
    from imagenet_ddp.settings.kinds import TrainConfig

    def loader_problems(run: dict) -> list[str]:
        cfg = TrainConfig.from_dict(run)
        problems = transform_problems(cfg)
        if cfg.loader != "dali":
            return problems
        missing = dali_problem(cfg)
        if missing:
            return [missing, *problems]
        from imagenet_ddp.training import dali_loader

        return problems + dali_loader.extreme_problems(cfg)

    run_checks.write_check(run_json, num_classes, run_dir, out, more=loader_problems)


def shutdown_loader_workers(loader: DataLoader) -> None:
    """Loader workers ignore stop signals (imagenet_ddp.jobs.signals), so the terminate() that
    multiprocessing sends its daemons at exit cannot end persistent ones: stop them here."""
    iterator = getattr(loader, "_iterator", None)  # persistent workers live in it
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None
