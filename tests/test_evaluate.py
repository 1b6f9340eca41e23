"""Evaluation counts every sample exactly once, whatever the number of ranks (also through
the real launcher: 2 local gloo ranks give the same result as 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from imagenet_ddp.evaluation.evaluate import evaluate_run
from imagenet_ddp.settings.evaluation import eval_settings
from imagenet_ddp.settings.geometry import Geometry
from imagenet_ddp.training.accuracy import evaluate_dataset


class Lookup(torch.nn.Module):
    """Returns the logits stored for each sample id (the 'image' is the sample id)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, ids):
        return self.logits[ids[:, 0].long()]


def make(n=23, classes=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, classes, generator=g)
    targets = torch.randint(0, classes, (n,), generator=g)
    ids = torch.arange(n, dtype=torch.float32)[:, None]
    return Lookup(logits), TensorDataset(ids, targets), logits, targets


def test_top1_top5_and_per_class_match_a_direct_computation():
    model, ds, logits, targets = make()
    result = evaluate_dataset(model, ds, num_classes=7, device=torch.device("cpu"), batch_size=4)
    assert result["samples"] == 23
    top1 = (logits.argmax(1) == targets).sum().item() / 23
    top5 = (logits.topk(5, 1).indices == targets[:, None]).any(1).sum().item() / 23
    assert abs(result["top1"] - top1) < 1e-12
    assert abs(result["top5"] - top5) < 1e-12
    assert sum(result["per_class_total"]) == 23
    assert result["per_class_total"] == torch.bincount(targets, minlength=7).tolist()


def test_uint8_batches_normalized_on_the_device_give_the_same_figures(prepared_demo):
    """Evaluation ships uint8 crops and normalizes on the device: bitwise what the float
    transform gave, with a quarter of the bytes through the loader."""
    from imagenet_ddp.data.dataset import PreparedImageDataset, eval_transform

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(4)
    )
    results = []
    for normalize in (True, False):
        ds = PreparedImageDataset(
            prepared_demo["val"], transform=eval_transform(24, 16, normalize=normalize)
        )
        assert ds[0][0].dtype == (torch.float32 if normalize else torch.uint8)
        results.append(
            evaluate_dataset(model, ds, num_classes=4, device=torch.device("cpu"), batch_size=3)
        )
    assert results[0] == results[1]


def test_two_rank_shards_cover_every_sample_once():
    model, ds, _, _ = make(n=23)
    whole = evaluate_dataset(model, ds, num_classes=7, device=torch.device("cpu"), batch_size=5)
    # Without a process group the reduction is local, so sum the two shards by hand.
    shards = [
        evaluate_dataset(
            model, ds, num_classes=7, device=torch.device("cpu"), batch_size=5, rank=r, world_size=2
        )
        for r in (0, 1)
    ]
    assert shards[0]["samples"] + shards[1]["samples"] == 23  # 12 + 11: no padding
    correct = [
        a + b
        for a, b in zip(shards[0]["per_class_correct"], shards[1]["per_class_correct"], strict=True)
    ]
    assert correct == whole["per_class_correct"]


# ------------------------------------------------------------------ through the real launcher


@pytest.fixture(scope="module")
def eval_inputs(demo_archives, demo_index, tmp_path_factory) -> dict[str, Path]:
    """A ResNet-18 model.pt written by training.model.save_model (random weights, eval-ready BN
    statistics from a few forward passes) and the demo's class table."""
    from imagenet_ddp.io import write_csv_atomic
    from imagenet_ddp.training.model import build_model, save_model

    root = tmp_path_factory.mktemp("eval-inputs")
    torch.manual_seed(0)
    model = build_model("resnet18", 4)
    with torch.no_grad():  # non-trivial running statistics, so logits differ per image
        for _ in range(3):
            model(torch.rand(8, 3, 16, 16))
    config = {"run": "eval-test", "crop_size": 16, "eval_resize": 20, "precision": "fp32"}
    save_model(root / "model.pt", model, arch="resnet18", num_classes=4, config=config)
    write_csv_atomic(root / "classes.csv", demo_index[0])
    return {"model": root / "model.pt", "classes": root / "classes.csv"}


