"""DDP training worker: one process per device, launched by the launcher (local or srun).

It builds the rank's data, model and checkpoint state, runs :func:`.loop.run_epochs` and
writes the run's outputs. Why the results are exact: :mod:`.data` (seeded augmentation, a
sampler that resumes mid-epoch on any rank count), :mod:`.checkpoint` (keyed by the settings
and global batch), :mod:`.loop` (every rank stops at the same step).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

# First, before torch: a stop signal while torch loads is held, not fatal (early_signals).
import imagenet_ddp.jobs.early_signals  # noqa: F401

# isort: split
import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from imagenet_ddp import models, optimizers
from imagenet_ddp.data.reader import create_dataset
from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.jobs.attempts import (
    RankProgress,
    cost_over_attempts,
    has_record,
    record_divergence,
    record_error,
    run_keys,
)
from imagenet_ddp.jobs.signals import StopFlag, ignore_stop_signals
from imagenet_ddp.monitoring.cost import over_attempts
from imagenet_ddp.monitoring.monitor import RunMonitor
from imagenet_ddp.settings.geometry import Geometry, global_batch
from imagenet_ddp.settings.kinds import TrainConfig
from imagenet_ddp.training import recipe
from imagenet_ddp.training.accuracy import shard_loader
from imagenet_ddp.training.checkpoint import (
    agreed_checkpoint,
    checkpoint_dir,
    checkpoint_tag,
    load_latest_checkpoint,
    loader_named,
    resume_job,
)
from imagenet_ddp.training.data import (
    EpochSampler,
    RepeatedAugmentationSampler,
    SeededAugmentation,
    read_ids,
    shutdown_loader_workers,
    train_loader,
)
from imagenet_ddp.training.discipline import check_device_discipline
from imagenet_ddp.training.guard import DIVERGED, Guard, GuardSettings
from imagenet_ddp.training.loop import Holdout, Loop, run_epochs
from imagenet_ddp.training.metrics import recorded_settings, write_run_metrics
from imagenet_ddp.training.model import save_model
from imagenet_ddp.training.profile_window import ProfileWindow
from imagenet_ddp.training.state import TrainingState

SIGNAL_CHECK_STEPS = 2  # ranks agree on a pending stop signal every this many steps


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: TrainConfig, paths, train_data: Path, stop_after_steps=None, attempt_key=None,
          stop_epoch=None):  # fmt: skip
    """Run training in this process (one rank); the process exit code. ``paths``: the job
    spec's (imagenet_ddp.jobs.spec.TrainPaths). ``attempt_key``: the run's key in the attempt
    record (imagenet_ddp.jobs.attempts), whose allocations the cost block sums; None: this
    job's cost alone. ``stop_epoch``: a rung's (jobs.spec.TrainJob), None: the run's end."""
    if cfg.deterministic:  # cuBLAS reads it when its first handle is created
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    stop = StopFlag(SIGNAL_CHECK_STEPS, checkpoint_seconds=cfg.checkpoint_interval_minutes * 60)
    stop.catch()  # a signal while the process group starts stops at the first step
    info = D.dist_info_from_env()
    device = D.select_device(
        cfg.device, info.local_rank, cfg.gpus_per_node, info.local_world_size, cfg.timeout_minutes
    )
    D.init_process_group(info, device, cfg.backend, cfg.timeout_minutes)
    stop.install()
    try:
        stops = (stop_after_steps, stop_epoch)
        return _train(cfg, info, device, stop, paths, train_data, stops, attempt_key)
    finally:
        stop.settle()
        D.destroy_process_group()


def _set_determinism(cfg: TrainConfig, device: torch.device) -> None:
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        if device.type == "cpu" and cfg.precision != "fp32":
            # oneDNN's bf16 CPU kernels differ between processes, beyond torch's deterministic
            # mode; without it resumes are bitwise exact, much slower (measured, ResNet-18,
            # 16 px, batch 4, 1 thread: 50 ms/step with oneDNN, 830 without). GPUs: unaffected.
            torch.backends.mkldnn.enabled = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    seed_everything(cfg.seed)


