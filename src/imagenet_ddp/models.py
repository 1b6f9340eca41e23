"""The model factory: every torchvision classification model and every timm model, by name.

A ``model`` setting names one family's model:

    resnet50, vit_b_16, ...               torchvision.models.get_model(name, weights=None, ...)
    timm/resnet50.a1_in1k, timm/vit_...   timm.create_model(name, pretrained=False, ...)

(``timm/`` as on the Hugging Face hub, where timm's models live under the ``timm`` owner; the
part after the dot is timm's pretrained tag, which only selects the model's default config.)
Weights are always randomly initialised: nothing is downloaded on a compute node.
``model_kwargs`` go to the constructor as they are (``drop_path_rate``, ``img_size``,
``stochastic_depth_prob``, ...). Adding a family is one entry of :data:`FAMILIES` here.

Torch-free at import: the workflow imports it while Snakemake parses the rules (the dry-run's
checks, :func:`model_problems`); torch, torchvision and timm are imported when a model is built.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from collections.abc import Mapping
from typing import Any

TIMM_PREFIX = "timm/"

# Keys model_kwargs may not set: the workflow sets them (num_classes from the data), the
# run setting with the same effect is the one home (zero_init_residual), or they load
# weights from the network (pretrained, weights): a job starts from random weights.
RESERVED_KWARGS = {
    "num_classes": "the class count comes from the data",
    "weights": "weights are never downloaded; a model trains from random initialisation",
    "pretrained": "weights are never downloaded; a model trains from random initialisation",
    "pretrained_cfg_overlay": "weights are never downloaded",
    "checkpoint_path": "weights are never loaded from a file by the model factory",
    "zero_init_residual": "set the run setting zero_init_residual instead",
    "zero_init_last": "set the run setting zero_init_residual instead",
    "features_only": "train needs the classifier",
}


def family(name: str) -> tuple[str, str]:
    """(family, the name within it) of a ``model`` setting."""
    if name.startswith(TIMM_PREFIX):
        return "timm", name[len(TIMM_PREFIX) :]
    return "torchvision", name


def importable(fam: str) -> bool:
    """Whether the family's package (and torch) can be imported here, without importing it."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", fam))


def build_model(
    name: str,
    num_classes: int,
    model_kwargs: Mapping[str, Any] | None = None,
    *,
    zero_init_residual: bool = False,
):
    """A randomly initialised classification model ``name`` with ``num_classes`` outputs.

    ``model_kwargs``: the constructor's own options. ``zero_init_residual``: zero-init the last
    BatchNorm of each residual block, where the model has that option (torchvision's
    ``zero_init_residual``, timm's ``zero_init_last``; :func:`residual_option`)."""
    fam, arch = family(name)
    kwargs = dict(model_kwargs or {})
    if fam == "torchvision" and zero_init_residual:
        kwargs["zero_init_residual"] = True  # only when set: earlier runs stay identical
    elif fam == "timm" and residual_option(name, kwargs) == "zero_init_last":
        kwargs["zero_init_last"] = zero_init_residual  # timm's default is True: say which
    return FAMILIES[fam](arch, num_classes, kwargs)


def _torchvision(arch: str, num_classes: int, kwargs: dict):
    import torchvision

    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)


def _timm(arch: str, num_classes: int, kwargs: dict):
    import timm

    return timm.create_model(arch, pretrained=False, num_classes=num_classes, **kwargs)


FAMILIES = {"torchvision": _torchvision, "timm": _timm}

# torchvision builders whose model class takes zero_init_residual (its ResNet family); timm's
# are found from the class (zero_init_last), which needs timm: see residual_option.
TORCHVISION_RESIDUAL_BN = ("resnet", "resnext", "wide_resnet")


