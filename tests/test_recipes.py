"""Recipe components do what they say, and the presets carry the published values."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from imagenet_ddp.optimizers import create_optimizer, scaled_lr
from imagenet_ddp.settings.geometry import global_batch
from imagenet_ddp.settings.presets import PRESETS
from imagenet_ddp.settings.runs import resolve_run
from imagenet_ddp.training import recipe
from tests.workflow_helpers import REPO, train_config

SCHEMA = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
RUN_KEYS = SCHEMA["definitions"]["run_settings"]["properties"]
DEFAULTS = {k: v["default"] for k, v in RUN_KEYS.items() if "default" in v}


# ------------------------------------------------------------------ learning-rate schedules


def lrs(steps_per_epoch=10, **settings) -> list[float]:
    f = recipe.lr_lambda(steps_per_epoch, train_config(**settings))
    return [f(step) for step in range(settings["epochs"] * steps_per_epoch + 1)]


def test_step_schedule_multiplies_by_gamma_at_each_milestone():
    f = lrs(epochs=9, lr_schedule="step", lr_step_epochs=[3, 6], lr_step_gamma=0.1)
    assert f[0] == f[29] == 1.0
    assert f[30] == f[59] == pytest.approx(0.1)
    assert f[60] == f[89] == pytest.approx(0.01)


def test_cosine_ends_at_the_minimum_and_warm_up_starts_at_its_factor():
    f = lrs(epochs=5, warmup_epochs=1, warmup_start_factor=0.01, lr_min_ratio=0.1)
    assert f[0] == 0.01 and f[5] == pytest.approx(0.01 + 0.99 / 2)  # linear warm-up
    assert f[10] == 1.0
    assert f[30] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f[50] == pytest.approx(0.1)


def test_v2_schedule_is_torchvisions_at_every_epoch_start():
    """torchvision's reference steps LinearLR(start_factor=0.01, total_iters=5) then
    CosineAnnealingLR(T_max=epochs - 5) once per epoch; ours steps per optimizer step and
    agrees at each epoch's first step (in between it interpolates)."""
    cfg = train_config(**PRESETS["torchvision-resnet50-v2"])
    f = recipe.lr_lambda(3, cfg)
    for epoch in range(600):
        if epoch < 5:
            expected = 0.01 + 0.99 * epoch / 5
        else:
            expected = 0.5 * (1 + math.cos(math.pi * (epoch - 5) / 595))
        assert f(3 * epoch) == pytest.approx(expected, abs=1e-12), epoch


def test_ffcv_schedule_is_its_per_step_interpolation():
    """train_imagenet.py: np.interp(epoch, [0, lr_peak_epoch, epochs], [1e-4 x lr, lr, 0]),
    and within an epoch interpolated per step from its value to the next epoch's."""
    import numpy as np

    cfg = train_config(**PRESETS["ffcv-resnet50"])
    steps = 7
    f = recipe.lr_lambda(steps, cfg)
    for step in range(88 * steps):
        expected = np.interp(step / steps, [0, 2, 88], [1e-4, 1.0, 0.0])
        assert f(step) == pytest.approx(expected, abs=1e-12), step


def test_linear_schedule_is_ffcvs_triangle():
    f = lrs(epochs=4, warmup_epochs=2, lr_schedule="linear")
    assert f[20] == 1.0 and f[30] == pytest.approx(0.5) and f[40] == 0.0


def test_linear_scaling_rule_uses_the_global_batch():
    run = {"lr": 0.1, "lr_scaling": "linear", "batch_size": 128, "nodes": 2, "tasks_per_node": 4}
    assert global_batch(run) == 1024 and scaled_lr(run, 1024) == pytest.approx(0.1 * 1024 / 256)
    # A rank: the ranks that started (its TrainConfig may leave the geometry to them).
    cfg = train_config(lr=0.1, lr_scaling="linear", batch_size=128)
    assert global_batch(vars(cfg), 8) == 1024 and scaled_lr(vars(cfg), 512) == pytest.approx(0.2)
    assert scaled_lr(vars(train_config(lr=0.1, lr_scaling="none", batch_size=128)), 1024) == 0.1
    # The default: a base LR per 256 images, as torchvision's reference and timm scale it.
    assert scaled_lr(vars(train_config(lr=0.1, batch_size=32)), 256) == 0.1
    optimizer = create_optimizer(cfg, torch.nn.Linear(2, 2), global_batch(vars(cfg), 8))
    assert optimizer.defaults["lr"] == pytest.approx(0.4)  # what the optimizer uses


# ------------------------------------------------------------------ optimizer


