"""Runs that could only fail (or train on upsampled/padded images) are refused at the dry-run.

Unit tests of imagenet_ddp.settings.run_checks per check, then one real `snakemake -n` per category:
non-zero exit and one line per problem naming the run and the key.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
import timm  # noqa: F401  imported here, not by a test: its first import (torch's CUDA library
import timm.optim  # noqa: F401  lookup) scans sys.path, which holds Snakemake's relative
import yaml  #                   .snakemake/pip-deployments (the checkout guard would flag it)

from imagenet_ddp.data.split import stratified_split
from imagenet_ddp.settings import run_checks
from imagenet_ddp.settings.kinds import SCHEMA, load_schema
from imagenet_ddp.settings.run_checks import ILSVRC2012_TRAIN_IMAGES, check_runs, split_sizes
from tests.workflow_helpers import (
    REPO,
    copy_workflow,
    read_config,
    snakemake,
    with_schema_defaults,
    write_config,
)


@pytest.fixture(scope="module")
def models():
    from imagenet_ddp.models import CLASSIFICATION_MODELS

    return CLASSIFICATION_MODELS


def resolved(config: dict) -> dict[str, dict]:
    """The runs as imagenet_ddp.settings.runs.resolve_runs resolves them where no preset is used."""
    return {e["name"]: {**config["train_defaults"], **e} for e in config["runs"]}


def demo_config(**run) -> dict:
    """The repo's demo config (10 classes x 100 images, holdout 0.1: 900 train, 100 holdout)
    with one run 'r' overriding ``run``, the schema's defaults filled in as the workflow does."""
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["runs"] = [{"name": "r", **run}]
    return with_schema_defaults(config)


# A GPU run's ranks need loader workers (refused without): 2 with auto.
FED = {"cpus_per_task": 3}


def problems(config: dict, models, tmp_path) -> list[str]:
    return check_runs(resolved(config), config)


def test_the_repo_config_passes(models, tmp_path):
    config = with_schema_defaults(yaml.safe_load((REPO / "config.yaml").read_text()))
    assert problems(config, models, tmp_path) == []


# ---------------------------------------------------------------- model


def test_unknown_model_names_run_and_key_and_suggests_close_names(models, tmp_path):
    [line] = problems(demo_config(model="resnet9000"), models, tmp_path)
    assert line.startswith("config.yaml: run 'r': model 'resnet9000' ")
    assert "'resnet50'" in line and "list_models" in line


def test_models_with_auxiliary_outputs_in_training_are_refused(models, tmp_path):
    """torchvision's GoogLeNet returns a named tuple in training: the loss would fail at the
    first step. By name, torch-free; with model_kwargs, from the meta-device build."""
    [line] = problems(demo_config(model="googlenet"), models, tmp_path)
    assert "model 'googlenet' returns its auxiliary classifiers' outputs" in line
    assert "aux_logits: false" in line
    [line] = model_lines(tmp_path, model="googlenet", model_kwargs={"dropout": 0.1})
    assert "returns GoogLeNetOutputs in training" in line
    assert model_lines(tmp_path, model="googlenet", model_kwargs={"aux_logits": False}) == []


@pytest.mark.parametrize("model", ["fasterrcnn_resnet50_fpn", "quantized_resnet18", "r3d_18"])
def test_models_that_are_not_classifiers_are_refused(models, tmp_path, model):
    """Registered in torchvision, but not image classifiers `train` can build and feed."""
    [line] = problems(demo_config(model=model), models, tmp_path)
    assert f"model {model!r}" in line


# ---------------------------------------------------------------- timm, model_kwargs, optimizers
# Exact, by the run's local `check` rule (torch, torchvision and timm import there): built on the
# meta device (imagenet_ddp.models); what the config alone shows, at the dry-run.


def model_lines(tmp_path, **run) -> list[str]:
    config = demo_config(crop_size=32, eval_resize=36, **run)  # demo: prepare.short_side 40
    runs = resolved(config)
    static = check_runs(runs, config)
    deep = [f"config.yaml: run 'r': {p}" for p in run_checks.deep_problems(runs["r"], 4)]
    return static or deep


