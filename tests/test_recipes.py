"""Recipe components do what they say, and the presets carry the published values."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from imagenet_ddp.settings.presets import PRESETS, resolve_run, scaled_lr
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
    assert scaled_lr(run) == pytest.approx(0.1 * 1024 / 256)
    # A rank: the ranks that started (its TrainConfig may leave the geometry to them).
    cfg = train_config(lr=0.1, lr_scaling="linear", batch_size=128)
    assert scaled_lr(vars(cfg), world_size=8) == pytest.approx(0.4)
    assert scaled_lr(vars(train_config(lr=0.1, lr_scaling="none", batch_size=128)), 8) == 0.1
    # The default: a base LR per 256 images, as torchvision's reference and timm scale it.
    assert scaled_lr(vars(train_config(lr=0.1, batch_size=32)), world_size=8) == 0.1
    optimizer = recipe.build_optimizer(cfg, torch.nn.Linear(2, 2), world_size=8)
    assert optimizer.defaults["lr"] == pytest.approx(0.4)  # what the optimizer uses


# ------------------------------------------------------------------ optimizer


def test_no_weight_decay_on_norm_and_bias_parameters_when_asked():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    cfg = train_config(weight_decay=1e-4, norm_weight_decay=0.0, bias_weight_decay=0.0)
    groups = {g["group"]: g for g in recipe.build_optimizer(cfg, model).param_groups}
    assert groups["norm"]["weight_decay"] == 0.0
    assert {id(p) for p in groups["norm"]["params"]} == {id(model[1].weight), id(model[1].bias)}
    assert [id(p) for p in groups["bias"]["params"]] == [id(model[0].bias)]
    assert groups["other"]["weight_decay"] == 1e-4
    assert [id(p) for p in groups["other"]["params"]] == [id(model[0].weight)]
    default = recipe.build_optimizer(train_config(weight_decay=1e-4), model)
    assert all(g["weight_decay"] == 1e-4 for g in default.param_groups)
    assert isinstance(recipe.build_optimizer(train_config(optimizer="adamw"), model),
                      torch.optim.AdamW)  # fmt: skip


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
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_preset_resolves_to_the_published_values(name):
    run = resolve_run(DEFAULTS, {"lr": 0.01, "epochs": 3}, {"name": "r", "recipe": name})
    run.update(nodes=1, tasks_per_node=8)  # the sources' 8 GPUs
    published = dict(PUBLISHED[name])
    assert scaled_lr(run) == pytest.approx(published.pop("global_lr"))
    assert {k: run[k] for k in published} == published
    assert run["model"] == "resnet50"


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