def rank_threads(geometry: Geometry) -> int:
    """Lower the rank's intra-op threads to its task's CPUs less its loader workers (each
    runs one: torch sets it in a DataLoader worker; DALI's threads likewise), at least one.
    The launcher exports the task's CPUs as every thread count; a CPU rank that ran that many
    beside its workers would oversubscribe its cores, and its threads wait at each parallel
    region for one the scheduler has put aside (measured: benchmarks/README.md "Train
    step"). Never raised above what the environment set."""
    threads = max(1, geometry.cpus_per_task - geometry.workers)
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _train(cfg, info, device, stop, paths, train_data, stops, attempt_key) -> int:
    split_dir, out_dir, checkpoint_root = paths.split_dir, paths.run_dir, paths.checkpoint_root
    _set_determinism(cfg, device)
    geometry = D.resolve_geometry(cfg, info, device)
    rank_threads(geometry)
    # decode=False: the transform decodes, after drawing its crop box (imagenet_ddp.data.jpeg)
    base = create_dataset(train_data, read_ids(split_dir / "train.csv"), train=True)
    holdout = _holdout(cfg, info, device, geometry, train_data, split_dir)
    sampler, loader = _train_loader(cfg, info, device, geometry, base)
    ckpt_dir = checkpoint_dir(checkpoint_root, cfg.fingerprint(), checkpoint_tag(cfg, geometry))
    # The checkpoint first: a fresh start alone reads the init_weights file, into the model
    # before EMA copies it and DDP wraps it; a resume never does (it may be gone by then).
    state = agreed_checkpoint(
        ckpt_dir, loader_named(checkpoint_root, cfg.fingerprint(), cfg, geometry)
    )
    init = initial_weights(cfg) if state is None else None
    job = build_job(cfg, info, device, geometry, base.num_classes, sampler.steps, init_weights=init)
    del init
    job.checkpoint_dir = ckpt_dir
    if attempt_key is not None:  # launched by the launcher, which names a hung rank at the end
        job.progress = RankProgress(checkpoint_root, info.rank, info.host)
    resume = resume_job(job, state)
    del state
    check_device_discipline(job, "after setup")
    # Rank 0: TensorBoard events, the NVML sampler thread, the wall clock of the cost block.
    monitor = RunMonitor.for_job(job, out_dir, sampler.steps, resumed=resume.path is not None)
    profile = ProfileWindow(cfg.profile, info, out_dir / "tensorboard")  # opt-in traces
    try:
        loop = Loop(loader, sampler, holdout, stop, monitor, profile, *stops)
        code = run_epochs(job, loop, resume)
    finally:
        monitor.close()  # idempotent; finish() below already closed it on success
        shutdown_loader_workers(loader)
        shutdown_loader_workers(holdout.loader)
        if job.checkpoint_writer is not None:  # run_epochs settled it, unless it raised
            job.checkpoint_writer.wait()
    if code not in (0, DIVERGED):
        return code
    ranks = D.all_gather_objects(D.placement(info, device))
    if info.is_main:
        cost = monitor.finish(job.history)  # the cost block of train_metrics.json
        if attempt_key is not None:  # every allocation of the run, this one up to now
            attempts = cost_over_attempts(checkpoint_root, attempt_key, time.time())
            cost = over_attempts(cost, attempts)
        write_outputs(job, out_dir, base.num_classes, ranks, resume.path, cost)
        if job.diverged is not None:  # the launcher records the attempt `diverged`
            record_divergence(checkpoint_root, job.diverged.line(cfg.run))
    D.barrier()
    return 0


def write_outputs(job, out_dir: Path, num_classes: int, ranks, resumed_from, cost) -> None:
    """Rank 0: model.pt, history.csv and train_metrics.json; a diverged run's marked, with
    the weights of its last good checkpoint."""
    diverged = None if job.diverged is None else job.diverged.record()
    out_dir.mkdir(parents=True, exist_ok=True)
    if diverged is not None:
        last_good_weights(job)
    extra = {} if job.ema is None else {"ema": job.ema.module.state_dict()}
    save_model(
        out_dir / "model.pt", job.model, arch=job.cfg.model, num_classes=num_classes,
        config=recorded_settings(job), extra=extra | ({"diverged": diverged} if diverged else {}),
    )  # fmt: skip
    write_run_metrics(job, out_dir, ranks, resumed_from=resumed_from, cost=cost, diverged=diverged)


