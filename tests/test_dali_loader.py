"""loader: dali on DALI's CPU backend: the same samples, order, crop windows and flips as the
pytorch path (training.data) for the same seeds, after a resume and on another rank count;
pixels within resampling tolerance (DALI decodes the full-scale window, ours a DCT-reduced one)."""

from __future__ import annotations

import io
import os
import signal
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali", reason="DALI (the dali extra) is not installed here")

from imagenet_ddp.settings.kinds import TrainConfig, declarations  # noqa: E402
from imagenet_ddp.training import recipe  # noqa: E402
from imagenet_ddp.training.data import EpochSampler, SeededAugmentation, train_loader  # noqa: E402


def _jpeg(height: int, width: int, shift: int) -> np.ndarray:
    """Ramps (red along x, green along y): where a window lies shows in its pixels."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 230 // width, y * 230 // height, np.full_like(x, shift)], axis=-1)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, "JPEG", quality=95)
    return np.frombuffer(out.getvalue(), np.uint8).copy()


class Encoded(torch.utils.data.Dataset):
    """The reader's training view (encoded JPEGs, data.reader.create_dataset(train=True))."""

    def __init__(self, n: int = 12):
        self.images = [_jpeg(96 + 8 * (i % 3), 128 - 8 * (i % 2), 20 * i) for i in range(n)]
        self.targets = np.arange(n) % 3

    def __len__(self):
        return len(self.images)

    def read_bytes(self, i):
        return self.images[i]

    def __getitem__(self, i):
        return self.images[i], int(self.targets[i])


def _cfg(**changes) -> TrainConfig:
    run = {**declarations().rank_defaults(), "run": "t", "crop_size": 32, "epochs": 2,
           "weight_decay_groups": "all", "normalization": "imagenet", **changes}  # fmt: skip
    return TrainConfig.from_dict(run)


def _batches(loader_name, world=1, rank=0, skip=0, batch=2, epoch=1, **changes):
    cfg = _cfg(loader=loader_name, **changes)
    dataset = SeededAugmentation(Encoded(), recipe.EpochTransforms(cfg), cfg.seed, per_epoch=True)
    sampler = EpochSampler(len(dataset), world, rank, cfg.seed, batch)
    sampler.set_epoch(epoch, skip)
    loader = train_loader(dataset, sampler, batch, 0, False, cfg=cfg, device=torch.device("cpu"))
    return list(loader)


def test_dali_batches_are_the_pytorch_paths_within_resampling_tolerance():
    ours, dali = _batches("pytorch"), _batches("dali")
    assert len(ours) == len(dali) == 6
    for (a, ta), (b, tb) in zip(ours, dali, strict=True):
        assert b.dtype == torch.uint8 and b.shape == a.shape == (2, 3, 32, 32)
        assert torch.equal(ta, tb)  # the same samples in the same order
        # the same windows and flips: a wrong window or flip moves the ramps by tens of levels
        assert (a.float() - b.float()).abs().mean() < 3.0


def test_trivialaugment_through_dali_is_the_pytorch_paths_within_tolerance():
    """The policy after the crop and flip, as torchvision's order: a policy applied before the
    flip, or another draw, moves the geometric ops' samples by tens of levels. Equalize and
    AutoContrast apart: on these small smooth crops their pixels differ more (EXTREMES)."""
    from imagenet_ddp.training.dali_augment import OP_NAMES

    ours = _batches("pytorch", auto_augment="trivialaugment", hflip=1.0)
    dali = _batches("dali", auto_augment="trivialaugment", hflip=1.0)
    cfg = _cfg(loader="dali", auto_augment="trivialaugment", hflip=1.0)
    dataset = SeededAugmentation(Encoded(), recipe.EpochTransforms(cfg), cfg.seed, per_epoch=True)
    sampler = EpochSampler(len(dataset), 1, 0, cfg.seed, 2)
    sampler.set_epoch(1, 0)
    loader = train_loader(dataset, sampler, 2, 0, False, cfg=cfg, device=torch.device("cpu"))
    ops = [OP_NAMES[int(op)] for op in loader.batch_inputs(list(sampler))[8]]
    images = [(a[i], b[i]) for (a, _), (b, _) in zip(ours, dali, strict=True) for i in range(2)]
    assert all(torch.equal(ta, tb) for (_, ta), (_, tb) in zip(ours, dali, strict=True))
    compared = [(op, float((a.float() - b.float()).abs().mean()))
                for op, (a, b) in zip(ops, images, strict=True)
                if op not in ("Equalize", "AutoContrast")]  # fmt: skip
    assert len(compared) >= 6 and all(diff < 3.0 for _, diff in compared), compared


def test_flip_agreement_at_probability_one_and_zero():
    for hflip in (0.0, 1.0):
        (a, _), *_ = _batches("pytorch", hflip=hflip)
        (b, _), *_ = _batches("dali", hflip=hflip)
        assert (a.float() - b.float()).abs().mean() < 3.0, hflip


def test_random_erasing_erases_the_same_boxes():
    """Erased pixels are the mean colour in both paths: exactly the same boxes, bitwise."""
    fill = torch.tensor([124, 116, 104], dtype=torch.uint8)[:, None, None]
    ours, dali = _batches("pytorch", random_erasing=0.7), _batches("dali", random_erasing=0.7)
    erased = 0
    for (a, _), (b, _) in zip(ours, dali, strict=True):
        mask_a, mask_b = (a == fill).all(dim=1), (b == fill).all(dim=1)
        assert torch.equal(mask_a, mask_b)
        erased += int(mask_a.any(dim=(1, 2)).sum())
        assert (a.float() - b.float()).abs().mean() < 3.0
    assert 0 < erased < 12  # some samples erased, not all


@pytest.mark.parametrize("policy", ["none", "trivialaugment"])
def test_a_resume_and_another_rank_count_see_the_same_samples(policy):
    whole = _batches("dali", auto_augment=policy)
    resumed = _batches("dali", skip=2, auto_augment=policy)  # from optimizer step 2 on
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole[2:], resumed, strict=True))
    two = [_batches("dali", world=2, rank=r, batch=1, auto_augment=policy) for r in (0, 1)]
    for step, (images, targets) in enumerate(whole):  # ranks 0 and 1 share each global batch
        assert torch.equal(torch.cat([two[0][step][0], two[1][step][0]]), images)
        assert torch.equal(torch.cat([two[0][step][1], two[1][step][1]]), targets)


