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
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imagenet_ddp.io import atomic_path


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


def save_checkpoint(directory: Path, state: dict[str, Any], keep: int) -> Path:
    path = directory / checkpoint_name(state["epoch"], state["step_in_epoch"])
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
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
