"""One rank of a preflight: placement, all-reduce, the run's training step, loader, holdout
evaluation and checkpoint. Started like a training rank, on its host's staged copy, it builds the
job with the training code itself (training.worker.build_job, loop.train_step), so it times
what training runs; rank 0 writes the report (:mod:`imagenet_ddp.preflight.report`). Fixed step
counts whatever the data set (docs/preflight.md "Budget")."""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Sampler

from imagenet_ddp.data.reader import create_dataset
from imagenet_ddp.io import atomic_path, write_json_atomic
from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.jobs.signals import stop_signals_blocked
from imagenet_ddp.jobs.spec import PreflightJob, read_spec, staged_copy, staging_reports
from imagenet_ddp.preflight.report import build_report, collective_figures, table
from imagenet_ddp.settings.kinds import TrainConfig
from imagenet_ddp.settings.node_memory import PREFETCH_BATCHES
from imagenet_ddp.training import recipe
from imagenet_ddp.training.accuracy import evaluate_loader, shard_loader
from imagenet_ddp.training.checkpoint import cpu_copy, job_state
from imagenet_ddp.training.data import (
    EpochSampler,
    SeededAugmentation,
    read_ids,
    shutdown_loader_workers,
    train_loader,
)
from imagenet_ddp.training.loop import train_step
from imagenet_ddp.training.metrics import synchronize
from imagenet_ddp.training.worker import build_job, rank_threads, seed_everything

# The first warm-up step holds torch.compile; "timed" steps with DDP, then as many without
# its all-reduce (a rank's own speed).
MODEL_STEPS = {"warmup": 3, "timed": 10}
# The loader in rounds of one batch per worker. iter() hands each worker PREFETCH_BATCHES batches
# at once, and a rank that is busy while they start (a loaded node, CUDA's start) finds them all
# decoded: the warm-up is the slowest worker's first batch and the rounds those queues hold,
# and the timing twice the queues (a stall just before it reads at most 2x, not from the queues
# alone: 2.4x the workers' true rate was read after 1 round warm-up and 4 timed).
LOADER_ROUNDS = {"warmup": 1 + PREFETCH_BATCHES, "timed": 2 * PREFETCH_BATCHES}
ALLREDUCE_OPS = {"warmup": 2, "timed": 5}
EVAL_BATCHES = 8  # per rank: the holdout sample each evaluation pass reads
SIZE_FACTORS = (1 / 16, 1 / 4, 1, 2)  # all-reduce sizes around the run's gradient size


def placement(cfg: TrainConfig, info: D.DistInfo, device: torch.device) -> dict:
    """Where this rank runs and which GPU it uses, or would (fake GPUs: the one
    distributed.select_device chose, as training would)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    record = {
        "rank": info.rank, "local_rank": info.local_rank, "host": info.host,
        **{k.lower(): os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID")},
        "visible": visible, "device": str(device), "gpu": None, "gpu_name": None,
        "gpu_memory_gb": None, "node_cpus": os.cpu_count(),
    }  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.update(gpu=str(props.uuid), gpu_name=props.name,
                      gpu_memory_gb=props.total_memory / 1e9)  # fmt: skip
    elif (cfg.gpus_per_node or 0) > 0:
        ids = visible or [str(i) for i in range(cfg.gpus_per_node)]
        if D.WOULD_SELECT:  # fake GPUs: select_device's choice
            index = int(D.WOULD_SELECT[0].split(":")[1])
        else:  # a CPU rehearsal (device: cpu) chose none: its place among the node's ranks,
            # wrapped where they outnumber the GPUs, so placement_problems names the sharing
            index = info.local_rank % len(ids)
        record["gpu"] = ids[index]
    return record


def _step_seconds(job, images, targets, steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps, the device synchronized after each."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        train_step(job, [(images, targets)] * job.cfg.accumulation, 0)
        synchronize(job.device)
        times.append(time.perf_counter() - started)
    return times


def _without_allreduce(job):
    """DDP's no_sync(): without the all-reduce, which makes every rank wait for the slowest."""
    ddp = getattr(job.step_model, "_orig_mod", job.step_model)  # under torch.compile
    return ddp.no_sync() if isinstance(ddp, DistributedDataParallel) else contextlib.nullcontext()