@pytest.mark.parametrize(
    "run, expected",
    [
        ({"model": "timm/resnt18"}, "model 'timm/resnt18' is not a timm classification model; "
         "did you mean 'timm/resnet18'"),
        ({"model": "timm/resnet50.no_such_tag"}, "Invalid pretrained tag (no_such_tag)"),
        # torchvision's ConvNeXt swallows unknown keys through **kwargs: refused all the same
        ({"model": "convnext_tiny", "model_kwargs": {"stochastic_depth": 0.1}},
         "model_kwargs.stochastic_depth: not a parameter of ConvNeXt ('convnext_tiny'); did you "
         "mean 'stochastic_depth_prob'?"),
        ({"model": "timm/vit_tiny_patch16_224", "model_kwargs": {"img_sise": 32}},
         "model_kwargs.img_sise: not a parameter of VisionTransformer ('timm/vit_tiny_patch16_224'"
         "); did you mean 'img_size'"),
        ({"model": "resnet18", "model_kwargs": {"pretrained": True}},
         "model_kwargs.pretrained: not settable (weights are never downloaded"),
        ({"model": "timm/vit_tiny_patch16_224", "model_kwargs": {"img_size": 16}},
         "model 'timm/vit_tiny_patch16_224' cannot take 32x32 images"),
        ({"model": "timm/vit_tiny_patch16_224", "model_kwargs": {"img_size": 32},
          "zero_init_residual": True}, "zero_init_residual true with model 'timm/vit_tiny"),
        ({"model": "timm/resnet18", "deterministic": True, "gpus_per_node": 1,
          "tasks_per_node": 1, **FED}, None),  # global average pooling to 1x1: a mean
        ({"model": "vgg11", "model_kwargs": {"dropout": 0.1}, "deterministic": True,
          "gpus_per_node": 1, "tasks_per_node": 1, **FED},
         "its layers ['avgpool (adaptive average pooling)'] have no deterministic CUDA"),
        # timm's VGG pools a feature map smaller than 7x7 up to it, by a functional call
        ({"model": "timm/vgg11", "deterministic": True, "gpus_per_node": 1,
          "tasks_per_node": 1, **FED}, "its layers ['pre_logits (adaptive average pooling)']"),
        ({"model": "timm/resnet18", "model_kwargs": {"global_pool": "avgmax"},
          "deterministic": True, "gpus_per_node": 1, "tasks_per_node": 1, **FED},
         "its layers ['global_pool.pool (adaptive max pooling)']"),
        ({"optimizer": "timm/lamd"}, "optimizer 'timm/lamd' is not sgd, adamw or a timm "
         "optimizer; did you mean"),
        # the schema takes any name: the registry (optimizers.FAMILIES) judges it
        ({"optimizer": "adam"}, "optimizer 'adam' is not sgd, adamw or a timm optimizer; did "
         "you mean 'adamw'"),
        ({"optimizer": "adamw", "optimizer_kwargs": {"beta": [0.9, 0.95]}},
         "optimizer_kwargs.beta: not a parameter of AdamW ('adamw'); did you mean 'betas'?"),
        ({"optimizer_kwargs": {"momentum": 0.8}},
         "optimizer_kwargs.momentum: set by the run setting momentum"),
        ({"optimizer_kwargs": {"dampening": 0.1}, "nesterov": True}, "optimizer 'sgd' with "
         "optimizer_kwargs {'dampening': 0.1}: Nesterov momentum requires a momentum and zero"),
    ],
    ids=["timm-name", "timm-tag", "swallowed-key", "timm-key", "reserved", "crop", "zero-init",
         "timm-resnet-ok", "pools", "timm-vgg-small", "timm-max-pool", "optimizer",
         "optimizer-family", "optimizer-key", "optimizer-setting", "optimizer-value"],
)  # fmt: skip
def test_models_and_optimizers_are_checked_exactly(tmp_path, run, expected):
    lines = model_lines(tmp_path, **run)
    if expected is None:
        assert lines == []
    else:
        [line] = lines
        assert line.startswith("config.yaml: run 'r': ") and expected in line, line


def test_timm_models_kwargs_and_optimizers_that_can_train_pass(tmp_path):
    for run in [
        {"model": "timm/resnet50.a1_in1k", "zero_init_residual": True, "optimizer": "timm/lars"},
        {"model": "timm/vit_tiny_patch16_224", "model_kwargs": {"img_size": 32,
         "drop_path_rate": 0.1}, "optimizer": "adamw",
         "optimizer_kwargs": {"betas": [0.9, 0.95], "eps": 1e-6}},
        {"model": "mobilenet_v3_small", "model_kwargs": {"dropout": 0.3}},
    ]:  # fmt: skip
        assert model_lines(tmp_path, **run) == [], run


def test_torchvision_names_are_judged_at_the_dry_run_without_torch(tmp_path):
    """The dry-run imports no torch: a torchvision name against the list kept with the package,
    model_kwargs, timm models and optimizers by the run's check."""
    config = demo_config(model="resnet9000", model_kwargs={"dropout": 0.1})
    [line] = check_runs(resolved(config), config)
    assert "model 'resnet9000' is not a torchvision classification model" in line
    config = demo_config(model="timm/resnt18", optimizer="timm/lamd")
    assert check_runs(resolved(config), config) == []  # the check's


def test_classification_models_are_torchvisions(models):
    """The list a bare Snakemake environment checks names against (no torchvision there)."""
    import torchvision

    assert models == set(torchvision.models.list_models(module=torchvision.models))
    assert {"resnet18", "vit_b_16", "convnext_tiny"} <= models


def test_the_kept_residual_prefixes_are_the_models_with_torchvisions_option(models):
    """models.RESIDUAL_BN names exactly the models whose class takes
    zero_init_residual (what the check finds from the meta-device build)."""
    from imagenet_ddp.models import RESIDUAL_BN, _init_parameters, _meta_model

    one_each = {}  # the first model of each builder family (resnet, resnext, wide, vgg, ...)
    for name in sorted(models, reverse=True):
        one_each[re.match("[a-z]+", name)[0]] = name
    built = {m: _init_parameters(_meta_model(m, {})) for m in one_each.values()}
    found = {m for m, parameters in built.items() if "zero_init_residual" in parameters}
    assert found == {m for m in built if m.startswith(RESIDUAL_BN)}
    assert len(built) > 15 and len(found) == 3


# ---------------------------------------------------------------- image sizes


@pytest.mark.parametrize(
    "run, expected",
    [
        # A crop above short_side is above eval_resize too, or eval_resize is above short_side.
        (
            {"crop_size": 48, "eval_resize": 40},
            ["crop_size 48 is larger than prepare.short_side 40: every training crop would be",
             "crop_size 48 is larger than eval_resize 40: evaluation's center crop would pad"],
        ),
        (
            {"crop_size": 32, "eval_resize": 44},
            ["eval_resize 44 is larger than prepare.short_side 40: evaluation would upsample"],
        ),
        (
            {"crop_size": 36, "eval_resize": 34},
            ["crop_size 36 is larger than eval_resize 34: evaluation's center crop would pad"],
        ),
    ],
)  # fmt: skip
def test_crop_or_resize_larger_than_what_they_are_taken_from(models, tmp_path, run, expected):
    lines = problems(demo_config(**run), models, tmp_path)
    assert len(lines) == len(expected)
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(f"config.yaml: run 'r': {start}")


def test_each_problem_is_its_own_line(models, tmp_path):
    config = demo_config(crop_size=48, eval_resize=44, model="resnet9000", batch_size=1000)
    lines = problems(config, models, tmp_path)
    # model; crop > short_side; eval_resize > short_side; crop > eval_resize; batch > train
    assert len(lines) == 5
    assert all(line.startswith("config.yaml: run 'r': ") and "\n" not in line for line in lines)