def test_no_weight_decay_on_norm_and_bias_parameters_when_asked():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    cfg = train_config(weight_decay=1e-4, norm_weight_decay=0.0, bias_weight_decay=0.0)
    groups = {g["group"]: g for g in create_optimizer(cfg, model, 256).param_groups}
    assert groups["norm"]["weight_decay"] == 0.0
    assert {id(p) for p in groups["norm"]["params"]} == {id(model[1].weight), id(model[1].bias)}
    assert [id(p) for p in groups["bias"]["params"]] == [id(model[0].bias)]
    assert groups["other"]["weight_decay"] == 1e-4
    assert [id(p) for p in groups["other"]["params"]] == [id(model[0].weight)]
    default = create_optimizer(train_config(weight_decay=1e-4), model, 256)
    assert all(g["weight_decay"] == 1e-4 for g in default.param_groups)
    adamw = create_optimizer(train_config(optimizer="adamw"), model, 256)
    assert isinstance(adamw, torch.optim.AdamW)


# ------------------------------------------------------------------ augmentation, EMA, crops


def test_mixup_and_cutmix_labels_are_distributions_and_replay_from_the_seed():
    mixer = recipe.batch_mixer(train_config(mixup_alpha=0.2, cutmix_alpha=1.0), num_classes=5)
    images, targets = torch.rand(8, 3, 16, 16), torch.arange(8) % 5
    mixed, labels = recipe.mix_batch(mixer, images.clone(), targets, seed=3)
    assert labels.shape == (8, 5)
    assert torch.allclose(labels.sum(1), torch.ones(8))
    again = recipe.mix_batch(mixer, images.clone(), targets, seed=3)
    assert torch.equal(again[0], mixed) and torch.equal(again[1], labels)
    assert recipe.batch_mixer(train_config(), 5) is None


def test_every_sample_augmentation_is_a_function_of_the_seed():
    from torchvision import tv_tensors

    from imagenet_ddp.training.data import SeededAugmentation

    cfg = train_config(crop_size=16, auto_augment="trivialaugment", random_erasing=1.0)
    image = tv_tensors.Image(torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8))
    data = SeededAugmentation([(image, 0)] * 4, recipe.EpochTransforms(cfg), 7, per_epoch=True)
    first = data[(1, 2)][0]
    assert first.dtype == torch.uint8 and first.shape == (3, 16, 16)
    torch.manual_seed(99)
    assert torch.equal(data[(1, 2)][0], first)
    assert not torch.equal(data[(1, 3)][0], first)


@pytest.mark.parametrize(
    "policy", ["none", "randaugment", "trivialaugment", "autoaugment", "rand-m9-mstd0.5-inc1"]
)
def test_pythons_and_numpys_rngs_are_seeded_per_sample_where_the_policy_draws_from_them(policy):
    """SeededAugmentation.of_run seeds Python's and NumPy's RNGs per sample only where
    recipe.draws_python_numpy says the transform draws from them (restoring NumPy's state
    costs ~70 us a sample): each torchvision policy, at each of its extremes and with erasing,
    leaves both as they were; timm's RandAugment moves them, and its samples are seeded."""
    import random

    import numpy as np

    from imagenet_ddp.training.data import SeededAugmentation

    cfg = train_config(crop_size=16, auto_augment=policy, random_erasing=0.5)
    crops, ops = recipe.extreme_transforms(cfg, 16)
    square = torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8)
    runs = [(recipe.sample_transform(cfg, 16), recipe.synthetic_images(24))]
    runs += [(t, recipe.synthetic_images(24)) for t in crops.values()]
    runs += [(t, [square]) for t in ops.values()]

    def states():
        name, keys, pos, *_ = np.random.get_state()
        return random.getstate(), keys.tobytes(), pos

    before = states()
    for transform, images in runs:
        for seed, image in enumerate(images * 3):
            torch.manual_seed(seed)
            transform(image)
    assert (states() != before) == recipe.draws_python_numpy(cfg)
    assert recipe.draws_python_numpy(cfg) == policy.startswith("rand-")

    image = recipe.synthetic_images(24)[0]
    data = SeededAugmentation.of_run([(image, 0)], cfg)
    assert data.python_numpy == recipe.draws_python_numpy(cfg)
    seeded_all = SeededAugmentation([(image, 0)], recipe.EpochTransforms(cfg), cfg.seed,
                                    per_epoch=True, python_numpy=True)  # fmt: skip
    random.seed(1)
    np.random.seed(1)
    first = data[(0, 0)][0]
    random.seed(2)
    np.random.seed(2)
    assert torch.equal(data[(0, 0)][0], first)
    assert torch.equal(seeded_all[(0, 0)][0], first)