@pytest.mark.parametrize("workers", [0, 2])
def test_one_pipeline_serves_the_passes_that_follow(workers):
    """Built once, the loader's pipeline gives epoch 1 from step 1 (a resume) and then epoch 2
    whole as fresh loaders give them, its draws in the rank's thread (workers 0) or in 2 DALI
    worker processes; a sampler set back to epoch 1 builds anew, and right."""
    cfg = _cfg(loader="dali", auto_augment="trivialaugment")
    dataset = SeededAugmentation(Encoded(), recipe.EpochTransforms(cfg), cfg.seed, per_epoch=True)
    sampler = EpochSampler(len(dataset), 1, 0, cfg.seed, 2)
    loader = train_loader(dataset, sampler, 2, workers, False, cfg=cfg, device=torch.device("cpu"))
    for epoch, skip in ((1, 1), (2, 0), (1, 0)):
        sampler.set_epoch(epoch, skip)
        got = list(loader)
        expected = _batches("dali", skip=skip, epoch=epoch, auto_augment="trivialaugment")
        assert len(got) == len(expected) == 6 - skip, (epoch, skip)
        for (a, ta), (b, tb) in zip(got, expected, strict=True):
            assert torch.equal(a, b) and torch.equal(ta, tb), (epoch, skip)
    first = loader._pipe
    sampler.set_epoch(2, 0)
    assert next(iter(loader))[0].shape == (2, 3, 32, 32) and loader._pipe is None  # mid-pass
    sampler.set_epoch(2, 0)
    again = _batches("dali", epoch=2, auto_augment="trivialaugment")
    assert torch.equal(list(loader)[0][0], again[0][0])
    assert first is not None and loader._pipe is not first  # the unfinished pass: built anew


def test_dali_takes_every_auto_augment_policy():
    """The dry-run refuses no auto_augment with loader dali: torchvision's and timm's rand-*
    (the presets' specs; the schema admits no other timm sets) all run through DALI."""
    from imagenet_ddp.settings.presets import PRESETS
    from imagenet_ddp.settings.run_checks import _recipe_problems

    run = {**declarations().rank_defaults(), "crop_size": 224, "model": "resnet18"}
    specs = {p.get("auto_augment") for p in PRESETS.values()} - {None}
    assert any(s.startswith("rand-") for s in specs), specs
    for policy in ("none", "trivialaugment", "randaugment", "autoaugment", *sorted(specs)):
        found = _recipe_problems({**run, "loader": "dali", "auto_augment": policy})
        assert not [p for p in found if "loader" in p], (policy, found)


def _scene(size: int = 48) -> np.ndarray:
    """HWC uint8 with ramps, a bright block and a dark corner: every op changes it visibly."""
    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x * 5, y * 5, (x + y) * 3 % 255], axis=-1).astype(np.uint8)
    pixels[12:30, 8:26] = 210
    pixels[:8, -8:] = 10
    return pixels


def _through_dali(images: list, draws: list, fill=(0, 0, 0), interp="INTERP_LINEAR"):
    """``images`` (HWC) through dali_augment.apply with each image's (op, parameter) slots,
    geometric ops filling with ``fill``: the output images (HWC)."""
    from nvidia.dali import fn, pipeline_def, types

    from imagenet_ddp.training import dali_augment

    slots = len(draws[0])
    columns = [[np.int32(d[k][0]) if j == 0 else np.float32(d[k][1]) for d in draws]
               for k in range(slots) for j in (0, 1)]  # fmt: skip

    @pipeline_def(batch_size=len(images), num_threads=1, device_id=None,
                  enable_conditionals=True)  # fmt: skip
    def pipe():
        layout = ["HWC"] + [""] * 2 * slots
        data, *flat = fn.external_source(source=lambda: [images, *columns], batch=True,
                                         num_outputs=1 + 2 * slots, layout=layout)  # fmt: skip
        return dali_augment.apply(data, flat, getattr(types, interp), fill)

    built = pipe()
    built.build()
    (out,) = built.run()
    return [out.at(i) for i in range(len(images))]


# Every op of torchvision's policies at its extremes (largest magnitude, both signs, TrivialAugment
# Wide's ranges, the wider): DALI's within two levels of torchvision's on average, Equalize within
# 15 (DALI's follows OpenCV's lookup table: ~11 on this scene).
EXTREMES = [("Identity", 0.0), ("ShearX", 0.99), ("ShearX", -0.99), ("ShearY", 0.99),
            ("ShearY", -0.3), ("TranslateX", 32.0), ("TranslateX", -10.7), ("TranslateY", 32.0),
            ("TranslateY", -150.0 / 331 * 48), ("Rotate", 135.0), ("Rotate", -30.0),
            ("Brightness", 0.99), ("Brightness", -0.99), ("Color", 0.99), ("Color", -0.99),
            ("Contrast", 0.99), ("Contrast", -0.99), ("Sharpness", 0.99), ("Sharpness", -0.99),
            ("Posterize", 2.0), ("Posterize", 8.0), ("Solarize", 0.0), ("Solarize", 1.0),
            ("Solarize", 0.5), ("AutoContrast", 0.0), ("Equalize", 0.0),
            ("Invert", 0.0)]  # fmt: skip
UNCHANGED = {("Identity", 0.0), ("Posterize", 8.0), ("Solarize", 1.0)}  # all bits, threshold 255


def test_every_policy_op_at_its_extremes_is_torchvisions_within_a_level():
    from torchvision.transforms import v2

    from imagenet_ddp.training import dali_augment

    policy = v2.TrivialAugmentWide(interpolation=v2.InterpolationMode.BILINEAR)
    scene = _scene()
    index, parameter = dali_augment.OP_NAMES.index, dali_augment.dali_parameter
    draws = [[(index(n), parameter(n, m))] for n, m in EXTREMES]
    dali = _through_dali([scene] * len(EXTREMES), draws)
    for (name, magnitude), b in zip(EXTREMES, dali, strict=True):
        image = torch.from_numpy(scene).permute(2, 0, 1).contiguous()
        a = policy._apply_image_or_video_transform(
            image, name, magnitude, interpolation=policy.interpolation, fill=policy._fill
        )
        diff = np.abs(a.permute(1, 2, 0).numpy().astype(float) - b.astype(float))
        changed = np.abs(a.permute(1, 2, 0).numpy().astype(float) - scene).mean()
        assert diff.mean() < (15.0 if name == "Equalize" else 2.0), (name, magnitude, diff.mean())
        assert (name, magnitude) in UNCHANGED or changed > 1.0, (name, magnitude)  # it acted


