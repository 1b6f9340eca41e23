"""The optimizer factory, one registry (:data:`FAMILIES`, keyed by a name or a prefix ending in
``/``): ``sgd`` and ``adamw`` (torch's) and ``timm/<name>`` (``create_optimizer_v2``). A run's
optimizer (:func:`create_optimizer`, as timm's ``create_optimizer_v2`` takes a model): its
parameter groups by weight decay and the scaled LR (:func:`scaled_lr`), passed with
``momentum`` and ``nesterov`` by the family's builder; ``optimizer_kwargs`` are checked against
the class's signature (:func:`optimizer_problem`). Torch-free at import (the workflow's parse
imports it).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from imagenet_ddp.errors import did_you_mean
from imagenet_ddp.models import TIMM_PREFIX  # timm's optimizers are named as its models are

# Passed by the factory from the run settings (the one home of each).
FROM_SETTINGS = {
    "lr": "lr",
    "momentum": "momentum",
    "nesterov": "nesterov",
    "weight_decay": "weight_decay (norm_weight_decay, bias_weight_decay)",
    "params": "the model's parameters",
}


@dataclass(frozen=True)
class Family:
    """``build(name, groups, *, lr, momentum, nesterov, kwargs)``, ``resolve(name)``: its class
    (raises for an unknown name), ``names()`` and ``packages`` (for the closest-name hint),
    ``label``, ``choices``: the unknown-name line's words."""

    build: Callable[..., Any]
    resolve: Callable[[str], type]
    names: Callable[[], list[str]]
    packages: tuple[str, ...]
    label: str
    choices: str


def _sgd(name, groups, *, lr, momentum, nesterov, kwargs):
    import torch

    nesterov = nesterov and momentum > 0  # torch refuses Nesterov without momentum
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, **kwargs)


def _adamw(name, groups, *, lr, momentum, nesterov, kwargs):
    import torch

    return torch.optim.AdamW(groups, lr=lr, **kwargs)  # its betas are its own: optimizer_kwargs


def _torch_class(attr: str) -> Callable[[str], type]:
    def resolve(name: str) -> type:
        import torch

        return getattr(torch.optim, attr)

    return resolve


def _timm(name, groups, *, lr, momentum, nesterov, kwargs):
    from timm.optim import create_optimizer_v2

    # The groups carry their weight decay; momentum reaches the optimizers that take it, each
    # with its own nesterov default (the run setting nesterov is torch's SGD's).
    return create_optimizer_v2(
        list(groups), opt=name[len(TIMM_PREFIX) :], lr=lr, momentum=momentum, **kwargs
    )


def _timm_class(name: str) -> type:
    from timm.optim import get_optimizer_class

    return get_optimizer_class(name[len(TIMM_PREFIX) :], bind_defaults=False)


def _timm_names() -> list[str]:
    from timm.optim import list_optimizers

    return [TIMM_PREFIX + n for n in list_optimizers()]


FAMILIES: dict[str, Family] = {
    "sgd": Family(_sgd, _torch_class("SGD"), lambda: ["sgd"], ("torch",), "sgd", "sgd"),
    "adamw": Family(_adamw, _torch_class("AdamW"), lambda: ["adamw"], ("torch",), "adamw", "adamw"),
    TIMM_PREFIX: Family(
        _timm,
        _timm_class,
        _timm_names,
        ("torch", "timm"),
        "a timm optimizer",
        "timm/<name of timm.optim.list_optimizers()>",
    ),
}


def family(name: str) -> Family | None:
    """The family holding ``name``: the entry of that key, or of the prefix it starts with."""
    if name in FAMILIES:
        return FAMILIES[name]
    prefix = name.split("/")[0] + "/" if "/" in name else None
    return FAMILIES.get(prefix) if prefix and name != prefix else None


def build_optimizer(
    name: str,
    groups: Iterable[dict],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    kwargs: Mapping[str, Any] | None = None,
):
    """The optimizer ``name`` over ``groups`` (parameter groups, each with its weight decay)."""
    fam = family(name)
    if fam is None:
        raise ValueError(_unknown(name, suggest=False))
    given = dict(kwargs or {})
    return fam.build(name, groups, lr=lr, momentum=momentum, nesterov=nesterov, kwargs=given)


