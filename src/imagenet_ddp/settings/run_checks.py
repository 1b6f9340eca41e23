"""Dry-run checks of what the schema cannot see: keys combined, torch-free, so that a run
that could only fail (or silently train on upsampled or padded images) is refused by
``snakemake -n``, one line each: ``config.yaml: run '<name>': <key> <value> ...; <what to do>``.
What needs torch is the local `check` rule's (:func:`deep_problems`, :func:`write_check`).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from pathlib import Path

from imagenet_ddp import optimizers
from imagenet_ddp.models import (
    AUX_OUTPUTS_IN_TRAINING,
    FAMILIES,
    NONDETERMINISTIC_ON_CUDA,
    RESIDUAL_BN,
    family,
    unknown_name,
)
from imagenet_ddp.settings import loader_rates
from imagenet_ddp.settings.evaluation import eval_crop, eval_settings
from imagenet_ddp.settings.geometry import global_batch, loader_workers
from imagenet_ddp.settings.init_weights import static_weights_problems
from imagenet_ddp.settings.notices import Notice

# Images in the ILSVRC2012 train archive (what `index` lists from the real archive).
ILSVRC2012_TRAIN_IMAGES = 1_281_167


def check_runs(runs: Mapping[str, Mapping], config: Mapping) -> list[str]:
    """The problems of the resolved runs that the config alone shows, one line each, in run
    order (``config`` and ``runs`` with the schema's defaults filled in)."""
    short_side = config["prepare"]["short_side"]
    sizes = split_sizes(config)
    problems = []
    for name, run in runs.items():
        found = [
            _model_problem(run) if _name_listed(family(run["model"])[0]) else None,
            *static_weights_problems(run),
            *_image_size_problems(run, short_side),
            _device_problem(run),
            _loader_workers_problem(run),
            _gpu_tasks_problem("", run),
            _gpu_tasks_problem("evaluation: ", eval_settings(config.get("evaluate"), run)),
            _determinism_problem(run),
            _gpu_type_problem(run),
            _batch_problem(run, sizes),
            *_recipe_problems(run),
            _profile_problem(run),
            _fallback_nodes_problem(run),
            _warmup_problem(run),
        ]
        problems += [f"config.yaml: run {name!r}: {p}" for p in found if p]
    return problems


# --------------------------------------------------------------------------- the checks


def _model_problem(run: Mapping) -> str | None:
    """A torchvision name against its torch-free name list."""
    model = run["model"]
    if model in AUX_OUTPUTS_IN_TRAINING and not run.get("model_kwargs"):
        return (
            f"model {model!r} returns its auxiliary classifiers' outputs too in training, not "
            "the logits the loss takes; set model_kwargs: {aux_logits: false}"
        )
    return unknown_name(model)


# What deep_problems reads of a run: the `check` rule's params (no other setting reruns it).
CHECKED_SETTINGS = (
    "model", "model_kwargs", "crop_size", "eval_crop_size", "progressive_min_crop",
    "zero_init_residual", "deterministic", "gpus_per_node", "optimizer", "optimizer_kwargs",
    "momentum", "nesterov", "init_weights_exclude", "init_weights_sha256",
    # and its transforms at their extremes (training.recipe.transform_problems)
    "auto_augment", "crop_scale", "crop_ratio", "random_erasing", "interpolation", "hflip",
    "eval_resize", "progressive_start_epoch", "progressive_end_epoch", "progressive_multiple",
    "epochs", "normalization",
    "loader",  # with dali: its import and its DALI pipeline at the same extremes
)  # fmt: skip


def deep_problems(run: Mapping, num_classes: int) -> list[str]:
    """What the local `check` rule finds with torch, one line each (no run prefix): the model
    on the meta device at the run's crops, its residual zero-init option, its CUDA determinism,
    the optimizer, and the init_weights file against ``num_classes`` outputs."""
    from imagenet_ddp import models as M

    name, kwargs = run["model"], dict(run.get("model_kwargs") or {})
    problems = list(M.model_problems(name, kwargs, _crops(run)))
    if problems:
        return problems
    if run.get("zero_init_residual") and not M.residual_option(name, kwargs):
        problems.append(
            f"zero_init_residual true with model {name!r}: its constructor has no residual "
            "BatchNorm zero-init (torchvision's zero_init_residual, timm's zero_init_last); "
            "set zero_init_residual: false"
        )
    if run.get("deterministic") and run["gpus_per_node"] > 0:
        layers = M.nondeterministic_on_cuda(name, kwargs, _crops(run))
        if layers:
            problems.append(
                f"deterministic true with model {name!r} on GPUs: its layers {layers[:3]} have "
                "no deterministic CUDA backward (torch would raise at the first step); set "
                "deterministic: false or pick another model"
            )
    given = {"momentum": run["momentum"], "nesterov": run["nesterov"]}
    problem = optimizers.optimizer_problem(
        run["optimizer"], dict(run.get("optimizer_kwargs") or {}), **given
    )
    problems += [problem] if problem else []
    path = run.get("init_weights")
    if path and os.path.isfile(path):
        exclude = list(run.get("init_weights_exclude") or [])
        problem = M.init_weights_problem(name, kwargs, num_classes, path, exclude)
        problems += [f"init_weights {problem}"] if problem else []
    return problems


def _name_listed(fam: str) -> bool:
    """A family whose bare names the dry-run judges by torchvision's name list (torch-free)."""
    return FAMILIES[fam].name_list


def _crops(run: Mapping) -> tuple[int, ...]:
    crops = {run["crop_size"], eval_crop(run)}
    if run.get("progressive_min_crop"):
        crops.add(run["progressive_min_crop"])
    return tuple(sorted(crops))


def _image_size_problems(run: Mapping, short_side: int) -> list[str]:
    crop, resize = run["crop_size"], run["eval_resize"]
    problems = []
    if crop > short_side:
        problems.append(
            f"crop_size {crop} is larger than prepare.short_side {short_side}: every training "
            "crop would be upsampled from the prepared images; lower crop_size or raise "
            "prepare.short_side (which re-prepares the data)"
        )
    if resize > short_side:
        problems.append(
            f"eval_resize {resize} is larger than prepare.short_side {short_side}: evaluation "
            "would upsample the prepared images; lower eval_resize or raise "
            "prepare.short_side (which re-prepares the data)"
        )
    if eval_crop(run) > resize:
        # eval_transform resizes the shorter side to eval_resize, then center-crops eval_crop:
        # a crop larger than the resized image is padded with black borders.
        key = "eval_crop_size" if run.get("eval_crop_size") else "crop_size"
        problems.append(
            f"{key} {eval_crop(run)} is larger than eval_resize {resize}: evaluation's center crop "
            f"would pad the resized images with black borders; set eval_resize >= {key} "
            "(ImageNet: 256 for 224)"
        )
    return problems


def _recipe_problems(run: Mapping) -> list[str]:
    """Recipe keys that could only fail on the GPU node, or silently do nothing."""
    problems = []
    low, crop = run.get("progressive_min_crop", 0), run["crop_size"]
    start, end = run.get("progressive_start_epoch", 0), run.get("progressive_end_epoch", 0)
    if low and (low > crop or end <= start):
        problems.append(
            f"progressive_min_crop {low} from epoch {start} to {end}: the crop must rise to "
            f"crop_size {crop} (>= progressive_min_crop) after a later end epoch; set "
            "progressive_end_epoch > progressive_start_epoch, or progressive_min_crop: 0"
        )
    for key in ("crop_scale", "crop_ratio"):
        low, high = run.get(key, (0, 0))
        if low > high:
            problems.append(
                f"{key} [{low}, {high}]: min is larger than max (RandomResizedCrop would "
                f"fail on the GPU node); set {key}: [{high}, {low}]"
            )
    if run.get("sync_bn") and (run["gpus_per_node"] == 0 or run["device"] == "cpu"):
        problems.append(
            "sync_bn true on the CPU: torch's SyncBatchNorm synchronizes GPU tensors only; "
            "set sync_bn: false or train on GPUs (gpus_per_node > 0)"
        )
    problems += _timm_recipe_problems(run)
    # timm's, and any model with model_kwargs: the check rule's (deep_problems)
    torchvision = _name_listed(family(run["model"])[0]) and not run.get("model_kwargs")
    residual = run["model"].startswith(RESIDUAL_BN)
    if run.get("zero_init_residual") and torchvision and not residual:
        problems.append(
            f"zero_init_residual true with model {run['model']!r}: only torchvision's ResNet "
            "family (resnet*, resnext*, wide_resnet*) has it; set zero_init_residual: false"
        )
    return problems


def _timm_recipe_problems(run: Mapping) -> list[str]:
    """Settings that timm's parts would silently ignore."""
    problems = []
    given = [k for k in ("norm_weight_decay", "bias_weight_decay") if run.get(k) is not None]
    if run.get("weight_decay_groups") == "timm" and given:
        problems.append(
            f"{given[0]} {run[given[0]]} with weight_decay_groups timm: timm's groups exempt "
            f"every 1-D parameter and bias from weight decay; set {given[0]}: null, or "
            "weight_decay_groups: torchvision"
        )
    mixing = run.get("mixup_alpha", 0) > 0 or run.get("cutmix_alpha", 0) > 0
    if run.get("loss") == "bce" and run.get("label_smoothing", 0) > 0 and mixing:
        problems.append(
            f"label_smoothing {run['label_smoothing']} with loss bce and mixup/cutmix: timm's "
            "BinaryCrossEntropy smooths one-hot targets only, not the mixed ones; set "
            "label_smoothing: 0 or loss: cross_entropy"
        )
    if run.get("bce_target_threshold") is not None and run.get("loss") != "bce":
        problems.append(
            f"bce_target_threshold {run['bce_target_threshold']} with loss "
            f"{run.get('loss')}: it applies to loss bce only; set loss: bce or "
            "bce_target_threshold: null"
        )
    return problems


def _profile_problem(run: Mapping) -> str | None:
    """A profiler window after the last epoch would record nothing, silently."""
    profile, epochs = run.get("profile"), run["epochs"]
    if profile and profile["epoch"] >= epochs:
        return (
            f"profile.epoch {profile['epoch']} is after the last epoch ({epochs} epochs, "
            f"counted from 0): no trace would be written; set profile.epoch below {epochs}"
        )
    return None


def _fallback_nodes_problem(run: Mapping) -> str | None:
    """A fallback count the run could not resume on with the same global batch."""
    nodes, accumulation = run["nodes"], run.get("accumulation", 1)
    fallback = run.get("fallback_nodes") or []
    wrong = [n for n in fallback if n >= nodes or (nodes * accumulation) % n]
    if wrong:
        return (
            f"fallback_nodes {fallback}: {wrong} not smaller than nodes {nodes} or not dividing "
            f"nodes x accumulation ({nodes} x {accumulation}), so the global batch could not "
            f"stay the same on it; list smaller counts that divide {nodes * accumulation}"
        )
    if fallback and run.get("sync_bn"):
        return (
            f"fallback_nodes {fallback} with sync_bn: its batch statistics span the ranks, so "
            "its checkpoints resume on the same rank count only; drop one of them"
        )
    return None


def _device_problem(run: Mapping) -> str | None:
    gpus = run["gpus_per_node"]
    if gpus > 0 and run["device"] == "cpu":
        return (
            f"gpus_per_node {gpus} with device 'cpu': the job would hold {gpus} GPU(s) per node "
            "and train on the CPU; set device: auto (or cuda), or gpus_per_node: 0"
        )
    return None


def _loader_workers_problem(run: Mapping) -> str | None:
    """A GPU rank without loader workers decodes every image between its steps; fewer than
    it needs: a warning (:func:`loader_notice`)."""
    gpus, cpus, setting = run["gpus_per_node"], run["cpus_per_task"], run["workers"]
    if gpus == 0 or run["device"] == "cpu" or loader_workers(setting, cpus) > 0:
        return None
    given = "workers 0" if setting != "auto" else "workers auto (0)"
    return (
        f"{given} with cpus_per_task {cpus} on a GPU run (gpus_per_node {gpus}): every image "
        "would be decoded in the training thread between the GPU's steps; set cpus_per_task "
        "to the node's CPUs per GPU (e.g. 14 on a DGX H100; workers auto = cpus_per_task - 1) "
        "or workers >= 1"
    )


LOADER_SLOWER = (
    "loader slower than the GPU's step, estimated from measured per-worker rates "
    "(docs/preflight.md#the-dry-runs-loader-estimate): the GPU would wait for data that share "
    f"of its time; ways out: {loader_rates.WAYS_OUT}; the preflight measures both"
)
NO_STEP_RATE = (
    "no GPU step rate known for the model (settings.loader_rates): its loader is not judged "
    "at the dry-run; the preflight measures both"
)


NO_DALI_RATE = (
    "loader dali on GPUs: its decode and augmentation run on the GPU, at a rate not measured "
    "here (the per-worker rates are the pytorch path's): not judged at the dry-run; the "
    "preflight (preflight: true) times its pipeline"
)


def loader_notice(name: str, run: Mapping, short_side: int) -> Notice | None:
    """A GPU run whose loader (workers x the measured rate of its augmentation) is estimated
    slower than its GPU's step, with the share of GPU time lost; a note where the model's
    step rate is not known (None: a CPU run, no workers, or fed)."""
    workers = loader_workers(run["workers"], run["cpus_per_task"])
    if run["gpus_per_node"] == 0 or run["device"] == "cpu" or workers == 0:
        return None
    if run.get("loader") == "dali":
        return Notice(NO_DALI_RATE, name, f"{workers} workers for its per-sample draws")
    per_worker = loader_rates.per_worker_rate(run, short_side)
    loader = workers * per_worker
    policy = loader_rates.policy(run.get("auto_augment", "none"))
    fed = f"{workers} workers x {per_worker:,.0f} img/s ({policy}) = {loader:,.0f} img/s a rank"
    step = loader_rates.gpu_step_rate(run)
    if step is None:
        return Notice(NO_STEP_RATE, name, f"{run['model']}; {fed}")
    gpu, source = step
    lost = loader_rates.gpu_time_lost(loader, gpu)
    if not lost:
        return None
    needed = loader_rates.cpus_for_loader(per_worker, gpu)
    return Notice(
        LOADER_SLOWER,
        name,
        f"{fed} against {source} {gpu:,.0f}: {lost:.0%} of GPU time lost; cpus_per_task "
        f"{needed} would feed it",
    )


def _gpu_tasks_problem(where: str, geometry: Mapping) -> str | None:
    """One rank per GPU: more put two on one GPU (NCCL fails), fewer leave paid GPUs idle."""
    gpus, tasks = geometry["gpus_per_node"], geometry["tasks_per_node"]
    if gpus == 0 or tasks == gpus:
        return None
    return (
        f"{where}tasks_per_node {tasks} with gpus_per_node {gpus}: one rank per GPU; "
        f"{'two ranks would share a GPU' if tasks > gpus else 'GPUs would idle, paid for'}; "
        f"set {'evaluate.' if where else ''}tasks_per_node: {gpus}"
    )


def _determinism_problem(run: Mapping) -> str | None:
    if not (run.get("deterministic") and run["gpus_per_node"] > 0):
        return None
    exact = run.get("model_kwargs") or not _name_listed(family(run["model"])[0])
    if exact or not run["model"].startswith(NONDETERMINISTIC_ON_CUDA):
        return None  # timm models and model_kwargs: the check's, from the built model
    return (
        f"deterministic true with model {run['model']!r} on GPUs: its adaptive average "
        "pooling has no deterministic CUDA backward (torch would raise at the first step); "
        "set deterministic: false or pick another model"
    )


def _gpu_type_problem(run: Mapping) -> str | None:
    gpu_type = run.get("gpu_type", "")
    if gpu_type and run["gpus_per_node"] == 0:
        return (
            f"gpu_type {gpu_type!r} with gpus_per_node 0: no GPU is asked for, so the type "
            "would be ignored; set gpus_per_node > 0 or remove gpu_type"
        )
    return None


def _batch_problem(run: Mapping, sizes: tuple[int, int, str]) -> str | None:
    """An epoch drops its last partial global batch (training.data.EpochSampler): none left
    when the global batch is larger than the train set."""
    train, _holdout, source = sizes
    batch = global_batch(run)
    if batch <= train:
        return None
    accumulation = (
        f" x accumulation {run['accumulation']}" if run.get("accumulation", 1) > 1 else ""
    )
    return (
        f"batch_size {run['batch_size']} x nodes {run['nodes']} x tasks_per_node "
        f"{run['tasks_per_node']}{accumulation} = global batch {batch} is larger than the "
        f"{train} training images ({source}): with the last partial batch dropped an epoch "
        "has no step; lower batch_size, accumulation or the number of ranks"
    )


def _warmup_problem(run: Mapping) -> str | None:
    if run.get("warmup_steps", 0) > 0 and run.get("warmup_epochs", 0) > 0:
        return (
            f"warmup_steps {run['warmup_steps']} and warmup_epochs {run['warmup_epochs']} are "
            "both set; set one of them (the other 0)"
        )
    return None


# --------------------------------------------------------------------------- warm-up rule

# Goyal et al. 2017 (arXiv:1706.02677, sections 2.1-2.2, 5): lr 0.1 per 256 images trains
# without warm-up; at batch 8192 (lr 3.2) the warm-up rises over 5 epochs, 782 steps: 0.0041
# per step, the steepest published ramp. The rule: rise per step x LR per 256 images stays
# within theirs (0.0041 x 0.1); per step, as the curvature that makes an early high LR
# diverge falls with the updates taken (Gilmer et al. 2021, arXiv:2110.04369). A heuristic
# beyond their recipe, hence a warning (docs/configuration.md "Warm-up and batch size").
GOYAL_NO_WARMUP_LR = 0.1  # per 256 images, and at most
GOYAL_LR, GOYAL_WARMUP_STEPS = 3.2, round(5 * ILSVRC2012_TRAIN_IMAGES / 8192)  # 782
GOYAL_RAMP = GOYAL_LR / GOYAL_WARMUP_STEPS * GOYAL_NO_WARMUP_LR  # per step x LR per 256 images


def required_warmup_steps(lr_used: float, batch: int) -> int:
    """The fewest warm-up steps in which the rule lets a run reach ``lr_used`` at ``batch``."""
    per_256 = lr_used * 256 / batch
    if lr_used <= GOYAL_NO_WARMUP_LR and per_256 <= GOYAL_NO_WARMUP_LR:
        return 0
    return math.ceil(lr_used * per_256 / GOYAL_RAMP - 1e-9)


# At most a tenth of a run's optimizer steps warm up (Goyal et al.: 5 of 90 epochs): a longer
# warm-up leaves the schedule too few steps (issue 51: 196 of 150 never decayed); past it the
# advice is a lower lr, down to Goyal et al.'s 0.1 per 256 images, which needs none.
MAX_WARMUP_SHARE = 0.1


def warmup_warnings(runs: Mapping[str, Mapping], config: Mapping) -> list[Notice]:
    """A warning per run that reaches its scaled LR in fewer warm-up steps than
    :func:`required_warmup_steps`, naming a warm-up, or a lower ``lr`` (in the run's
    ``lr_scaling``), that fits in MAX_WARMUP_SHARE of its optimizer steps. A folder layout's
    size is unknown here: a warm-up in epochs is judged by the smallest train set it suits."""
    train, _, where = split_sizes(config)
    # ImageNet's count assumed (split_sizes): exact only for the archives' layout
    unknown = where.startswith(ASSUMED) and config["data"].get("layout") != "archives"
    notices = []
    for name, run in runs.items():
        batch = global_batch(run)
        needed = required_warmup_steps(optimizers.scaled_lr(run, batch), batch)
        if unknown:
            detail = _warmup_advice_unknown_size(run, batch, needed)
            notices += [Notice(WARMUP_UNKNOWN, name, detail)] if detail else []
        else:
            advice = warmup_advice(run, batch, needed, train)
            notices += [Notice(advice[0], name, advice[1])] if advice else []
    return notices


def warmup_advice(run: Mapping, batch: int, needed: int, train: int) -> tuple[str, str] | None:
    """(kind, detail) for a run of ``train`` images whose warm-up is shorter than ``needed``
    steps or as long as the run: ``needed`` steps if they fit in MAX_WARMUP_SHARE of its
    steps, else a lower lr whose warm-up does (None: its warm-up fits)."""
    per_epoch = max(1, train // batch)
    steps = run["warmup_steps"] or int(run["warmup_epochs"] * per_epoch)
    lr_used, total = optimizers.scaled_lr(run, batch), run["epochs"] * per_epoch
    if needed <= steps < total or (steps == 0 and needed == 0):
        return None
    longest = max(1, int(MAX_WARMUP_SHARE * total))
    ramp = f"{lr_used / steps:.2g}/step" if steps else "at once"
    if needed == 0:
        fix = f"none needed at this lr: warmup_epochs 0, or warmup_steps {longest} at most"
    elif needed <= longest:
        fix = f"warmup_steps {needed} or warmup_epochs {math.ceil(needed / per_epoch * 10) / 10}"
    else:
        fit = max(math.sqrt(longest * GOYAL_RAMP * batch / 256), _no_warmup_lr(batch))
        lr, used = _lr_setting(run, fit, batch)
        warm = required_warmup_steps(used, batch)
        fix = (
            f"{needed} steps are {needed / total:.0%} of the run's {total} (at most "
            f"{MAX_WARMUP_SHARE:.0%}): lr {lr:g} (lr_used {used:.2g}"
            + (f") with warmup_steps {warm}" if warm else ", no warm-up needed)")
        )
    if steps >= total:  # the LR rises through the whole run and never decays
        return WARMUP_TOO_LONG, f"{steps} warm-up steps of the run's {total}; {fix}"
    return WARMUP_TOO_SHORT, (
        f"{steps} steps to lr_used {lr_used:.3g}: {ramp}, max "
        f"{GOYAL_RAMP / (lr_used * 256 / batch):.2g}; {fix}"
    )


def _warmup_advice_unknown_size(run: Mapping, batch: int, needed: int) -> str | None:
    """The advice for a train set of unknown size: ``needed`` steps where the run is long
    enough for them to be MAX_WARMUP_SHARE of it, else the lr that needs no warm-up."""
    if not needed or run["warmup_steps"] >= needed:
        return None
    smallest = 0
    if not run["warmup_steps"] and run["warmup_epochs"]:
        smallest = math.ceil(needed * batch / run["warmup_epochs"])
    fewer = f"fewer than {smallest} train images" if smallest else "any train set"
    enough = math.ceil(needed * batch / (MAX_WARMUP_SHARE * run["epochs"]))
    lr, used = _lr_setting(run, _no_warmup_lr(batch), batch)
    return (
        f"{fewer}: warmup_steps {needed} with {enough} train images or more (then "
        f"{MAX_WARMUP_SHARE:.0%} of the run's steps at most), with fewer lr {lr:g} (lr_used "
        f"{used:.2g}, no warm-up needed)"
    )


def _no_warmup_lr(batch: int) -> float:
    """The highest lr_used the rule lets start without warm-up at ``batch``."""
    return GOYAL_NO_WARMUP_LR * min(1.0, batch / 256)


def _lr_setting(run: Mapping, lr_used: float, batch: int) -> tuple[float, float]:
    """The run's ``lr`` (two significant digits, rounded down) whose ``lr_scaling`` gives at
    most ``lr_used`` at ``batch``, and the lr_used it gives."""
    factor = optimizers.scaled_lr({**run, "lr": 1.0}, batch)
    exact = lr_used / factor
    unit = 10 ** (math.floor(math.log10(exact)) - 1)
    lr = round(math.floor(exact / unit * (1 + 1e-9)) * unit, 12)
    return lr, optimizers.scaled_lr({**run, "lr": lr}, batch)


WARMUP_TOO_SHORT = (
    'warm-up steeper than Goyal et al. 2017, "Accurate, Large Minibatch SGD" (5 epochs of '
    "gradual warm-up; docs/configuration.md#warm-up-and-batch-size): use the warm-up or lr shown"
)
WARMUP_TOO_LONG = (
    "warm-up as long as the run: its LR rises to the last step and never decays; use the "
    "warm-up or lr shown (docs/configuration.md#warm-up-and-batch-size)"
)
WARMUP_UNKNOWN = (
    "warm-up in epochs too short for Goyal et al. 2017's rule (\"Accurate, Large Minibatch "
    'SGD", 5 epochs of gradual warm-up) if data.dir holds the train images shown (its size is '
    "not known at the dry-run): set warmup_steps or lr as shown"
)


# torchvision's references/classification/train.py defaults (its README's ResNet command adds
# none of these): lr used as given (--lr 0.1 at 8 GPUs x 32), --wd 1e-4, plain momentum,
# --lr-scheduler steplr --lr-step-size 30 --lr-gamma 0.1. Ours (the schema's) differ.
REFERENCE_DEFAULTS = {
    "weight_decay": (1e-4, "1e-4"),
    "nesterov": (False, "false"),
    "lr_schedule": ("step", "step every 30 epochs x 0.1"),
    "lr_scaling": ("none", "none (--lr as given)"),
}
REFERENCE_DIFFERS = (
    "SGD settings other than torchvision's reference train.py's (ours/theirs); to port a "
    "reference command: docs/configuration.md#porting-a-reference-command, or recipe: "
    "torchvision-resnet50-v1"
)


def reference_notes(runs: Mapping[str, Mapping]) -> list[Notice]:
    """A note per SGD run without a recipe naming its settings that differ from torchvision's
    reference defaults, and the reference --lr its lr is (what a side-by-side run needs)."""
    notes = []
    for name, run in runs.items():
        if run.get("recipe", "none") != "none" or run["optimizer"] != "sgd":
            continue
        differ = [
            f"{key} {_shown(run[key])}/{theirs}"
            for key, (value, theirs) in REFERENCE_DEFAULTS.items()
            if run[key] != value
        ]
        if not differ:
            continue
        batch = global_batch(run)
        used = optimizers.scaled_lr(run, batch)
        lr = f"lr {run['lr']:g} is their --lr {used:.3g} at global batch {batch}"
        notes.append(Notice(REFERENCE_DIFFERS, name, ", ".join([*differ, lr])))
    return notes


def _shown(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def container_problem(
    image: str, *, apptainer: bool, workdir: str | os.PathLike[str] = "."
) -> str | None:
    """With ``--sdm apptainer``: a local ``container.image`` that is missing (a URI is pulled)."""
    if not apptainer or "://" in image or os.path.exists(os.path.join(workdir, image)):
        return None
    return (
        f"config.yaml: container.image {image!r} not found; build it with "
        f"`apptainer build {image} workflow/envs/imagenet-ddp.def` (docs/cluster.md 'Containers')"
        " or set container.image to an existing image or a docker:// / oras:// URI"
    )


# A setting's optional component: (its module, the extra installing it; the image and the conda
# env install them all, tests/test_envs.py).
OPTIONAL_COMPONENTS = {
    "wandb_project": ("wandb", "wandb"),
    "mlflow_uri": ("mlflow", "mlflow"),
    "loader": ("nvidia.dali", "dali"),
}
# A setting that asks for its component at one value only (any other: none asked).
COMPONENT_VALUE = {"loader": "dali"}


def optional_component_problems(
    runs: Mapping[str, Mapping], *, deployment: str, has_module=None
) -> list[str]:
    """One line per run setting whose component the jobs' environment lacks; ``deployment``
    "apptainer" or "conda": the image or env has every extra, nothing to check (``has_module``
    default: importlib's find_spec)."""
    if deployment:
        return []
    has_module = has_module or _importable
    problems = []
    for name, run in runs.items():
        for key, (module, extra) in OPTIONAL_COMPONENTS.items():
            value = COMPONENT_VALUE.get(key)
            if not (run.get(key) == value if value else run.get(key)) or has_module(module):
                continue
            asked = f"runs[].{key} {value!r} needs {module}, not" if value else (
                f"{key} is set but {module} is not")  # fmt: skip
            problems.append(
                f"config.yaml: run {name!r}: {asked} installed in the environment the jobs run "
                f"in (this Snakemake's): install it (pip install 'imagenet-ddp[{extra}]'), use "
                f"--sdm apptainer or conda, or {f'set {key}: pytorch' if value else f'unset {key}'}"
            )
    return problems


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked install: not usable either
        return False


# --------------------------------------------------------------------------- set sizes


# split_sizes' source when its figures are ImageNet's, not data.dir's
ASSUMED = f"the {ILSVRC2012_TRAIN_IMAGES} images of ILSVRC2012"


def split_sizes(config: Mapping) -> tuple[int, int, str]:
    """(train images, holdout images, where the figures come from) of the split the config
    makes, from the config alone (the parse reads no results): exact, as `split` takes
    holdout = round(n x holdout_fraction), n the demo's size or the real archive's."""
    fraction, demo = config["split"]["holdout_fraction"], config["demo"]
    n, where = ILSVRC2012_TRAIN_IMAGES, ASSUMED
    if demo["enabled"]:
        classes, per_class = demo["num_classes"], demo["train_per_class"]
        n = classes * per_class
        where = f"demo.num_classes {classes} x demo.train_per_class {per_class}"
    holdout = _holdout_count(n, fraction)
    return n - holdout, holdout, f"{where} less split.holdout_fraction {fraction}"


def _holdout_count(n: int, fraction: float) -> int:
    return int(round(n * fraction))  # exactly as imagenet_ddp.data.split.stratified_split


def write_check(run_json: str, num_classes: int, run_dir: Path, out: Path, more=None) -> None:
    """The ``check`` stage: :func:`deep_problems` of the run (its settings' JSON) and its weights
    file's digest, which ``out`` records for train's param; refused with one line per problem.
    ``more``: the run's further problems, of its resolved settings (training.recipe's check of
    its transforms, a layer above this one)."""
    import json

    from imagenet_ddp import __version__
    from imagenet_ddp.errors import InputError
    from imagenet_ddp.io import write_json_atomic
    from imagenet_ddp.settings.init_weights import weights_digest
    from imagenet_ddp.settings.kinds import declarations

    run = {**declarations().rank_defaults(), **json.loads(run_json)}  # only those not at default
    digest, problem = weights_digest(run, run_dir)
    if problem:  # the file is gone or not the pinned one: nothing more to say of its keys
        run = {**run, "init_weights": ""}
    problems = deep_problems(run, num_classes) + ([problem] if problem else [])
    problems += more(run) if more and not problems else []
    if problems:
        name = run.get("run") or run.get("name")
        raise InputError("\n".join(f"config.yaml: run {name!r}: {p}" for p in problems))
    write_json_atomic(out, {"init_weights_sha256": digest, "checked_by": __version__})


# BatchNorm's running statistics (momentum 0.1) keep 0.9^n of their initial values after n
# steps (0.5 % at 50), and follow weights that still move fast early on: a run of fewer
# optimizer steps is evaluated on statistics of other weights (the 3-class demo: 10
# steps, train top-1 90 %, holdout at chance; with batch statistics 100 %).
BATCHNORM_MIN_STEPS = 50

# Model names (torchvision's, or timm's after its prefix) that normalize with LayerNorm only.
NO_BATCHNORM = ("vit_", "deit", "swin", "convnext", "beit", "cait", "xcit", "mixer", "eva")

# Optimizers that normalize the step by the gradient's own scale: linear LR scaling (Goyal et
# al.'s rule for SGD) does not carry over to them.
ADAPTIVE_OPTIMIZERS = ("adamw", "timm/adam", "timm/nadam", "timm/radam", "timm/lamb",
                       "timm/lion", "timm/ada", "timm/laprop", "timm/madgrad", "timm/novograd",
                       "timm/rmsprop", "timm/kron", "timm/mars")  # fmt: skip

FEW_STEPS_FOR_BATCHNORM = (
    f"fewer than {BATCHNORM_MIN_STEPS} optimizer steps in all: BatchNorm's running statistics "
    "will not describe the trained weights and the holdout may score at chance (docs/results.md"
    "#accuracy-flags): more epochs or a smaller global batch"
)
NO_STEADY_WINDOW = (
    "steps per epoch do not exceed throughput_warmup_steps: img/s (steady) and scaling "
    "efficiency stay empty; lower throughput_warmup_steps or train on more images per epoch"
)
ADAPTIVE_LR_SHRUNK = (
    "lr_scaling shrinks an adaptive optimizer's lr more than 10x (lr x global batch / 256): "
    "set lr for this batch with lr_scaling: none, or lr_scaling: sqrt"
)


def training_warnings(runs: Mapping[str, Mapping], config: Mapping) -> list[Notice]:
    """Per run: too few optimizer steps for BatchNorm's statistics; no steady-state window (an
    epoch of no more steps than throughput_warmup_steps); linear LR scaling that shrinks an
    adaptive optimizer's lr more than 10x; a loader estimated slower than the GPU's step
    (:func:`loader_notice`). A folder layout's size is unknown here: the step counts are judged
    only where it is known (the archives', the demo's)."""
    train, _, where = split_sizes(config)
    known = not where.startswith(ASSUMED) or config["data"].get("layout") == "archives"
    notices = []
    for name, run in runs.items():
        batch = global_batch(run)
        per_epoch = train // batch
        tail = run["model"].split("/")[-1]
        if known and not tail.startswith(NO_BATCHNORM):
            steps = run["epochs"] * per_epoch
            if steps < BATCHNORM_MIN_STEPS:
                notices.append(Notice(FEW_STEPS_FOR_BATCHNORM, name, f"{steps} steps"))
        if known and per_epoch <= run["throughput_warmup_steps"]:
            detail = f"{per_epoch} <= {run['throughput_warmup_steps']}"
            notices.append(Notice(NO_STEADY_WINDOW, name, detail))
        lr_used = optimizers.scaled_lr(run, batch)
        if run["optimizer"].startswith(ADAPTIVE_OPTIMIZERS) and lr_used < run["lr"] / 10:
            detail = f"lr {run['lr']:g} -> lr_used {lr_used:.3g} at global batch {batch}"
            notices.append(Notice(ADAPTIVE_LR_SHRUNK, name, detail))
        loader = loader_notice(name, run, config["prepare"]["short_side"])
        notices += [loader] if loader else []
    return notices


def report_settings(config: Mapping, runs: Mapping[str, Mapping]) -> tuple[list[str], str]:
    """(problems, the aggregate rule's JSON): the sweeps' axes in written order and
    report.target_top1 by run name (one number: every run's; a mapping: the runs it names)."""
    import json

    targets = (config.get("report") or {}).get("target_top1")
    problems = []
    if targets is None:
        by_run = {}
    elif isinstance(targets, int | float):
        by_run = dict.fromkeys(runs, float(targets))
    else:
        by_run = {k: float(v) for k, v in targets.items() if k in runs}
        unknown = [k for k in targets if k not in runs]
        if unknown:
            problems.append(
                f"config.yaml: report.target_top1 names {', '.join(map(repr, unknown))}, no run "
                f"of this config (runs: {', '.join(map(repr, list(runs)[:5]))}"
                f"{', ...' if len(runs) > 5 else ''}); name runs, or give one number for all"
            )
    axes = [
        key
        for sweep in config.get("sweep") or []
        for part in ("grid", "zip")
        for key in sweep.get(part) or {}
    ]
    settings = {"axes": list(dict.fromkeys(axes)), "target_top1": by_run}
    return problems, json.dumps(settings, sort_keys=True)
