"""The evaluation stage: a trained run's model on the holdout split and the test set, one
process per rank (:func:`main`, started through jobs.launch like the training workers).

A run with EMA (``ema_decay`` > 0) is evaluated with its trained weights (``holdout``, ``test``)
and its averaged ones (``ema``): sources report one or the other (presets.REPORTED_MODEL;
eval.json's ``reported_model`` names the one its preset's published figure is of)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from imagenet_ddp.errors import InputError
from imagenet_ddp.models import input_normalization
from imagenet_ddp.settings.evaluation import DEFAULT_BATCH_SIZE, DEFAULT_WORKERS, EvalInput
from imagenet_ddp.settings.geometry import Geometry, loader_workers
from imagenet_ddp.settings.presets import REPORTED_MODEL
from imagenet_ddp.training.accuracy import evaluate_dataset
from imagenet_ddp.training.model import model_from_state, read_model_file
from imagenet_ddp.training.recipe import dali_problem
from imagenet_ddp.training.worker import rank_threads

TIMING_NOTE = (
    "wall_seconds: rank 0's time from all ranks ready (model loaded, process group up) to the "
    "end of the last set's reduction: loader start-up, reading and decoding, forward passes and "
    "reductions of holdout and test, for each model evaluated (models: the trained weights, "
    "and the EMA's where the run kept one; images counts each model's pass); process start-up, "
    "imports and model loading excluded (job_wall_seconds, written by the launcher, includes "
    "them)"
)


def evaluate_run(
    *, model_path, prepared_train, prepared_val, holdout_ids_csv, geometry: Geometry,
    batch_size: int = DEFAULT_BATCH_SIZE, workers: int | str = DEFAULT_WORKERS, device="auto",
) -> dict[str, Any]:  # fmt: skip
    """A trained model on the holdout split and the test set (official val), as one rank of
    ``geometry`` (started by :mod:`imagenet_ddp.jobs.launch`); every rank returns the summed
    counts. Precision and channels_last are the run's (from the checkpoint's config)."""
    from imagenet_ddp.jobs import distributed as D

    info = D.dist_info_from_env()
    if geometry.world_size != info.world_size:
        raise RuntimeError(
            f"evaluation configured for {geometry.nodes} node(s) x {geometry.tasks_per_node} "
            f"task(s) per node, but {info.world_size} ranks started; check the launcher's geometry"
        )
    dev = D.select_device(
        device, info.local_rank, geometry.gpus_per_node, info.local_world_size, 30
    )
    D.init_process_group(info, dev, "auto", timeout_minutes=30)
    try:
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = True  # one input shape throughout
        state = read_model_file(Path(model_path))
        problem = dali_problem(EvalInput.of(state["config"]))  # it evaluates as it trained
        if problem:
            raise InputError(f"{model_path}: its run trained with loader: dali; {problem}")
        weights = ["model"] + (["ema"] if state.get("ema") is not None else [])  # the EMA's, kept
        models = {w: model_from_state(state, dev, weights=w, path=model_path) for w in weights}
        cfg = state["config"]
        workers = loader_workers(workers, geometry.cpus_per_task)
        rank_threads(dataclasses.replace(geometry, workers=workers))  # as training's ranks
        settings = {
            "num_classes": state["num_classes"], "device": dev, "batch_size": batch_size,
            "workers": workers,
            "precision": cfg.get("precision", "fp32"),
            "channels_last": bool(cfg.get("channels_last")),
            "rank": info.rank, "world_size": info.world_size,
            "cfg": EvalInput.of(cfg),  # the run's loader reads the sets (pytorch or dali)
            # a model.pt from before the setting: ImageNet's, as it trained with
            "mean_std": input_normalization(state["arch"], cfg.get("normalization", "imagenet")),
        }  # fmt: skip
        sets = _datasets(settings["cfg"], prepared_train, prepared_val, holdout_ids_csv)
        D.barrier()
        started = time.perf_counter()
        results = {
            weights: {name: evaluate_dataset(model, ds, **settings) for name, ds in sets.items()}
            for weights, model in models.items()
        }
        seconds = time.perf_counter() - started
        settings["backend"] = torch.distributed.get_backend() if D.is_distributed() else "none"
        ranks = D.all_gather_objects(D.placement(info, dev))
    finally:
        D.destroy_process_group()
    return {
        "run": cfg.get("run"),
        "evaluation": _evaluation_block(geometry, settings, ranks, results, seconds),
        **results["model"],
        "ema": results.get("ema"),  # None: the run kept no EMA
        # which weights the preset's published figure is of ("model" or "ema"); None: no preset
        "reported_model": REPORTED_MODEL.get(cfg.get("recipe") or "none"),
    }


def _datasets(inputs: EvalInput, prepared_train, prepared_val, holdout_ids) -> dict[str, Dataset]:
    # Read from the shared prepared copy directly (no node-local staging): evaluation reads
    # every image exactly once, so staging a copy first would only double the reads.
    from imagenet_ddp.data.reader import create_dataset
    from imagenet_ddp.training.data import read_ids

    size, mode = (inputs.eval_resize, inputs.eval_crop), inputs.interpolation
    holdout_ids = read_ids(holdout_ids)  # the split's holdout.csv
    return {  # uint8 crops: see training.accuracy
        "holdout": create_dataset(Path(prepared_train), holdout_ids, eval_size=size,
                                  interpolation=mode),
        "test": create_dataset(Path(prepared_val), None, eval_size=size, interpolation=mode),
    }  # fmt: skip


def _evaluation_block(geometry, settings, ranks, results, seconds) -> dict[str, Any]:
    images = sum(r["samples"] for sets in results.values() for r in sets.values())
    rate = images / seconds if seconds > 0 else None
    return {
        **{k: getattr(geometry, k) for k in ("nodes", "tasks_per_node")},
        "world_size": settings["world_size"],
        **{k: getattr(geometry, k) for k in ("cpus_per_task", "gpus_per_node")},
        "loader_workers": settings["workers"],
        "device": settings["device"].type,
        "loader": settings["cfg"].loader,
        **{k: settings[k] for k in ("backend", "precision", "channels_last", "batch_size")},
        "models": list(results),
        "hosts": sorted({r["host"] for r in ranks}),
        "images": images,
        "wall_seconds": seconds,
        "images_per_s": rate,
        "images_per_s_per_rank": None if rate is None else rate / settings["world_size"],
        "timing_note": TIMING_NOTE,
        "ranks": ranks,
    }


def write_outputs(result: dict[str, Any], *, classes, out, per_class_csv, provenance) -> None:
    """eval.json, per_class.csv and the provenance beside eval.json (rank 0 calls this)."""
    import pandas as pd

    from imagenet_ddp.io import write_csv_atomic, write_json_atomic
    from imagenet_ddp.provenance import provenance_path, write_provenance

    table = pd.read_csv(classes, keep_default_na=False)
    per_class = table[["class_index", "wnid", "words"]].copy()
    for name in ("holdout", "test"):
        per_class[f"{name}_top1"] = result[name].pop("per_class_top1")
        per_class[f"{name}_total"] = result[name].pop("per_class_total")
        result[name].pop("per_class_correct")
        if result.get("ema"):  # same images and totals: only the accuracy differs
            per_class[f"{name}_ema_top1"] = result["ema"][name].pop("per_class_top1")
            result["ema"][name].pop("per_class_total")
            result["ema"][name].pop("per_class_correct")
    write_csv_atomic(per_class_csv, per_class)
    write_json_atomic(out, result)
    write_provenance(provenance_path(out), "evaluate", provenance)


def main(argv: list[str] | None = None) -> int:
    """One evaluation rank (started by ``imagenet-ddp evaluate`` through the launcher); all it
    needs is in the job spec (:mod:`imagenet_ddp.jobs.spec`)."""
    import argparse

    from imagenet_ddp.jobs.distributed import dist_info_from_env
    from imagenet_ddp.jobs.spec import read_spec

    parser = argparse.ArgumentParser(description="evaluation rank (one per device)")
    parser.add_argument("--spec", type=Path, required=True, help="the job spec file")
    job = read_spec(parser.parse_args(argv).spec, "evaluate")
    paths, settings = job.paths, job.settings
    result = evaluate_run(
        model_path=paths.model,
        prepared_train=paths.prepared_train,
        prepared_val=paths.prepared_val,
        holdout_ids_csv=paths.split_dir / "holdout.csv",
        geometry=job.geometry,
        batch_size=settings.batch_size,
        workers=settings.workers,
        device=settings.device,
    )
    if dist_info_from_env().rank == 0:
        write_outputs(
            result,
            classes=paths.classes,
            out=paths.out,
            per_class_csv=paths.per_class,
            provenance={"model": str(paths.model), "batch_size": settings.batch_size},
        )
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