def test_ema_equals_its_formula():
    model = torch.nn.Linear(2, 1, bias=False)
    cfg = train_config(ema_decay=0.9, ema_steps=1, epochs=1, batch_size=1)
    ema = recipe.build_ema(
        cfg, model, world_size=1, device=torch.device("cpu")
    )  # adjust = 1: decay 0.9 as given
    expected = model.weight.detach().clone()
    for step in range(1, 4):
        with torch.no_grad():
            model.weight.add_(1.0)
        recipe.update_ema(cfg, ema, model, step, epoch=0)
        # The first update copies the weights; later ones average with the decay.
        expected = (
            model.weight.detach().clone() if step == 1 else 0.9 * expected + 0.1 * model.weight
        )
        assert torch.allclose(ema.module.weight, expected)


def test_every_interpolation_is_bilinear_as_the_reference_passes_it():
    """torchvision's reference passes --interpolation (bilinear) to RandomResizedCrop, each
    auto-augment policy and the eval Resize; the policies' own default is NEAREST."""
    from torchvision.transforms import v2

    from imagenet_ddp.data.dataset import eval_transform

    bilinear = v2.InterpolationMode.BILINEAR

    def mode(transform):  # some transforms keep the string they were given
        return v2.InterpolationMode(transform.interpolation)

    assert mode(v2.TrivialAugmentWide()) != bilinear  # why it must be passed
    for policy in ("trivialaugment", "randaugment", "autoaugment"):
        steps = recipe.sample_transform(train_config(auto_augment=policy), 16).transforms
        crop, augment = steps[0].transforms[0], steps[1]
        assert (mode(crop), mode(augment)) == (bilinear, bilinear), policy
        assert crop.antialias
    resize, center = eval_transform(232, 224).transforms[:2]
    assert (resize.size, mode(resize), resize.antialias) == ([232], bilinear, True)
    assert center.size == (224, 224)
    randaugment = recipe.sample_transform(train_config(auto_augment="randaugment"), 16)
    assert randaugment.transforms[1].magnitude == 9  # the reference's --ra-magnitude default


def test_v2_ema_is_torchvisions_adjusted_decay_every_32_steps():
    """train.py: adjust = world_size x batch_size x model_ema_steps / epochs, alpha =
    min(1, (1 - model_ema_decay) x adjust); updated every model_ema_steps steps, and copied
    (n_averaged reset) during the warm-up epochs."""
    cfg = train_config(**PRESETS["torchvision-resnet50-v2"])
    model = torch.nn.Linear(1, 1, bias=False)
    ema = recipe.build_ema(cfg, model, world_size=8, device=torch.device("cpu"))
    decay = 1 - (1 - 0.99998) * 8 * 128 * 32 / 600
    with torch.no_grad():
        model.weight.fill_(1.0)
    recipe.update_ema(cfg, ema, model, 32, epoch=4)  # in warm-up: a copy, count reset
    assert ema.module.weight.item() == 1.0 and ema.n_averaged.item() == 0
    recipe.update_ema(cfg, ema, model, 64, epoch=5)  # first after warm-up: still a copy
    with torch.no_grad():
        model.weight.fill_(2.0)
    recipe.update_ema(cfg, ema, model, 65, epoch=5)  # not a multiple of 32: nothing
    assert ema.module.weight.item() == 1.0
    recipe.update_ema(cfg, ema, model, 96, epoch=5)
    assert ema.module.weight.item() == pytest.approx(decay * 1.0 + (1 - decay) * 2.0)
    # A warm-up in steps (warmup_steps) restarts the average up to its last step.
    cfg = train_config(**{**PRESETS["torchvision-resnet50-v2"], "warmup_epochs": 0,
                          "warmup_steps": 64})  # fmt: skip
    recipe.update_ema(cfg, ema, model, 64, epoch=0)
    assert ema.n_averaged.item() == 0
    recipe.update_ema(cfg, ema, model, 96, epoch=0)
    assert ema.n_averaged.item() == 1


def test_progressive_crop_sizes_per_epoch_follow_ffcv():
    cfg = train_config(**PRESETS["ffcv-resnet50"])
    sizes = [cfg.crop_for_epoch(e) for e in range(88)]
    # FFCV's get_resolution: min_res until start_ramp, interpolated and rounded to 32 until
    # end_ramp, then max_res.
    assert sizes[:66] == [160] * 66 and sizes[76:] == [192] * 12
    assert set(sizes[66:76]) == {160, 192} and sizes == sorted(sizes)
    assert train_config(crop_size=64).crop_for_epoch(0) == 64  # off by default


# ------------------------------------------------------------------ presets