@pytest.mark.parametrize("name", ["trivialaugment", "randaugment", "autoaugment"])
def test_each_policys_draws_are_torchvisions_own_for_the_same_seed(name):
    """Under one seed, the recorded draws are the ops and magnitudes torchvision's policy applies
    to the same crop, exactly; DALI applying them gives its image (samples that drew Equalize
    apart: its pixels differ, see EXTREMES)."""
    from torchvision.transforms import v2

    from imagenet_ddp.training import dali_augment

    mode, scene, names = v2.InterpolationMode.BILINEAR, _scene(), dali_augment.OP_NAMES
    expected, draws = [], []
    for seed in range(40):
        policy, applied = recipe.POLICIES[name](mode), []
        apply_op = policy._apply_image_or_video_transform

        def spy(image, op, magnitude, apply_op=apply_op, applied=applied, **kwargs):
            applied.append((names.index(op), dali_augment.dali_parameter(op, magnitude)))
            return apply_op(image, op, magnitude, **kwargs)

        policy._apply_image_or_video_transform = spy
        torch.manual_seed(seed)
        image = policy(torch.from_numpy(scene).permute(2, 0, 1)).permute(1, 2, 0).numpy()
        torch.manual_seed(seed)
        count = dali_augment.slots(name)
        drawn = dali_augment.recorded_draws(recipe.POLICIES[name](mode), 48, count)
        assert [d for d in drawn if d[0]] == [a for a in applied if a[0]], (name, seed)
        expected.append(image)
        draws.append(drawn)
    assert len({tuple(op for op, _ in d) for d in draws}) > 5  # the draws vary with the seed
    dali = _through_dali([scene] * len(draws), draws)
    for a, b, drawn in zip(expected, dali, draws, strict=True):
        if names.index("Equalize") not in [op for op, _ in drawn]:
            assert np.abs(a.astype(float) - b.astype(float)).mean() < 2.0, (name, drawn)


# --------------------------------------------------------------------------- timm's RandAugment

MEAN_FILL = (124, 116, 104)  # the ImageNet mean, timm's img_mean (DeiT's fill) as we pass it
# The presets' (DeiT's m9, ResNet strikes back's m7 and m6) and a plain set of 3 layers
PRESET_SPECS = ["rand-m9-mstd0.5-inc1", "rand-m7-mstd0.5-inc1", "rand-m6-mstd0.5-inc1",
                "rand-m9-n3-mstd0.5"]  # fmt: skip


def _photo(size: int = 64) -> np.ndarray:
    """HWC uint8, photo-like: smooth shading (bicubic-upsampled noise), hard-edged objects, fine
    grain, through JPEG; a full range of levels, so no op is a no-op by accident."""
    rng = np.random.default_rng(0)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    pixels = np.asarray(coarse.resize((size, size), Image.BICUBIC)).astype(float)
    pixels[10:30, 14:40] = (230, 200, 40)
    pixels[40:58, 6:22] = (20, 30, 90)
    pixels += rng.normal(0, 6, pixels.shape)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return np.asarray(Image.open(out).convert("RGB")).copy()


def _timm(spec: str, size: int, interpolation: str = "bilinear"):
    """The pytorch path's timm RandAugment (recipe.timm_rand_augment), without its PIL wrap."""
    mean = tuple(m / 255 for m in MEAN_FILL)
    return recipe.timm_rand_augment(spec, size, mean, interpolation).transforms[1]


@pytest.mark.parametrize("spec", PRESET_SPECS)
def test_timms_rand_augment_draws_are_timms_own_for_the_same_seed(spec):
    """For 40 samples, each sample's seed (SeededAugmentation's key_seed), the ops and level
    arguments DaliLoader records (dali_loader.sample_window) are exactly those timm's ops apply
    on the pytorch path (SeededAugmentation over recipe.timm_rand_augment); DALI applying them
    gives its image within two levels (samples that drew Equalize apart: EXTREMES)."""
    from torchvision.transforms import v2

    from imagenet_ddp.training import dali_augment
    from imagenet_ddp.training.dali_loader import sample_window

    photo, size = _photo(48), 48
    augment, applied = _timm(spec, size), []
    for op in augment.ops:  # a spy on the ops the pytorch path applies, their own aug_fn after
        op.aug_fn = lambda img, *args, _fn=op.aug_fn, _name=op.name, **kw: (
            applied.append(dali_augment.timm_parameter(_name, args, size)) or _fn(img, *args, **kw)
        )
    base = [(torch.from_numpy(photo).permute(2, 0, 1).contiguous(), 0)] * 40
    ours = SeededAugmentation(base, recipe.through_pil(augment), 7)
    crop, count = v2.RandomResizedCrop(size), dali_augment.slots(spec)
    assert count == (3 if "-n3" in spec else 2)
    expected, draws, policy = [], [], _timm(spec, size)
    for index in range(40):
        applied.clear()
        expected.append(ours[(0, index)][0].permute(1, 2, 0).numpy())
        drawn = sample_window(ours.key_seed((0, index)), 60, 80, crop, 0.5, None, policy, count)[-1]
        assert [d for d in drawn if d[0]] == applied, (spec, index)
        draws.append(drawn)
    assert len({tuple(d) for d in draws}) > 20  # the draws vary with the seed
    assert len({p for d in draws for _, p in d}) > 15  # the magnitudes too (mstd 0.5)
    assert sum(op == 0 for d in draws for op, _ in d) > 10  # some ops skipped (p 0.5)
    dali = _through_dali([photo] * len(draws), draws, fill=MEAN_FILL)
    equalize, compared = dali_augment.OP_NAMES.index("Equalize"), 0
    for a, b, drawn in zip(expected, dali, draws, strict=True):
        if equalize not in [op for op, _ in drawn]:
            compared += 1
            assert np.abs(a.astype(float) - b.astype(float)).mean() < 2.0, (spec, drawn)
    assert compared > 25


