"""The model, optimizer and dataset-reader factories (imagenet_ddp.models, .optimizers,
.data.reader): what each builds and what reaches it. Their dry-run checks are
tests/test_run_checks.py's; training and bitwise resume with them, tests/test_resume.py's."""

from __future__ import annotations

import pytest
import torch

from imagenet_ddp import models, optimizers
from imagenet_ddp.data.reader import create_dataset
from imagenet_ddp.training.model import load_model, save_model


def test_zero_init_residual_sets_timms_zero_init_last_either_way():
    """timm's ResNet zero-inits by default (zero_init_last=True): the run setting decides."""
    on = models.build_model("timm/resnet18", 10, zero_init_residual=True)
    off = models.build_model("timm/resnet18", 10, zero_init_residual=False)
    assert on.layer1[0].bn2.weight.abs().sum() == 0
    assert off.layer1[0].bn2.weight.abs().sum() > 0
    torchvision_on = models.build_model("resnet18", 10, zero_init_residual=True)
    assert torchvision_on.layer1[0].bn2.weight.abs().sum() == 0
    assert models.residual_option("timm/vit_tiny_patch16_224") is None


def test_sync_batchnorm_keeps_timms_fused_activation():
    """timm's BatchNormAct2d carries its activation: torch's converter would drop it."""
    model = models.convert_sync_batchnorm(
        "timm/efficientnet_b0", models.build_model("timm/efficientnet_b0", 10)
    )
    assert type(model.bn1).__name__ == "SyncBatchNormAct"
    assert isinstance(model.bn1.act, torch.nn.SiLU)


def test_a_model_family_is_one_registry_entry(monkeypatch):
    """A new family (here "tiny/") is named, built, checked and converted from its entry alone."""

    def build(arch, num_classes, kwargs):
        width = kwargs.get("width", 4)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3), torch.nn.BatchNorm2d(width),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, num_classes),
        )  # fmt: skip

    tiny = models.Family(
        prefix="tiny/",
        build=build,
        names=lambda: ["net"],
        listing="the tiny nets",
        residual_option=lambda name, kwargs: None,
        sync_batchnorm=torch.nn.SyncBatchNorm.convert_sync_batchnorm,
    )
    monkeypatch.setitem(models.FAMILIES, "tiny", tiny)
    assert models.family("tiny/net") == ("tiny", "net") and models.family("net") == (
        "torchvision", "net")  # fmt: skip
    model = models.build_model("tiny/net", 7, {"width": 5}, zero_init_residual=True)
    assert model(torch.zeros(2, 3, 8, 8)).shape == (2, 7)
    assert models.model_problems("tiny/net", {}, crops=(8,)) == []
    [line] = models.model_problems("tiny/nett", {})
    assert line == (
        "model 'tiny/nett' is not a tiny classification model; did you mean 'tiny/net'? "
        "pick one of the tiny nets"
    )
    [line] = models.model_problems("resnet9000", {})  # bare names list every prefixed family
    assert line.endswith("or timm/<name>, or tiny/<name>")
    converted = models.convert_sync_batchnorm("tiny/net", model)
    assert isinstance(converted[1], torch.nn.SyncBatchNorm)
    assert models.residual_option("tiny/net") is None


def test_layers_without_a_deterministic_cuda_backward_are_found_from_the_forward():
    """Named by module, whatever the family or call: a ViT with dynamic_img_size resamples its
    position embedding (bicubic interpolation) only at a crop other than its img_size."""
    vit, kwargs = "timm/vit_tiny_patch16_224", {"img_size": 32, "dynamic_img_size": True}
    assert models.nondeterministic_on_cuda(vit, kwargs, crops=(32,)) == []
    found = models.nondeterministic_on_cuda(vit, kwargs, crops=(32, 48))
    assert found == ["VisionTransformer (interpolation)"]
    assert models.nondeterministic_on_cuda("vgg11", {}, crops=(224,)) == [
        "avgpool (adaptive average pooling)"
    ]
    assert models.nondeterministic_on_cuda("timm/vgg11", {}, crops=(224,)) == []  # 7x7 already
    assert models.nondeterministic_on_cuda("resnet18", {}, crops=(64,)) == []
    # CrossViT resizes the image itself (bicubic), which has no backward: not reported
    assert models.nondeterministic_on_cuda("timm/crossvit_tiny_240", {}, crops=(240,)) == []


