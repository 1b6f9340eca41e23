"""``auto_augment`` under ``loader: dali``: the policy's own draws, per sample, applied by DALI.

Each sample's ops and magnitudes are the ones the pytorch path's policy itself draws, recorded
instead of applied, inside the sample's seeded draws (dali_loader.sample_window, after the crop
and flip, as recipe.sample_transform orders them): torchvision's policies (trivialaugment,
randaugment, autoaugment) run their ``forward`` on a stand-in of the crop's size, its per-op call
replaced; timm's RandAugment (``rand-*``, recipe.timm_rand_augment) runs its ``__call__`` on a
stand-in PIL image with each op's ``aug_fn`` replaced, so the op choice (NumPy), the
probability skip, the magnitude noise (Python's ``random``) and ``level_fn`` are timm's. So the
draws are the pytorch path's, the same on any rank or worker count and after a resume, and a
torchvision or timm release that changes them changes both paths alike. DALI then applies the
recorded ops to the decoded crop (on the GPU on CUDA), one ``select`` per op slot (DALI's
conditional split; timm's: its ``n`` layers), timm's geometric ops filling with the mean
(its ``img_mean``) and resampling with the run's interpolation, as the pytorch path passes
them (bilinear for bicubic, below).
Pixels match torchvision's and Pillow's within a level or two on every op but Equalize (DALI's
follows OpenCV's lookup table: ~5-11 levels off on average) and, with ``interpolation:
bicubic``, the warps: DALI's take no cubic filter, so they resample bilinearly (Rotate 2.4 levels
off Pillow's bicubic at 30 degrees; tests/test_dali_loader.py).
"""

from __future__ import annotations

import copy
from functools import partial

import torch
from torchvision.transforms import v2

# The ops of torchvision's three policies (v2 TrivialAugmentWide, RandAugment, AutoAugment's
# ImageNet policy) and of timm's RandAugment (its SolarizeAdd too); the index is what the
# pipeline's select() reads.
OP_NAMES = (
    "Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color",
    "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert",
    "SolarizeAdd",
)  # fmt: skip

# Op slots a sample's draw fills: TrivialAugmentWide applies one op, RandAugment num_ops (its
# default 2, as recipe.POLICIES builds it), AutoAugment a sub-policy of two (each applied with
# its probability: an op not applied is Identity).
SLOTS = {"trivialaugment": 1, "randaugment": 2, "autoaugment": 2}


def slots(auto_augment: str) -> int:
    """Op slots of a run's ``auto_augment`` under DALI: 0 for none; a timm ``rand-*`` spec's
    layers (its ``n``, as timm's own parser reads it)."""
    if auto_augment.startswith("rand-"):
        from timm.data.auto_augment import rand_augment_transform

        return rand_augment_transform(auto_augment, {}).num_layers
    return SLOTS.get(auto_augment, 0)


def is_timm(policy) -> bool:
    """Whether ``policy`` is timm's RandAugment (drawing from Python's and NumPy's RNGs), not a
    torchvision policy (torch's)."""
    return policy is not None and not isinstance(policy, v2.Transform)


def recorded_draws(policy, size: int, count: int) -> list[tuple[int, float]]:
    """(op index, DALI parameter) of each of ``count`` slots: ``policy`` (a torchvision v2 policy,
    or timm's RandAugment: :func:`timm_draws`) drawing on a ``size`` x ``size`` crop, from the
    current torch RNG (torchvision's), as it would transform it; unused slots are Identity."""
    if is_timm(policy):
        return timm_draws(policy, size, count)
    drawn: list[tuple[str, float]] = []

    def record(image, transform_id, magnitude, **_):
        drawn.append((transform_id, magnitude))
        return image

    policy._apply_image_or_video_transform = record  # this instance only: it draws, never applies
    policy(torch.zeros((3, 1, 1), dtype=torch.uint8).expand(3, size, size))
    if len(drawn) > count:
        raise RuntimeError(f"{type(policy).__name__} applied {len(drawn)} ops, more than {count}")
    drawn += [("Identity", 0.0)] * (count - len(drawn))
    return [(OP_NAMES.index(name), dali_parameter(name, magnitude)) for name, magnitude in drawn]


def dali_parameter(name: str, magnitude: float) -> float:
    """The number DALI's op of ``name`` takes for torchvision's ``magnitude``
    (torchvision.transforms.v2's _AutoAugmentBase._apply_image_or_video_transform)."""
    if name in ("ShearX", "ShearY"):
        return -magnitude  # DALI's shear maps forward: torchvision's factor, negated
    if name in ("TranslateX", "TranslateY"):
        return float(int(magnitude))  # whole pixels, truncated as torchvision does
    if name in ("Brightness", "Color", "Contrast"):
        return 1.0 + magnitude
    if name == "Posterize":
        return float(255 ^ (2 ** (8 - int(magnitude)) - 1))  # the mask of the bits kept
    if name == "Solarize":
        return 255.0 * magnitude  # threshold on uint8 pixels
    return float(magnitude)  # Rotate (degrees), Sharpness (factor - 1), the unparameterized