def residual_option(name: str, model_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """The constructor option that zero-inits residual BatchNorm, None where there is none.
    For timm models it is read from the model class's signature (a meta-device build: timm
    must be importable)."""
    fam, arch = family(name)
    if fam == "torchvision":
        return "zero_init_residual" if arch.startswith(TORCHVISION_RESIDUAL_BN) else None
    model = _meta_model(name, model_kwargs or {})
    return "zero_init_last" if "zero_init_last" in _init_parameters(model) else None


def convert_sync_batchnorm(name: str, model):
    """``model`` with SyncBatchNorm (``sync_bn``). timm's fused BatchNormAct2d (BatchNorm,
    then its activation and drop) needs timm's converter: torch's would keep the BatchNorm and
    silently drop the activation."""
    if family(name)[0] == "timm":
        from timm.layers import convert_sync_batchnorm

        return convert_sync_batchnorm(model)
    import torch

    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


# --------------------------------------------------------------------------- dry-run checks


def known_names(fam: str) -> list[str]:
    """Every model name of the family (importing it)."""
    if fam == "timm":
        import timm

        return sorted(timm.list_models())
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def model_problems(
    name: str, model_kwargs: Mapping[str, Any], crops: tuple[int, ...] = ()
) -> list[str]:
    """What would fail when the job builds and runs the model, one line each (empty: none):
    an unknown name (with the closest names), a ``model_kwargs`` key that is reserved or not a
    parameter of the constructor's signature, a constructor that refuses the values, a model
    that refuses ``crops``-sized images. Exact: the model is built on torch's meta device (no
    memory, no compute) and run forward on a meta batch. Needs torch and the family's package."""
    import difflib

    fam, arch = family(name)
    names = known_names(fam)
    if arch.split(".")[0] not in names:
        close = difflib.get_close_matches(arch.split(".")[0], names, n=3, cutoff=0.6)
        prefix = TIMM_PREFIX if fam == "timm" else ""
        hint = f"did you mean {', '.join(repr(prefix + c) for c in close)}? " if close else ""
        listing = (
            "timm.list_models()"
            if fam == "timm"
            else "torchvision.models.list_models(module=torchvision.models), or timm/<name>"
        )
        return [f"model {name!r} is not a {fam} classification model; {hint}pick one of {listing}"]
    for key in model_kwargs:
        if key in RESERVED_KWARGS:
            return [f"model_kwargs.{key}: not settable ({RESERVED_KWARGS[key]}); remove it"]
    try:
        model = _meta_model(name, model_kwargs)
    except Exception as error:  # the constructor's own refusal: a key, or a bad value
        unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(error))
        if unexpected and unexpected[1] in model_kwargs:
            return [_unknown_key(name, unexpected[1], _meta_model(name, {}))]
        given = f" with model_kwargs {dict(model_kwargs)}" if model_kwargs else ""
        return [f"model {name!r}{given}: {_first_line(error)}"]
    accepted = _init_parameters(model)
    unknown = [k for k in model_kwargs if k not in accepted]
    if unknown:
        return [_unknown_key(name, unknown[0], model)]
    return [p for crop in sorted(set(crops)) if (p := _forward_problem(name, model, crop))]


def _unknown_key(name: str, key: str, model) -> str:
    import difflib

    accepted = sorted(_init_parameters(model))
    close = difflib.get_close_matches(key, accepted, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
    return (
        f"model_kwargs.{key}: not a parameter of {type(model).__name__} ({name!r}); "
        f"{hint}its parameters: {', '.join(accepted)}"
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _meta_model(name: str, model_kwargs: Mapping[str, Any]):
    import torch

    fam, arch = family(name)
    with torch.device("meta"):
        return FAMILIES[fam](arch, 10, dict(model_kwargs))


def _init_parameters(model) -> set[str]:
    """The named parameters of the model class's constructor (its whole MRO up to the first
    without ``**kwargs``: torchvision's ConvNeXt takes and ignores **kwargs, so a misspelled
    key would pass silently through the builder)."""
    names: set[str] = set()
    for cls in type(model).__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind == p.VAR_KEYWORD for p in params) or cls.__module__ == "torch.nn":
            break
    return names - {"self", "device", "dtype"}


def _forward_problem(name: str, model, crop: int) -> str | None:
    import torch

    try:
        with torch.device("meta"), torch.no_grad():
            model.eval()(torch.empty(2, 3, crop, crop))
    except Exception as error:
        return (
            f"model {name!r} cannot take {crop}x{crop} images ({_first_line(error)}); set "
            "model_kwargs (e.g. img_size) to match crop_size / eval_crop_size, or change them"
        )
    return None


def adaptive_pools(model) -> list[str]:
    """The model's adaptive average/max pooling layers to more than 1x1: their CUDA backward
    is not deterministic (torch.use_deterministic_algorithms raises at the first backward)."""
    import torch

    pools = (torch.nn.AdaptiveAvgPool2d, torch.nn.AdaptiveMaxPool2d)
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, pools):
            size = module.output_size
            size = (size, size) if isinstance(size, int) else tuple(size)
            if any(s is not None and s > 1 for s in size):
                found.append(module_name)
    return found
