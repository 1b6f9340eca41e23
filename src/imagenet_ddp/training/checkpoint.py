"""Training checkpoints: where they live, atomic writes, finding the newest that loads.

``<root>/<settings fingerprint>-<tag>/`` lies outside the rule's outputs, so Snakemake's cleanup
keeps it for the next attempt. The fingerprint hashes every setting that changes the weights;
the tag (settings.geometry.checkpoint_tag) the global batch, sample order and CPU or GPU, not
the rank count nor the loader's CPUs and workers, so a run resumes on another rank count with
the same global batch (an elastic resume) and after a loader change. Directories an earlier
version also named by the loader (``-c16-g8-w15``) are resumed too (:func:`loader_named`).
Rank 0 writes in the background and alone chooses the checkpoint to resume
(:func:`agreed_checkpoint`). Tensors and plain data only (``weights_only=True``): a file that
needs another class could run code and is refused (:class:`UnsafeCheckpoint`).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imagenet_ddp.io import STALE_S, atomic_path, remove_stale_temporaries
from imagenet_ddp.jobs import distributed as D
from imagenet_ddp.settings.geometry import Geometry, trains_on_gpus
from imagenet_ddp.settings.geometry import checkpoint_tag as settings_tag
from imagenet_ddp.training.state import TrainingState


def checkpoint_tag(cfg, geometry: Geometry) -> str:
    """The key's second part (settings.geometry.checkpoint_tag) of the job's resolved geometry."""
    settings = {**vars(cfg), "gpus_per_node": geometry.gpus_per_node}
    return settings_tag(settings, geometry.world_size)


def checkpoint_dir(root: Path, fingerprint: str, geometry_tag: str) -> Path:
    return root / f"{fingerprint}-{geometry_tag}"


# Earlier versions' tag, which keyed on the loader too: b1024-o2-c16-g8-w15[-r32].
_LOADER_NAMED = re.compile(r"(b\d+-o\d+)-c\d+-g(\d+)-w\d+(-r\d+)?")


def loader_named(root: Path, fingerprint: str, cfg, geometry: Geometry) -> list[Path]:
    """This key's directories as an earlier version named them, by CPUs, GPUs and workers as
    well: the same sample stream, so a run upgraded mid-training resumes from them (the
    newest checkpoint of any wins, :func:`load_latest_checkpoint`)."""
    mine = checkpoint_tag(cfg, geometry)
    found = []
    for d in sorted(root.glob(f"{fingerprint}-b*-c*-g*-w*")) if root.is_dir() else []:
        m = _LOADER_NAMED.fullmatch(d.name[len(fingerprint) + 1 :])
        on_gpus = trains_on_gpus({"device": cfg.device, "gpus_per_node": int(m[2])}) if m else 0
        if m and f"{m[1]}-{'gpu' if on_gpus else 'cpu'}{m[3] or ''}" == mine and d.is_dir():
            found.append(d)
    return found


def other_geometries(root: Path, fingerprint: str, geometry_tag: str) -> list[Path]:
    """Checkpoint directories of the same settings under another tag."""
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
    """Write atomically, then prune the oldest: a failed write (full disk, quota) leaves the
    earlier ones intact and ends the job with one line. First the temporaries of a writer
    SIGKILLed mid-write (no cleanup ran) go, silent for STALE_S: one job writes a run's
    checkpoints (jobs.holders), and a live write moves its temporary's mtime."""
    path = directory / checkpoint_name(state["epoch"], state["step_in_epoch"])
    remove_stale_temporaries(directory, "checkpoint-*.pt", older_than=STALE_S)
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


def load_latest_checkpoint(directory: Path, earlier: Sequence[Path] = ()) -> dict[str, Any] | None:
    """Newest checkpoint that loads, of ``directory`` and the ``earlier`` directories of the
    same key (:func:`loader_named`; ``directory``'s first at the same point); a torn one is
    skipped, an unsafe one refused."""
    found = [(p.name, i, p) for i, d in enumerate(reversed([directory, *earlier]))
             for p in (d.glob("checkpoint-*.pt") if d.is_dir() else ())]  # fmt: skip
    for *_, path in sorted(found, reverse=True):
        try:
            return load_checkpoint(path)
        except UnsafeCheckpoint:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable file is skipped, not fatal
            print(f"warning: ignoring unreadable checkpoint {path}: {exc}", file=sys.stderr)
    return None


class UnsafeCheckpoint(ValueError):
    """A file that only arbitrary unpickling could read (it could run code): refused."""