def model_step(job, cfg: TrainConfig, num_classes: int) -> dict:
    """img/s (medians) of the run's step on a fixed random batch, with and without DDP's
    all-reduce; torch.compile's time is the first step's excess over a steady one."""
    g = torch.Generator().manual_seed(cfg.seed)
    crop = cfg.crop_for_epoch(0)
    images = torch.randn(cfg.batch_size, 3, crop, crop, generator=g).to(job.device)
    targets = torch.randint(0, num_classes, (cfg.batch_size,), generator=g).to(job.device)
    job.step_model.train()
    first = _step_seconds(job, images, targets, MODEL_STEPS["warmup"])[0]
    D.barrier()
    step = statistics.median(_step_seconds(job, images, targets, MODEL_STEPS["timed"]))
    with _without_allreduce(job):
        compute = statistics.median(_step_seconds(job, images, targets, MODEL_STEPS["timed"]))
    per_step = cfg.batch_size * cfg.accumulation  # a rank's images per optimizer step
    cuda = job.device.type == "cuda"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    peak = torch.cuda.max_memory_allocated(job.device) if cuda else rss  # CPU: peak RSS
    return {
        "model_images_per_s": per_step / step,
        "compute_images_per_s": per_step / compute,
        "compile_seconds": max(0.0, first - step) if cfg.compile else 0.0,
        "peak_memory_gb": peak / 1e9,
        "peak_memory_kind": "device" if cuda else "host RSS",
    }


def _time_allreduce(numel: int, group, device: torch.device) -> float:
    """Seconds per all-reduce of ``numel`` fp32 values on ``group``, after warm-up."""
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    for _ in range(ALLREDUCE_OPS["warmup"]):
        dist.all_reduce(tensor, group=group)
    synchronize(device)
    dist.barrier(group=group)
    started = time.perf_counter()
    for _ in range(ALLREDUCE_OPS["timed"]):
        dist.all_reduce(tensor, group=group)
    synchronize(device)
    return (time.perf_counter() - started) / ALLREDUCE_OPS["timed"]


