"""The model factory: every torchvision classification model (``resnet50``) and every timm
model (``timm/resnet50.a1_in1k``: the tag selects timm's config only), by name; a family is one
:class:`Family` entry of :data:`FAMILIES`. Nothing is downloaded: a model starts from random
initialisation or a local weights file (``init_weights``), whose weights win over
``zero_init_residual``. Torch-free at import (the workflow's parse imports it).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from imagenet_ddp.errors import did_you_mean

TIMM_PREFIX = "timm/"  # a timm model's (and optimizer's: optimizers) name: timm/<its name>

# torchvision.models.list_models(module=torchvision.models) of the pinned torchvision, kept
# torch-free for a login node's bare Snakemake (tests/test_run_checks.py holds it to the
# installed one's).
CLASSIFICATION_MODELS = frozenset((
    "alexnet", "convnext_base", "convnext_large", "convnext_small", "convnext_tiny",
    "densenet121", "densenet161", "densenet169", "densenet201", "efficientnet_b0",
    "efficientnet_b1", "efficientnet_b2", "efficientnet_b3", "efficientnet_b4",
    "efficientnet_b5", "efficientnet_b6", "efficientnet_b7", "efficientnet_v2_l",
    "efficientnet_v2_m", "efficientnet_v2_s", "googlenet", "inception_v3", "maxvit_t",
    "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3", "mobilenet_v2",
    "mobilenet_v3_large", "mobilenet_v3_small", "regnet_x_16gf", "regnet_x_1_6gf",
    "regnet_x_32gf", "regnet_x_3_2gf", "regnet_x_400mf", "regnet_x_800mf", "regnet_x_8gf",
    "regnet_y_128gf", "regnet_y_16gf", "regnet_y_1_6gf", "regnet_y_32gf", "regnet_y_3_2gf",
    "regnet_y_400mf", "regnet_y_800mf", "regnet_y_8gf", "resnet101", "resnet152", "resnet18",
    "resnet34", "resnet50", "resnext101_32x8d", "resnext101_64x4d", "resnext50_32x4d",
    "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5", "shufflenet_v2_x2_0",
    "squeezenet1_0", "squeezenet1_1", "swin_b", "swin_s", "swin_t", "swin_v2_b", "swin_v2_s",
    "swin_v2_t", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19",
    "vgg19_bn", "vit_b_16", "vit_b_32", "vit_h_14", "vit_l_16", "vit_l_32", "wide_resnet101_2",
    "wide_resnet50_2",
))  # fmt: skip

# Builders whose model class takes zero_init_residual (torchvision's ResNet family).
RESIDUAL_BN = ("resnet", "resnext", "wide_resnet")
# Models returning a named tuple (the auxiliary classifiers' outputs too) in training.
AUX_OUTPUTS_IN_TRAINING = ("googlenet", "inception_v3")
# Adaptive average pooling to more than 1x1 (vgg, alexnet) has no deterministic CUDA backward:
# torch raises at the first backward on the GPU (the CPU's is deterministic).
NONDETERMINISTIC_ON_CUDA = ("vgg", "alexnet")

# Keys model_kwargs may not set: the workflow's, a run setting's, or a download.
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


@dataclass(frozen=True)
class Family:
    """One family of models: ``prefix`` ("" for bare names), ``build(arch, num_classes,
    kwargs)``, ``names()`` and ``listing`` (where users find them), ``residual_option(name,
    kwargs)``, ``sync_batchnorm``; ``name_list``: ``names()`` is torch-free (the dry-run's)."""

    prefix: str
    build: Callable[[str, int, dict], Any]
    names: Callable[[], list[str]]
    listing: str
    residual_option: Callable[[str, Mapping[str, Any]], str | None]
    sync_batchnorm: Callable[[Any], Any]
    name_list: bool = False


def family(name: str) -> tuple[str, str]:
    """(family, the name within it) of a ``model`` setting."""
    for key, fam in FAMILIES.items():
        if fam.prefix and name.startswith(fam.prefix):
            return key, name[len(fam.prefix) :]
    return next(k for k, f in FAMILIES.items() if not f.prefix), name


def build_model(
    name: str,
    num_classes: int,
    model_kwargs: Mapping[str, Any] | None = None,
    *,
    zero_init_residual: bool | None = False,
):
    """A randomly initialised model ``name`` with ``num_classes`` outputs. ``zero_init_residual``
    is set either way (timm's default is True, torchvision's False); None: the constructor's."""
    fam, arch = family(name)
    kwargs = dict(model_kwargs or {})
    option = residual_option(name, kwargs) if zero_init_residual is not None else None
    if option:
        kwargs[option] = zero_init_residual
    return FAMILIES[fam].build(arch, num_classes, kwargs)


def residual_option(name: str, model_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """The constructor option that zero-inits residual BatchNorm (None: none)."""
    return FAMILIES[family(name)[0]].residual_option(name, model_kwargs or {})


# The ImageNet mean and std (torchvision's models, timm's IMAGENET_DEFAULT_MEAN/STD).
IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@functools.cache
def input_normalization(name: str, normalization: str = "imagenet") -> tuple[tuple, tuple]:
    """(mean, std) of model ``name``'s input: ImageNet's, or with ``normalization: model`` a
    timm model's pretrained config's."""
    fam, arch = family(name)
    if normalization != "model" or fam != "timm":
        return IMAGENET_MEAN_STD
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(arch)
    if cfg is None:
        return IMAGENET_MEAN_STD
    return tuple(map(float, cfg.mean)), tuple(map(float, cfg.std))


def convert_sync_batchnorm(name: str, model):
    """``model`` with SyncBatchNorm, by its family's converter."""
    return FAMILIES[family(name)[0]].sync_batchnorm(model)


def unknown_name(name: str) -> str | None:
    """The line for a name its family lacks, with its closest names and the other families'
    prefixes (None: known)."""
    key, arch = family(name)
    fam = FAMILIES[key]
    names = sorted(fam.names())
    if arch.split(".")[0] in names:
        return None
    hint = did_you_mean(arch.split(".")[0], names, fam.prefix)
    listing = fam.listing + "".join(
        f", or {f.prefix}<name>" for f in FAMILIES.values() if f.prefix and not fam.prefix
    )
    return f"model {name!r} is not a {key} classification model; {hint}pick one of {listing}"


# --------------------------------------------------------------------------- the families


def _torchvision(arch: str, num_classes: int, kwargs: dict):
    import torchvision

    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)


def _torch_sync_batchnorm(model):
    import torch

    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


def _timm(arch: str, num_classes: int, kwargs: dict):
    import timm

    return timm.create_model(arch, pretrained=False, num_classes=num_classes, **kwargs)


def _timm_names() -> list[str]:
    import timm

    return timm.list_models()


def _timm_residual(name: str, kwargs: Mapping[str, Any]) -> str | None:
    model = _meta_model(name, kwargs)
    return "zero_init_last" if "zero_init_last" in _init_parameters(model) else None


def _timm_sync_batchnorm(model):
    """timm's converter: torch's would drop the activation of timm's fused BatchNormAct2d."""
    from timm.layers import convert_sync_batchnorm

    return convert_sync_batchnorm(model)


FAMILIES: dict[str, Family] = {
    "torchvision": Family(
        prefix="",
        build=_torchvision,
        names=lambda: CLASSIFICATION_MODELS,  # torchvision's list_models, kept torch-free
        listing="torchvision.models.list_models(module=torchvision.models)",
        residual_option=lambda name, kw: (
            "zero_init_residual" if name.startswith(RESIDUAL_BN) else None
        ),
        sync_batchnorm=_torch_sync_batchnorm,
        name_list=True,
    ),
    "timm": Family(
        prefix=TIMM_PREFIX,
        build=_timm,
        names=_timm_names,
        listing="timm.list_models()",
        residual_option=_timm_residual,
        sync_batchnorm=_timm_sync_batchnorm,
    ),
}


# --------------------------------------------------------------------------- dry-run checks


def model_problems(
    name: str, model_kwargs: Mapping[str, Any], crops: tuple[int, ...] = ()
) -> list[str]:
    """What would fail when the job builds and runs the model, one line each (an unknown name,
    a reserved or unknown ``model_kwargs`` key, a refused value or crop): exact, built and run
    forward on torch's meta device (no memory, no compute)."""
    unknown = unknown_name(name)
    if unknown:
        return [unknown]
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
    accepted = sorted(_init_parameters(model))
    hint = did_you_mean(key, accepted)
    return (
        f"model_kwargs.{key}: not a parameter of {type(model).__name__} ({name!r}); "
        f"{hint}its parameters: {', '.join(accepted)}"
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _meta_model(name: str, model_kwargs: Mapping[str, Any], num_classes: int = 10):
    fam, arch = family(name)
    return on_meta(lambda: FAMILIES[fam].build(arch, num_classes, dict(model_kwargs)))


def on_meta(build: Callable[[], Any]):
    """``build()``'s model on torch's meta device. A builder that computes its architecture
    from tensors (torchvision's RegNet) fails under ``torch.device("meta")``: it is built again
    with each parameter and buffer moved to meta as it registers (torch's registration hooks)."""
    import torch
    from torch.nn.modules import module

    try:
        with torch.device("meta"):
            return build()
    except NotImplementedError:  # "Cannot copy out of meta tensor"
        pass

    def parameter(owner, name, param):
        if param is not None:
            return torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        return None

    def buffer(owner, name, tensor):
        return tensor.to("meta") if tensor is not None else None

    hooks = (
        module.register_module_parameter_registration_hook(parameter),
        module.register_module_buffer_registration_hook(buffer),
    )
    try:
        return build()
    finally:
        for hook in hooks:
            hook.remove()


def _init_parameters(model) -> set[str]:
    """The named parameters of the model class's constructors, up the MRO to the first without
    ``**kwargs`` (torchvision's ConvNeXt takes and ignores **kwargs: a misspelled key)."""
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
    """A crop the model refuses, or a training-mode output that is not the logits (GoogLeNet's
    and Inception v3's auxiliary outputs)."""
    import torch

    aux = "torchvision's googlenet, inception_v3: aux_logits: false"
    training = False
    try:
        with torch.device("meta"), torch.no_grad():
            model.eval()(torch.empty(2, 3, crop, crop))
            training = True
            output = model.train()(torch.empty(2, 3, crop, crop))
    except Exception as error:
        where = f" in training ({aux}, or a larger crop)" if training else ""
        return (
            f"model {name!r} cannot take {crop}x{crop} images{where} ({_first_line(error)}); "
            "set model_kwargs (e.g. img_size) to match crop_size / eval_crop_size, or change them"
        )
    if not isinstance(output, torch.Tensor):
        return (
            f"model {name!r} returns {type(output).__name__} in training, not the logits the "
            f"loss takes (its auxiliary classifiers' too); set model_kwargs to drop them ({aux})"
        )
    return None


# Forward aten ops whose CUDA backward has no deterministic kernel (the list in
# torch.use_deterministic_algorithms' documentation); pooling to 1x1 is a mean in aten.
_NONDETERMINISTIC = {
    "adaptive average pooling": "_adaptive_avg_pool2d _adaptive_avg_pool3d",
    "adaptive max pooling": "adaptive_max_pool2d",
    "3-D average pooling": "avg_pool3d",
    "fractional max pooling": "fractional_max_pool2d fractional_max_pool3d",
    "max unpooling": "max_unpool2d max_unpool3d",
    "interpolation": "upsample_linear1d upsample_bilinear2d upsample_bicubic2d "
    "upsample_trilinear3d _upsample_bilinear2d_aa _upsample_bicubic2d_aa",
    "reflection padding": "reflection_pad1d reflection_pad2d reflection_pad3d",
    "grid sampling": "grid_sampler_2d grid_sampler_3d",
}
NONDETERMINISTIC_CUDA_BACKWARD = {
    op: what for what, ops in _NONDETERMINISTIC.items() for op in ops.split()
}


def nondeterministic_on_cuda(
    name: str, model_kwargs: Mapping[str, Any], crops: tuple[int, ...] = (224,)
) -> list[str]:
    """The model's layers without a deterministic CUDA backward, as "<module> (<what>)": a
    training step on the meta device at each crop under ``FlopCounterMode`` counts the ops
    above (their backward where they have one) by the innermost modules that called them."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    backward = {f: getattr(aten, f"{f}_backward", None) for f in NONDETERMINISTIC_CUDA_BACKWARD}
    ops = {op for f in backward for op in (getattr(aten, f), backward[f]) if op is not None}
    model = _meta_model(name, model_kwargs).train()
    root = type(model).__name__
    found: dict[str, None] = {}
    for crop in sorted(set(crops)):
        counter = FlopCounterMode(display=False, custom_mapping=dict.fromkeys(ops, _one))
        with torch.device("meta"), torch.enable_grad(), counter:
            model(torch.empty(2, 3, crop, crop)).sum().backward()
        counts = counter.get_flop_counts()
        ran = set(counts.get("Global", {}))
        for f, what in NONDETERMINISTIC_CUDA_BACKWARD.items():
            forward = getattr(aten, f)
            if (backward[f] or forward) not in ran:
                continue
            callers = [k for k, v in counts.items() if k != "Global" and forward in v]
            for key in callers:  # innermost: no caller below it
                if not any(c.startswith(key + ".") for c in callers):
                    found[f"{key.removeprefix(root + '.')} ({what})"] = None
    return list(found)


def _one(*shapes, **kwargs) -> int:
    """FlopCounterMode's count of a listed op: one per call."""
    return 1


# --------------------------------------------------------------------------- a weights file

# Where a dict checkpoint keeps its state_dict: ours ("model"), Lightning's and timm's
# ("state_dict"), hand-written ones ("model_state_dict"), DeepSpeed's ("module").
STATE_ENTRIES = ("model", "state_dict", "model_state_dict", "module")
# Prefixes a wrapper adds to every key: DistributedDataParallel's, torch.compile's.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class WeightsFileError(ValueError):
    """A weights file that cannot start this run: one line naming the file and what to do."""


def read_init_weights(path, sha256: str = "") -> dict:
    """The state_dict of the weights file ``path`` (on the CPU, wrapper prefixes stripped), its
    bytes read once: the digest checked against ``sha256`` (empty: unchecked) is that of the
    weights loaded, even if the file is replaced meanwhile."""
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
    """The shape of each tensor of the file's state_dict, from a safetensors header or torch's
    zip format mmapped (the tensors unread)."""
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
    """safetensors: an 8-byte length, then the JSON header (torch's: a zip's PK or 0x80)."""
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
    """``obj`` itself or its first :data:`STATE_ENTRIES` entry of tensors, unwrapped."""
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
    load), keys under an ``exclude`` prefix (each must match a key) left out."""
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
    """Copy ``state`` into ``model`` but the keys under an ``exclude`` prefix (returned: they
    keep their initialisation); WeightsFileError where the two do not match."""
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
    """The check of a weights file against the model it would start, built on the meta device
    (None: it loads)."""
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