def last_good_weights(job) -> None:
    """Rank 0, a diverged run: its model (and EMA) back to the newest checkpoint, every one of
    which the guard let through before the bad step; the job's own start without one."""
    state = load_latest_checkpoint(job.checkpoint_dir)
    if state is None:
        print("no checkpoint before the divergence: model.pt holds the weights at the stop")
        return
    job.model.load_state_dict(state["model"])
    if job.ema is not None and state.get("ema") is not None:
        job.ema.load_state_dict(state["ema"])
    print(f"model.pt: the weights of {state['path']}, the last good checkpoint", flush=True)


def _holdout(cfg, info, device, geometry, train_data, split_dir) -> Holdout:
    """This rank's share of the holdout, made once: its loader's workers (forked at the first
    evaluation) serve every evaluation."""
    data = create_dataset(
        train_data, read_ids(split_dir / "holdout.csv"), eval_size=(cfg.eval_resize, cfg.eval_crop),
        interpolation=cfg.interpolation,
    )  # fmt: skip
    loader = shard_loader(
        data, device=device, batch_size=cfg.batch_size, workers=geometry.workers, rank=info.rank,
        world_size=info.world_size, persistent=True, cfg=cfg,
    )  # fmt: skip
    return Holdout(data.num_classes, loader)


def _train_loader(cfg, info, device, geometry, base):
    """The seeded, resumable sampler over ``base`` and its DataLoader; a global batch larger
    than the training set is refused."""
    dataset = SeededAugmentation.of_run(base, cfg)
    shape = (len(dataset), info.world_size, info.rank, cfg.seed, cfg.batch_size, cfg.accumulation)
    if cfg.repeated_augmentation > 1:
        sampler = RepeatedAugmentationSampler(*shape, repeats=cfg.repeated_augmentation)
    else:
        sampler = EpochSampler(*shape)
    if sampler.steps == 0:
        raise ValueError(
            f"run {cfg.run!r}: the global batch, batch_size {cfg.batch_size} x "
            f"{info.world_size} ranks x accumulation {cfg.accumulation}, exceeds the "
            f"{len(dataset)} training samples; lower batch_size or accumulation"
        )
    loader = train_loader(
        dataset, sampler, cfg.batch_size, geometry.workers, pin=device.type == "cuda", cfg=cfg,
        device=device,
    )  # fmt: skip
    return sampler, loader


def initial_weights(cfg: TrainConfig) -> dict | None:
    """The run's ``init_weights`` state_dict (None: no file), read by every rank, each
    checking the digest of the bytes it read against the dry-run's (a file replaced since, or
    seen otherwise by one node's cache, is refused). Collective: one rank's failure raises on
    every rank, none waits for the others."""
    if not cfg.init_weights:
        return None
    state, error = None, None
    if not os.path.isfile(cfg.init_weights):  # a scratch purge: only a fresh start needs it
        error = (
            f"run {cfg.run!r}: init_weights {cfg.init_weights} not found on "
            f"{socket.gethostname()}, and this run has no checkpoint of its settings to "
            "resume: put the file back, or remove init_weights to start from random weights"
        )
    elif not cfg.init_weights_sha256:  # the workflow fills it; a spec written by hand must too
        error = (
            f"run {cfg.run!r}: init_weights {cfg.init_weights} without init_weights_sha256 "
            "(the workflow's dry-run fills it in); set it to the file's SHA-256"
        )
    else:
        try:
            state = models.read_init_weights(cfg.init_weights, cfg.init_weights_sha256)
        except models.WeightsFileError as exc:
            error = f"init_weights {exc}"
        except OSError as exc:
            error = f"init_weights {cfg.init_weights}: cannot be read ({exc.strerror or exc})"
    failed = [(rank, e) for rank, e in enumerate(D.all_gather_objects(error)) if e]
    if failed:
        rank, e = failed[0]
        raise models.WeightsFileError(f"rank {rank} (of {len(failed)} failing): {e}")
    return state