def test_a_model_whose_builder_computes_with_tensors_is_checked_on_meta_too():
    """torchvision's RegNet computes its widths with torch.arange(...).tolist(): under
    torch.device("meta") that raises, and a valid run was refused (models.on_meta)."""
    assert models.model_problems("regnet_y_400mf", {"stem_width": 16}, crops=(32,)) == []
    model = models.on_meta(lambda: models.build_model("regnet_y_400mf", 10))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    # torch's registration hooks, not a patched nn.Module, and removed after the build
    assert torch.nn.Module.register_parameter.__qualname__ == "Module.register_parameter"
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"


def test_model_file_rebuilds_a_timm_model_with_its_model_kwargs(tmp_path):
    kwargs = {"img_size": 16, "patch_size": 8}
    model = models.build_model("timm/vit_tiny_patch16_224", 5, kwargs)
    save_model(tmp_path / "model.pt", model, arch="timm/vit_tiny_patch16_224", num_classes=5,
               config={"model_kwargs": kwargs})  # fmt: skip
    loaded, state = load_model(tmp_path / "model.pt")
    images = torch.randn(2, 3, 16, 16)
    assert torch.equal(loaded.eval()(images), model.eval()(images))
    assert state["arch"] == "timm/vit_tiny_patch16_224"


def groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": list(model.parameters()), "weight_decay": 0.05, "group": "other"}]


@pytest.mark.parametrize(
    "name, kwargs, cls, expected",
    [
        ("adamw", {"betas": [0.9, 0.95], "eps": 1e-6}, "AdamW", {"betas": (0.9, 0.95)}),
        ("sgd", {"maximize": True}, "SGD",
         {"nesterov": True, "momentum": 0.8, "maximize": True}),
        ("timm/lamb", {"max_grad_norm": 2.0}, "Lamb", {"max_grad_norm": 2.0}),
        ("timm/lars", {"trust_coeff": 0.002}, "Lars", {"trust_coeff": 0.002, "momentum": 0.8}),
    ],
)  # fmt: skip
def test_each_optimizer_gets_its_own_options_and_the_groups_weight_decay(
    name, kwargs, cls, expected
):
    model = torch.nn.Linear(3, 2)
    opt = optimizers.build_optimizer(
        name, groups(model), lr=0.1, momentum=0.8, nesterov=True, kwargs=kwargs
    )
    assert type(opt).__name__ == cls
    group = opt.param_groups[0]
    assert group["lr"] == 0.1 and group["weight_decay"] == 0.05 and group["group"] == "other"
    for key, value in expected.items():
        assert group[key] == (tuple(value) if isinstance(value, list) else value), key


def test_an_optimizer_family_is_one_registry_entry(monkeypatch):
    """A new family (here a prefix, "plain/") is built, resolved and named from its entry alone."""
    family = optimizers.Family(
        build=lambda name, groups, *, lr, momentum, nesterov, kwargs: torch.optim.SGD(
            groups, lr=lr, **kwargs
        ),
        resolve=lambda name: torch.optim.SGD,
        names=lambda: ["plain/sgd"],
        packages=("torch",),
        label="a plain optimizer",
        choices="plain/sgd",
    )
    monkeypatch.setitem(optimizers.FAMILIES, "plain/", family)
    model = torch.nn.Linear(3, 2)
    opt = optimizers.build_optimizer(
        "plain/sgd", groups(model), lr=0.1, momentum=0.8, nesterov=True, kwargs={"dampening": 0.5}
    )
    assert type(opt).__name__ == "SGD" and opt.param_groups[0]["dampening"] == 0.5
    assert optimizers.optimizer_problem("plain/sgd", {"dampening": 0.5}) is None
    line = optimizers.optimizer_problem("plaine/sgd", {})
    assert line.startswith("optimizer 'plaine/sgd' is not sgd, adamw, a timm optimizer or a plain")
    assert "did you mean 'plain/sgd'" in line and line.endswith(", plain/sgd")


def test_the_reader_factory_gives_training_its_encoded_and_evaluation_its_crops(prepared_demo):
    train = create_dataset(prepared_demo["train"], [0, 1], train=True)
    encoded, label = train[0]
    assert encoded.dtype.name == "uint8" and encoded.ndim == 1 and 0 <= label < train.num_classes
    holdout = create_dataset(prepared_demo["train"], [1], eval_size=(20, 16))
    crop, _ = holdout[0]
    assert crop.dtype == torch.uint8 and tuple(crop.shape) == (3, 16, 16)
