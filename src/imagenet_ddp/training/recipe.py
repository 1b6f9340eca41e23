"""The recipe: learning-rate schedule, loss, augmentation and model EMA of a run, from torch's
and torchvision's parts (its optimizer: imagenet_ddp.optimizers.create_optimizer). The
schedule is one closed-form factor per step in a LambdaLR: a resumed run gets exactly the LR
of an uninterrupted one.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import math
import random
from functools import partial

import numpy as np
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


def mean_colour(cfg: TrainConfig) -> tuple[int, ...]:
    """The run's normalization mean as uint8 pixels: erased pixels' colour (zero after
    normalization, as torchvision's reference erases) and timm's geometric ops' fill."""
    return tuple(round(255 * m) for m in mean_std(cfg)[0])


def draws_python_numpy(cfg: TrainConfig) -> bool:
    """Whether the run's sample transform draws from Python's and NumPy's RNGs: timm's
    RandAugment alone does; torchvision's transforms and policies draw from torch's
    (tests/test_recipes.py checks every policy)."""
    return cfg.auto_augment.startswith("rand-")


def timm_rand_augment(spec: str, crop_size: int, mean, interpolation: str):
    """timm's RandAugment of a ``rand-...`` spec with ``create_transform``'s hyperparameters, on
    PIL images as timm runs it (its Python and NumPy draws seeded per sample by
    training.data.SeededAugmentation: :func:`draws_python_numpy`)."""
    from timm.data import auto_augment
    from timm.data.auto_augment import rand_augment_transform
    from timm.data.transforms import str_to_pil_interp

    hparams = {
        "translate_const": int(crop_size * 0.45),
        "img_mean": tuple(round(255 * m) for m in mean),
        "interpolation": str_to_pil_interp(interpolation),
    }
    augment = rand_augment_transform(spec, hparams)
    for op in augment.ops:
        if op.aug_fn is auto_augment.posterize:
            op.aug_fn = posterize
    return through_pil(augment)


def through_pil(op):
    """``op`` (timm's, on PIL images) on a uint8 crop tensor, back to one: the hand-off of the
    pytorch path and of the check's forced ops; DALI's draws read ``op`` (``transforms[1]``)."""
    return v2.Compose([pil_image, op, v2.PILToTensor()])


def pil_image(image):
    """A uint8 RGB crop (3 x H x W) as the PIL image v2.ToPILImage makes, pixel for pixel, in
    ~30 us instead of ~220 at 224: ToPILImage hands Pillow a channels-last view, which numpy
    copies out byte by byte 3 apart (6-12 % of a DeiT sample's time: bench_loader.py); Pillow's
    merge of the three contiguous planes interleaves them in C."""
    from PIL import Image

    planes = image.numpy()
    if planes.shape[0] != 3 or planes.dtype != np.uint8:  # not a crop of the reader's
        return v2.functional.to_pil_image(image)
    return Image.merge("RGB", [Image.fromarray(plane) for plane in planes])


def posterize(img, bits_to_keep, **_):
    """timm's posterize op as the published ``inc1`` recipes ran it. PosterizeIncreasing keeps
    4 - int(m / 10 x 4) bits: 0 at magnitude 10, which a magnitude of 9 with mstd 0.5 draws
    (clipped) in ~2 % of its ops. Pillow up to 12 kept no bits there (mask ~255: every
    channel 0, a black image; timm's own policy comment says so), Pillow 13 raises
    ``bits must be between or equal to 1 and 8``. Clamping to 1 bit would be another image
    (values 0 and 128), so 0 bits stay black, as DeiT and ResNet strikes back trained."""
    from PIL import ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point([0] * 256 * len(img.getbands()))
    return ImageOps.posterize(img, bits_to_keep)


@contextlib.contextmanager
def seeded_draws(seed: int, python_numpy: bool = True):
    """One sample's draws: torch's CPU generator seeded by ``seed`` for the block, and Python's
    and NumPy's (timm's RandAugment draws from them) unless ``python_numpy`` is false, each
    restored after (training.data.SeededAugmentation, dali_loader.sample_window). Not
    torch.manual_seed: on CUDA builds it also queues lazy seeding of every device type and costs
    ~10x more per call; only the CPU generator drives torchvision's transforms."""
    saved = (random.getstate(), np.random.get_state()) if python_numpy else None
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        if saved:
            random.seed(seed)
            np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            if saved:
                random.setstate(saved[0])
                np.random.set_state(saved[1])


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
        steps.append(v2.RandomErasing(p=cfg.random_erasing, value=list(mean_colour(cfg))))
    return v2.Compose(steps)


# --------------------------------------------------------------------------- extreme draws


def extreme_transforms(cfg: TrainConfig, crop_size: int) -> tuple[dict, dict]:
    """The run's training transform at each extreme one of its draws can reach, by name:
    (crops, ops). Crops: the box at each end of crop_scale x crop_ratio, the flip and erasing
    at probability 1. Ops: each op of its ``auto_augment`` policy alone at probability 1, at
    both ends of its magnitudes, then erasing: applied to the smallest crop's output. A draw
    that raises once in 500 samples (1 per step at 2,048 images a step) raises here always."""
    erase = [v2.RandomErasing(p=1.0, value=list(mean_colour(cfg)))]
    erase = erase if cfg.random_erasing > 0 else []
    crops = {}
    for scale in sorted(set(cfg.crop_scale)):  # the smallest first
        for ratio in sorted(set(cfg.crop_ratio)):
            crop = train_transform(
                crop_size,
                normalize=False,
                scale=(scale, scale),
                ratio=(ratio, ratio),
                hflip=1.0,
                interpolation=cfg.interpolation,
            )
            crops[f"crop scale {scale:g} ratio {ratio:.3g}"] = v2.Compose([crop, *erase])
    ops = {name: v2.Compose([_forced_transform(forced), *erase])
           for name, forced in policy_extremes(cfg, crop_size)}  # fmt: skip
    return crops, ops


def policy_extremes(cfg: TrainConfig, crop_size: int):
    """(name, forced op) for each op of the run's policy at each extreme, on a ``crop_size``
    square: timm's op (a copy at probability 1, magnitude 0 or its upper bound, no noise; its
    sign still drawn), or torchvision's (policy, op name, magnitude) at the ends of the bins
    it draws from, each sign. The pytorch path applies them (:func:`extreme_transforms`), the
    DALI path records them (dali_loader.extreme_problems)."""
    if cfg.auto_augment.startswith("rand-"):
        timm = timm_rand_augment(cfg.auto_augment, crop_size, mean_std(cfg)[0], cfg.interpolation)
        for op in timm.transforms[1].ops:
            for magnitude in (0.0, float(op.magnitude_max or 10)):
                forced = copy.copy(op)
                forced.prob, forced.magnitude_std, forced.magnitude = 1.0, 0, magnitude
                yield f"{op.name} at magnitude {magnitude:g}", forced
    elif cfg.auto_augment != "none":
        policy = POLICIES[cfg.auto_augment](v2.InterpolationMode(cfg.interpolation))
        bins = {"randaugment": [getattr(policy, "magnitude", 0)], "autoaugment": [0, 9]}
        ends = bins.get(cfg.auto_augment, [0, getattr(policy, "num_magnitude_bins", 31) - 1])
        count = 10 if isinstance(policy, v2.AutoAugment) else policy.num_magnitude_bins
        # their per-op table and call are the only way to force one op
        for op_name, (magnitudes_fn, signed) in policy._AUGMENTATION_SPACE.items():
            magnitudes = magnitudes_fn(count, crop_size, crop_size)
            for end in ends:
                for sign in (1, -1) if signed else (1,):
                    magnitude = 0.0 if magnitudes is None else sign * float(magnitudes[end])
                    name = f"{op_name} at bin {end}{' negated' if sign < 0 else ''}"
                    yield name, (policy, op_name, magnitude)


def _forced_transform(forced):
    """A transform of :func:`policy_extremes`'s forced op."""
    if not isinstance(forced, tuple):  # timm's, on PIL images
        return through_pil(forced)
    return partial(_torchvision_op, *forced)


def _torchvision_op(policy, op_name, magnitude, image):
    return policy._apply_image_or_video_transform(
        image, op_name, magnitude, interpolation=policy.interpolation, fill=policy._fill
    )


def run_crops(cfg: TrainConfig) -> list[int]:
    """The training crops a run reaches (progressive resizing's too), smallest first."""
    return sorted({cfg.crop_for_epoch(e) for e in range(cfg.epochs)} | {cfg.crop_size})


def synthetic_images(size: int) -> list:
    """A few images a transform must take: noise and one flat colour (what equalize and
    autocontrast divide by), landscape and portrait, decoded and as an encoded JPEG (the
    training crop's two inputs) with the shorter side ``size``."""
    import numpy as np
    import simplejpeg

    generator = torch.Generator().manual_seed(0)
    long = size * 4 // 3
    noise = torch.randint(0, 256, (3, size, long), dtype=torch.uint8, generator=generator)
    flat = torch.full((3, long, size), 128, dtype=torch.uint8)
    encoded = simplejpeg.encode_jpeg(np.ascontiguousarray(noise.permute(1, 2, 0).numpy()))
    return [noise, flat, encoded]


def transform_problems(cfg: TrainConfig) -> list[str]:
    """The run's training transform at its extremes (:func:`extreme_transforms`) at each of its
    crops, and its evaluation transform, on :func:`synthetic_images`: one line per transform
    that raises, naming it (what would otherwise raise in a step on the GPU node)."""
    import random

    import numpy as np

    from imagenet_ddp.data.dataset import eval_transform

    crops = run_crops(cfg)
    images = synthetic_images(max(*crops, cfg.eval_resize))
    decoded = [i for i in images if torch.is_tensor(i)]
    problems = []

    def apply(name, transform, inputs):
        try:
            outputs = []
            for seed, image in enumerate(inputs):
                random.seed(seed)
                np.random.seed(seed)
                torch.manual_seed(seed)
                outputs.append(transform(image))
            return outputs
        except Exception as error:  # noqa: BLE001 - any of them would stop the run's step
            first = (str(error).splitlines() or [""])[0]
            problems.append(
                f"auto_augment {cfg.auto_augment!r}: its {name} raises {type(error).__name__}: "
                f"{first}; the run would fail in a step on its node: change auto_augment, "
                "crop_scale, crop_ratio or the crops"
            )
            return None

    for crop in crops:
        boxes, ops = extreme_transforms(cfg, crop)
        smallest = [apply(f"training {name} at crop {crop}", t, images)
                    for name, t in boxes.items()][0]  # fmt: skip
        for name, transform in ops.items() if smallest else ():
            apply(f"training {name} at crop {crop}", transform, smallest[:2])
    evaluation = eval_transform(cfg.eval_resize, cfg.eval_crop, normalize=False,
                                interpolation=cfg.interpolation)  # fmt: skip
    apply(f"evaluation resize {cfg.eval_resize} crop {cfg.eval_crop}", evaluation, decoded)
    return problems


def dali_problem(cfg) -> str | None:
    """The check job's line where this environment cannot run ``loader: dali``."""
    if getattr(cfg, "loader", "pytorch") != "dali":
        return None
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as error:
        return (
            f"runs[].loader 'dali': nvidia.dali does not import in the jobs' environment "
            f"({error}); install imagenet-ddp[dali] there, or set loader: pytorch"
        )
    return None


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