def _timm_extremes(interpolation: str) -> list:
    """(timm op, its level arguments) of every op of timm's two rand-* op sets (the increasing
    set of the DeiT presets, the plain one) at magnitude 0 and 10, each sign of the signed."""
    import random

    cases = []
    for spec in ("rand-m9-inc1", "rand-m9"):
        for op in _timm(spec, 48, interpolation).ops:
            for magnitude in (0.0, 10.0):
                for coin in (0.0, 1.0):  # timm's _randomly_negate: negative above 0.5
                    draw, random.random = random.random, lambda coin=coin: coin
                    try:
                        args = op.level_fn(magnitude, op.hparams) if op.level_fn else ()
                    finally:
                        random.random = draw
                    if (op, args) not in cases:
                        cases.append((op, args))
    return cases


# Ops timm's levels leave the image as it is: magnitude 0 of the signed geometric ops, of
# SolarizeAdd and of the increasing enhancements (factor 1), threshold 256 (SolarizeIncreasing
# at 0, Solarize at 10).
TIMM_UNCHANGED = {"Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel", "SolarizeAdd",
                  "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
                  "SharpnessIncreasing", "Solarize", "SolarizeIncreasing"}  # fmt: skip


# Measured, the worst case of each op (mean |difference|, levels; bilinear / bicubic): Equalize
# 5.4 (DALI's follows OpenCV's lookup table); at bicubic the warps resample bilinearly (DALI's
# take no cubic), Pillow bicubically: Rotate 2.4 (bilinear 0.9), ShearX/Y 1.5-1.6 (0.7-0.8),
# TranslateX/YRel 1.4-1.5 (0.7-0.9); the others pixel by pixel within 2 levels (rounding):
# Color, Contrast, Brightness 0.5, Sharpness 0.4, AutoContrast 0.2, Invert, Posterize,
# Solarize and SolarizeAdd exact.
GEOMETRIC = {"Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"}
TIMM_TOLERANCE = {("Equalize", "bilinear"): 15.0, ("Equalize", "bicubic"): 15.0,
                  ("Rotate", "bicubic"): 3.0}  # fmt: skip


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_every_timm_op_at_its_extremes_is_pillows_within_a_level(interpolation):
    """Each op of timm's rand-* sets, at the ends of its levels and both signs, through DALI
    (filling with the mean, as timm's img_mean) against timm's own op (Pillow, our posterize)
    on a photo-like image: within two levels on average but TIMM_TOLERANCE's; the geometric
    ops' edge, where Pillow fills hard and DALI blends, within that."""
    from imagenet_ddp.training import dali_augment

    photo, cases = _photo(48), _timm_extremes(interpolation)
    draws = [[dali_augment.timm_parameter(op.name, args, 48)] for op, args in cases]
    interp = {"bilinear": "INTERP_LINEAR", "bicubic": "INTERP_CUBIC"}[interpolation]
    dali = _through_dali([photo] * len(cases), draws, fill=MEAN_FILL, interp=interp)
    unchanged, report = set(), []
    for (op, args), b in zip(cases, dali, strict=True):
        a = np.asarray(op.aug_fn(Image.fromarray(photo), *args, **op.kwargs)).astype(float)
        diff = np.abs(a - b.astype(float)).mean()
        report.append((op.name, args, round(diff, 2)))
        assert diff < TIMM_TOLERANCE.get((op.name, interpolation), 2.0), report[-1]
        if op.name not in GEOMETRIC and op.name != "Equalize":  # rounding only, borders too
            assert np.abs(a - b).max() <= 2, (op.name, args, np.abs(a - b).max())
        if np.array_equal(a, photo):
            unchanged.add(op.name)
    assert unchanged == TIMM_UNCHANGED, unchanged
    assert len(cases) > 50, len(cases)


def test_timm_draws_refuse_what_dali_cannot_replay():
    """A RandAugment without an interpolation hparam resamples at random inside the op, a draw
    the recorder would skip; an op of timm's other sets (3-Augment's blur) has no DALI op."""
    from timm.data.auto_augment import rand_augment_transform

    from imagenet_ddp.training import dali_augment

    assert len(dali_augment.timm_draws(_timm("rand-m9-p1.0", 32), 32, 2)) == 2
    with pytest.raises(ValueError, match="resamples at random"):
        dali_augment.timm_draws(rand_augment_transform("rand-m9-p1.0", {}), 32, 2)
    with pytest.raises(ValueError, match="op GaussianBlur has no DALI counterpart"):
        dali_augment.timm_parameter("GaussianBlur", (1.0,), 32)


def _pass_draws(**changes) -> list[tuple[int, float]]:
    """The recorded (op, parameter) slots of each sample of one DaliLoader pass (epoch 1)."""
    cfg = _cfg(loader="dali", **changes)
    dataset = SeededAugmentation(Encoded(), recipe.EpochTransforms(cfg), cfg.seed, per_epoch=True)
    sampler = EpochSampler(len(dataset), 1, 0, cfg.seed, 2)
    sampler.set_epoch(1, 0)
    loader = train_loader(dataset, sampler, 2, 0, False, cfg=cfg, device=torch.device("cpu"))
    columns = loader.batch_inputs(list(sampler))[8:]
    pairs = [list(zip(columns[k], columns[k + 1], strict=True)) for k in range(0, len(columns), 2)]
    return [[(int(o), float(p)) for o, p in slots] for slots in zip(*pairs, strict=True)]


@pytest.mark.parametrize("preset", ["deit-small", "timm-resnet50-a3"])
def test_a_presets_rand_augment_through_dali_is_the_pytorch_paths_within_tolerance(preset):
    """A preset's timm RandAugment (with its interpolation and random erasing) through
    DaliLoader on DALI's CPU backend, against the pytorch path's batches: the same samples, and
    each sample's pixels within resampling tolerance where its draws hold no Equalize or
    AutoContrast (on these small smooth crops their pixels differ more: EXTREMES); a policy
    applied before the flip, another draw or a fill of 0 moves them by tens of levels."""
    from imagenet_ddp.settings.presets import PRESETS
    from imagenet_ddp.training.dali_augment import OP_NAMES

    keys = ("auto_augment", "interpolation", "random_erasing")
    changes = {k: PRESETS[preset][k] for k in keys if k in PRESETS[preset]} | {"hflip": 1.0}
    assert changes["auto_augment"].startswith("rand-")
    ours, dali = _batches("pytorch", **changes), _batches("dali", **changes)
    draws = _pass_draws(**changes)
    images = [(a[i], b[i]) for (a, _), (b, _) in zip(ours, dali, strict=True) for i in range(2)]
    assert all(torch.equal(ta, tb) for (_, ta), (_, tb) in zip(ours, dali, strict=True))
    skip = {OP_NAMES.index("Equalize"), OP_NAMES.index("AutoContrast")}
    compared = [([OP_NAMES[op] for op, _ in slots], float((a.float() - b.float()).abs().mean()))
                for slots, (a, b) in zip(draws, images, strict=True)
                if not skip & {op for op, _ in slots}]  # fmt: skip
    applied = [ops for ops, _ in compared if set(ops) != {"Identity"}]
    assert len(compared) >= 6 and len(applied) >= 4, compared
    assert all(diff < 3.0 for _, diff in compared), compared