def test_sizes_equal_to_what_they_are_taken_from_pass(models, tmp_path):
    assert problems(demo_config(crop_size=40, eval_resize=40), models, tmp_path) == []


# ---------------------------------------------------------------- device


def test_gpus_with_device_cpu(models, tmp_path):
    [line] = problems(
        demo_config(gpus_per_node=4, tasks_per_node=4, device="cpu"), models, tmp_path
    )
    assert line.startswith("config.yaml: run 'r': gpus_per_node 4 with device 'cpu'")
    assert "gpus_per_node: 0" in line


def test_a_gpu_type_without_gpus(models, tmp_path):
    [line] = problems(demo_config(gpu_type="a100"), models, tmp_path)
    assert line.startswith("config.yaml: run 'r': gpu_type 'a100' with gpus_per_node 0")
    one_rank_per_gpu = {"gpus_per_node": 1, "tasks_per_node": 1, **FED}
    assert problems(demo_config(gpu_type="a100", **one_rank_per_gpu), models, tmp_path) == []


def test_a_gpu_run_that_would_decode_in_its_training_thread_is_refused(models, tmp_path):
    """cpus_per_task 1 (the default) gives workers auto = 0: every image is decoded between
    the GPU's steps. One line naming both keys and what to set; one worker is a warning's
    (the loader estimate), CPU runs are not judged."""
    gpu = {"gpus_per_node": 2, "tasks_per_node": 2}
    [line] = problems(demo_config(**gpu, workers="auto"), models, tmp_path)
    assert line.startswith(
        "config.yaml: run 'r': workers auto (0) with cpus_per_task 1 on a GPU run "
        "(gpus_per_node 2): every image would be decoded in the training thread"
    )
    assert "set cpus_per_task to the node's CPUs per GPU" in line and "workers >= 1" in line
    [line] = problems(demo_config(**gpu, cpus_per_task=8, workers=0), models, tmp_path)
    assert line.startswith("config.yaml: run 'r': workers 0 with cpus_per_task 8 on a GPU run")
    assert problems(demo_config(**gpu, cpus_per_task=2, workers="auto"), models, tmp_path) == []
    assert problems(demo_config(**gpu, workers=1), models, tmp_path) == []
    assert problems(demo_config(tasks_per_node=2, workers="auto"), models, tmp_path) == []


def loader_lines(**run) -> list[str]:
    config = demo_config(**run)
    config["prepare"]["short_side"] = 256  # the rates' own
    notices = run_checks.training_warnings(resolved(config), config)
    return [str(n) for n in notices if n.kind in (run_checks.LOADER_SLOWER,
                                                  run_checks.NO_STEP_RATE,
                                                  run_checks.NO_DALI_RATE)]  # fmt: skip


H200 = {"gpus_per_node": 1, "tasks_per_node": 1, "gpu_type": "h200", "model": "resnet50",
        "crop_size": 224, "eval_resize": 256}  # fmt: skip
# The policies of the v1 and DeiT presets (the helper `resolved` applies no preset)
V1, DEIT = {"auto_augment": "none"}, {"auto_augment": "rand-m9-mstd0.5-inc1"}


def test_a_dali_gpu_run_is_not_judged_by_the_pytorch_paths_rates():
    """The same run, input-bound by the pytorch path's figure, through DALI: a note that its
    GPU-side rate is not known, never the pytorch path's share lost."""
    [slower] = loader_lines(**V1, cpus_per_task=5, **H200)
    [note] = loader_lines(**V1, cpus_per_task=5, **H200, loader="dali")
    assert "GPU time lost" in slower and "GPU time lost" not in note
    assert "loader dali on GPUs: its decode and augmentation run on the GPU" in note, note


def test_a_gpu_run_whose_loader_is_slower_than_its_step_is_warned_with_the_share_lost():
    """workers x the measured per-worker rate of the run's augmentation (an idle core's, at the
    share of a core a SLURM CPU is taken to give) against the GPU's step: DeiT's RandAugment
    loses more GPU time than v1's plain crop at the same workers."""
    rates = run_checks.loader_rates
    v1, deit = (rates.per_worker_rate(policy, 256) for policy in (V1, DEIT))
    assert v1 == pytest.approx(rates.IDLE_CORE_RATES["none"] * rates.CPU_SHARE) and deit < v1
    [plain] = loader_lines(**V1, cpus_per_task=5, **H200)
    [dear] = loader_lines(**DEIT, cpus_per_task=5, **H200)
    assert plain.startswith("config.yaml: run 'r' (4 workers x ") and "loader slower" in plain
    assert f"4 workers x {v1:,.0f} img/s (none) = {4 * v1:,.0f} img/s a rank" in plain
    assert f"4 workers x {deit:,.0f} img/s (timm rand-*) = {4 * deit:,.0f} img/s a rank" in dear
    assert f"resnet50 on h200 4,689: {1 - 4 * v1 / 4689:.0%} of GPU time lost" in plain
    assert f"resnet50 on h200 4,689: {1 - 4 * deit / 4689:.0%} of GPU time lost" in dear
    assert "loader: dali" in plain and "prepare.short_side" in plain and "\n" not in plain
    assert f"cpus_per_task {math.ceil(4689 / deit) + 1} would feed it" in dear
    # compiled: the compiled figure; any GPU type: the slowest listed, said so
    [fast] = loader_lines(**V1, cpus_per_task=5, compile=True, **H200)
    assert "resnet50 on h200 compiled 6,809" in fast
    [any_gpu] = loader_lines(cpus_per_task=5, **{**H200, "gpu_type": ""})
    assert "resnet50 on a100 (gpu_type any: the slowest GPU listed) 2,470" in any_gpu