def timm_draws(augment, size: int, count: int) -> list[tuple[int, float]]:
    """(op index, DALI parameter) of each of ``count`` slots: ``augment`` (timm's RandAugment)
    drawing from the current Python and NumPy RNGs on a ``size`` x ``size`` crop, its ops'
    ``aug_fn`` (on this instance) recording the level arguments timm's ``level_fn`` gives them
    instead of applying them; ops skipped by their probability, and unused slots, are Identity."""
    from PIL import Image

    drawn: list[tuple[int, float]] = []
    for op in augment.ops:
        op.aug_fn = partial(_record_timm_op, drawn, op.name, size)
    augment(Image.new("RGB", (size, size)))
    if len(drawn) > count:
        raise RuntimeError(f"timm's RandAugment applied {len(drawn)} ops, more than {count}")
    return drawn + [(0, 0.0)] * (count - len(drawn))


def forced_draw(forced, size: int) -> tuple[int, float]:
    """(op index, DALI parameter) of one of recipe.policy_extremes's forced ops on a ``size``
    crop: torchvision's (policy, name, magnitude) converted, or timm's op called (its sign
    drawn from the current Python RNG) with its ``aug_fn`` recording."""
    if isinstance(forced, tuple):
        _, name, magnitude = forced
        return OP_NAMES.index(name), dali_parameter(name, magnitude)
    from PIL import Image

    drawn: list[tuple[int, float]] = []
    op = copy.copy(forced)
    op.aug_fn = partial(_record_timm_op, drawn, forced.name, size)
    op(Image.new("RGB", (size, size)))
    return drawn[0]


def _record_timm_op(drawn: list, name: str, size: int, image, *args, resample=None, **_):
    if isinstance(resample, (list, tuple)):  # timm's random choice, in the aug_fn not drawn here
        raise ValueError(
            f"timm's RandAugment resamples at random among {resample} (its {name} drew): give "
            "it an interpolation hparam, as recipe.timm_rand_augment does, whose draw is timm's"
        )
    drawn.append(timm_parameter(name, args, size))
    return image


def timm_parameter(name: str, args: tuple, size: int) -> tuple[int, float]:
    """(op index, DALI parameter) of timm's op ``name`` with the level arguments its ``aug_fn``
    receives (timm.data.auto_augment's LEVEL_TO_ARG), on a square crop of ``size``."""
    base = name.removesuffix("Increasing").removesuffix("Original")
    if base in ("ShearX", "ShearY"):  # Pillow's affine is the inverse map: DALI's, negated
        value = -args[0]
    elif base in ("TranslateXRel", "TranslateYRel"):
        base, value = base[: -len("Rel")], -args[0] * size  # a fraction of the side, inverse map
    elif base in ("TranslateX", "TranslateY"):
        value = -args[0]  # pixels, inverse map
    elif base in ("Rotate", "Brightness", "Color", "Contrast", "Solarize", "SolarizeAdd"):
        value = args[0]  # degrees (counterclockwise, as DALI's), Pillow's factor, thresholds
    elif base == "Sharpness":
        value = args[0] - 1.0  # Pillow's factor, DALI's sharpness op the amount over 1
    elif base == "Posterize":  # the mask of the bits kept; 0 bits: black (recipe.posterize)
        bits = min(8, max(0, int(args[0])))
        value = float(255 ^ (2 ** (8 - bits) - 1))
    elif base in ("AutoContrast", "Equalize", "Invert"):
        value = 0.0
    else:
        raise ValueError(
            f"auto_augment: timm's RandAugment op {name} has no DALI counterpart here; set "
            "loader: pytorch, or use one of timm's default rand-* op sets (no t section)"
        )
    return OP_NAMES.index(base), float(value)