def load_tensors(path: Path) -> Any:
    """``torch.load(weights_only=True)``: a file naming any other class or function is refused
    with one line, without running it; other errors are raised as they are."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))  # a class or function it names
        if found is None:
            raise
        raise UnsafeCheckpoint(
            f"{path}: refused: it needs arbitrary unpickling ({found.group(1)}), which can run "
            "code; a checkpoint or model.pt of an earlier version that you trust: "
            f"`imagenet-ddp convert-checkpoint {path}` (docs/reliability.md), else delete it"
        ) from None


def load_checkpoint(path: Path) -> dict[str, Any]:
    state = load_tensors(path)
    state["path"] = str(path)
    return state


def _each_leaf(obj: Any, leaf) -> Any:
    """``obj`` with ``leaf`` applied to all but its dicts, lists and tuples (copied)."""
    if isinstance(obj, dict):
        return {key: _each_leaf(value, leaf) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_each_leaf(value, leaf) for value in obj)
    return leaf(obj)


def plain(obj: Any) -> Any:
    """``obj`` with numpy arrays as tensors and numpy scalars as numbers (``weights_only``)."""
    return _each_leaf(
        obj,
        lambda x: (
            torch.from_numpy(x.copy())
            if isinstance(x, np.ndarray)
            else x.item()
            if isinstance(x, np.generic)
            else x
        ),
    )


def convert_trusted(path: Path) -> Path:
    """Rewrite a trusted checkpoint or model.pt of an earlier version (unpickled in full) as
    tensors and plain data, in place."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a checkpoint or model.pt (a {type(state).__name__})")
    for entry in state.get("rng") or []:
        if isinstance(entry, dict) and isinstance(entry.get("numpy"), tuple):
            entry["numpy"] = numpy_rng_record(entry["numpy"])
    state.pop("path", None)
    with atomic_path(Path(path)) as tmp:
        torch.save(plain(state), tmp)
    load_tensors(path)  # what a resume reads
    return Path(path)


class ResumeDisagreement(RuntimeError):
    """A rank cannot read the checkpoint rank 0 resumes from; every rank raises it."""


def agreed_checkpoint(directory: Path, earlier: Sequence[Path] = ()) -> dict[str, Any] | None:
    """The checkpoint rank 0 chooses (the newest that loads there), read by name by every rank.
    Collective. Each rank's own choice could differ: after a fast requeue a node's attribute
    cache (NFS ``acdirmax``) may list no newest file. A rank that cannot read it makes every
    rank raise :class:`ResumeDisagreement`, so none waits for ever."""
    main = not D.is_distributed() or torch.distributed.get_rank() == 0
    state, refused = None, None
    if main:
        try:
            state = load_latest_checkpoint(directory, earlier)
        except UnsafeCheckpoint as error:  # every rank refuses, none waits for rank 0
            refused = str(error)
    # By name; one in an earlier directory (loader_named) with that directory's name.
    chosen, sent = None if state is None else Path(state["path"]), None
    if chosen is not None:
        sent = chosen.name if chosen.parent == directory else f"{chosen.parent.name}/{chosen.name}"
    name, refused = D.all_gather_objects((sent, refused))[0]
    if refused:
        raise UnsafeCheckpoint(refused)
    if name is None:
        return None
    error, path = None, (directory.parent if "/" in name else directory) / name
    if not main:
        try:
            state = load_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 - reported by every rank below
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    failed = [(rank, e) for rank, e in enumerate(D.all_gather_objects(error)) if e]
    if failed:
        rank, e = failed[0]
        raise ResumeDisagreement(
            f"rank {rank} (of {len(failed)} failing) cannot read {path}, the checkpoint rank 0 "
            f"resumes from ({e}); if the file exists, this node's view of the "
            "shared filesystem is stale (attribute cache after a fast requeue): rerun to resume"
        )
    return state


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generators (CPU, this rank's GPU, numpy, Python)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": numpy_rng_record(np.random.get_state()),
        "python": random.getstate(),
    }


def numpy_rng_record(state: tuple) -> dict[str, Any]:
    """numpy's legacy RNG state as tensors and numbers (``weights_only`` reads no ndarray)."""
    name, keys, position, has_gauss, cached = state
    keys = torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64))
    return {"name": name, "keys": keys, "pos": int(position), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached)}  # fmt: skip


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(_tuples(state["python"]))