def collectives(gradient_bytes: int, device: torch.device, hosts: list[str], rank: int) -> dict:
    """This rank's seconds per all-reduce per scope (``world``; ``intra_node`` with several
    multi-rank nodes) and size in bytes."""
    sizes = sorted({max(4, int(gradient_bytes * f)) // 4 * 4 for f in SIZE_FACTORS})
    if len(hosts) == 1:
        return {"world": {str(n): 0.0 for n in sizes}}  # one rank: nothing to reduce
    scopes = {"world": None}
    nodes = sorted(set(hosts), key=hosts.index)
    if 1 < len(nodes) < len(hosts):
        for host in nodes:  # every rank creates every group, in the same order
            group = dist.new_group([r for r, h in enumerate(hosts) if h == host])
            if hosts[rank] == host:
                scopes["intra_node"] = group
    return {
        scope: {str(n): _time_allreduce(n // 4, group, device) for n in sizes}
        for scope, group in scopes.items()
    }


class _Epochs(Sampler):
    """``epochs`` epochs of ``sampler`` in one iter() of the loader (one pass of DaliLoader's,
    which sets its first epoch as training sets its sampler's): no epoch boundary (where
    workers run out of work, or DALI's pipeline resets) falls in the timing."""

    def __init__(self, sampler: EpochSampler, epochs: int):
        self.sampler, self.epochs = sampler, epochs
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip_steps: int = 0) -> None:
        self.epoch, self.skip = epoch, skip_steps

    def __iter__(self):
        for epoch in range(self.epoch, self.epoch + self.epochs):
            self.sampler.set_epoch(epoch)
            yield from self.sampler

    def __len__(self) -> int:
        return self.epochs * len(self.sampler)


def loader_batches(workers: int) -> dict[str, int]:
    """Batches of the loader's warm-up and of its timing: whole rounds of the workers."""
    per_round = max(1, workers)
    return {key: rounds * per_round for key, rounds in LOADER_ROUNDS.items()}


def preflight_loader(dataset, info: D.DistInfo, cfg, workers: int, device, endless=False):
    """The run's loader (data.train_loader: its DataLoader, or DaliLoader for ``loader: dali``)
    over as many epochs of this rank's share as the timing takes (``endless``: as many as a
    timing by duration takes; the sampler is lazy)."""
    batch_size = cfg.batch_size
    sampler = EpochSampler(len(dataset), info.world_size, info.rank, cfg.seed, batch_size)
    if len(sampler) < batch_size:
        raise ValueError(
            f"batch_size {batch_size} x {info.world_size} ranks exceeds the {len(dataset)} "
            "sampled training images; lower batch_size"
        )
    needed = sum(loader_batches(workers).values()) * batch_size
    epochs = 10**6 if endless else -(-needed // (len(sampler) // batch_size * batch_size))
    return train_loader(dataset, _Epochs(sampler, epochs), batch_size, workers,
                        pin=device.type == "cuda", cfg=cfg, device=device)  # fmt: skip


def steady_loader_rate(loader, workers: int, batch_size: int, device, min_seconds=0.0) -> dict:
    """img/s of ``loader`` once its pipeline is full (:data:`LOADER_ROUNDS`), each batch copied
    to ``device``; the start-up apart. ``min_seconds``: whole rounds of the workers more until
    the timing lasts that long (a benchmark's window; a few rounds read noisy at 8+ workers)."""
    counts = loader_batches(workers)
    per_round = max(1, workers)
    started = time.perf_counter()
    with stop_signals_blocked():  # workers are forked here; see imagenet_ddp.jobs.signals
        batches = iter(loader)
    for _ in range(counts["warmup"]):
        next(batches)
    startup = time.perf_counter() - started
    started, timed = time.perf_counter(), 0
    while timed < counts["timed"] or time.perf_counter() - started < min_seconds:
        for _ in range(per_round):
            images, _ = next(batches)
            images = images.to(device, non_blocking=True)
        timed += per_round
        if timed >= counts["timed"]:
            synchronize(device)
    seconds = time.perf_counter() - started
    del batches
    shutdown_loader_workers(loader)
    return {
        "loader_images_per_s": timed * batch_size / seconds,
        "loader_startup_seconds": startup,
        "loader_timed_seconds": seconds,
        "workers": workers,
    }


def eval_rate(cfg: TrainConfig, job, holdout, info: D.DistInfo, workers: int, device) -> dict:
    """img/s of this rank's holdout evaluation as training runs it: a persistent loader, a
    first pass to start its workers, then a pass timed, pipeline fill included (every
    evaluation refills it)."""
    loader = shard_loader(
        holdout,
        device=device,
        batch_size=cfg.batch_size,
        workers=workers,
        rank=info.rank,
        world_size=info.world_size,
        persistent=True,
        cfg=cfg,  # loader: dali evaluates through DALI: time that
    )
    settings = {
        "num_classes": holdout.num_classes,
        "device": device,
        "precision": cfg.precision,
        "channels_last": cfg.channels_last,
        "mean_std": recipe.mean_std(cfg),
    }
    try:
        evaluate_loader(job.model, loader, **settings)
        started = time.perf_counter()
        result = evaluate_loader(job.model, loader, **settings)  # ends with a collective
        seconds = time.perf_counter() - started
    finally:
        shutdown_loader_workers(loader)
    return {"eval_images_per_s": result["samples"] / info.world_size / seconds}


def checkpoint_cost(job, directory: Path) -> dict:
    """Rank 0: how long a checkpoint holds it (RNG gather, CPU copy) and how long the
    background write takes into ``directory`` (the checkpoints' filesystem). Collective."""
    began = time.perf_counter()
    state = job_state(job, 0, 0, None)
    if not job.info.is_main:
        return {}
    snapshot = cpu_copy(state)
    hold = time.perf_counter() - began
    directory.mkdir(parents=True, exist_ok=True)
    # Not named checkpoint-*: nothing may take it for one (attempts reads their times).
    probe = Path(tempfile.mkdtemp(prefix=".preflight-write-rate-", dir=directory))
    try:
        began = time.perf_counter()
        with atomic_path(probe / "write-rate.pt") as tmp:  # as save_checkpoint writes
            torch.save(snapshot, tmp)
        write = time.perf_counter() - began
        size = (probe / "write-rate.pt").stat().st_size
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return {
        "checkpoint_hold_seconds": hold,
        "checkpoint_write_seconds": write,
        "checkpoint_mb": size / 1e6,
        "checkpoint_write_mb_per_s": size / 1e6 / write,
    }


def loader_rate(
    cfg: TrainConfig, base, info: D.DistInfo, workers: int, device, min_seconds=0.0
) -> dict:
    """img/s of this rank's loader with the run's augmentation and workers: training's own
    dataset, transform (uint8 crops), sampler and ``loader`` (DALI's pipeline for ``dali``;
    benchmarks/bench_gpu.py times this too)."""
    dataset = SeededAugmentation.of_run(base, cfg)
    try:
        loader = preflight_loader(dataset, info, cfg, workers, device, endless=min_seconds > 0)
    except ValueError as error:
        raise ValueError(f"run {cfg.run!r}: {error}") from None
    return steady_loader_rate(loader, workers, cfg.batch_size, device, min_seconds)


def seeded_sample(ids: list[int], wanted: int, seed: int) -> list[int]:
    """``wanted`` of ``ids`` drawn with ``seed``, in order (all of them when fewer)."""
    if wanted >= len(ids):
        return list(ids)
    return sorted(np.random.default_rng(seed).choice(ids, size=wanted, replace=False).tolist())


def measure(spec: PreflightJob, cfg: TrainConfig, info: D.DistInfo, device: torch.device) -> dict:
    """Every figure of this rank; the sizes of the run's data for the projection."""
    seed_everything(cfg.seed)
    geometry = D.resolve_geometry(cfg, info, device)
    record_threads = rank_threads(geometry)  # training's: its step is timed at its threads
    paths = spec.paths
    split = paths.split_dir
    train_ids = read_ids(split / "train.csv")
    batches = sum(loader_batches(geometry.workers).values()) + 1  # per rank
    wanted = info.world_size * cfg.batch_size * batches
    copy = staged_copy(paths.run_dir, info.host)
    base = create_dataset(copy, seeded_sample(train_ids, wanted, cfg.seed), train=True)
    record = {**placement(cfg, info, device), "intra_op_threads": record_threads}
    hosts = [r["host"] for r in D.all_gather_objects({"host": info.host})]
    steps_per_epoch = max(1, len(train_ids) // info.world_size // cfg.batch_size)
    job = build_job(cfg, info, device, geometry, base.num_classes, steps_per_epoch)
    gradient_bytes = sum(
        p.numel() * p.element_size() for p in job.model.parameters() if p.requires_grad
    )
    record["allreduce_seconds"] = collectives(gradient_bytes, device, hosts, info.rank)
    record.update(model_step(job, cfg, base.num_classes))
    record.update(loader_rate(cfg, base, info, geometry.workers, device))
    holdout_ids = read_ids(split / "holdout.csv")
    holdout = create_dataset(
        copy,
        seeded_sample(holdout_ids, info.world_size * cfg.batch_size * EVAL_BATCHES, cfg.seed),
        eval_size=(cfg.eval_resize, cfg.eval_crop),
        interpolation=cfg.interpolation,
    )
    record.update(eval_rate(cfg, job, holdout, info, geometry.workers, device))
    record.update(checkpoint_cost(job, paths.checkpoint_root))
    sizes = {"train": len(train_ids), "holdout": len(holdout_ids)}
    return {"record": record, "gradient_bytes": gradient_bytes, "sizes": sizes}


def run(job: PreflightJob) -> int:
    cfg = TrainConfig.from_dict(job.run)
    info = D.dist_info_from_env()
    device = D.select_device(
        cfg.device, info.local_rank, cfg.gpus_per_node, info.local_world_size, cfg.timeout_minutes
    )
    D.init_process_group(info, device, cfg.backend, cfg.timeout_minutes)
    try:
        mine = measure(job, cfg, info, device)
        ranks = D.all_gather_objects(mine["record"])
        if info.is_main:
            run_settings = {**job.run, "name": job.name, "loader": cfg.loader}
            limits = {"train_runtime_minutes": job.train_runtime_minutes,
                      "max_allocations": job.run["max_allocations"]}  # fmt: skip
            report = build_report(
                run_settings, ranks, collective_figures(ranks, mine["gradient_bytes"]),
                staging_reports(job.paths.run_dir), mine["sizes"], limits,
            )  # fmt: skip
            report["budget"] = {
                "model_steps": MODEL_STEPS, "loader_rounds": LOADER_ROUNDS,
                "allreduce_ops": ALLREDUCE_OPS, "size_factors": list(SIZE_FACTORS),
                "eval_batches": EVAL_BATCHES,
            }  # fmt: skip
            write_json_atomic(job.paths.out, report)
            print(table(report), flush=True)
        D.barrier()
    finally:
        D.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="preflight rank (one per device)")
    parser.add_argument("--spec", type=Path, required=True, help="the preflight's job spec")
    args = parser.parse_args(argv)
    return run(read_spec(args.spec, "preflight"))


if __name__ == "__main__":
    sys.exit(main())
