"""Training checkpoints: where they live, atomic writes, finding the newest that loads.

A run's checkpoints live in ``<root>/<settings fingerprint>-<geometry>/``, outside the rule's
outputs, so Snakemake's cleanup of a failed attempt keeps them and the next attempt resumes.
Both parts of the name matter:

- the fingerprint hashes every setting that changes the weights: a changed ``lr`` never resumes
  a stale run;
- the geometry (nodes, ranks per node, CPUs per rank, GPUs per node, loader workers) is part of
  the key because every figure of a run is measured under the geometry its row states. A run
  resumed under another world size would also change the batch order and the LR schedule's
  steps per epoch. Such a resume is refused with one line and the run starts fresh
  (:func:`other_geometries`).

What a checkpoint holds and how a job resumes from it: :func:`save_job`, :func:`resume_job`.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imagenet_ddp import distributed as D
from imagenet_ddp.io import atomic_path
from imagenet_ddp.training.state import TrainingState


def checkpoint_dir(root: Path, fingerprint: str, geometry_tag: str) -> Path:
    return root / f"{fingerprint}-{geometry_tag}"


def other_geometries(root: Path, fingerprint: str, geometry_tag: str) -> list[Path]:
    """Checkpoint directories of the same settings written under another geometry."""
    if not root.is_dir():
        return []
    mine = checkpoint_dir(root, fingerprint, geometry_tag)
    return sorted(
        d
        for d in root.glob(f"{fingerprint}-*")
        if d != mine and d.is_dir() and any(d.glob("checkpoint-*.pt"))
    )


def checkpoint_name(epoch: int, step: int) -> str:
    return f"checkpoint-e{epoch:04d}-s{step:07d}.pt"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, quota); the older ones are intact."""


def save_checkpoint(directory: Path, state: dict[str, Any], keep: int) -> Path:
    """Write atomically (a temporary sibling renamed into place), then prune the oldest: a
    failed write (full disk, quota) leaves every earlier checkpoint as it was, and ends the
    job with one line saying so."""
    path = directory / checkpoint_name(state["epoch"], state["step_in_epoch"])
    try:
        with atomic_path(path) as tmp:
            torch.save(state, tmp)
    except OSError as error:
        kept = sorted(directory.glob("checkpoint-*.pt"))
        raise CheckpointWriteError(
            error.errno,
            f"checkpoint {path} not written ({error.strerror or error}); "
            f"{'the newest, ' + kept[-1].name + ', is intact' if kept else 'no earlier one'}"
            f"; free space or quota in {directory} and rerun to resume",
        ) from error
    for old in sorted(directory.glob("checkpoint-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_latest_checkpoint(directory: Path) -> dict[str, Any] | None:
    """Newest checkpoint that loads; a torn or corrupt file is reported and skipped."""
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("checkpoint-*.pt"), reverse=True):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            state["path"] = str(path)
            return state
        except Exception as exc:  # noqa: BLE001 - any unreadable file is skipped, not fatal
            print(f"warning: ignoring unreadable checkpoint {path}: {exc}", file=sys.stderr)
    return None


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generators (CPU, this rank's GPU, numpy, Python)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


# --------------------------------------------------------------------------- a job's state


def job_state(job: TrainingState, epoch: int, step: int, partial: list | None) -> dict[str, Any]:
    """Everything a resumed job needs. Collective (every rank's RNG state is gathered)."""
    return {
        "model": job.model.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scheduler": job.scheduler.state_dict(),
        "scaler": job.scaler.state_dict(),
        "ema": None if job.ema is None else job.ema.state_dict(),
        "epoch": epoch,
        "step_in_epoch": step,
        "partial_epoch": partial,
        "history": job.history,
        "config": dataclasses.asdict(job.cfg),
        "geometry": dataclasses.asdict(job.geometry),
        "world_size": job.info.world_size,
        "rng": D.all_gather_objects(rng_state(job.device)),
    }


def save_job(job: TrainingState, epoch: int, step: int, partial: list | None = None) -> Path | None:
    """Checkpoint the job at (epoch, step); collective, rank 0 writes. Returns the path."""
    state = job_state(job, epoch, step, partial)
    path = None
    if job.info.is_main:
        path = save_checkpoint(job.checkpoint_dir, state, job.cfg.keep_checkpoints)
    D.barrier()
    return path


@dataclass(frozen=True)
class ResumePoint:
    """Where a rank's training starts: an epoch and a step in it, the resumed epoch's counts
    so far (per rank; None: none) and the checkpoint it came from (None: a fresh start)."""

    epoch: int = 0
    step: int = 0
    partial: list | None = None
    path: str | None = None


def resume_job(job: TrainingState) -> ResumePoint:
    """Load the newest checkpoint of this run and geometry into ``job``: where it resumes."""
    state = load_latest_checkpoint(job.checkpoint_dir)
    if state is None:
        root, tag = job.checkpoint_dir.parent, job.geometry.tag
        others = other_geometries(root, job.cfg.fingerprint(), tag)
        if others and job.info.is_main:
            print(
                f"not resuming {others[-1]}: written under another geometry "
                f"({others[-1].name.split('-', 1)[1]}), this job is {job.geometry.tag}; the "
                "batch order, LR schedule and measured figures would mix; starting fresh",
                flush=True,
            )
        return ResumePoint()
    job.model.load_state_dict(state["model"])
    job.optimizer.load_state_dict(state["optimizer"])
    job.scheduler.load_state_dict(state["scheduler"])
    job.scaler.load_state_dict(state["scaler"])
    if job.ema is not None:
        job.ema.load_state_dict(state["ema"])
    job.history = state["history"]
    restore_rng_state(state["rng"][job.info.rank], job.device)
    if job.info.is_main:
        print(
            f"resuming from {state['path']} (epoch {state['epoch']}, step "
            f"{state['step_in_epoch']})",
            flush=True,
        )
    return ResumePoint(
        state["epoch"], state["step_in_epoch"], state["partial_epoch"], state["path"]
    )