def _tuples(obj: Any) -> Any:
    """Python's RNG state, its tuples as ``random.setstate`` wants them (a list after a
    round trip through a file)."""
    return tuple(_tuples(v) for v in obj) if isinstance(obj, list | tuple) else obj


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
        "partial_epoch": plain(partial),
        "history": plain(job.history),
        "config": plain(dataclasses.asdict(job.cfg)),
        "geometry": dataclasses.asdict(job.geometry),
        "world_size": job.info.world_size,
        "rng": D.all_gather_objects(rng_state(job.device)),
    }


def cpu_copy(obj: Any) -> Any:
    """A copy with every tensor on the CPU, nothing shared with the live job."""
    return _each_leaf(
        obj,
        lambda x: (
            x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else copy.deepcopy(x)
        ),
    )


class CheckpointWriter:
    """Rank 0's checkpoint writes, one at a time in a background thread (at most one copy
    held); :meth:`wait` re-raises a failed write in the training thread. The executor's thread
    is joined at interpreter exit: an exit mid-write finishes the file first."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._pending: Future | None = None
        self.path: Path | None = None  # the newest checkpoint written
        self.write_seconds: float | None = None  # of the newest write

    def submit(self, directory: Path, state: dict[str, Any], keep: int) -> Path:
        self.wait()
        self._pending = self._pool.submit(self._write, directory, state, keep)
        return directory / checkpoint_name(state["epoch"], state["step_in_epoch"])

    def _write(self, directory: Path, state: dict[str, Any], keep: int) -> None:
        began = time.perf_counter()
        self.path = save_checkpoint(directory, state, keep)
        self.write_seconds = time.perf_counter() - began

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


def save_job(
    job: TrainingState,
    epoch: int,
    step: int,
    partial: list | None = None,
    *,
    record: dict[str, Any] | None = None,
) -> Path | None:
    """Checkpoint the job at (epoch, step); collective, rank 0 writes it in the background
    and gets its path. ``record``: this epoch's row, given ``checkpoint_seconds`` (how long the
    save held rank 0)."""
    began = time.perf_counter()
    state = job_state(job, epoch, step, partial)
    if not job.info.is_main:
        return None
    if job.checkpoint_writer is None:
        job.checkpoint_writer = CheckpointWriter()
    job.checkpoint_writer.wait()  # the previous write: at most one copy held
    snapshot = cpu_copy(state)
    if record is not None:
        record["checkpoint_seconds"] = time.perf_counter() - began
        snapshot["history"][-1]["checkpoint_seconds"] = record["checkpoint_seconds"]
    return job.checkpoint_writer.submit(job.checkpoint_dir, snapshot, job.cfg.keep_checkpoints)


def settle_checkpoints(job: TrainingState) -> None:
    """Collective: every rank returns once rank 0's last checkpoint is on disk."""
    if job.checkpoint_writer is not None:
        job.checkpoint_writer.wait()
    D.barrier()


@dataclass(frozen=True)
class ResumePoint:
    """Where a rank's training starts, the resumed epoch's counts and its checkpoint."""

    epoch: int = 0
    step: int = 0
    partial: list | None = None
    path: str | None = None


def resume_job(job: TrainingState, state: dict[str, Any] | None) -> ResumePoint:
    """Load ``state`` (:func:`agreed_checkpoint`'s; None: none) into ``job``: where it resumes.
    Collective."""
    if state is None:
        root, tag = job.checkpoint_dir.parent, job.checkpoint_dir.name.split("-", 1)[1]
        others = other_geometries(root, job.cfg.fingerprint(), tag)
        if others and job.info.is_main:
            print(
                f"not resuming {others[-1]}: written under another global batch or geometry, "
                f"or an earlier version's sample order ({others[-1].name.split('-', 1)[1]}), "
                f"this job's is {tag}; the batch order and LR schedule would mix; starting fresh",
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
    # Written on another rank count (an elastic resume): rank r takes rank r mod N's streams.
    # Sampling and augmentation draw from none of them (training.data); only a model that
    # draws during training (dropout, stochastic depth) differs from the unbroken run.
    restore_rng_state(state["rng"][job.info.rank % len(state["rng"])], job.device)
    if job.info.is_main:
        written = state.get("world_size", job.info.world_size)
        elastic = "" if written == job.info.world_size else (
            f", written on {written} ranks, now {job.info.world_size} with accumulation "
            f"{job.cfg.accumulation}"
        )  # fmt: skip
        print(
            f"resuming from {state['path']} (epoch {state['epoch']}, step "
            f"{state['step_in_epoch']}{elastic})",
            flush=True,
        )
    return ResumePoint(
        state["epoch"], state["step_in_epoch"], state["partial_epoch"], state["path"]
    )