def evaluate_cli(inputs, prepared, split_dir, out: Path, tasks: int = 1, cpus: int = 1, **given):
    """`imagenet-ddp evaluate --job FILE`: a spec file written as a user would (by hand)."""
    from imagenet_ddp.jobs.spec import write_spec
    from tests.workflow_helpers import make_job

    geometry = {"nodes": 1, "tasks_per_node": tasks, "cpus_per_task": cpus, "gpus_per_node": 0}
    job = make_job(
        "evaluate", geometry, model=inputs["model"], classes=inputs["classes"],
        prepared_train=prepared["train"], prepared_val=prepared["val"], split_dir=split_dir,
        out=out / "eval.json", per_class=out / "per_class.csv",
        **{"launcher": "auto", "workers": "auto", **given},
    )  # fmt: skip
    spec = write_spec(out / "my_eval_spec.json", job)
    argv = [sys.executable, "-m", "imagenet_ddp.cli", "evaluate", "--job", str(spec)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((out / "eval.json").read_text())


def test_two_local_ranks_give_the_same_result_as_one(
    eval_inputs, prepared_demo, demo_split, tmp_path
):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    a = evaluate_cli(eval_inputs, prepared_demo, demo_split, tmp_path / "one")
    b = evaluate_cli(
        eval_inputs, prepared_demo, demo_split, tmp_path / "two",
        tasks=2, launcher="local", workers=1,
    )  # fmt: skip
    ea, eb = a["evaluation"], b["evaluation"]
    assert (ea["world_size"], ea["backend"], ea["loader_workers"]) == (1, "none", 0)
    assert (eb["world_size"], eb["tasks_per_node"], eb["backend"]) == (2, 2, "gloo")
    assert eb["loader_workers"] == 1 and eb["device"] == "cpu" and eb["precision"] == "fp32"
    for split in ("holdout", "test"):
        assert a[split]["samples"] == b[split]["samples"] > 0
        assert a[split]["top1"] == b[split]["top1"] and a[split]["top5"] == b[split]["top5"]
        # Counts are exact; the mean loss is a float sum whose order follows the batches.
        assert a[split]["loss"] == pytest.approx(b[split]["loss"], rel=1e-6)
    assert eb["images"] == a["holdout"]["samples"] + a["test"]["samples"]
    assert eb["images_per_s"] > 0 and eb["job_wall_seconds"] >= eb["wall_seconds"] > 0
    one, two = (tmp_path / d / "per_class.csv" for d in ("one", "two"))
    assert one.read_bytes() == two.read_bytes()


def test_a_run_with_ema_is_evaluated_with_both_weights_and_names_the_published_one(
    eval_inputs, prepared_demo, demo_split, tmp_path
):
    """The v2 recipe's published figure is its EMA model's: eval.json carries the EMA's
    accuracy beside the raw weights', each exactly what a model.pt holding only those weights
    gives, and says which of the two the preset reports; per_class.csv has both."""
    from imagenet_ddp.training.model import build_model, read_model_file, save_model

    state = read_model_file(eval_inputs["model"])
    torch.manual_seed(1)
    averaged = build_model("resnet18", 4)
    with torch.no_grad():
        for _ in range(3):
            averaged(torch.rand(8, 3, 16, 16))
    config = {**state["config"], "recipe": "torchvision-resnet50-v2"}
    raw = build_model("resnet18", 4)
    raw.load_state_dict(state["model"])
    for name, model, extra in (
        ("both", raw, {"ema": averaged.state_dict()}),
        ("ema-alone", averaged, {}),
    ):
        (tmp_path / name).mkdir()
        save_model(tmp_path / name / "model.pt", model, arch="resnet18", num_classes=4,
                   config=config, extra=extra)  # fmt: skip
    inputs = {**eval_inputs, "model": tmp_path / "both" / "model.pt"}
    both = evaluate_cli(inputs, prepared_demo, demo_split, tmp_path / "both")
    inputs["model"] = tmp_path / "ema-alone" / "model.pt"
    alone = evaluate_cli(inputs, prepared_demo, demo_split, tmp_path / "ema-alone")
    (tmp_path / "raw").mkdir()
    plain = evaluate_cli(eval_inputs, prepared_demo, demo_split, tmp_path / "raw")
    assert both["reported_model"] == "ema" and plain["reported_model"] is None
    assert plain["ema"] is None and alone["ema"] is None
    assert both["evaluation"]["models"] == ["model", "ema"]
    for split in ("holdout", "test"):
        assert both[split] == plain[split]  # the raw weights, as without EMA
        assert both["ema"][split] == alone[split]  # the EMA weights, as loaded alone
    assert both["ema"]["test"]["top1"] != both["test"]["top1"]  # two different models
    assert both["evaluation"]["images"] == 2 * plain["evaluation"]["images"]
    import pandas as pd

    per_class = pd.read_csv(tmp_path / "both" / "per_class.csv")
    only = pd.read_csv(tmp_path / "ema-alone" / "per_class.csv")
    assert list(per_class["test_ema_top1"]) == list(only["test_top1"])
    assert list(per_class["holdout_ema_top1"]) == list(only["holdout_top1"])


def test_an_evaluation_rank_runs_its_tasks_cpus_less_its_loader_workers_as_threads(
    eval_inputs, prepared_demo, demo_split, tmp_path
):
    """As a training rank (training.worker.rank_threads): 2 CPUs and 1 loader worker, one
    intra-op thread (the launcher exports 2); without workers, both."""
    threads = {}
    for workers in (1, 0):
        (tmp_path / str(workers)).mkdir()
        result = evaluate_cli(eval_inputs, prepared_demo, demo_split, tmp_path / str(workers),
                              cpus=2, workers=workers)  # fmt: skip
        threads[workers] = [r["intra_op_threads"] for r in result["evaluation"]["ranks"]]
    assert threads == {1: [1], 0: [2]}


def test_a_rank_count_that_disagrees_with_the_geometry_is_refused(
    eval_inputs, prepared_demo, demo_split, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="2 task\\(s\\) per node, but 1 ranks started"):
        evaluate_run(
            model_path=eval_inputs["model"],
            prepared_train=prepared_demo["train"],
            prepared_val=prepared_demo["val"],
            holdout_ids_csv=demo_split / "holdout.csv",
            geometry=Geometry(nodes=1, tasks_per_node=2, cpus_per_task=1, gpus_per_node=0),
        )


def test_eval_geometry_follows_the_run_unless_set():
    gpu_run = {"gpus_per_node": 8, "cpus_per_task": 12, "nodes": 4, "tasks_per_node": 8}
    assert eval_settings({"batch_size": 64}, gpu_run) == {
        "nodes": 1, "tasks_per_node": 8, "cpus_per_task": 12, "gpus_per_node": 8,
        "batch_size": 64, "workers": "auto",
    }  # fmt: skip
    cpu_run = {"gpus_per_node": 0, "cpus_per_task": 2, "tasks_per_node": 2}
    assert eval_settings(None, cpu_run)["tasks_per_node"] == 1
    override = {**gpu_run, "evaluate": {"gpus_per_node": 2, "workers": 3}}
    settings = eval_settings({"nodes": 2, "workers": 0}, override)
    assert (settings["nodes"], settings["tasks_per_node"], settings["workers"]) == (2, 2, 3)