AUTO_AUGMENT = load_schema(SCHEMA)["definitions"]["run_settings"]["properties"]["auto_augment"]


@pytest.mark.parametrize(
    "auto_augment", [*AUTO_AUGMENT["anyOf"][0]["enum"], "rand-m9-mstd0.5-inc1", "rand-n3-m15"]
)
def test_every_auto_augment_policy_has_its_own_measured_rate(auto_augment):
    """Each policy the schema accepts is judged by its own measurement (timm's specs by DeiT's),
    its decode scaled by the prepared image's pixels."""
    rates = run_checks.loader_rates
    measured = rates.IDLE_CORE_RATES[rates.policy(auto_augment)] * rates.CPU_SHARE
    assert rates.per_worker_rate({"auto_augment": auto_augment}, 256) == measured
    assert rates.per_worker_rate({"auto_augment": auto_augment}, 512) == measured / 4
    assert rates.policy(auto_augment) == ("timm rand-*" if "-" in auto_augment else auto_augment)


def test_no_loader_warning_when_it_feeds_the_step_or_on_the_cpu():
    workers = math.ceil(4689 / run_checks.loader_rates.per_worker_rate(V1, 256))
    assert loader_lines(cpus_per_task=workers + 1, **H200) == []
    assert loader_lines(cpus_per_task=workers, **H200) != []  # one fewer cannot
    assert loader_lines(model="resnet50", cpus_per_task=2) == []  # a CPU run


def test_a_model_without_a_known_step_rate_is_noted_not_judged():
    [line] = loader_lines(**{**H200, "model": "vit_b_16"}, cpus_per_task=3)
    assert "no GPU step rate known" in line and "vit_b_16; 2 workers x" in line


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_gpus_with_a_gpu_device_pass(models, tmp_path, device):
    config = demo_config(gpus_per_node=4, tasks_per_node=4, device=device, **FED)
    assert problems(config, models, tmp_path) == []


@pytest.mark.parametrize(
    ("tasks", "evaluate", "expected"),
    [
        (8, None, "run 'r': tasks_per_node 8 with gpus_per_node 4: one rank per GPU; two ranks"),
        (2, None, "run 'r': tasks_per_node 2 with gpus_per_node 4: one rank per GPU; GPUs would"),
        (4, {"tasks_per_node": 8}, "run 'r': evaluation: tasks_per_node 8 with gpus_per_node 4"),
    ],
    ids=["more-ranks", "fewer-ranks", "evaluation"],
)
def test_one_rank_per_gpu(models, tmp_path, tasks, evaluate, expected):
    run = {"gpus_per_node": 4, "tasks_per_node": tasks, **FED}
    [line] = problems(demo_config(**run, **({"evaluate": evaluate} if evaluate else {})),
                      models, tmp_path)  # fmt: skip
    assert expected in line


def test_deterministic_without_a_deterministic_cuda_kernel(models, tmp_path):
    run = {"gpus_per_node": 2, "tasks_per_node": 2, "deterministic": True, **FED}
    [line] = problems(demo_config(model="vgg11", **run), models, tmp_path)
    assert "deterministic true with model 'vgg11' on GPUs" in line
    assert problems(demo_config(model="resnet18", **run), models, tmp_path) == []
    cpu = demo_config(model="alexnet", deterministic=True)  # CPU kernels are deterministic
    assert problems(cpu, models, tmp_path) == []


# ---------------------------------------------------------------- global batch


def test_global_batch_larger_than_the_train_set(models, tmp_path):
    """900 training images: 450 x 2 ranks is one step per epoch, 451 x 2 none (drop_last)."""
    assert problems(demo_config(batch_size=450, tasks_per_node=2), models, tmp_path) == []
    [line] = problems(demo_config(batch_size=451, tasks_per_node=2), models, tmp_path)
    assert line.startswith(
        "config.yaml: run 'r': batch_size 451 x nodes 1 x tasks_per_node 2 = global batch 902 "
        "is larger than the 900 training images (demo.num_classes 10 x demo.train_per_class 100 "
        "less split.holdout_fraction 0.1): "
    )


def test_global_batch_larger_than_the_holdout_only_passes(models, tmp_path):
    """The holdout (100 images) is evaluated without drop_last: a global batch of 200 is one
    partial batch of 50 per rank, not a failure."""
    assert problems(demo_config(batch_size=100, tasks_per_node=2), models, tmp_path) == []


def test_split_sizes_from_the_config():
    """From the config alone: the parse reads no results/ (issue 41)."""
    config = demo_config()
    assert split_sizes(config)[:2] == (900, 100)
    config["demo"]["enabled"] = False
    holdout = round(ILSVRC2012_TRAIN_IMAGES * 0.1)
    assert split_sizes(config)[:2] == (ILSVRC2012_TRAIN_IMAGES - holdout, holdout)


@pytest.mark.parametrize("fraction", [0.1, 0.15, 0.333, 0.5])
def test_expected_split_sizes_are_exact(fraction):
    """What the config predicts is what `split` makes, whatever the per-class rounding."""
    rng = np.random.default_rng(0)
    targets = np.repeat(np.arange(7), rng.integers(3, 40, size=7))
    index = pd.DataFrame({"sample_id": np.arange(len(targets)), "class_index": targets})
    train, holdout = stratified_split(index, fraction, seed=0)
    n = len(targets)
    assert (len(train), len(holdout)) == (n - run_checks._holdout_count(n, fraction),
                                          run_checks._holdout_count(n, fraction))  # fmt: skip


# ---------------------------------------------------------------- through snakemake -n