def test_timms_draws_in_dali_worker_processes_are_the_ranks_thread_s():
    """DeiT's policy with its draws in 2 spawned DALI worker processes (Python's and NumPy's
    RNGs seeded there per sample, as in the rank's thread): bitwise the batches of workers 0."""
    changes = {"auto_augment": "rand-m9-mstd0.5-inc1", "interpolation": "bicubic"}
    cfg = _cfg(loader="dali", **changes)
    dataset = SeededAugmentation(Encoded(), recipe.EpochTransforms(cfg), cfg.seed, per_epoch=True)
    sampler = EpochSampler(len(dataset), 1, 0, cfg.seed, 2)
    sampler.set_epoch(1, 0)
    loader = train_loader(dataset, sampler, 2, 2, False, cfg=cfg, device=torch.device("cpu"))
    got, expected = list(loader), _batches("dali", **changes)
    assert len(got) == len(expected) == 6
    for (a, ta), (b, tb) in zip(got, expected, strict=True):
        assert torch.equal(a, b) and torch.equal(ta, tb)


def test_a_dali_run_where_the_jobs_lack_dali_is_refused_in_one_line():
    from imagenet_ddp.settings.run_checks import optional_component_problems

    runs = {"a": {"loader": "dali"}, "b": {"loader": "pytorch"}}
    assert optional_component_problems(runs, deployment="", has_module=lambda m: False) == [
        "config.yaml: run 'a': runs[].loader 'dali' needs nvidia.dali, not installed in the "
        "environment the jobs run in (this Snakemake's): install it (pip install "
        "'imagenet-ddp[dali]'), use --sdm apptainer or conda, or set loader: pytorch"
    ]
    assert optional_component_problems(runs, deployment="") == []  # installed here


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its ranks in sessions of their own)."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    pairs = [tuple(map(int, line.split())) for line in table.splitlines() if line.strip()]
    for child, parent in pairs:
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def test_the_worker_trains_through_dali_and_resumes_bitwise(prepared_demo, demo_split, tmp_path):
    """The product's worker (one gloo rank) with ``loader: dali``: SIGTERM to every process of
    the run (the launcher, the rank, its DALI worker process: what SLURM sends at a time limit)
    checkpoints it, and resumed its weights are the unbroken run's bitwise (DALI's CPU pixels
    are deterministic; the draws in the rank's thread there, in a DALI worker here), and not
    the pytorch path's (other pixels: DALI read them); its holdout, evaluated through DALI by
    the resumed job's own pipeline, scores as the unbroken run's."""
    import pandas as pd

    from tests.test_resume import CONFIG, output_within, torchrun, weights

    config = {**CONFIG, "loader": "dali", "auto_augment": "trivialaugment", "epochs": 2,
              "run": "dali"}  # fmt: skip
    train, runs = prepared_demo["train"], {}
    for name in ("whole", "resumed", "torch"):
        out, ckpt = tmp_path / name / "out", tmp_path / name / "ckpt"
        if name == "torch":
            config = {**config, "loader": "pytorch", "auto_augment": "none"}
        if name == "resumed":
            signalled = {**config, "workers": 1}
            proc = torchrun(train, demo_split, out, ckpt, config=signalled, nproc=1, popen=True)
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "epoch 0 step 2/" in line:
                    break
            tree = _descendants(proc.pid)
            assert len(tree) >= 2, lines  # the rank, a DALI worker at least
            for pid in [proc.pid, *tree]:
                os.kill(pid, signal.SIGTERM)
            output = output_within(proc, 180, head="".join(lines))
            assert "interrupted" in output and proc.returncode != 0, output[-3000:]
            config = signalled
        first = torchrun(train, demo_split, out, ckpt, config=config, nproc=1)
        assert first.returncode == 0, first.stdout + first.stderr
        runs[name] = weights(out)
        runs[f"{name} holdout"] = pd.read_csv(out / "history.csv")["holdout_loss"].tolist()
    assert runs["whole holdout"] == runs["resumed holdout"] and runs["whole holdout"][-1] > 0
    assert runs["whole"].keys() == runs["resumed"].keys()
    assert all(torch.equal(runs["whole"][k], runs["resumed"][k]) for k in runs["whole"])
    assert not all(torch.equal(runs["whole"][k], runs["torch"][k]) for k in runs["whole"])


def test_the_check_job_refuses_dali_where_it_does_not_import(monkeypatch):
    import sys

    from imagenet_ddp.training.recipe import dali_problem

    assert dali_problem(_cfg(loader="dali")) is None and dali_problem(_cfg()) is None
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # as if not installed
    problem = dali_problem(_cfg(loader="dali"))
    assert problem.startswith("runs[].loader 'dali': nvidia.dali does not import")
    assert problem.endswith("install imagenet-ddp[dali] there, or set loader: pytorch")


@pytest.mark.parametrize("name", ["torchvision-resnet50-v2", "deit-small", "ffcv-resnet50"])
def test_a_presets_dali_pipeline_takes_its_extreme_draws(name):
    """The check job's DALI cases (dali_loader.extreme_problems) of a preset through DALI:
    every window at the ends of crop_scale x crop_ratio, flip and erasing always, each op of its
    policy at both ends of its magnitudes in every slot, at each of its crops (FFCV's
    progressive ones), and the evaluation crop, run without a problem; the cases are the
    pytorch path's (recipe.extreme_transforms), each on two images."""
    from imagenet_ddp.settings.presets import PRESETS
    from imagenet_ddp.training import dali_loader

    cfg = _cfg(**{**PRESETS[name], "loader": "dali"})
    assert dali_loader.extreme_problems(cfg) == []
    jpegs = dali_loader._synthetic_jpegs(cfg)
    for size in recipe.run_crops(cfg):
        names = [n for n, _ in dali_loader._extreme_cases(cfg, size, 2, jpegs)]
        boxes, ops = recipe.extreme_transforms(cfg, size)
        forced = [f"training {n} at crop {size}" for n in (*boxes, *ops)]
        assert sorted(set(names)) == sorted(forced) and len(names) == 2 * len(forced)
    assert (len(recipe.run_crops(cfg)) > 1) == (name == "ffcv-resnet50")  # progressive


