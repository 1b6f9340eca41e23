"""The model factory: every torchvision classification model and every timm model, by name.

A ``model`` setting names one family's model:

    resnet50, vit_b_16, ...               torchvision.models.get_model(name, weights=None, ...)
    timm/resnet50.a1_in1k, timm/vit_...   timm.create_model(name, pretrained=False, ...)

(``timm/`` as on the Hugging Face hub, where timm's models live under the ``timm`` owner; the
part after the dot is timm's pretrained tag, which only selects the model's default config.)
Nothing is downloaded on a compute node: a model starts from random initialisation, or from
a local weights file (the run settings ``init_weights`` and ``init_weights_exclude``;
:func:`read_init_weights`, :func:`load_init_weights`): a plain state_dict, torchvision's or
timm's downloaded ``.pth``/``.bin``/``.safetensors``, this workflow's model.pt or checkpoint
(its ``model`` entry), with a DDP ``module.`` prefix stripped, read with ``weights_only=True``.
The file is read at a fresh start only (a resume takes the checkpoint's weights), on every
rank, before EMA copies the model and DDP wraps it. Loaded weights win over
``zero_init_residual``: it applies to the excluded keys alone (they keep the constructor's
initialisation, zero-init included).
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
# run setting with the same effect is the one home (zero_init_residual, init_weights), or
# they load weights from the network (pretrained, weights).
RESERVED_KWARGS = {
    "num_classes": "the class count comes from the data",
    "weights": "weights are never downloaded; set the run setting init_weights to a local file",
    "pretrained": "weights are never downloaded; set the run setting init_weights to a local file",
    "pretrained_cfg_overlay": "weights are never downloaded",
    "checkpoint_path": "set the run setting init_weights instead",
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


def _meta_model(name: str, model_kwargs: Mapping[str, Any], num_classes: int = 10):
    import torch

    fam, arch = family(name)
    with torch.device("meta"):
        return FAMILIES[fam](arch, num_classes, dict(model_kwargs))


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


# --------------------------------------------------------------------------- a weights file

# Where a dict checkpoint keeps its model's state_dict: this workflow's model.pt and
# checkpoints ("model"), Lightning's and timm's train.py checkpoints ("state_dict"), the
# common hand-written {"model_state_dict": ...}, DeepSpeed's ("module").
STATE_ENTRIES = ("model", "state_dict", "model_state_dict", "module")
# Prefixes a wrapper adds to every key: DistributedDataParallel's, torch.compile's.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class WeightsFileError(ValueError):
    """A weights file that cannot start this run: one line naming the file and what to do."""


def read_init_weights(path, sha256: str = "") -> dict:
    """The state_dict of the weights file ``path`` (tensors on the CPU, wrapper prefixes
    stripped), read once: its bytes are hashed and parsed from memory, so the digest checked
    against ``sha256`` (the run's ``init_weights_sha256``; empty: unchecked) is that of the
    weights loaded, even when the file is replaced meanwhile."""
    import hashlib
    import io

    with open(path, "rb") as f:
        data = f.read()
    found = hashlib.sha256(data).hexdigest()
    if sha256 and found != sha256:
        raise WeightsFileError(
            f"{path}: its SHA-256 is {found}, the run's init_weights_sha256 {sha256} (the file "
            "changed after the dry-run): dry-run again to train from the new file, or put "
            "the old one back"
        )
    if _is_safetensors(data[:9]):
        from safetensors.torch import load

        return _state_dict(path, _safetensors(path, lambda: load(data)))
    return _state_dict(path, _torch_load(path, io.BytesIO(data)))


def weights_file_shapes(path) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of the file's state_dict, for the dry-run: without reading
    the tensors where the format allows (a safetensors header; torch's zip format mmapped)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if _is_safetensors(head):
        from safetensors import safe_open

        def shapes() -> dict:
            with safe_open(str(path), framework="pt") as file:
                names = file.keys()  # a safe_open is no mapping
                return {k: tuple(file.get_slice(k).get_shape()) for k in names}

        return _strip_wrappers(_safetensors(path, shapes))
    state = _state_dict(path, _torch_load(path, path, mmap=head[:2] == b"PK"))
    return {k: tuple(v.shape) for k, v in state.items()}


def _is_safetensors(head: bytes) -> bool:
    """safetensors: an 8-byte header length, then the JSON header; torch's files start with
    a zip's PK or a pickle's 0x80."""
    return len(head) == 9 and head[8:9] == b"{" and head[:2] != b"PK"


def _safetensors(path, read):
    try:
        return read()
    except Exception as error:  # safetensors' own errors (a torn header, a bad offset)
        raise WeightsFileError(
            f"{path}: not a readable safetensors file ({_first_line(error)})"
        ) from None


def _torch_load(path, source, *, mmap: bool = False):
    """torch.load with weights_only=True (tensors and plain data: nothing in it runs)."""
    import pickle

    import torch

    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # not a torch file, a torn one, or one that would run code
        found = re.search(r"GLOBAL ([\w.]+)", str(error))  # the class or function it names
        if isinstance(error, pickle.UnpicklingError) and found:
            raise WeightsFileError(
                f"{path}: refused: it needs arbitrary unpickling ({found[1]}), which can run "
                "code; where you trust it, save its weights alone: "
                "torch.save(model.state_dict(), path)"
            ) from None
        raise WeightsFileError(
            f"{path}: not a readable torch or safetensors weights file "
            f"({type(error).__name__}: {_first_line(error)[:160]})"
        ) from None


def _state_dict(path, obj) -> dict:
    """The state_dict in ``obj``: ``obj`` itself, or the first of :data:`STATE_ENTRIES` that
    holds tensors; wrapper prefixes stripped."""
    import torch

    candidates = [obj] + [obj.get(e) for e in STATE_ENTRIES if isinstance(obj, Mapping)]
    for candidate in candidates:
        if isinstance(candidate, Mapping) and candidate:
            tensors = {k: v for k, v in candidate.items() if isinstance(v, torch.Tensor)}
            if len(tensors) == len(candidate):
                return _strip_wrappers(tensors)
    raise WeightsFileError(
        f"{path}: holds no state_dict (neither a mapping of names to tensors nor one under "
        f"{', '.join(map(repr, STATE_ENTRIES))}); save one with "
        "torch.save(model.state_dict(), path)"
    )


def _strip_wrappers(state: dict) -> dict:
    for prefix in WRAPPER_PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def init_weights_mismatch(
    model_shapes: Mapping[str, tuple], file_shapes: Mapping[str, tuple], exclude=()
) -> str | None:
    """What keeps the file's weights from loading into the model, in one phrase (None: they
    load): keys the file lacks or the model lacks, shapes that differ, an ``exclude`` prefix
    matching no key of the model; keys under an ``exclude`` prefix are left out."""
    prefixes = tuple(exclude)

    def kept(key: str) -> bool:
        return not (prefixes and key.startswith(prefixes))

    # BatchNorm's counter is absent from some published files; the module starts it at 0.
    missing = [
        k for k in model_shapes
        if kept(k) and k not in file_shapes and not k.endswith("num_batches_tracked")
    ]  # fmt: skip
    unexpected = [k for k in file_shapes if kept(k) and k not in model_shapes]
    shapes = [
        f"{k} {list(file_shapes[k])} in the file, {list(model_shapes[k])} in the model"
        for k in model_shapes
        if kept(k) and k in file_shapes and tuple(file_shapes[k]) != tuple(model_shapes[k])
    ]
    unused = [p for p in prefixes if not any(k.startswith(p) for k in model_shapes)]
    parts = [
        _listed("shapes differ", shapes),
        _listed("keys the file lacks", missing),
        _listed("keys the model lacks", unexpected),
        _listed("init_weights_exclude prefixes matching no key of the model", unused),
    ]
    parts = [p for p in parts if p]
    return "; ".join(parts) if parts else None


def _listed(what: str, items: list[str], most: int = 3) -> str:
    if not items:
        return ""
    more = f" (+{len(items) - most} more)" if len(items) > most else ""
    return f"{what}: {', '.join(items[:most])}{more}"


def load_init_weights(model, state: Mapping, exclude=(), where: str = "") -> list[str]:
    """Copy ``state`` (:func:`read_init_weights`) into ``model`` but the keys under an
    ``exclude`` prefix, which keep their initialisation; those keys. WeightsFileError where
    the two do not match (:func:`init_weights_mismatch`)."""
    own = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in own.items()}
    problem = init_weights_mismatch(shapes, {k: tuple(v.shape) for k, v in state.items()}, exclude)
    if problem:
        raise WeightsFileError(f"{where}: does not fit the model: {problem}")
    prefixes = tuple(exclude)
    kept = {k: v for k, v in state.items() if not (prefixes and k.startswith(prefixes))}
    model.load_state_dict(kept, strict=False)
    return sorted(k for k in own if k not in kept and not k.endswith("num_batches_tracked"))


def init_weights_problem(
    name: str, model_kwargs: Mapping[str, Any], num_classes: int, path, exclude=()
) -> str | None:
    """The dry-run's check of a weights file against the model it would start: ``path: what
    is wrong; what to do`` (None: it loads). Cheap: the file's shapes without its tensors
    (:func:`weights_file_shapes`), the model built on the meta device."""
    try:
        file_shapes = weights_file_shapes(path)
    except WeightsFileError as error:
        return str(error)
    except OSError as error:
        return f"{path}: cannot be read ({error.strerror or error}); set an existing file"
    model = _meta_model(name, model_kwargs, num_classes)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problem = init_weights_mismatch(shapes, file_shapes, exclude)
    if problem is None:
        return None
    return (
        f"{path}: does not fit model {name!r} with {num_classes} classes: {problem}; set "
        "init_weights_exclude to the key prefixes to leave at initialisation (e.g. [fc.] or "
        "[head.] for a classifier with another class count), or set the model (and "
        "model_kwargs) the file was saved from"
    )
