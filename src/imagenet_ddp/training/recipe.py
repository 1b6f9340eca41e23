"""The recipe: learning-rate schedule, loss, augmentation and model EMA of a run, from torch's
and torchvision's parts (its optimizer: imagenet_ddp.optimizers.create_optimizer). The
schedule is one closed-form factor per step in a LambdaLR: a resumed run gets exactly the LR
of an uninterrupted one.
"""

from __future__ import annotations

import bisect
import math

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision.transforms import v2

from imagenet_ddp import models
from imagenet_ddp.data.dataset import train_transform
from imagenet_ddp.settings.geometry import global_batch
from imagenet_ddp.settings.kinds import TrainConfig

# --------------------------------------------------------------------------- schedule


def lr_lambda(steps_per_epoch: int, cfg: TrainConfig):
    """The LR factor of each optimizer step: linear warm-up from ``warmup_start_factor`` (its
    first step at that factor, as torchvision's LinearLR and FFCV), then ``lr_schedule``."""
    warmup = warmup_steps(cfg, steps_per_epoch)
    total = max(1, cfg.epochs * steps_per_epoch)
    milestones = sorted(e * steps_per_epoch for e in cfg.lr_step_epochs)
    start, low = cfg.warmup_start_factor, cfg.lr_min_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return start + (1.0 - start) * step / warmup
        if cfg.lr_schedule == "step":
            return cfg.lr_step_gamma ** bisect.bisect_right(milestones, step)
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if cfg.lr_schedule == "linear":
            return low + (1.0 - low) * (1.0 - progress)
        return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def warmup_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """``warmup_steps``, else ``warmup_epochs`` x the steps of an epoch."""
    if cfg.warmup_steps > 0:
        return int(cfg.warmup_steps)
    return int(cfg.warmup_epochs * steps_per_epoch)


def build_criterion(cfg: TrainConfig) -> torch.nn.Module:
    """Cross-entropy, or timm's BinaryCrossEntropy (``loss: bce``, ResNet strikes back's); each
    takes class indices or mixup/cutmix's label distributions."""
    if cfg.loss == "bce":
        from timm.loss import BinaryCrossEntropy

        return BinaryCrossEntropy(
            smoothing=cfg.label_smoothing, target_threshold=cfg.bce_target_threshold
        )
    return torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)


# --------------------------------------------------------------------------- augmentation

# torchvision's reference passes its --interpolation (default "bilinear") to each policy
# (references/classification/presets.py), timm its --interpolation to its RandAugment; the
# policies' own default is NEAREST, which makes every rotate, shear and translate blockier
# than the published recipes trained with.
POLICIES = {
    "randaugment": lambda mode: v2.RandAugment(interpolation=mode),
    "trivialaugment": lambda mode: v2.TrivialAugmentWide(interpolation=mode),
    "autoaugment": lambda mode: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=mode),
}


def mean_std(cfg: TrainConfig) -> tuple[tuple, tuple]:
    """The run's input normalization (``normalization``; models.input_normalization)."""
    return models.input_normalization(cfg.model, cfg.normalization)


def timm_rand_augment(spec: str, crop_size: int, mean, interpolation: str):
    """timm's RandAugment of a ``rand-...`` spec with ``create_transform``'s hyperparameters, on
    PIL images as timm runs it (its Python and NumPy draws seeded per sample by
    training.data.SeededAugmentation)."""
    from timm.data.auto_augment import rand_augment_transform
    from timm.data.transforms import str_to_pil_interp

    hparams = {
        "translate_const": int(crop_size * 0.45),
        "img_mean": tuple(round(255 * m) for m in mean),
        "interpolation": str_to_pil_interp(interpolation),
    }
    return v2.Compose([v2.ToPILImage(), rand_augment_transform(spec, hparams), v2.PILToTensor()])


def sample_transform(cfg: TrainConfig, crop_size: int):
    """Per-image training transform on uint8 crops (normalized later, on the device): random
    resized crop and flip, the ``auto_augment`` policy, random erasing."""
    mean = mean_std(cfg)[0]
    steps = [
        train_transform(
            crop_size,
            normalize=False,
            scale=cfg.crop_scale,
            ratio=cfg.crop_ratio,
            hflip=cfg.hflip,
            interpolation=cfg.interpolation,
        )
    ]
    mode = v2.InterpolationMode(cfg.interpolation)
    if cfg.auto_augment.startswith("rand-"):
        steps.append(timm_rand_augment(cfg.auto_augment, crop_size, mean, cfg.interpolation))
    elif cfg.auto_augment != "none":
        steps.append(POLICIES[cfg.auto_augment](mode))
    if cfg.random_erasing > 0:
        # Erased pixels get the mean colour: zero after normalization, as torchvision's
        # reference (which erases after normalizing) gives them.
        steps.append(v2.RandomErasing(p=cfg.random_erasing, value=[round(255 * m) for m in mean]))
    return v2.Compose(steps)


class EpochTransforms:
    """The sample transform of each epoch (its crop size follows progressive resizing)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg, self.cache = cfg, {}

    def __call__(self, epoch: int):
        size = self.cfg.crop_for_epoch(epoch)
        if size not in self.cache:
            self.cache[size] = sample_transform(self.cfg, size)
        return self.cache[size]


def batch_mixer(cfg: TrainConfig, num_classes: int):
    """Mixup and/or cutmix on a batch (one of the two per batch when both are on); None: off."""
    choices = []
    if cfg.mixup_alpha > 0:
        choices.append(v2.MixUp(alpha=cfg.mixup_alpha, num_classes=num_classes))
    if cfg.cutmix_alpha > 0:
        choices.append(v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=num_classes))
    if not choices:
        return None
    return choices[0] if len(choices) == 1 else v2.RandomChoice(choices)


def mix_batch(mixer, images, targets, seed: int):
    """Apply ``mixer`` with the CPU generator seeded by ``seed`` (resumes replay it)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return mixer(images, targets)


# --------------------------------------------------------------------------- EMA


def build_ema(cfg: TrainConfig, model: torch.nn.Module, world_size: int, device: torch.device):
    """The EMA of the weights and buffers on ``device`` (else NCCL's broadcast of its CPU
    ``n_averaged`` fails), or None. As torchvision's reference, the decay is per image: alpha =
    (1 - decay) x global batch x ema_steps / epochs."""
    if cfg.ema_decay <= 0:
        return None
    adjust = global_batch(vars(cfg), world_size) * cfg.ema_steps / cfg.epochs
    alpha = min(1.0, (1.0 - cfg.ema_decay) * adjust)
    return AveragedModel(
        model, device=device, multi_avg_fn=get_ema_multi_avg_fn(1.0 - alpha), use_buffers=True
    )


def update_ema(cfg: TrainConfig, ema, model: torch.nn.Module, step: int, epoch: int) -> None:
    """After optimizer step ``step`` (counted from the run's start): every ``ema_steps``."""
    if ema is None or step % cfg.ema_steps:
        return
    ema.update_parameters(model)
    # during warm-up the average restarts (as the reference), per epoch or per step
    warming = epoch < cfg.warmup_epochs if cfg.warmup_steps == 0 else step <= cfg.warmup_steps
    if warming:
        ema.n_averaged.fill_(0)