def initial_model(cfg: TrainConfig, info: D.DistInfo, num_classes: int, init_weights):
    """The run's model, from ``init_weights`` (a state_dict, :func:`initial_weights`) or random
    initialisation; loaded weights win over zero_init_residual, which keeps only the keys
    under init_weights_exclude (imagenet_ddp.models)."""
    model = models.build_model(
        cfg.model, num_classes, cfg.model_kwargs, zero_init_residual=cfg.zero_init_residual
    )
    if init_weights is not None:
        where = f"init_weights {cfg.init_weights}"
        kept = models.load_init_weights(model, init_weights, cfg.init_weights_exclude, where)
        if info.is_main:
            print(
                f"{where}: started from its {len(init_weights)} tensors (sha256 "
                f"{cfg.init_weights_sha256[:16]}...); at initialisation: "
                f"{len(kept)} tensors {kept[:4]}{' ...' if len(kept) > 4 else ''}",
                flush=True,
            )
    if cfg.sync_bn and D.is_distributed():
        model = models.convert_sync_batchnorm(cfg.model, model)
    return model


def build_job(
    cfg: TrainConfig,
    info: D.DistInfo,
    device: torch.device,
    geometry: Geometry,
    num_classes: int,
    steps_per_epoch: int,
    *,
    init_weights: dict | None = None,
) -> TrainingState:
    """The model, its DDP wrapper and the recipe's optimizer, schedule, loss, EMA, mixing and
    the divergence guard."""
    model = initial_model(cfg, info, num_classes, init_weights).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = optimizers.create_optimizer(cfg, model, global_batch(vars(cfg), info.world_size))
    ema = recipe.build_ema(cfg, model, info.world_size, device)  # a copy, before DDP's hooks
    step_model = model
    if D.is_distributed():
        step_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if cfg.compile:
        # dynamic=False: a new crop size (progressive resizing) compiles a new static graph;
        # by default the second size would recompile with dynamic shapes (slower kernels).
        step_model = torch.compile(step_model, dynamic=False)
    warmup = recipe.warmup_steps(cfg, steps_per_epoch)
    return TrainingState(
        cfg=cfg,
        info=info,
        device=device,
        geometry=geometry,
        model=model,
        step_model=step_model,
        optimizer=optimizer,
        scheduler=LambdaLR(optimizer, recipe.lr_lambda(steps_per_epoch, cfg)),
        scaler=torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16"),
        criterion=recipe.build_criterion(cfg),
        checkpoint_dir=Path(),
        guard=Guard(GuardSettings.of(cfg, num_classes, warmup), device, info.rank),
        ema=ema,
        mixer=recipe.batch_mixer(cfg, num_classes),
    )


def main(argv: list[str] | None = None) -> int:
    """One rank of a training job: all it needs is in the job spec (imagenet_ddp.jobs.spec)."""
    from imagenet_ddp.jobs.spec import read_spec, staged_copy

    parser = argparse.ArgumentParser(description="DDP training worker (one per device)")
    parser.add_argument("--spec", type=Path, required=True, help="the job spec file")
    parser.add_argument("--train-data", type=Path, help="prepared train dir (default: the "
                        "copy this host staged for the run)")  # fmt: skip
    parser.add_argument("--stop-after-steps", type=int, help="testing: behave as if signalled "
                        "after this many steps")  # fmt: skip
    args = parser.parse_args(argv)
    # `kill -USR2 <pid>` (or `scancel --signal=USR2 <job>`) prints every thread's traceback:
    # where a rank of a job that seems stuck is waiting, without stopping it.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    job = read_spec(args.spec, "train")
    paths, info = job.paths, D.dist_info_from_env()
    try:
        train_data = args.train_data or staged_copy(paths.run_dir, info.host)
        # the launcher keeps the record; a rank started by hand (tests) has none
        key = run_keys(job.run) if has_record(paths.checkpoint_root) else None
        cfg = TrainConfig.from_dict(job.run)
        return train(cfg, paths, train_data, args.stop_after_steps, key, job.stop_epoch)
    except Exception as error:  # the attempt record names it; a retry repeats it (attempts)
        record_error(paths.checkpoint_root, info.rank, info.host, error)
        raise
    finally:
        # Done: a stop signal from now on must not turn the exit code into "killed by signal".
        # srun's --kill-on-bad-exit sends SIGTERM to the other ranks as soon as one exits 75
        # (seen: rank 0 "Terminated" after writing the checkpoint, its job recorded failed),
        # and Python restores the default handlers while it shuts down; ignored ones it keeps.
        ignore_stop_signals()


if __name__ == "__main__":
    sys.exit(main())