@pytest.mark.parametrize(
    "override, expected",
    [
        ({"model": "resnet9000"}, "model 'resnet9000' is not a torchvision classification model"),
        ({"crop_size": 48}, "crop_size 48 is larger than prepare.short_side 40"),
        # Two problems of one run: two lines (a crop range the GPU node could only fail on).
        (
            {"gpus_per_node": 2, "device": "cpu", "crop_ratio": [2.0, 0.5]},
            ("gpus_per_node 2 with device 'cpu'", "crop_ratio [2.0, 0.5]: min is larger than max"),
        ),
        ({"gpus_per_node": 2, "tasks_per_node": 1}, "tasks_per_node 1 with gpus_per_node 2"),
        ({"batch_size": 400}, "global batch 800 is larger than the 324 training images"),
        ({"gpus_per_node": 2}, "workers 0 with cpus_per_task 1 on a GPU run (gpus_per_node 2)"),
    ],
    ids=[
        "model",
        "image-size",
        "device",
        "gpus-vs-tasks",
        "global-batch",
        "loader-workers",
    ],
)
def test_dry_run_refuses_with_one_line(tmp_path, override, expected):
    workdir = copy_workflow(tmp_path / "wf")  # 6 classes x 60 images, holdout 0.1: 324 train
    config = read_config(workdir)
    config["runs"] = [{"name": "ok", "tasks_per_node": 1}, {"name": "bad", **override}]
    write_config(workdir, config)
    result = snakemake(workdir, "-n", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    lines = [line for line in output.splitlines() if line.startswith("config.yaml: ")]
    assert lines and all(line.startswith("config.yaml: run 'bad': ") for line in lines)
    for text in [expected] if isinstance(expected, str) else expected:
        assert any(text in line for line in lines), (text, lines)
    assert "Traceback" not in output and "Job stats" not in output


# ---------------------------------------------------------------- recipe keys


def test_crop_ranges_with_min_above_max_are_refused(models, tmp_path):
    found = problems(demo_config(crop_scale=[1.0, 0.5], crop_ratio=[1.5, 0.5]), models, tmp_path)
    assert found == [
        "config.yaml: run 'r': crop_scale [1.0, 0.5]: min is larger than max (RandomResizedCrop "
        "would fail on the GPU node); set crop_scale: [0.5, 1.0]",
        "config.yaml: run 'r': crop_ratio [1.5, 0.5]: min is larger than max (RandomResizedCrop "
        "would fail on the GPU node); set crop_ratio: [0.5, 1.5]",
    ]
    assert problems(demo_config(crop_scale=[1.0, 1.0], crop_ratio=[1, 1]), models, tmp_path) == []


def test_recipe_keys_that_could_only_fail_are_refused(models, tmp_path):
    config = demo_config(
        eval_crop_size=40, sync_bn=True, zero_init_residual=True, model="mobilenet_v2",
        progressive_min_crop=16, progressive_start_epoch=3, progressive_end_epoch=2,
    )  # fmt: skip
    found = problems(config, models, tmp_path)
    assert len(found) == 4, found
    assert "eval_crop_size 40 is larger than eval_resize 36" in found[0]
    assert "progressive_min_crop 16 from epoch 3 to 2" in found[1]
    assert "sync_bn true on the CPU" in found[2]
    assert "zero_init_residual true with model 'mobilenet_v2'" in found[3]
    fine = demo_config(zero_init_residual=True, progressive_min_crop=16, progressive_end_epoch=2)
    assert problems(fine, models, tmp_path) == []


def test_a_profiler_window_after_the_last_epoch_is_refused(models, tmp_path):
    found = problems(demo_config(epochs=2, profile={"epoch": 2, "steps": 3}), models, tmp_path)
    assert found == [
        "config.yaml: run 'r': profile.epoch 2 is after the last epoch (2 epochs, counted from "
        "0): no trace would be written; set profile.epoch below 2"
    ]
    assert problems(demo_config(epochs=2, profile={"epoch": 1, "steps": 3}), models, tmp_path) == []


@pytest.mark.parametrize(
    "run, expected",
    [
        ({"nodes": 4, "fallback_nodes": [2, 1]}, None),
        ({"nodes": 4, "fallback_nodes": [3]},
         "fallback_nodes [3]: [3] not smaller than nodes 4 or not dividing"),
        ({"nodes": 2, "fallback_nodes": [2]}, "fallback_nodes [2]: [2] not smaller than nodes 2"),
        ({"nodes": 2, "accumulation": 3, "fallback_nodes": [1]}, None),
        ({"nodes": 2, "fallback_nodes": [1], "sync_bn": True, "gpus_per_node": 1,
          "tasks_per_node": 1, **FED}, "fallback_nodes [1] with sync_bn"),
    ],
)  # fmt: skip
def test_fallback_node_counts_must_keep_the_global_batch(models, tmp_path, run, expected):
    lines = problems(demo_config(batch_size=2, **run), models, tmp_path)
    if expected is None:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith(f"config.yaml: run 'r': {expected}"), lines


# ---------------------------------------------------------------- warm-up rule


def test_the_warm_up_rule_warns_for_a_4_rank_scale_up_and_not_for_its_1_and_2_rank_runs(tmp_path):
    """Issue 37: the repo's demo config on 4 ranks (lr_used doubled, warmup_epochs 1: 14 steps)
    diverged; on 1 and 2 ranks, and on 4 with warmup_epochs 3, it trained."""
    config = demo_config()
    config["runs"] = [
        {"name": f"r{tasks}", "tasks_per_node": tasks, **extra}
        for tasks, extra in ((1, {}), (2, {}), (4, {}), (4, {"warmup_epochs": 3}))
    ]
    config["runs"][-1]["name"] = "r4-long"
    (notice,) = run_checks.warmup_warnings(resolved(config), config)
    assert str(notice).startswith(
        "config.yaml: run 'r4' (14 steps to lr_used 0.05: 0.0036/step, max 0.002; 25 steps are "
        "45% of the run's 56 (at most 10%): lr 0.1 (lr_used 0.025, no warm-up needed)): warm-up "
        'steeper than Goyal et al. 2017, "Accurate, Large Minibatch SGD" (5 epochs of '
    )  # the 2-rank run's lr_used, which trained: a value that satisfies it
    config["runs"] = [{"name": "r4", "tasks_per_node": 4, "lr": 0.1, "warmup_epochs": 0}]
    assert run_checks.warmup_warnings(resolved(config), config) == []
    config["train_defaults"]["epochs"] = 20  # 280 steps: the rule's 25 fit in a tenth
    config["runs"] = [{"name": "r4", "tasks_per_node": 4}]
    (notice,) = run_checks.warmup_warnings(resolved(config), config)
    assert notice.detail.endswith("; warmup_steps 25 or warmup_epochs 1.8")
    config["runs"] = [{"name": "r4", "tasks_per_node": 4, "warmup_steps": 25, "warmup_epochs": 0}]
    assert run_checks.warmup_warnings(resolved(config), config) == []


def test_a_sweeps_warnings_are_one_short_line_per_kind(tmp_path):
    """Issue 42: a 12-run sweep that shares a problem gets one line naming its runs."""
    from imagenet_ddp.settings.notices import Notice, summarised

    config = demo_config()
    config["train_defaults"]["epochs"] = 20  # the rule's warm-up fits in a tenth of the run
    config["runs"] = [{"name": f"r{i}", "tasks_per_node": 4, "seed": i} for i in range(12)]
    notices = run_checks.warmup_warnings(resolved(config), config)
    notices.append(Notice("another kind", "r0"))
    first, second = summarised(notices)
    assert first == (
        "config.yaml: runs 'r0', 'r1', 'r2' and 9 more (14 steps to lr_used 0.05: 0.0036/step, "
        f"max 0.002; warmup_steps 25 or warmup_epochs 1.8): {run_checks.WARMUP_TOO_SHORT}"
    )
    assert len(first) <= 320  # 12 runs, one line
    config["runs"][1]["warmup_epochs"] = 0.5  # its own figure, named with it
    first = summarised(run_checks.warmup_warnings(resolved(config), config))[0]
    assert first.startswith("config.yaml: runs 'r0' (14 steps to lr_used 0.05: 0.0036/step")
    assert "'r1' (7 steps to lr_used 0.05: " in first and first.endswith(
        "1.8) and 9 more: " + run_checks.WARMUP_TOO_SHORT
    )
    assert second == "config.yaml: run 'r0': another kind"


def digits_config(known: bool) -> dict:
    """Issue 42's runs: ResNet-18, batch 32 per rank, lr 0.4 per 256 scaled linearly, a
    1-epoch warm-up, on 1,437 train images (1,293 after the holdout: 10 steps per epoch at 4
    ranks): their size known (a demo set of that size) or not (data.dir, an ImageFolder)."""
    config = demo_config()
    config["demo"].update(enabled=known, num_classes=3, train_per_class=479)  # 1,437 images
    config["train_defaults"].update(batch_size=32, lr=0.4, warmup_epochs=1, epochs=15)
    config["runs"] = [{"name": f"r{n}", "tasks_per_node": n} for n in (1, 2, 4)]
    return config


def test_the_warm_up_rule_judges_the_ramp_per_step_whatever_the_batch(tmp_path):
    """Issue 42: 4 ranks reach lr_used 0.2 in 10 steps (0.02 per step; Goyal et al. ramp
    0.0041 per step at a quarter of its LR per image) and train to 60 %: warned, with the
    warm-up that the rule asks for. Its 1- and 2-rank runs, at the same LR per image, need
    longer warm-ups than they had too (they trained: the rule is conservative, a warning)."""
    config = digits_config(known=True)
    notices = run_checks.warmup_warnings(resolved(config), config)
    assert [n.run for n in notices] == ["r1", "r2", "r4"]
    assert notices[2].detail == (  # the 150-step run's: a tenth of it, the LR that fits it
        "10 steps to lr_used 0.2: 0.02/step, max 0.001; 196 steps are 131% of the run's 150 "
        "(at most 10%): lr 0.11 (lr_used 0.055) with warmup_steps 15"
    )
    assert notices[1].detail == (
        "20 steps to lr_used 0.1: 0.005/step, max 0.001; 98 steps are 33% of the run's 300 "
        "(at most 10%): lr 0.22 (lr_used 0.055) with warmup_steps 30"
    )
    # the invariant: the rise per step x the LR per 256 images is Goyal et al.'s at most
    assert pytest.approx(3.2 / 782 * 0.1) == run_checks.GOYAL_RAMP
    for lr_used, batch in ((0.2, 128), (3.2, 8192), (0.8, 256), (12.8, 8192)):
        steps = run_checks.required_warmup_steps(lr_used, batch)
        assert lr_used / steps * (lr_used * 256 / batch) <= run_checks.GOYAL_RAMP * 1.0001
        assert lr_used / (steps - 1) * (lr_used * 256 / batch) > run_checks.GOYAL_RAMP
    config["train_defaults"]["warmup_epochs"] = 0
    config["runs"][2].update(lr=0.11, warmup_steps=15)  # the advice: no warning
    assert [n.run for n in run_checks.warmup_warnings(resolved(config), config)] == [
        "r1",
        "r2",
    ]


def test_a_run_without_warm_up_is_named_as_reaching_its_lr_at_once(tmp_path):
    config = demo_config(tasks_per_node=4, warmup_epochs=0)
    (notice,) = run_checks.warmup_warnings(resolved(config), config)
    assert notice.detail.startswith("0 steps to lr_used 0.05: at once, max 0.002; 25 steps are")


def test_the_issues_digits_run_is_told_a_warm_up_that_fits_its_150_steps():
    """Issue 51: 1,294 train images, batch 32 x 4 ranks, 15 epochs (150 optimizer steps), lr
    0.4 per 256 scaled linearly. The old advice, warmup_steps 196, is longer than the run: a
    warning of its own now; the advice is a tenth of the run with the lr that fits it, in the
    run's lr_scaling (and that advice passes)."""
    run = {"batch_size": 32, "nodes": 1, "tasks_per_node": 4, "lr": 0.4, "lr_scaling": "linear",
           "epochs": 15, "warmup_epochs": 1.0, "warmup_steps": 0}  # fmt: skip
    needed = run_checks.required_warmup_steps(0.2, 128)
    assert needed == 196
    kind, detail = run_checks.warmup_advice(run, 128, needed, 1294)
    assert kind == run_checks.WARMUP_TOO_SHORT and detail.endswith(
        "196 steps are 131% of the run's 150 (at most 10%): lr 0.11 (lr_used 0.055) with "
        "warmup_steps 15"
    )
    followed = {**run, "warmup_epochs": 0.0, "warmup_steps": 196}  # the old advice
    kind, detail = run_checks.warmup_advice(followed, 128, needed, 1294)
    assert kind == run_checks.WARMUP_TOO_LONG
    assert detail.startswith("196 warm-up steps of the run's 150; 196 steps are 131%")
    fixed = {**followed, "lr": 0.11, "warmup_steps": 15}
    assert run_checks.warmup_advice(fixed, 128, run_checks.required_warmup_steps(
        0.055, 128), 1294) is None  # fmt: skip
    for scaling, lr in (("none", 0.055), ("sqrt", 0.078)):  # the same lr_used, its own lr
        kind, detail = run_checks.warmup_advice({**run, "lr_scaling": scaling}, 128, needed, 1294)
        assert f": lr {lr} (lr_used 0.055) with warmup_steps 15" in detail, detail
    assert "Goyal et al. 2017" in run_checks.WARMUP_TOO_SHORT
    assert "Accurate, Large Minibatch SGD" in run_checks.WARMUP_UNKNOWN


def test_a_warm_up_in_epochs_on_data_not_indexed_yet_is_judged_by_its_smallest_train_set(
    tmp_path,
):
    """The first dry-run on a folder of any size counts no images: the run is named with the
    train set below which its warm-up is too short (not judged at ImageNet's 1.28 M)."""
    config = digits_config(known=False)
    notices = run_checks.warmup_warnings(resolved(config), config)
    assert {n.kind for n in notices} == {run_checks.WARMUP_UNKNOWN}
    assert notices[2] == (run_checks.WARMUP_UNKNOWN, "r4",
                          "fewer than 25088 train images: warmup_steps 196 with 16726 train "
                          "images or more (then 10% of the run's steps at most), with fewer lr "
                          "0.1 (lr_used 0.05, no warm-up needed)")  # fmt: skip
    config["data"]["layout"] = "archives"  # the archives' count is exact: judged, and enough
    assert run_checks.warmup_warnings(resolved(config), config) == []


@pytest.mark.parametrize("preset", ["torchvision-resnet50-v1", "torchvision-resnet50-v2",
                                    "ffcv-resnet50"])  # fmt: skip
def test_the_warm_up_rule_passes_the_presets_as_published(preset, tmp_path):
    from imagenet_ddp.settings.presets import PRESETS

    config = demo_config()
    config["demo"]["enabled"] = False  # ImageNet's 1.28 M images
    config["data"]["layout"] = "archives"  # their count exact before the index
    config["runs"] = [{"name": preset, **PRESETS[preset], "tasks_per_node": 8}]
    assert run_checks.required_warmup_steps(3.2, 8192) == run_checks.GOYAL_WARMUP_STEPS == 782
    assert run_checks.warmup_warnings(resolved(config), config) == []


def test_warm_up_in_epochs_and_in_steps_is_refused(models, tmp_path):
    config = demo_config(warmup_steps=10, warmup_epochs=1)
    (line,) = problems(config, models, tmp_path)
    assert "warmup_steps 10 and warmup_epochs 1 are both set" in line


def test_the_runs_check_refuses_with_one_line_before_any_of_its_jobs(tmp_path):
    """What needs torch (a timm name, model_kwargs): the run's local `check` job, which its
    GPU jobs wait for, fails with one line naming the run and the key; the dry-run passes."""
    workdir = copy_workflow(tmp_path / "wf")
    config = read_config(workdir)
    config["runs"] = [
        {"name": "name", "model": "timm/vit_tiny_patch16_24"},
        {
            "name": "kwargs",
            "model": "timm/vit_tiny_patch16_224",
            "model_kwargs": {"drop_path": 0.1},
        },
    ]
    write_config(workdir, config)
    assert snakemake(workdir, "-n").returncode == 0
    targets = ["results/checks/name.json", "results/checks/kwargs.json"]
    result = snakemake(workdir, "-c1", "--keep-going", *targets, check=False)
    assert result.returncode != 0
    for run, expected in (
        ("name", "model 'timm/vit_tiny_patch16_24' is not a timm classification model; did "
         "you mean 'timm/vit_tiny_patch16_224'"),
        ("kwargs", "model_kwargs.drop_path: not a parameter of VisionTransformer"),
    ):  # fmt: skip
        log = (workdir / f"logs/check/{run}.log").read_text().splitlines()
        assert len(log) == 1 and f"config.yaml: run '{run}': " in log[0] and expected in log[0]
        assert not (workdir / f"results/checks/{run}.json").exists()


TIMM_PRESETS = ["timm-resnet50-a1", "timm-resnet50-a2", "timm-resnet50-a3", "deit-small",
                "deit-base"]  # fmt: skip


@pytest.mark.parametrize("preset", TIMM_PRESETS)
def test_timms_and_deits_presets_pass_the_dry_run_at_2_x_8_gpus(preset, tmp_path):
    """At the scale of the sources (2 nodes x 8 GPUs: their global batch), each preset passes
    every check (its timm model built on the meta device at its crops, its optimizer, the
    warm-up rule) and its log's hyperparameter line states the source's global batch and LR."""
    from imagenet_ddp.settings.kinds import declarations, hyperparameter_line
    from imagenet_ddp.settings.runs import resolve_run

    config = demo_config()
    config["demo"]["enabled"] = False  # ImageNet's 1.28 M images
    config["prepare"]["short_side"] = 256
    shape = {"nodes": 2, "tasks_per_node": 8, "gpus_per_node": 8, "cpus_per_task": 16}
    config["runs"] = [{"name": preset, "recipe": preset, **shape}]
    defaults = {k: v for k, v in config["train_defaults"].items()}
    runs = {preset: resolve_run(defaults, {}, config["runs"][0])}
    assert check_runs(runs, config) == []
    assert run_checks.deep_problems(runs[preset], num_classes=1000) == []  # the check rule's
    assert run_checks.warmup_warnings(runs, config) == []
    batch, lr = (1024, 1e-3) if preset.startswith("deit") else (2048, 5e-3)
    lr = 8e-3 if preset.endswith("a3") else lr
    line = hyperparameter_line(runs[preset], declarations())
    assert f"global_batch={batch} " in line and f"lr_used={lr}" in line, line


def test_settings_timms_parts_would_ignore_are_refused():
    def problems(config):
        return check_runs(resolved(config), config)

    config = demo_config(weight_decay_groups="timm", norm_weight_decay=0.0)
    (line,) = problems(config)
    assert line.startswith("config.yaml: run 'r': norm_weight_decay 0.0 with weight_decay_groups")
    (line,) = problems(demo_config(loss="bce", label_smoothing=0.1, mixup_alpha=0.2))
    assert "BinaryCrossEntropy smooths one-hot targets only" in line
    (line,) = problems(demo_config(bce_target_threshold=0.2))
    assert "it applies to loss bce only" in line


def test_the_issues_short_demo_runs_are_warned_at_the_dry_run():
    """Issue 53: a 3-class tree, 5 steps an epoch against throughput_warmup_steps 5, 10 steps
    in all (holdout at chance), and AdamW's lr 0.001 scaled to 6.25e-05 at batch 16."""
    from imagenet_ddp.settings.notices import summarised

    config = demo_config()
    config["demo"].update(num_classes=3, train_per_class=30)  # 90 images, 81 after the holdout
    config["train_defaults"].update(epochs=2, batch_size=16, throughput_warmup_steps=5)
    config["runs"] = [
        {"name": "sgd", "tasks_per_node": 1},
        {"name": "adamw", "tasks_per_node": 1, "optimizer": "adamw", "lr": 0.001},
        {"name": "vit", "tasks_per_node": 1, "model": "timm/vit_tiny_patch16_224"},
    ]
    notices = run_checks.training_warnings(resolved(config), config)
    by_kind = {}
    for notice in notices:
        by_kind.setdefault(notice.kind, []).append((notice.run, notice.detail))
    assert by_kind == {
        run_checks.FEW_STEPS_FOR_BATCHNORM: [("sgd", "10 steps"), ("adamw", "10 steps")],
        run_checks.NO_STEADY_WINDOW: [("sgd", "5 <= 5"), ("adamw", "5 <= 5"), ("vit", "5 <= 5")],
        run_checks.ADAPTIVE_LR_SHRUNK: [
            ("adamw", "lr 0.001 -> lr_used 6.25e-05 at global batch 16")
        ],
    }  # fmt: skip
    lines = summarised(notices)
    assert len(lines) == 3 and lines[1].startswith("config.yaml: runs 'sgd', 'adamw', 'vit' (")
    # the repository's demo: 28 and 56 steps an epoch, 4 epochs, SGD
    shipped = with_schema_defaults(yaml.safe_load((REPO / "config.yaml").read_text()))
    assert run_checks.training_warnings(resolved(shipped), shipped) == []


def test_report_settings_name_runs_and_the_sweeps_axes():
    import json

    config = demo_config()
    runs = {"a": {}, "b": {}}
    config["sweep"] = [{"name": "x", "zip": {"seed": [0, 1]}, "grid": {"lr": [0.1]}}]
    config["report"] = {"target_top1": 75.9}
    problems, text = run_checks.report_settings(config, runs)
    assert problems == [] and json.loads(text) == {
        "axes": ["lr", "seed"], "target_top1": {"a": 75.9, "b": 75.9},
    }  # fmt: skip
    config["report"] = {"target_top1": {"a": 70, "nope": 60}}
    problems, text = run_checks.report_settings(config, runs)
    assert json.loads(text)["target_top1"] == {"a": 70.0}
    assert problems == [
        "config.yaml: report.target_top1 names 'nope', no run of this config (runs: 'a', 'b'); "
        "name runs, or give one number for all"
    ]


def test_the_dry_run_names_the_defaults_that_differ_from_torchvisions_reference():
    """Issue 51: a reference command ported by its numbers trained at a quarter of its LR, with
    our weight decay and Nesterov: an SGD run without a recipe is named with each setting that
    is not the reference train.py's and the --lr its lr is; the reference's own values pass."""
    from imagenet_ddp.settings.notices import summarised

    config = demo_config(batch_size=32, tasks_per_node=2, lr=0.1)
    (line,) = summarised(run_checks.reference_notes(resolved(config)))
    assert line == (
        "config.yaml: run 'r' (weight_decay 5e-05/1e-4, nesterov true/false, lr_schedule "
        "cosine/step every 30 epochs x 0.1, lr_scaling linear/none (--lr as given), lr 0.1 is "
        f"their --lr 0.025 at global batch 64): {run_checks.REFERENCE_DIFFERS}"
    )
    ported = {"weight_decay": 1e-4, "nesterov": False, "lr_schedule": "step",
              "lr_scaling": "none"}  # fmt: skip
    assert run_checks.reference_notes(resolved(demo_config(**ported))) == []
    assert run_checks.reference_notes(resolved(demo_config(recipe="torchvision-resnet50-v1"))) == []
    assert run_checks.reference_notes(resolved(demo_config(optimizer="adamw"))) == []