def scaled_lr(run: Mapping[str, Any], global_batch: int) -> float:
    """The LR the optimizer uses, its one computation (the rank's optimizer, the dry-run's
    `lr_used`, the warm-up rule, the log's header): the run's ``lr`` x ``global_batch`` / 256
    with ``lr_scaling: linear``, x sqrt(``global_batch`` / 256) with ``sqrt`` (Krizhevsky 2014),
    else ``lr``. ``global_batch``: settings.geometry.global_batch, ``accumulation`` counted."""
    if run["lr_scaling"] == "sqrt":
        return float(run["lr"]) * math.sqrt(global_batch / 256)
    if run["lr_scaling"] != "linear":
        return float(run["lr"])
    return float(run["lr"]) * global_batch / 256


def parameter_groups(cfg, model) -> list[dict]:
    """``model``'s parameters grouped by weight decay (``cfg.weight_decay_groups``):
    torchvision's reference's (``set_weight_decay``: normalization layers, other biases, the
    rest); or timm's (``create_optimizer_v2``'s: every 1-D parameter, bias and name of the
    model's ``no_weight_decay()`` without weight decay)."""
    import torch

    if cfg.weight_decay_groups == "timm":
        from timm.optim import param_groups_weight_decay

        exempt = getattr(model, "no_weight_decay", set)()
        groups = param_groups_weight_decay(model, cfg.weight_decay, no_weight_decay_list=exempt)
        return [{**g, "group": "decay" if g["weight_decay"] else "no_decay"} for g in groups]
    nn = torch.nn  # the reference's normalization layers
    norm_layers = (
        nn.modules.batchnorm._BatchNorm,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.modules.instancenorm._InstanceNorm,
        nn.LocalResponseNorm,
    )
    decay = {
        "norm": cfg.weight_decay if cfg.norm_weight_decay is None else cfg.norm_weight_decay,
        "bias": cfg.weight_decay if cfg.bias_weight_decay is None else cfg.bias_weight_decay,
        "other": cfg.weight_decay,
    }
    groups: dict[str, list] = {"norm": [], "bias": [], "other": []}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                norm = isinstance(module, norm_layers)
                groups["norm" if norm else "bias" if name == "bias" else "other"].append(param)
    return [
        {"params": params, "weight_decay": decay[kind], "group": kind}
        for kind, params in groups.items()
        if params
    ]


def create_optimizer(cfg, model, global_batch: int):
    """The optimizer of the run ``cfg`` (a TrainConfig) over ``model``, its LR scaled to
    ``global_batch`` (samples per optimizer step of the ranks that started)."""
    return build_optimizer(
        cfg.optimizer,
        parameter_groups(cfg, model),
        lr=scaled_lr(vars(cfg), global_batch),
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        kwargs=cfg.optimizer_kwargs,
    )


def _unknown(name: str, suggest: bool = True) -> str:
    """The line for an unknown optimizer; ``suggest``: with the closest names of every family
    whose packages import here."""
    entries = list(FAMILIES.values())
    labels = ", ".join(f.label for f in entries[:-1]) + f" or {entries[-1].label}"
    names = [n for f in entries if _packages_here(f) for n in f.names()] if suggest else []
    hint = did_you_mean(name, names)
    choices = ", ".join(f.choices for f in entries)
    return f"optimizer {name!r} is not {labels}; {hint}pick one of {choices}"


def _packages_here(fam: Family) -> bool:
    return all(importlib.util.find_spec(p) is not None for p in fam.packages)


def optimizer_problem(
    name: str, kwargs: Mapping[str, Any], *, momentum: float = 0.9, nesterov: bool = False
) -> str | None:
    """An unknown optimizer, an ``optimizer_kwargs`` key that a run setting owns or its class
    lacks, or values it refuses (built over a dummy parameter), in one line; None: it builds."""
    fam = family(name)
    if fam is None:
        return _unknown(name)
    try:
        cls = fam.resolve(name)
    except Exception:
        return _unknown(name)
    for key in kwargs:
        if key in FROM_SETTINGS:
            return f"optimizer_kwargs.{key}: set by the run setting {FROM_SETTINGS[key]}; remove it"
    accepted = sorted(
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in ("self", "params")
    )
    for key in kwargs:
        if key not in accepted:
            hint = did_you_mean(key, accepted)
            return (
                f"optimizer_kwargs.{key}: not a parameter of {cls.__name__} ({name!r}); "
                f"{hint}its parameters: {', '.join(accepted)}"
            )
    import torch

    dummy = [{"params": [torch.zeros(1, requires_grad=True)], "weight_decay": 0.0}]
    try:
        build_optimizer(name, dummy, lr=0.1, momentum=momentum, nesterov=nesterov, kwargs=kwargs)
    except Exception as error:
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"optimizer {name!r} with optimizer_kwargs {dict(kwargs)}: {text}"
    return None
