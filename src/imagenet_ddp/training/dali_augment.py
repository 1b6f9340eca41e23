"""``auto_augment`` under ``loader: dali``: torchvision's policy draws, per sample, applied by DALI.

Each sample's ops and magnitudes are the ones torchvision's policy itself draws: its ``forward``
runs on a stand-in of the crop's size inside the sample's seeded draws (dali_loader.sample_window,
after the crop and flip, as recipe.sample_transform orders them) and records what it would apply
instead of applying it. So the draws are the pytorch path's, the same on any rank or worker count
and after a resume, and a torchvision release that changes them changes both paths alike. DALI
then applies the recorded ops to the decoded crop (on the GPU on CUDA), one ``select`` per op
slot (DALI's conditional split). Pixels match torchvision's within a level or two on every op
but Equalize: DALI's follows OpenCV's lookup table, ~10 levels off on average
(tests/test_dali_loader.py). timm's RandAugment (``rand-*``) runs Pillow's ops and stays with
``loader: pytorch`` (settings.run_checks).
"""

from __future__ import annotations

import torch

# The ops of torchvision's three policies (v2 TrivialAugmentWide, RandAugment, AutoAugment's
# ImageNet policy); the index is what the pipeline's select() reads.
OP_NAMES = (
    "Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color",
    "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert",
)  # fmt: skip

# Op slots a sample's draw fills: TrivialAugmentWide applies one op, RandAugment num_ops (its
# default 2, as recipe.POLICIES builds it), AutoAugment a sub-policy of two (each applied with
# its probability: an op not applied is Identity).
SLOTS = {"trivialaugment": 1, "randaugment": 2, "autoaugment": 2}


def slots(auto_augment: str) -> int:
    """Op slots of a run's ``auto_augment`` under DALI: 0 for none."""
    return SLOTS.get(auto_augment, 0)


def recorded_draws(policy, size: int, count: int) -> list[tuple[int, float]]:
    """(op index, DALI parameter) of each of ``count`` slots: ``policy`` (a torchvision v2 policy)
    drawing on a ``size`` x ``size`` crop from the current torch RNG, as it would transform it;
    unused slots are Identity."""
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


def dali_ops(interp):
    """The DALI functions of OP_NAMES, in order: (HWC uint8 batch, per-sample parameter) -> batch.
    Geometric ops fill with 0 (torchvision's default fill) and resample with ``interp``."""
    import numpy as np
    from nvidia.dali import fn, types

    def on(data, value):  # an arithmetic operand where the data is (named arguments: the CPU)
        return value.gpu() if data.device == "gpu" else value

    def warp(data, matrix):
        return fn.warp_affine(data, matrix=matrix, fill_value=0, interp_type=interp,
                              inverse_map=False)  # fmt: skip

    def contrast(data, factor):  # PIL's and torchvision's centre: the grey image's mean
        mean = fn.reductions.mean(data, axis_names="HW", keep_dims=True)
        grey = types.Constant(np.array([0.299, 0.587, 0.114], np.float32))
        centre = fn.reductions.sum(mean * grey, axis_names="C", keep_dims=True)
        return fn.cast_like(centre + (data - centre) * on(data, factor), data)

    def sharpness(data, amount):  # torchvision's: blend with its 3x3 smoothing, borders kept
        blur = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13
        ident = np.zeros((3, 3), np.float32)
        ident[1, 1] = 1
        kernel = types.Constant(ident) + types.Constant(ident - blur) * amount
        return fn.filter(data, on(data, kernel))

    def solarize(data, threshold):
        kept = data < on(data, threshold)
        return kept * data + (kept ^ True) * (types.Constant(255, dtype=types.UINT8) - data)

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
        lambda data, angle: fn.rotate(
            data, angle=angle, fill_value=0, interp_type=interp, keep_size=True
        ),  # fmt: skip
        lambda data, factor: fn.brightness(data, brightness=factor),
        lambda data, factor: fn.saturation(data, saturation=factor),
        contrast,
        sharpness,
        lambda data, mask: data & on(data, fn.cast(mask, dtype=types.UINT8)),
        solarize,
        auto_contrast,
        lambda data, _: fn.equalize(data),
        lambda data, _: types.Constant(255, dtype=types.UINT8) - data,
    )


def apply(images, draws: list, interp):
    """``images`` (HWC uint8) through each slot's drawn op: ``draws``, the slots' op index and
    parameter DataNodes in turn (op, parameter, op, ...). Needs ``enable_conditionals``, whose
    conversion of this code knows no ``zip(strict=)``."""
    from nvidia.dali.auto_aug.core import select

    ops = dali_ops(interp)
    for slot in range(0, len(draws), 2):
        images = select(ops, draws[slot], images, draws[slot + 1])
    return images
