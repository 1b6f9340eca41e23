"""The prepared copy's format (``shards/shard-NNNNN.tar``, ``samples.csv``, ``prepared.json``;
what and why: docs/stages.md "Prepared shards"), the manifest naming a workflow's copy
(:func:`resolve_prepared`), and its content digests. Written by :mod:`imagenet_ddp.data.prepare`,
read by :mod:`imagenet_ddp.data.dataset`. Torch-free: the rules and the staging steps import it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from imagenet_ddp.errors import InputError
from imagenet_ddp.io import file_digest, write_json_atomic

# Recorded in every prepared.json: a copy of another format is rebuilt.
FORMAT = "imagenet_ddp.prepared"
# 2: shards are tar files with WebDataset member names (1: bare concatenated JPEGs, .bin)
FORMAT_VERSION = 2
SHARD_DIR = "shards"
SAMPLES_CSV = "samples.csv"
PREPARED_JSON = "prepared.json"

# A workflow's `prepare` output is a manifest naming its copy in prepare.dir, whose name is the
# digest of what makes its bytes: Snakemake deletes a job's outputs before the job, so the
# manifest, never a copy another workflow reads. No stage removes a copy (docs/configuration.md).
MANIFEST_FORMAT = "imagenet_ddp.prepared-manifest"
DIGEST_CHARS = 16  # of the sha256: the copy's name, unique among the copies of one dir


def copy_name(which: str, digest: str) -> str:
    """The content-addressed copy's folder name in prepare.dir."""
    return f"{which}-{digest[:DIGEST_CHARS]}"


def resolve_prepared(path: str | os.PathLike[str]) -> Path:
    """The prepared directory that ``path`` stands for: the copy a manifest names, or ``path``."""
    path = Path(path)
    if not path.is_file():
        return path
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise InputError(f"{path}: not a prepared manifest ({error}); rerun prepare") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{path}: not a prepared manifest; rerun prepare")
    copy = Path(manifest["dir"])
    if not (copy / PREPARED_JSON).is_file():
        raise InputError(
            f"{path} names {copy}, which is not a complete prepared copy (removed by hand?); "
            "rebuild it: snakemake --forcerun prepare"
        )
    return copy


def provenance_file(out: Path) -> Path:
    """Beside the prepared directory, which holds exactly the data (staged, fingerprinted)."""
    out = Path(out)
    return out.with_name(out.name + ".provenance.json")


def identity_digest(wanted: dict) -> str:
    """The sha256 of an identity (imagenet_ddp.data.prepare.identity): its copy's address."""
    return hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()


def write_manifest(manifest: Path, copy: Path, wanted: dict, reused: bool) -> None:
    """The workflow's pointer to its copy (its `prepare` output), written last, atomically."""
    write_json_atomic(
        manifest,
        {
            "format": MANIFEST_FORMAT,
            "dir": os.path.abspath(copy),  # the same path on every node of a cluster
            "digest": identity_digest(wanted),
            "content_sha256": content_digest(copy),
            "identity": wanted,
            "reused": reused,
        },
    )


# What a training or an evaluation reads, by content (the workflow's data_content checkpoint):
# the same images in any input layout or data.dir give the same digests, other images others.
def content_digest(copy: str | os.PathLike[str]) -> str:
    """The sha256 of a copy's prepared.json, which holds every shard's and samples.csv's."""
    return hashlib.sha256((Path(copy) / PREPARED_JSON).read_bytes()).hexdigest()


def prepared_content(path: str | os.PathLike[str]) -> str | None:
    """The content digest of the copy ``path`` stands for; None where there is none."""
    path = Path(path)
    try:
        if path.is_dir():
            return content_digest(path)
        manifest = json.loads(path.read_text())
        return manifest.get("content_sha256") or content_digest(manifest["dir"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _samples_digest(split_csv: str | os.PathLike[str]) -> str:
    """The sha256 of a split file's sample ids in its order: which images, in any layout."""
    import csv

    digest = hashlib.sha256()
    with open(split_csv, newline="") as f:
        for row in csv.DictReader(f):
            digest.update(f"{row['sample_id']}\n".encode())
    return digest.hexdigest()


def content_record(
    prepared_train: Path, prepared_val: Path, split_train: Path, split_holdout: Path, classes: Path
) -> dict[str, str]:
    """The digests the train and evaluate jobs take as params: of what a training reads (train
    copy, split ids) and of what an evaluation reads and writes (both copies, holdout ids, the
    classes its per-class rows name)."""
    parts = {
        "prepared_train": prepared_content(prepared_train),
        "prepared_val": prepared_content(prepared_val),
        "split_train": _samples_digest(split_train),
        "split_holdout": _samples_digest(split_holdout),
        "classes": file_digest(classes, "sha256"),
    }
    missing = [k for k, v in parts.items() if v is None]
    if missing:
        raise InputError(f"{', '.join(missing)}: no prepared copy to read; rerun prepare")

    def digest(*keys: str) -> str:
        return hashlib.sha256(" ".join(parts[k] for k in keys).encode()).hexdigest()

    return {
        "train": digest("prepared_train", "split_train", "split_holdout"),
        "evaluate": digest("prepared_train", "prepared_val", "split_holdout", "classes"),
        **parts,
    }
