"""Published ImageNet recipes by name (``recipe:`` in a run or in ``train_defaults``), each key
checked against its source by tests/test_recipes.py; what a source used that is not
implemented is named "Left out". Keys set at the same level or below win
(:func:`imagenet_ddp.settings.runs.resolve_run`):

- ``recipe`` in ``train_defaults``: schema defaults < preset < ``train_defaults`` < the run;
- ``recipe`` in a run: schema defaults < ``train_defaults`` < preset < the run.

Batch sizes are per rank at the sources' 8 GPUs; ``lr`` is per 256 images (``lr_scaling:
linear``), so another rank count keeps the source's LR per image. Torch-free.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # torchvision references/classification README, "ResNet" (torchrun --nproc_per_node=8
    # train.py --model resnet50, the script's defaults): 90 epochs, batch 32 x 8 GPUs, SGD lr
    # 0.1 momentum 0.9 (no Nesterov), weight decay 1e-4, StepLR step 30 gamma 0.1, crop 224,
    # val resize 256. Reported: ResNet50_Weights.IMAGENET1K_V1 acc@1 76.130, acc@5 92.862.
    "torchvision-resnet50-v1": {
        "model": "resnet50",
        "epochs": 90,
        "batch_size": 32,
        "optimizer": "sgd",
        "lr": 0.1,
        "lr_scaling": "linear",
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 1e-4,
        "lr_schedule": "step",
        "lr_step_epochs": [30, 60],
        "lr_step_gamma": 0.1,
        "warmup_epochs": 0.0,
        "label_smoothing": 0.0,
        "crop_size": 224,
        "eval_resize": 256,
        "eval_crop_size": 224,
    },
    # "How to Train State-Of-The-Art Models Using TorchVision's Latest Primitives" (PyTorch
    # blog, Nov 2021) and ResNet50_Weights.IMAGENET1K_V2's recipe: batch 128 x 8 GPUs, lr 0.5
    # (0.125 per 256), cosine over 600 epochs, linear warm-up 5 epochs from 0.01, weight decay
    # 2e-5 and none on norm layers, label smoothing 0.1, mixup 0.2, cutmix 1.0, TrivialAugment
    # (ta_wide), random erasing 0.1, EMA decay 0.99998 every 32 steps, train crop 176, val
    # resize 232 and crop 224. Reported: acc@1 80.858, acc@5 95.434. Left out: repeated
    # augmentation (ra_sampler, 4 repeats).
    "torchvision-resnet50-v2": {
        "model": "resnet50",
        "epochs": 600,
        "batch_size": 128,
        "optimizer": "sgd",
        "lr": 0.125,
        "lr_scaling": "linear",
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 2e-5,
        "norm_weight_decay": 0.0,
        "lr_schedule": "cosine",
        "lr_min_ratio": 0.0,
        "warmup_epochs": 5.0,
        "warmup_start_factor": 0.01,
        "label_smoothing": 0.1,
        "mixup_alpha": 0.2,
        "cutmix_alpha": 1.0,
        "auto_augment": "trivialaugment",
        "random_erasing": 0.1,
        "ema_decay": 0.99998,
        "ema_steps": 32,
        "crop_size": 176,
        "eval_resize": 232,
        "eval_crop_size": 224,
    },
    # ffcv-imagenet rn50_configs/rn50_88_epochs.yaml with train_imagenet.py: batch 512 x 8
    # GPUs, SGD lr 1.7 for 4096 images (0.10625 per 256) momentum 0.9, weight decay 1e-4 and
    # none on BatchNorm (bn_wd 0), label smoothing 0.1, "cyclic" LR: linear from 1e-4 x lr to lr
    # over 2 epochs, then linear to 0; progressive resizing 160 -> 192 between epochs 65 and 76
    # (rounded to multiples of 32); validation at 256 with crop ratio 224/256. Reported
    # (ffcv-imagenet README): top-1 0.784, top-5 0.941 (88 epochs, 8 x A100, 77 min); 16 epochs
    # (ramp 11 -> 13): 0.738. Left out: BlurPool and test-time flip averaging (lr_tta), which
    # the reported numbers include.
    "ffcv-resnet50": {
        "model": "resnet50",
        "epochs": 88,
        "batch_size": 512,
        "optimizer": "sgd",
        "lr": 0.10625,
        "lr_scaling": "linear",
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 1e-4,
        "norm_weight_decay": 0.0,
        "lr_schedule": "linear",
        "lr_min_ratio": 0.0,
        "warmup_epochs": 2.0,
        "warmup_start_factor": 1e-4,
        "label_smoothing": 0.1,
        "crop_size": 192,
        "progressive_min_crop": 160,
        "progressive_start_epoch": 65,
        "progressive_end_epoch": 76,
        "progressive_multiple": 32,
        "eval_resize": 293,  # 256 / (224 / 256) = 292.6: the centre 224/256 of the image
        "eval_crop_size": 256,
    },
}


# ResNet strikes back (Wightman, Touvron, Jegou 2021, arXiv:2110.00476, Table 1) with timm's
# train.py (its defaults for what the table leaves out: --warmup-lr 1e-4, --min-lr 1e-6,
# timm's ResNet with zero_init_last): ResNet-50, LAMB, global batch 2048 (128 per rank at
# 2 x 8 GPUs), lr 5e-3 for 2048 (A3: 8e-3), cosine with 5 warm-up epochs, BCE with target
# threshold 0.2, no label smoothing, RandAugment rand-m7-mstd0.5-inc1 (A3: m6), mixup 0.2
# (A2, A3: 0.1) / cutmix 1.0, stochastic depth 0.05 (A3: none), repeated augmentation (A1:
# 3 repeats), bicubic, test crop ratio 0.95 (timm: resize floor(224 / 0.95) = 235, crop 224),
# weight decay 0.01 (A2, A3: 0.02) off 1-D parameters. Train at 224 (A3: 160), test at 224.
# Reported top-1: 80.4 / 79.8 / 78.1 (timm/resnet50.a1_in1k, a2, a3).
def _rsb(epochs, lr, wd, magnitude, mixup, drop_path, repeats, crop):
    return {
        "model": "timm/resnet50.a1_in1k",
        "model_kwargs": {"drop_path_rate": drop_path} if drop_path else {},
        "zero_init_residual": True,
        "epochs": epochs,
        "batch_size": 128,
        "optimizer": "timm/lamb",
        "lr": lr * 256 / 2048,
        "lr_scaling": "linear",
        "weight_decay": wd,
        "weight_decay_groups": "timm",
        "lr_schedule": "cosine",
        "warmup_epochs": 5.0,
        "warmup_start_factor": 1e-4 / lr,
        "lr_min_ratio": 1e-6 / lr,
        "loss": "bce",
        "bce_target_threshold": 0.2,
        "label_smoothing": 0.0,
        "auto_augment": f"rand-m{magnitude}-mstd0.5-inc1",
        "interpolation": "bicubic",
        "mixup_alpha": mixup,
        "cutmix_alpha": 1.0,
        "repeated_augmentation": repeats,
        "crop_size": crop,
        "eval_resize": 235,
        "eval_crop_size": 224,
    }


# DeiT (Touvron et al. 2021, "Training data-efficient image transformers", facebookresearch/
# deit main.py's defaults and README commands): AdamW lr 5e-4 x global batch / 512 (1024:
# 64 per rank at 2 x 8 GPUs, DeiT-B's 16 GPUs x 64), eps 1e-8, weight decay 0.05 off 1-D
# parameters and pos_embed/cls_token (timm's create_optimizer), 300 epochs, cosine per epoch
# from 5 warm-up epochs at 1e-6 to min 1e-5, label smoothing 0.1, RandAugment
# rand-m9-mstd0.5-inc1, mixup 0.8 / cutmix 1.0, random erasing 0.25, repeated augmentation
# (3), drop path 0.1, bicubic, eval resize int(224 / 0.875) = 256 and crop 224. Reported
# top-1: 79.8 (DeiT-S), 81.8 (DeiT-B), of the trained weights.
def _deit(model):
    return {
        "model": model,
        "model_kwargs": {"drop_path_rate": 0.1},
        "epochs": 300,
        "batch_size": 64,
        "optimizer": "adamw",
        "optimizer_kwargs": {"eps": 1e-8},
        "lr": 5e-4 * 256 / 512,
        "lr_scaling": "linear",
        "weight_decay": 0.05,
        "weight_decay_groups": "timm",
        "lr_schedule": "cosine",
        "warmup_epochs": 5.0,
        "warmup_start_factor": 1e-6 / 1e-3,
        "lr_min_ratio": 1e-5 / 1e-3,
        "label_smoothing": 0.1,
        "auto_augment": "rand-m9-mstd0.5-inc1",
        "interpolation": "bicubic",
        "mixup_alpha": 0.8,
        "cutmix_alpha": 1.0,
        "random_erasing": 0.25,
        "repeated_augmentation": 3,
        "crop_size": 224,
        "eval_resize": 256,
        "eval_crop_size": 224,
    }


PRESETS.update(
    {
        "timm-resnet50-a1": _rsb(600, 5e-3, 0.01, 7, 0.2, 0.05, 3, 224),
        "timm-resnet50-a2": _rsb(300, 5e-3, 0.02, 7, 0.1, 0.05, 1, 224),
        "timm-resnet50-a3": _rsb(100, 8e-3, 0.02, 6, 0.1, 0.0, 1, 160),
        "deit-small": _deit("timm/deit_small_patch16_224"),
        "deit-base": _deit("timm/deit_base_patch16_224"),
    }
)

# What each source reports for its recipe (docs/configuration.md "Recipes").
REPORTED_TOP1 = {
    "torchvision-resnet50-v1": 76.130,
    "torchvision-resnet50-v2": 80.858,
    "ffcv-resnet50": 78.4,
    "timm-resnet50-a1": 80.4,
    "timm-resnet50-a2": 79.8,
    "timm-resnet50-a3": 78.1,
    "deit-small": 79.8,
    "deit-base": 81.8,
}

# Which weights each reported figure is of: "ema", the averaged model (torchvision's reference
# evaluates model_ema with --model-ema: IMAGENET1K_V2 are those weights), or "model".
REPORTED_MODEL = {name: "model" for name in PRESETS} | {"torchvision-resnet50-v2": "ema"}

# MLPerf Training's ResNet-50 target (top-1 on ImageNet's validation set, in %): the default
# report.target_top1 of a ResNet-50 run whose preset reports none.
MLPERF_RESNET50_TOP1 = 75.9


def default_target_top1(recipe: str | None, model: str) -> tuple[float | None, str]:
    """(report.target_top1 of a run that sets none, in %, and where it comes from): its
    preset's reported top-1, else MLPerf's for a ResNet-50, else none."""
    if recipe in REPORTED_TOP1:
        return REPORTED_TOP1[recipe], f"published ({recipe})"
    if model in ("resnet50", "timm/resnet50") or model.startswith("timm/resnet50."):
        return MLPERF_RESNET50_TOP1, "MLPerf ResNet-50"
    return None, ""


def preset(name: str) -> dict[str, Any]:
    if name == "none":
        return {}
    if name not in PRESETS:
        raise ValueError(
            f"config.yaml: recipe {name!r} is not a preset; use one of "
            f"{', '.join(['none', *PRESETS])}"
        )
    return {"recipe": name, **PRESETS[name]}