def test_the_check_job_refuses_a_dali_op_that_raises_naming_it(tmp_path, monkeypatch):
    """A `dali` run whose pipeline raises at one extreme draw (the rotation resampling bicubic,
    which DALI's CPU warp refuses: every bicubic run with a policy before the fallback) is
    refused by the check job in one line naming the run, the case and the way out; the
    pytorch path's transforms of the same run pass."""
    import json

    from nvidia.dali import fn, types

    from imagenet_ddp.errors import InputError
    from imagenet_ddp.settings.kinds import declarations
    from imagenet_ddp.training import dali_augment
    from imagenet_ddp.training.data import write_check
    from tests.workflow_helpers import run_settings

    run = run_settings(
        run="tv",
        model="resnet18",
        model_kwargs={},
        crop_size=32,
        eval_resize=36,
        eval_crop_size=32,
        epochs=1,
        auto_augment="trivialaugment",
        loader="dali",
    )
    settings = json.dumps(declarations().changed_from_default(run))
    write_check(settings, 10, tmp_path / "run", tmp_path / "ok.json")
    assert (tmp_path / "ok.json").is_file()
    ops = dali_augment.dali_ops
    rotate = dali_augment.OP_NAMES.index("Rotate")

    def cubic_rotate(interp, fill=(0, 0, 0)):
        def cubic(data, angle):
            return fn.rotate(data, angle=angle, interp_type=types.INTERP_CUBIC, keep_size=True)

        return tuple(cubic if i == rotate else op for i, op in enumerate(ops(interp, fill)))

    monkeypatch.setattr(dali_augment, "dali_ops", cubic_rotate)
    with pytest.raises(InputError) as refused:
        write_check(settings, 10, tmp_path / "run", tmp_path / "check.json")
    message = str(refused.value)
    assert "\n" not in message and not (tmp_path / "check.json").exists()
    assert message.startswith(
        "config.yaml: run 'tv': loader 'dali': its training Rotate at bin 0 at crop 32 raises "
    ), message
    assert "on DALI's CPU backend: nvidia.dali.fn.rotate: Only nearest and linear " in message
    assert message.endswith("crop_scale, crop_ratio or the crops, or set loader: pytorch")


# --------------------------------------------------------------------------- evaluation


class Prepared(Encoded):
    """The reader's evaluation view (data.reader.create_dataset(eval_size=...)): decoded, then
    the eval transform; its encoded bytes (read_bytes) are what DALI reads."""

    def __init__(self, transform):
        super().__init__()
        # landscape, portrait and square, so both of Resize's sides and odd crop offsets, and
        # smaller than eval_resize 40 (upscaled); 13 images: partial last batches, on 2 ranks too
        shapes = [(96, 128), (128, 96), (100, 100), (77, 131), (131, 77), (64, 50), (30, 36)]
        self.images = [_jpeg(*shape, 20 * i) for i, shape in enumerate((shapes * 2)[:13])]
        self.targets, self.transform = np.arange(len(self.images)) % 3, transform

    def __getitem__(self, i):
        from imagenet_ddp.data.jpeg import decode_jpeg

        return self.transform(decode_jpeg(self.images[i])), int(self.targets[i])


def _eval_batches(loader_name, dataset, world=1, rank=0, batch=4, **changes):
    from imagenet_ddp.training.accuracy import shard_loader

    cfg = _cfg(loader=loader_name, eval_resize=40, **changes)
    loader = shard_loader(dataset, device=torch.device("cpu"), batch_size=batch, rank=rank,
                          world_size=world, cfg=cfg)  # fmt: skip
    return list(loader)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_dali_evaluation_batches_are_the_pytorch_paths_within_resampling_tolerance(interpolation):
    """Each rank's shard in order, the last batch partial, the center crop of the same window
    (measured: 0.14 levels on average, at most 1; a window one pixel off: 1.4-2 on average
    per sample, up to 7-8)."""
    from imagenet_ddp.data.dataset import eval_transform

    dataset = Prepared(eval_transform(40, 32, normalize=False, interpolation=interpolation))
    for world, rank, sizes in ((1, 0, [4, 4, 4, 1]), (2, 0, [4, 3]), (2, 1, [4, 2])):
        ours = _eval_batches("pytorch", dataset, world, rank, interpolation=interpolation)
        dali = _eval_batches("dali", dataset, world, rank, interpolation=interpolation)
        assert [len(t) for _, t in dali] == [len(t) for _, t in ours] == sizes
        for (a, ta), (b, tb) in zip(ours, dali, strict=True):
            assert b.dtype == torch.uint8 and b.shape == a.shape and a.shape[1:] == (3, 32, 32)
            assert tb.dtype == torch.int64 and torch.equal(ta, tb)
            difference = (a.float() - b.float()).abs()
            assert difference.mean() < 0.5 and difference.max() <= 2, (world, rank)


class MeanColour(torch.nn.Module):
    """Logits from each image's mean colour (fixed weights): a decision that resampling noise,
    which averages out over the crop, does not flip, unlike a random conv net's near ties."""

    def __init__(self, classes: int):
        super().__init__()
        self.linear = torch.nn.Linear(3, classes)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[3.0, -2, 1], [-1, 3, -2], [1, -1, 3],
                                                   [-2, 1, -1]])[:classes])  # fmt: skip
            self.linear.bias.zero_()

    def forward(self, images):
        return self.linear(images.mean(dim=(2, 3)))