# The published values, by source (batch sizes per GPU for 8 GPUs; lr as the source gives it
# for that global batch). Checked against the resolved presets.
PUBLISHED = {
    # https://github.com/pytorch/vision/tree/main/references/classification#resnet and
    # train.py's defaults: epochs 90, batch-size 32, lr 0.1, momentum 0.9, wd 1e-4,
    # lr-scheduler steplr, lr-step-size 30, lr-gamma 0.1, val-resize 256, crop 224.
    "torchvision-resnet50-v1": {
        "epochs": 90, "batch_size": 32, "global_lr": 0.1, "momentum": 0.9, "nesterov": False,
        "weight_decay": 1e-4, "lr_schedule": "step", "lr_step_epochs": [30, 60],
        "lr_step_gamma": 0.1, "crop_size": 224, "eval_resize": 256, "eval_crop_size": 224,
    },
    # https://pytorch.org/blog/how-to-train-state-of-the-art-models-using-torchvision-latest-primitives/
    # (ResNet50_Weights.IMAGENET1K_V2): --batch-size 128 --lr 0.5 --lr-scheduler
    # cosineannealinglr --lr-warmup-epochs 5 --lr-warmup-method linear --auto-augment ta_wide
    # --epochs 600 --random-erase 0.1 --weight-decay 0.00002 --norm-weight-decay 0.0
    # --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 --train-crop-size 176
    # --model-ema --val-resize-size 232 (lr-warmup-decay 0.01, model-ema-decay 0.99998,
    # model-ema-steps 32 are train.py's defaults).
    "torchvision-resnet50-v2": {
        "epochs": 600, "batch_size": 128, "global_lr": 0.5, "lr_schedule": "cosine",
        "warmup_epochs": 5.0, "warmup_start_factor": 0.01, "auto_augment": "trivialaugment",
        "random_erasing": 0.1, "weight_decay": 2e-5, "norm_weight_decay": 0.0,
        "label_smoothing": 0.1, "mixup_alpha": 0.2, "cutmix_alpha": 1.0, "crop_size": 176,
        "ema_decay": 0.99998, "ema_steps": 32, "eval_resize": 232, "eval_crop_size": 224,
    },
    # https://github.com/libffcv/ffcv-imagenet rn50_configs/rn50_88_epochs.yaml: lr 1.7,
    # batch_size 512, epochs 88, label_smoothing 0.1, momentum 0.9, weight_decay 1e-4, bn_wd 0,
    # min_res 160, max_res 192, start_ramp 65, end_ramp 76, validation resolution 256;
    # train_imagenet.py: lr_peak_epoch 2, cyclic schedule from 1e-4 x lr, crop ratio 224/256.
    "ffcv-resnet50": {
        "epochs": 88, "batch_size": 512, "global_lr": 1.7, "momentum": 0.9,
        "label_smoothing": 0.1, "weight_decay": 1e-4, "norm_weight_decay": 0.0,
        "progressive_min_crop": 160, "crop_size": 192, "progressive_start_epoch": 65,
        "progressive_end_epoch": 76, "eval_crop_size": 256, "warmup_epochs": 2.0,
        "warmup_start_factor": 1e-4, "lr_schedule": "linear",
    },
    # ResNet strikes back (arXiv:2110.00476) Table 1, A1: 600 epochs, batch 2048, LAMB lr 5e-3,
    # wd 0.01, cosine, 5 warm-up epochs, BCE (target threshold 0.2), no label smoothing,
    # stochastic depth 0.05, repeated augmentation, RandAugment 7/0.5, mixup 0.2, cutmix 1.0,
    # train 224, test 224 at crop ratio 0.95; timm's train.py --warmup-lr 1e-4 --min-lr 1e-6
    # (its defaults), bicubic; A2: 300 epochs, wd 0.02, mixup 0.1, no repeats; A3: 100
    # epochs, lr 8e-3, wd 0.02, RandAugment 6/0.5, mixup 0.1, no stochastic depth, train 160.
    "timm-resnet50-a1": {
        "model": "timm/resnet50.a1_in1k", "epochs": 600, "global_batch": 2048,
        "global_lr": 5e-3, "optimizer": "timm/lamb", "weight_decay": 0.01,
        "lr_schedule": "cosine", "warmup_epochs": 5.0, "warmup_lr": 1e-4, "min_lr": 1e-6,
        "loss": "bce", "bce_target_threshold": 0.2, "label_smoothing": 0.0,
        "model_kwargs": {"drop_path_rate": 0.05}, "repeated_augmentation": 3,
        "auto_augment": "rand-m7-mstd0.5-inc1", "mixup_alpha": 0.2, "cutmix_alpha": 1.0,
        "crop_size": 224, "eval_crop_size": 224, "eval_resize": 235,
        "interpolation": "bicubic", "zero_init_residual": True,
    },
    "timm-resnet50-a2": {
        "model": "timm/resnet50.a1_in1k", "epochs": 300, "global_batch": 2048,
        "global_lr": 5e-3, "weight_decay": 0.02, "warmup_lr": 1e-4, "min_lr": 1e-6,
        "model_kwargs": {"drop_path_rate": 0.05}, "repeated_augmentation": 1,
        "auto_augment": "rand-m7-mstd0.5-inc1", "mixup_alpha": 0.1, "crop_size": 224,
        "eval_resize": 235, "loss": "bce", "bce_target_threshold": 0.2,
    },
    "timm-resnet50-a3": {
        "model": "timm/resnet50.a1_in1k", "epochs": 100, "global_batch": 2048,
        "global_lr": 8e-3, "weight_decay": 0.02, "warmup_lr": 1e-4, "min_lr": 1e-6,
        "model_kwargs": {}, "repeated_augmentation": 1, "auto_augment": "rand-m6-mstd0.5-inc1",
        "mixup_alpha": 0.1, "crop_size": 160, "eval_crop_size": 224, "eval_resize": 235,
    },
    # facebookresearch/deit main.py defaults with the README's commands (DeiT-B: 16 GPUs x
    # batch 64; DeiT-S: 4 x 256): lr 5e-4 x 1024 / 512, AdamW eps 1e-8, wd 0.05, 300 epochs,
    # cosine, warmup-epochs 5, warmup-lr 1e-6, min-lr 1e-5, smoothing 0.1, aa
    # rand-m9-mstd0.5-inc1, train-interpolation bicubic, reprob 0.25, repeated-aug, mixup 0.8,
    # cutmix 1.0, drop-path 0.1, eval_crop_ratio 0.875 (resize int(224 / 0.875) = 256).
    "deit-small": {
        "model": "timm/deit_small_patch16_224", "epochs": 300, "global_batch": 1024,
        "global_lr": 1e-3, "optimizer": "adamw", "optimizer_kwargs": {"eps": 1e-8},
        "weight_decay": 0.05, "warmup_epochs": 5.0, "warmup_lr": 1e-6, "min_lr": 1e-5,
        "label_smoothing": 0.1, "auto_augment": "rand-m9-mstd0.5-inc1",
        "interpolation": "bicubic", "random_erasing": 0.25, "repeated_augmentation": 3,
        "mixup_alpha": 0.8, "cutmix_alpha": 1.0, "model_kwargs": {"drop_path_rate": 0.1},
        "crop_size": 224, "eval_resize": 256, "eval_crop_size": 224,
        "weight_decay_groups": "timm",
    },
    "deit-base": {
        "model": "timm/deit_base_patch16_224", "global_batch": 1024, "global_lr": 1e-3,
        "warmup_lr": 1e-6, "min_lr": 1e-5, "model_kwargs": {"drop_path_rate": 0.1},
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_preset_resolves_to_the_published_values(name):
    run = resolve_run(DEFAULTS, {"lr": 0.01, "epochs": 3}, {"name": "r", "recipe": name})
    published = dict(PUBLISHED[name])
    # the sources' 8 GPUs; timm's and DeiT's global batch at 2 nodes x 8 GPUs
    run.update(nodes=2 if "global_batch" in published else 1, tasks_per_node=8)
    assert global_batch(run) == published.pop("global_batch", 8 * run["batch_size"])
    lr = published.pop("global_lr")
    assert scaled_lr(run, global_batch(run)) == pytest.approx(lr)
    # timm's absolute warm-up start and minimum LR, as factors of the source's LR
    if "warmup_lr" in published:
        assert run["warmup_start_factor"] * lr == pytest.approx(published.pop("warmup_lr"))
        assert run["lr_min_ratio"] * lr == pytest.approx(published.pop("min_lr"))
    assert {k: run[k] for k in published} == published
    assert run["model"] == published.get("model", "resnet50")


def test_presets_use_schema_keys_and_the_schema_lists_every_preset():
    assert set(RUN_KEYS["recipe"]["enum"]) == {"none", *PRESETS}
    for name, values in PRESETS.items():
        assert set(values) <= set(RUN_KEYS), (name, set(values) - set(RUN_KEYS))


def test_keys_set_at_the_presets_level_or_below_win():
    td = {"recipe": "ffcv-resnet50", "epochs": 16, "lr": 0.5}
    run = resolve_run(DEFAULTS, td, {"name": "a", "batch_size": 8})
    assert (run["epochs"], run["lr"], run["batch_size"]) == (16, 0.5, 8)
    assert run["label_smoothing"] == 0.1  # from the preset
    # A run's own preset replaces train_defaults' keys, but not the run's.
    run = resolve_run(DEFAULTS, {"lr": 0.5, "epochs": 3}, {"name": "b", "recipe":
                      "torchvision-resnet50-v1", "epochs": 2})  # fmt: skip
    assert (run["lr"], run["epochs"], run["lr_schedule"]) == (0.1, 2, "step")
    assert resolve_run(DEFAULTS, {"lr": 0.5}, {"name": "c"})["mixup_alpha"] == 0.0


# ------------------------------------------------------------------ timm's parts


@pytest.mark.parametrize("name", ["timm/resnet10t", "timm/vit_tiny_patch16_224",
                                  "timm/convnext_atto"])  # fmt: skip
def test_timm_weight_decay_groups_are_timms_own(name):
    """weight_decay_groups timm gives each parameter the weight decay timm's create_optimizer_v2
    gives it (ResNet, ViT, ConvNeXt: BatchNorm, LayerNorm, LayerNorm2d, pos_embed, cls_token,
    biases); torchvision's groups decay what timm exempts (the issue's defect, kept as the
    default so earlier runs stay what they were)."""
    from timm.optim import create_optimizer_v2

    from imagenet_ddp import models

    model = models.on_meta(lambda: models.build_model(name, 10))
    theirs = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    ours = create_optimizer(
        train_config(optimizer="adamw", weight_decay=0.05, weight_decay_groups="timm"), model, 256
    )

    def decay(optimizer):
        return {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}

    assert decay(ours) == decay(theirs)
    assert len(decay(ours)) == len(list(model.parameters()))
    named = dict(model.named_parameters())
    exempt = {n for n, p in named.items() if decay(ours)[id(p)] == 0.0}
    default = decay(create_optimizer(train_config(weight_decay=0.05), model, 256))
    if "pos_embed" in named:
        assert {"pos_embed", "cls_token"} <= exempt and default[id(named["pos_embed"])] == 0.05
    assert all(named[n].ndim <= 1 or n in ("pos_embed", "cls_token") for n in exempt)


def test_normalization_is_the_models_pretrained_config():
    """normalization: model takes mean and std from the timm model's tag, as timm's
    resolve_data_config does for the built model (nothing downloaded)."""
    import timm
    from timm.data import resolve_data_config

    from imagenet_ddp.models import IMAGENET_MEAN_STD, input_normalization

    for name in ("vit_tiny_patch16_224.augreg_in21k", "vit_base_patch16_clip_224.openai",
                 "resnet50.a1_in1k"):  # fmt: skip
        size = {"img_size": 32} if "vit" in name else {}
        model = timm.create_model(name, pretrained=False, num_classes=2, **size)
        config = resolve_data_config(model=model)
        assert input_normalization(f"timm/{name}", "model") == (config["mean"], config["std"])
    assert input_normalization("timm/vit_tiny_patch16_224.augreg_in21k", "model")[0] == (
        0.5, 0.5, 0.5)  # fmt: skip
    assert input_normalization("timm/vit_tiny_patch16_224.augreg_in21k") == IMAGENET_MEAN_STD
    assert input_normalization("vit_b_16", "model") == IMAGENET_MEAN_STD  # torchvision's
    images = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    from imagenet_ddp.data.dataset import normalize_batch

    half = ((0.5,) * 3, (0.5,) * 3)
    assert torch.equal(normalize_batch(images, *half), torch.ones(1, 3, 2, 2))


@pytest.mark.parametrize("preset", ["timm-resnet50-a1", "timm-resnet50-a3", "deit-small"])
def test_timm_presets_transforms_are_timms_create_transform(preset):
    """The preset's training RandAugment (ops, magnitudes, noise, fill, translate, bicubic)
    and evaluation resize/crop are those of timm's create_transform with the source's
    arguments, and the same seeded draws give the same image."""
    import random

    import numpy as np
    from timm.data import create_transform
    from timm.data.auto_augment import RandAugment
    from torchvision.transforms import v2

    from imagenet_ddp.data.dataset import eval_transform

    cfg = train_config(**PRESETS[preset])
    crop = cfg.crop_size
    mean, std = recipe.mean_std(cfg)
    timms = create_transform(crop, is_training=True, auto_augment=cfg.auto_augment,
                             interpolation="bicubic", mean=mean, std=std)  # fmt: skip
    [theirs] = [t for t in timms.transforms if isinstance(t, RandAugment)]
    ours = recipe.sample_transform(cfg, crop).transforms[1].transforms[1]

    def ops(augment):
        return [(o.name, o.prob, o.magnitude, o.magnitude_std, o.hparams) for o in augment.ops]

    assert ops(ours) == ops(theirs) and ours.num_layers == theirs.num_layers == 2
    image = v2.ToPILImage()(torch.randint(0, 256, (3, crop, crop), dtype=torch.uint8))
    results = []
    for augment in (ours, theirs):
        random.seed(5)
        np.random.seed(5)
        results.append(np.asarray(augment(image)))
    assert np.array_equal(*results)
    evals = create_transform(224, is_training=False, interpolation="bicubic",
                             crop_pct=0.95 if preset.startswith("timm") else 0.875)  # fmt: skip
    resize, center = evals.transforms[:2]
    ours = eval_transform(cfg.eval_resize, cfg.eval_crop, interpolation=cfg.interpolation)
    assert (ours.transforms[0].size, ours.transforms[1].size) == (
        [resize.size], (center.size[0], center.size[1]))  # fmt: skip
    assert resize.interpolation.value == ours.transforms[0].interpolation.value == "bicubic"


def test_pil_image_is_to_pil_images_image_pixel_for_pixel():
    """recipe.pil_image (before timm's RandAugment, in the pytorch path and the check's forced
    ops) gives the bytes, mode and size of torchvision's ToPILImage: the reader's crops,
    a flipped or transposed (strided) one, a tv_tensors.Image, an odd size; a one-channel
    image goes through to_pil_image itself."""
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    generator = torch.Generator().manual_seed(3)
    for shape in [(3, 224, 224), (3, 17, 31), (3, 1, 1), (1, 9, 5)]:
        crop = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        for image in (crop, crop.flip(-1), crop.transpose(1, 2), tv_tensors.Image(crop)):
            ours, theirs = recipe.pil_image(image), v2.ToPILImage()(image)
            assert (ours.mode, ours.size) == (theirs.mode, theirs.size), shape
            assert ours.tobytes() == theirs.tobytes(), shape
    assert recipe.pil_image(crop).mode == "L"


def test_bce_is_timms_with_its_target_threshold():
    criterion = recipe.build_criterion(train_config(loss="bce", bce_target_threshold=0.2))
    logits, mixed = torch.randn(4, 5), torch.softmax(torch.randn(4, 5), 1)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits, (mixed > 0.2).float())
    assert torch.equal(criterion(logits, mixed), expected)
    one_hot = torch.nn.functional.one_hot(torch.arange(4) % 5, 5).float()
    assert torch.equal(criterion(logits, torch.arange(4) % 5), criterion(logits, one_hot))


def deit_rasampler(n: int, world: int, rank: int, epoch: int, repeats: int = 3) -> list[int]:
    """DeiT's samplers.RASampler (facebookresearch/deit), without its 256-rounding (n here
    is a multiple of the global batch): the reference the sampler is checked against."""
    g = torch.Generator().manual_seed(epoch)
    indices = [i for i in torch.randperm(n, generator=g).tolist() for _ in range(repeats)]
    total = int(math.ceil(n * repeats / world)) * world
    indices += indices[: total - len(indices)]
    return indices[rank:total:world][: n // world]


def test_repeated_augmentation_is_deits_split_and_the_same_on_any_rank_count():
    from imagenet_ddp.training.data import RepeatedAugmentationSampler

    n, batch = 96, 4

    def keys(world, accumulation, skip=0):
        """Per (step, group): the keys, from every rank."""
        groups = {}
        for rank in range(world):
            s = RepeatedAugmentationSampler(n, world, rank, 0, batch, accumulation, repeats=3)
            s.set_epoch(2, skip)
            flat = list(s)
            for i in range(0, len(flat), batch):
                micro = i // batch
                step = skip + micro // accumulation
                groups[(step, s.group(micro % accumulation))] = flat[i : i + batch]
        return groups

    four = keys(4, 1)
    assert four == keys(2, 2) == keys(1, 4)
    assert {k: v for k, v in four.items() if k[0] >= 3} == keys(2, 2, skip=3)  # a resume
    for rank in range(4):  # one micro-batch per rank: DeiT's split, step by step
        ours = [index for step in range(n // 16) for _, index, _ in four[(step, rank)]]
        assert ours == deit_rasampler(n, 4, rank, epoch=2)
    step0 = [(i, r) for g in range(4) for _, i, r in four[(0, g)]]
    assert len({i for i, _ in step0}) < len(step0)  # an image's repeats in one step,
    for group in range(4):  # each in another group's batch
        assert len({i for _, i, _ in four[(0, group)]}) == batch


def test_each_repeat_is_augmented_with_its_own_seed():
    from torchvision import tv_tensors

    from imagenet_ddp.training.data import SeededAugmentation

    cfg = train_config(crop_size=16, auto_augment="rand-m9-mstd0.5-inc1")
    image = tv_tensors.Image(torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8))
    data = SeededAugmentation([(image, 0)], recipe.EpochTransforms(cfg), 7, per_epoch=True)
    assert torch.equal(data[(1, 0)][0], data[(1, 0, 0)][0])  # repeat 0: the sample's seed
    assert not torch.equal(data[(1, 0, 0)][0], data[(1, 0, 1)][0])
    assert torch.equal(data[(1, 0, 1)][0], data[(1, 0, 1)][0])  # timm's draws seeded too


# ------------------------------------------------------------------ the extreme draw


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_transform_takes_its_extreme_draws(name):
    """Each preset's training transform with every extreme forced (each op of its policy alone
    at probability 1 and at magnitude 0 and 10, the smallest and largest crop box, flip and
    erasing at probability 1) and its evaluation transform take synthetic images at each of
    its crops: the 1-in-500 draw that a few-step test misses cannot raise in a step. On the
    old code the DeiT and ResNet-strikes-back presets raised (posterize to 0 bits)."""
    cfg = train_config(**PRESETS[name])
    assert recipe.transform_problems(cfg) == []
    boxes, ops = recipe.extreme_transforms(cfg, cfg.crop_size)
    assert len(boxes) == 4  # both ends of crop_scale x crop_ratio
    if cfg.auto_augment.startswith("rand-"):  # every op of timm's policy, at both ends
        policy = recipe.timm_rand_augment(cfg.auto_augment, 224, (0.5,) * 3, "bicubic")
        names = [op.name for op in policy.transforms[1].ops]
        assert list(ops) == [f"{n} at magnitude {m}" for n in names for m in (0, 10)]
        assert "PosterizeIncreasing at magnitude 10" in ops
    elif cfg.auto_augment != "none":
        space = recipe.POLICIES[cfg.auto_augment](None)._AUGMENTATION_SPACE
        assert {n.split(" at ")[0] for n in ops} == set(space)


def test_posterize_at_zero_bits_is_black_as_pillow_before_13_made_it():
    """timm's PosterizeIncreasing asks for 0 bits at magnitude 10; the pinned Pillow refuses
    it (while this holds, our op stays), Pillow 11.3 and 12.3 returned every channel 0 (their
    mask ~(2**8 - 1); checked by hand against both, docs/proven.md). Ours: black at 0 bits,
    Pillow's own at 1 to 8 (1 bit keeps 0 and 128, another image than 0 bits)."""
    import numpy as np
    from PIL import Image, ImageOps
    from timm.data import auto_augment

    pixels = torch.randint(0, 256, (16, 16, 3), dtype=torch.uint8).numpy()
    for mode in ("RGB", "L"):
        image = Image.fromarray(pixels).convert(mode)
        with pytest.raises(ValueError, match="bits must be between"):
            auto_augment.posterize(image, 0)
        assert not np.asarray(recipe.posterize(image, 0)).any()
        assert recipe.posterize(image, 0).mode == mode
        for bits in range(1, 9):
            ours, pillows = recipe.posterize(image, bits), ImageOps.posterize(image, bits)
            assert np.array_equal(np.asarray(ours), np.asarray(pillows)), (mode, bits)
    # timm's own op is replaced in each policy built here
    policy = recipe.timm_rand_augment("rand-m9-mstd0.5-inc1", 224, (0.5,) * 3, "bicubic")
    [op] = [o for o in policy.transforms[1].ops if o.name == "PosterizeIncreasing"]
    assert op.aug_fn is recipe.posterize


def test_the_check_stage_refuses_a_transform_that_raises_in_one_line(tmp_path, monkeypatch):
    """The `check` job's stage runs the run's transforms at their extremes: the old posterize
    (timm's own, under Pillow 13) fails it in one line naming the run and the transform."""
    import json

    from timm.data import auto_augment

    from imagenet_ddp.errors import InputError
    from imagenet_ddp.settings.kinds import declarations
    from imagenet_ddp.training.data import write_check
    from tests.workflow_helpers import run_settings

    small = {"model": "resnet18", "model_kwargs": {}, "crop_size": 32, "eval_resize": 36,
             "eval_crop_size": 32, "epochs": 1}  # fmt: skip
    run = run_settings(**{**PRESETS["deit-small"], **small, "run": "deit"})
    settings = json.dumps(declarations().changed_from_default(run))
    write_check(settings, 10, tmp_path / "run", tmp_path / "ok.json")
    assert (tmp_path / "ok.json").is_file()
    monkeypatch.setattr(recipe, "posterize", auto_augment.posterize)
    with pytest.raises(InputError) as refused:
        write_check(settings, 10, tmp_path / "run", tmp_path / "check.json")
    assert str(refused.value) == (
        "config.yaml: run 'deit': auto_augment 'rand-m9-mstd0.5-inc1': its training "
        "PosterizeIncreasing at magnitude 10 at crop 32 raises ValueError: bits must be between "
        "or equal to 1 and 8; the run would fail in a step on its node: change auto_augment, "
        "crop_scale, crop_ratio or the crops"
    )
    assert not (tmp_path / "check.json").exists()
