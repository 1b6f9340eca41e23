"""The prepared copy's format: its layout, file names and version, and why it is so.

Written by :mod:`imagenet_ddp.data.prepare`, read by :mod:`imagenet_ddp.data.dataset`.

Torch-free: the rules (a format change reruns ``prepare``) and the staging steps import it.
A workflow points at its copy through a manifest (:func:`resolve_prepared`).

Layout of a prepared directory::

    shards/shard-00000.tar ...   POSIX tar files (``shard_samples`` images each) of baseline
                                 JPEGs, members <key>.jpg and <key>.cls (class index) per
                                 sample, WebDataset style (key = sample_id, 10 digits): `tar -t`,
                                 webdataset/wids and DALI's webdataset reader read them as they are
    samples.csv                  sample_id, class_index, shard, offset, length (sample_id order;
                                 offset is that of the JPEG's bytes inside the tar)
    prepared.json                format version, short_side, quality, counts, per-shard bytes
                                 and sha256, skipped images

Why this format (what ``benchmarks/`` measures against reading the archives or an extracted
ImageFolder):

* **Sequential, few files.** 1.28M small files are slow on parallel file systems (one metadata
  lookup per image) and slow to copy to node-local scratch; a few hundred 256 MiB shards copy at
  disk bandwidth (see :mod:`imagenet_ddp.data.stage`) and are read through the page cache via
  ``np.memmap``. ``samples.csv`` gives each image's (shard, offset, length): random access, no
  tar parsing at train time. The tar framing costs ~1.5 KB per image (headers, padding, the
  .cls member), ~3 % of a 43 KB image.
* **Decoded once, pre-resized.** Every image is decoded once at preparation (PIL,
  ``convert("RGB")``, so grayscale, CMYK and PNG-named-.JPEG all become RGB), resized so its
  shorter side is ``short_side`` and re-encoded as a baseline JPEG. An average ImageNet JPEG
  is ~400x350; at ``short_side`` 160 the per-epoch decode is ~5x cheaper and the data ~4x
  smaller.
* **Fast decode.** Training decodes with :mod:`imagenet_ddp.data.jpeg` (libjpeg-turbo through
  simplejpeg) straight into a uint8 tensor, no PIL round trip, drawing the random crop box
  before decoding so that a box much larger than the output is decoded at a reduced DCT scale;
  it augments with ``transforms.v2`` on tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from imagenet_ddp.errors import InputError
from imagenet_ddp.io import write_json_atomic

# The value stays "imagenet_ddp.prepared" (the module that wrote it first): it is recorded in
# every prepared.json, and a copy of another format is rebuilt.
FORMAT = "imagenet_ddp.prepared"
# 2: shards are tar files with WebDataset member names (1: bare concatenated JPEGs, .bin)
FORMAT_VERSION = 2
SHARD_DIR = "shards"
SAMPLES_CSV = "samples.csv"
PREPARED_JSON = "prepared.json"

# ----------------------------------------------------------------------------- the manifest
# A workflow's `prepare` output is a small manifest under its own results/, naming the copy in
# prepare.dir; the copy's name holds the digest of what determines its bytes (index, classes,
# settings, format, code). Snakemake deletes a job's outputs before it runs the job: the
# manifest, never a copy that another workflow (or a running job of this one) reads. No stage
# removes a copy; a copy that no manifest names is removed by hand (docs/configuration.md).
MANIFEST_FORMAT = "imagenet_ddp.prepared-manifest"
DIGEST_CHARS = 16  # of the sha256: the copy's name, unique among the copies of one dir


def copy_name(which: str, digest: str) -> str:
    """The content-addressed copy's folder name in prepare.dir."""
    return f"{which}-{digest[:DIGEST_CHARS]}"


def resolve_prepared(path: str | os.PathLike[str]) -> Path:
    """The prepared directory that ``path`` stands for: the copy a manifest names (its
    absolute path), or ``path`` itself (a directory)."""
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
    """Beside the prepared directory, not inside: the directory holds exactly the data (staged
    to every node and fingerprinted), and is replaced as a whole by an atomic rename."""
    out = Path(out)
    return out.with_name(out.name + ".provenance.json")


def identity_digest(wanted: dict) -> str:
    """The sha256 of an identity (imagenet_ddp.data.prepare.identity): its copy's address."""
    return hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()


def write_manifest(manifest: Path, copy: Path, wanted: dict, reused: bool) -> None:
    """The workflow's pointer to its copy (its `prepare` output), written last, atomically."""
    content = content_digest(copy)
    write_json_atomic(
        manifest,
        {
            "format": MANIFEST_FORMAT,
            "dir": os.path.abspath(copy),  # the same path on every node of a cluster
            "digest": identity_digest(wanted),
            "content_sha256": content,
            "identity": wanted,
            "reused": reused,
        },
    )


# ----------------------------------------------------------------------------- content
# What a training or an evaluation reads, by content (the workflow's data_content checkpoint):
# the same images in any input layout or data.dir give the same digests, other images others.


def content_digest(copy: str | os.PathLike[str]) -> str:
    """The sha256 of a prepared copy's content: of its prepared.json, which holds the sha256
    of every shard and of samples.csv (the same for the same images in any input layout)."""
    return hashlib.sha256((Path(copy) / PREPARED_JSON).read_bytes()).hexdigest()


def prepared_content(path: str | os.PathLike[str]) -> str | None:
    """The content digest of the copy ``path`` stands for (a manifest, or the copy itself);
    None where there is none to read."""
    path = Path(path)
    try:
        if path.is_dir():
            return content_digest(path)
        manifest = json.loads(path.read_text())
        return manifest.get("content_sha256") or content_digest(manifest["dir"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _sha256_file(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _samples_digest(split_csv: str | os.PathLike[str]) -> str:
    """The sha256 of a split file's sample ids, in its order: which images it holds, not their
    class names or where a layout keeps their bytes (the same images in another layout agree)."""
    import csv

    digest = hashlib.sha256()
    with open(split_csv, newline="") as f:
        for row in csv.DictReader(f):
            digest.update(f"{row['sample_id']}\n".encode())
    return digest.hexdigest()


def content_record(
    prepared_train: Path, prepared_val: Path, split_train: Path, split_holdout: Path, classes: Path
) -> dict[str, str]:
    """The digests the workflow's train and evaluate jobs take as params: ``train`` of the
    prepared train copy's content (its images and class indices) and the split's sample ids
    (what a training reads), ``evaluate`` of both copies' content, the holdout's ids and the
    classes file (what an evaluation reads and writes: per-class rows name the classes)."""
    parts = {
        "prepared_train": prepared_content(prepared_train),
        "prepared_val": prepared_content(prepared_val),
        "split_train": _samples_digest(split_train),
        "split_holdout": _samples_digest(split_holdout),
        "classes": _sha256_file(classes),
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