def test_the_holdout_through_dali_scores_as_through_pytorch(prepared_demo, demo_split):
    """The product's dataset (data.reader.create_dataset over the prepared demo's holdout, 12
    images of 4 classes, batches of 5: the last partial) through evaluate_dataset: the same
    samples and predictions through either loader; and a persistent
    DALI loader gives the same batches on every pass, one left unfinished too."""
    from imagenet_ddp.data.reader import create_dataset
    from imagenet_ddp.settings.evaluation import EvalInput
    from imagenet_ddp.training.accuracy import evaluate_dataset, shard_loader
    from imagenet_ddp.training.data import read_ids

    run = {"eval_resize": 20, "crop_size": 16, "interpolation": "bilinear"}
    data = create_dataset(prepared_demo["train"], read_ids(demo_split / "holdout.csv"),
                          eval_size=(20, 16))  # fmt: skip
    model, cpu = MeanColour(data.num_classes), torch.device("cpu")
    results = {}
    for loader in ("pytorch", "dali"):
        inputs = EvalInput.of({**run, "loader": loader})
        results[loader] = evaluate_dataset(model, data, num_classes=data.num_classes,
                                           device=cpu, batch_size=5, cfg=inputs)  # fmt: skip
        assert results[loader]["samples"] == len(data) == 12
    ours, dali = results["pytorch"], results["dali"]
    assert 0 < ours["top1"] < 1 and ours["top1"] == dali["top1"] and ours["top5"] == dali["top5"]
    assert ours["per_class_correct"] == dali["per_class_correct"]
    assert ours["per_class_total"] == dali["per_class_total"]
    assert ours["loss"] == pytest.approx(dali["loss"], rel=1e-3)
    inputs = EvalInput.of({**run, "loader": "dali"})
    loader = shard_loader(data, device=cpu, batch_size=5, persistent=True, cfg=inputs)
    first = list(loader)
    next(iter(loader))  # a pass left unfinished: the next pass starts at the first batch
    assert [len(t) for _, t in first] == [5, 5, 2]
    for (a, ta), (b, tb) in zip(first, list(loader), strict=True):
        assert torch.equal(a, b) and torch.equal(ta, tb)


def test_the_evaluate_stage_reads_through_the_runs_loader(
    prepared_demo, demo_split, demo_index, tmp_path
):
    """`imagenet-ddp evaluate` of a model.pt whose run has ``loader: dali`` (one rank, one DALI
    thread; sharding: the tests above): eval.json names the loader and counts every holdout and
    test image once, with the top-1 of the same weights read through the pytorch path."""
    from imagenet_ddp.evaluation.evaluate import _datasets
    from imagenet_ddp.io import write_csv_atomic
    from imagenet_ddp.settings.evaluation import EvalInput
    from imagenet_ddp.training.accuracy import evaluate_dataset
    from imagenet_ddp.training.model import build_model, save_model
    from tests.test_evaluate import evaluate_cli

    write_csv_atomic(tmp_path / "classes.csv", demo_index[0])
    torch.manual_seed(0)
    net = build_model("resnet18", 4)
    with torch.no_grad():  # non-trivial running statistics, so logits differ per image
        for _ in range(3):
            net(torch.rand(8, 3, 16, 16))
    net.eval()
    config = {"run": "e", "crop_size": 16, "eval_resize": 20, "precision": "fp32"}
    save_model(tmp_path / "model.pt", net, arch="resnet18", num_classes=4,
               config={**config, "loader": "dali"})  # fmt: skip
    inputs = {"model": tmp_path / "model.pt", "classes": tmp_path / "classes.csv"}
    dali = evaluate_cli(inputs, prepared_demo, demo_split, tmp_path, workers=1)
    assert dali["evaluation"]["loader"] == "dali" and dali["evaluation"]["loader_workers"] == 1
    pytorch = EvalInput.of({**config, "loader": "pytorch"})
    sets = _datasets(pytorch, prepared_demo["train"], prepared_demo["val"],
                     demo_split / "holdout.csv")  # fmt: skip
    for split, data in sets.items():
        ours = evaluate_dataset(net, data, num_classes=4, device=torch.device("cpu"),
                                batch_size=128, cfg=pytorch)  # fmt: skip
        assert ours["samples"] == dali[split]["samples"] == len(data) > 0
        assert ours["top1"] == dali[split]["top1"], split
        assert ours["loss"] == pytest.approx(dali[split]["loss"], rel=1e-3)