def dali_ops(interp, fill=(0, 0, 0)):
    """The DALI functions of OP_NAMES, in order: (HWC uint8 batch, per-sample parameter) -> batch.
    Geometric ops fill with ``fill`` (per channel: torchvision's default 0, timm's the mean) and
    resample with ``interp``, bilinear for bicubic: DALI's warps (warp_affine, rotate) take
    nearest and linear only, and refuse cubic in the pipeline's first batch."""
    import numpy as np
    from nvidia.dali import fn, types

    if interp not in (types.INTERP_NN, types.INTERP_LINEAR):
        interp = types.INTERP_LINEAR

    def on(data, value):  # an arithmetic operand where the data is (named arguments: the CPU)
        return value.gpu() if data.device == "gpu" else value

    def filled(geometric, data):
        """``geometric`` (filling with 0) of ``data``, filled with ``fill``: DALI's fill_value
        is one number for every channel, so the op runs on data - fill, in float."""
        if not any(fill):
            return geometric(data)
        shift = types.Constant(np.array(fill, np.float32))
        return fn.cast_like(geometric(fn.cast(data, dtype=types.FLOAT) - shift) + shift, data)

    def warp(data, matrix):
        return filled(partial(fn.warp_affine, matrix=matrix, fill_value=0, interp_type=interp,
                              inverse_map=False), data)  # fmt: skip

    def rotate(data, angle):
        return filled(partial(fn.rotate, angle=angle, fill_value=0, interp_type=interp,
                              keep_size=True), data)  # fmt: skip

    def contrast(data, factor):  # PIL's and torchvision's centre: the grey image's mean
        mean = fn.reductions.mean(data, axis_names="HW", keep_dims=True)
        grey = types.Constant(np.array([0.299, 0.587, 0.114], np.float32))
        centre = fn.reductions.sum(mean * grey, axis_names="C", keep_dims=True)
        return fn.cast_like(centre + (data - centre) * on(data, factor), data)

    def sharpness(data, amount):  # Pillow's and torchvision's: blend with a 3x3 smoothing
        blur = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13
        ident = np.zeros((3, 3), np.float32)
        ident[1, 1] = 1
        kernel = types.Constant(ident) + types.Constant(ident - blur) * amount
        sharpened = fn.filter(data, on(data, kernel))
        # both keep the border pixels as they are; DALI's filter reflects there: the pixels
        # whose 3x3 window lies inside the image (a mean of 1 over ones, 0 outside) take it
        ones = fn.cast(data, dtype=types.FLOAT) * 0.0 + 1.0
        window = on(data, types.Constant(np.full((3, 3), 1 / 9, np.float32)))
        inside = fn.filter(ones, window, border="constant") > 0.99
        return inside * sharpened + (inside ^ True) * data

    def solarize(data, threshold):
        kept = data < on(data, threshold)
        return kept * data + (kept ^ True) * (types.Constant(255, dtype=types.UINT8) - data)

    def solarize_add(data, add):  # timm's: below 128, add (saturating at 255); the rest kept
        low = data < types.Constant(128, dtype=types.UINT8)
        added = fn.cast_like(fn.cast(data, dtype=types.FLOAT) + on(data, add), data)
        return low * added + (low ^ True) * data

    def auto_contrast(data, _):
        low = fn.reductions.min(data, axis_names="HW", keep_dims=True)
        high = fn.reductions.max(data, axis_names="HW", keep_dims=True)
        spread = high - low
        scaled = spread > 0
        divisor = spread * scaled + types.Constant(255, dtype=types.UINT8) * (scaled ^ True)
        return fn.cast_like((data - low * scaled) * (255 / divisor), data)

    def pair(first, second):
        return fn.stack(first, second)

    return (
        lambda data, _: data,
        lambda data, s: warp(data, fn.transforms.shear(shear=pair(s, s * 0.0))),
        lambda data, s: warp(data, fn.transforms.shear(shear=pair(s * 0.0, s))),
        lambda data, t: warp(data, fn.transforms.translation(offset=pair(t, t * 0.0))),
        lambda data, t: warp(data, fn.transforms.translation(offset=pair(t * 0.0, t))),
        rotate,
        lambda data, factor: fn.brightness(data, brightness=factor),
        lambda data, factor: fn.saturation(data, saturation=factor),
        contrast,
        sharpness,
        lambda data, mask: data & on(data, fn.cast(mask, dtype=types.UINT8)),
        solarize,
        auto_contrast,
        lambda data, _: fn.equalize(data),
        lambda data, _: types.Constant(255, dtype=types.UINT8) - data,
        solarize_add,
    )


def apply(images, draws: list, interp, fill=(0, 0, 0)):
    """``images`` (HWC uint8) through each slot's drawn op: ``draws``, the slots' op index and
    parameter DataNodes in turn (op, parameter, op, ...); geometric ops fill with ``fill``.
    Needs ``enable_conditionals``, whose conversion of this code knows no ``zip(strict=)``."""
    from nvidia.dali.auto_aug.core import select

    ops = dali_ops(interp, fill)
    for slot in range(0, len(draws), 2):
        images = select(ops, draws[slot], images, draws[slot + 1])
    return images
