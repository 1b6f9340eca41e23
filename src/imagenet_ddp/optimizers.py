"""The optimizer factory: torch's SGD and AdamW, and every optimizer timm provides, by name.

An ``optimizer`` setting names one:

    sgd, adamw          torch.optim.SGD / torch.optim.AdamW
    timm/<name>         timm.optim.create_optimizer_v2(opt=<name>): timm/lamb, timm/lars, ...

The run settings ``lr`` (scaled), ``momentum``, ``nesterov`` and the parameter groups' weight
decay are passed by the factory; ``optimizer_kwargs`` are the optimizer's own other options
(AdamW ``betas``, ``eps``; LAMB ``max_grad_norm`` ...), checked at the dry-run against its
class's signature (:func:`optimizer_problem`). Adding a family is one branch of
:func:`optimizer_class` and :func:`build_optimizer`.

Torch-free at import, as imagenet_ddp.models (the dry-run imports it while Snakemake parses).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

TIMM_PREFIX = "timm/"

# Passed by the factory from the run settings (the one home of each).
FROM_SETTINGS = {
    "lr": "lr",
    "momentum": "momentum",
    "nesterov": "nesterov",
    "weight_decay": "weight_decay (norm_weight_decay, bias_weight_decay)",
    "params": "the model's parameters",
}


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
    import torch

    kwargs = dict(kwargs or {})
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, **kwargs)
    if name == "sgd":
        return torch.optim.SGD(
            groups, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0, **kwargs
        )
    from timm.optim import create_optimizer_v2

    # The groups carry their own weight decay; create_optimizer_v2 passes momentum only to
    # the optimizers that take it. Its "nesterov"/"momentum" names select SGD variants.
    return create_optimizer_v2(
        list(groups), opt=name[len(TIMM_PREFIX) :], lr=lr, momentum=momentum, **kwargs
    )


def optimizer_class(name: str):
    """The optimizer's class (imports torch, and timm for ``timm/``)."""
    import torch

    if name in ("sgd", "adamw"):
        return {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[name]
    from timm.optim import get_optimizer_class

    return get_optimizer_class(name[len(TIMM_PREFIX) :], bind_defaults=False)


def importable(name: str) -> bool:
    packages = ("torch", "timm") if name.startswith(TIMM_PREFIX) else ("torch",)
    return all(importlib.util.find_spec(p) is not None for p in packages)


def optimizer_problem(
    name: str, kwargs: Mapping[str, Any], *, momentum: float = 0.9, nesterov: bool = False
) -> str | None:
    """An unknown optimizer (with the closest names), an ``optimizer_kwargs`` key that the run
    settings own or its class's signature lacks, or values it refuses (built over one dummy
    parameter, as the job would: SGD's nesterov with dampening), in one line; None when it
    can be built."""
    import difflib

    try:
        cls = optimizer_class(name)
    except Exception:
        from timm.optim import list_optimizers

        names = ["sgd", "adamw", *(TIMM_PREFIX + n for n in list_optimizers())]
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
        return (
            f"optimizer {name!r} is not sgd, adamw or a timm optimizer; {hint}pick one of "
            "sgd, adamw, timm/<name of timm.optim.list_optimizers()>"
        )
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
            close = difflib.get_close_matches(key, accepted, n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
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
