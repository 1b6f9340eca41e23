"""Provenance beside every artifact: config subset, code version, library versions, seeds."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from imagenet_ddp.io import write_json_atomic

LIBRARIES = (
    "imagenet-ddp",
    "torch",
    "torchvision",
    "snakemake",
    "snakemake-executor-plugin-slurm",
    "scikit-learn",
    "pandas",
    "numpy",
    "pillow",
)


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10
    ).stdout


def code_version() -> dict[str, Any]:
    """Git commit of the workflow checkout, whether it had uncommitted changes to tracked files
    and, if so, a digest of them (``git diff HEAD``): two dirty runs of one commit ran the same
    code only if their digests agree."""
    root = Path(__file__).resolve().parents[2]
    info: dict[str, Any] = {"package_version": library_versions()["imagenet-ddp"]}
    try:
        commit = _git(root, "rev-parse", "HEAD").strip()
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no").strip())
        info.update(git_commit=commit, git_dirty=dirty)
        if dirty:
            diff = _git(root, "diff", "--no-ext-diff", "--binary", "HEAD").encode()
            info["git_diff_sha256"] = hashlib.sha256(diff).hexdigest()[:16]
    except (OSError, subprocess.SubprocessError):
        info.update(git_commit=os.environ.get("IMAGENET_DDP_GIT_COMMIT", "unknown"), git_dirty=None)
    return info


def provenance_record(
    stage: str,
    config: dict[str, Any],
    seeds: dict[str, int] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "stage": stage,
        "config": config,
        "seeds": seeds or {},
        "code": code_version(),
        "libraries": library_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": platform.node(),
        **(extra or {}),
    }


def provenance_path(artifact: str | os.PathLike[str]) -> Path:
    """``results/x/train.csv`` -> ``results/x/train.csv.provenance.json``; a dir gets one inside."""
    artifact = Path(artifact)
    if artifact.is_dir():
        return artifact / "provenance.json"
    return artifact.with_name(artifact.name + ".provenance.json")


def write_provenance(
    path: str | os.PathLike[str],
    stage: str,
    config: dict[str, Any],
    seeds: dict[str, int] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    write_json_atomic(path, provenance_record(stage, config, seeds, extra))