def test_resampling_the_crops_region_is_resizing_the_whole_image_then_cropping():
    """DALI's own two ways, on noise (sharp edges at every pixel): fn.resize of the eval
    window's ROI is bitwise fn.resize of the whole image to Resize's size, then the center crop
    at CenterCrop's offsets (the filter reads past the ROI; on the CPU backend)."""
    from nvidia.dali import fn, pipeline_def, types

    from imagenet_ddp.training.dali_loader import eval_window

    rng, shapes = np.random.default_rng(0), [(96, 128), (128, 96), (77, 131), (300, 200)]
    jpegs = []
    for shape in shapes:
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (*shape, 3), dtype=np.uint8)).save(out, "JPEG")
        jpegs.append(np.frombuffer(out.getvalue(), np.uint8).copy())
    windows = [eval_window(h, w, 40, 32) for h, w in shapes]
    resized = [(40, w * 40 // h) if h <= w else (h * 40 // w, 40) for h, w in shapes]

    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def both():
        encoded = fn.external_source(lambda: jpegs, batch=True)
        images = fn.decoders.image(encoded, output_type=types.RGB)
        starts = fn.external_source(lambda: [s for s, _ in windows], batch=True)
        ends = fn.external_source(lambda: [e for _, e in windows], batch=True)
        sizes = fn.external_source(lambda: [np.float32(r) for r in resized], batch=True)
        roi = fn.resize(images, size=[32, 32], roi_start=starts, roi_end=ends,
                        roi_relative=False, antialias=True)  # fmt: skip
        return roi, fn.resize(images, size=sizes, antialias=True)

    pipe = both()
    pipe.build()
    roi, whole = pipe.run()
    for k, (h, w) in enumerate(resized):
        top, left = int(round((h - 32) / 2.0)), int(round((w - 32) / 2.0))
        assert whole.at(k).shape[:2] == (h, w)
        assert np.array_equal(roi.at(k), whole.at(k)[top : top + 32, left : left + 32]), k


def test_the_preflights_evaluation_rate_times_the_dali_path(prepared_demo, demo_split, monkeypatch):
    """preflight.rank.eval_rate of a ``loader: dali`` run times DaliEvalLoader (the pipeline
    built once, at the warm-up pass; the timed pass reuses it)."""
    from types import SimpleNamespace

    from imagenet_ddp.data.reader import create_dataset
    from imagenet_ddp.jobs.distributed import DistInfo
    from imagenet_ddp.preflight.rank import eval_rate
    from imagenet_ddp.training import dali_loader
    from imagenet_ddp.training.data import read_ids

    built, pipeline = [], dali_loader.DaliEvalLoader.pipeline
    monkeypatch.setattr(dali_loader.DaliEvalLoader, "pipeline",
                        lambda self: built.append(1) or pipeline(self))  # fmt: skip
    cfg = _cfg(loader="dali", crop_size=16, eval_resize=20, batch_size=5)
    holdout = create_dataset(prepared_demo["train"], read_ids(demo_split / "holdout.csv"),
                             eval_size=(20, 16))  # fmt: skip
    job, info = SimpleNamespace(model=MeanColour(4)), DistInfo(0, 1, 0, 1, "here")
    rate = eval_rate(cfg, job, holdout, info, 0, torch.device("cpu"))["eval_images_per_s"]
    assert rate > 0 and built == [1]


def test_the_preflights_loader_figure_times_trainings_dali_pipeline_across_epochs():
    """A loader: dali run's preflight (and bench_gpu.py) times DaliLoader, not the DataLoader:
    its one pass over the timing's epochs gives the batches training's passes give, epoch after
    epoch (no pipeline reset in the timing), and the figure comes from it."""
    from imagenet_ddp.jobs.distributed import DistInfo
    from imagenet_ddp.preflight.rank import loader_rate, preflight_loader
    from imagenet_ddp.training.dali_loader import DaliLoader

    cfg = _cfg(loader="dali", auto_augment="trivialaugment", batch_size=2)
    cpu, info = torch.device("cpu"), DistInfo(0, 1, 0, 1, "h")
    dataset = SeededAugmentation(Encoded(), recipe.EpochTransforms(cfg), cfg.seed, per_epoch=True)
    loader = preflight_loader(dataset, info, cfg, 0, cpu, endless=True)
    assert isinstance(loader, DaliLoader)
    batches = iter(loader)
    got = [next(batches) for _ in range(9)]  # epoch 0's 6 batches, then 3 of epoch 1's
    del batches
    expected = [*_batches("dali", epoch=0, auto_augment="trivialaugment"),
                *_batches("dali", epoch=1, auto_augment="trivialaugment")[:3]]  # fmt: skip
    for (a, ta), (b, tb) in zip(got, expected, strict=True):
        assert torch.equal(a, b) and torch.equal(ta, tb)
    figure = loader_rate(cfg, Encoded(), info, 0, cpu)
    assert figure["workers"] == 0 and figure["loader_images_per_s"] > 0, figure


class _Counted(torch.utils.data.Sampler):
    """A sampler's keys, counted as they are read (``read``: shared with its copies)."""

    def __init__(self, sampler, read: list):
        self.sampler, self.read = sampler, read

    def set_epoch(self, epoch: int, skip_steps: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip_steps)

    def __iter__(self):
        for key in self.sampler:
            self.read[0] += 1
            yield key


def test_dalis_source_reads_a_pass_as_its_batches_ask_not_the_whole_pass_first():
    """A preflight's (and bench_gpu.py's) timing pass spans 10**6 epochs: the source listed the
    whole pass before its first batch, which never ended with DALI's workers. Each batch is
    read from the sampler as asked, the keys before it skipped; one asked out of order reads
    the pass afresh. Either way the batch holds the sampler's keys at its place."""
    from types import SimpleNamespace

    from imagenet_ddp.jobs.distributed import DistInfo
    from imagenet_ddp.preflight.rank import preflight_loader

    cfg = _cfg(loader="dali", batch_size=2)
    cpu, info = torch.device("cpu"), DistInfo(0, 1, 0, 1, "h")
    dataset = SeededAugmentation(Encoded(), recipe.EpochTransforms(cfg), cfg.seed, per_epoch=True)
    loader = preflight_loader(dataset, info, cfg, 0, cpu, endless=True)
    keys = [key for _, key in zip(range(40), loader.sampler, strict=False)]  # 3+ epochs
    read = [0]
    loader.sampler = _Counted(loader.sampler, read)

    def images(iteration: int) -> list[bytes]:
        jpegs = loader.source(SimpleNamespace(epoch_idx=0, iteration=iteration))[0]
        return [bytes(j) for j in jpegs]

    def expected(iteration: int) -> list[bytes]:
        return [bytes(Encoded().images[k[1]]) for k in keys[2 * iteration : 2 * iteration + 2]]

    assert images(3) == expected(3) and read[0] == 8  # batches 0-2 skipped, nothing beyond
    assert images(16) == expected(16) and read[0] == 34  # past two epochs, in one pass
    assert images(1) == expected(1) and read[0] == 34 + 4  # behind: the pass read afresh


def test_evaluating_a_dali_model_where_dali_does_not_import_names_the_file_and_the_way_out(
    prepared_demo, demo_split, tmp_path, monkeypatch
):
    """A loader: dali run's model.pt evaluated where nvidia.dali does not import (by hand on
    another machine; the workflow's check job refuses it first): one line naming the file and
    the install, before any image is read."""
    import sys

    from imagenet_ddp.errors import InputError
    from imagenet_ddp.evaluation.evaluate import evaluate_run
    from imagenet_ddp.settings.geometry import Geometry
    from imagenet_ddp.training.model import build_model, save_model

    model = tmp_path / "model.pt"
    config = {"run": "e", "crop_size": 16, "eval_resize": 20, "precision": "fp32"}
    save_model(model, build_model("resnet18", 4), arch="resnet18", num_classes=4,
               config={**config, "loader": "dali"})  # fmt: skip
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import nvidia.dali: ImportError
    with pytest.raises(InputError, match=r"model\.pt: its run trained with loader: dali; .*"
                                         r"install imagenet-ddp\[dali\]"):  # fmt: skip
        evaluate_run(model_path=model, prepared_train=prepared_demo["train"],
                     prepared_val=prepared_demo["val"], holdout_ids_csv=demo_split / "holdout.csv",
                     geometry=Geometry(nodes=1, tasks_per_node=1, cpus_per_task=1,
                                       gpus_per_node=0))  # fmt: skip
