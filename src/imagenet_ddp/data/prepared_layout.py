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
    """The workflow's pointer to its copy (its `prepare` output), written last, atomically;
    then the copy's key file made current (:func:`mark_current_key`)."""
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
    mark_current_key(manifest, content)


# ----------------------------------------------------------------------------- the key files
# What a training is made from, by content: `train` takes the key file of the copy its manifest
# names, results/prepared/keys/<which>-<content digest>. A file is written (a new mtime) only
# when its content becomes the current one, so a prepare rerun that makes the same bytes again
# (its code, the same images in another layout or another data.dir, --forcerun) retrains
# nothing, and one that makes other bytes (other images, classes, settings) is newer than every
# model trained before it. The manifest cannot carry this: Snakemake deletes it before every
# prepare job.
KEYS_DIR = "keys"


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


def key_path(manifest: str | os.PathLike[str], content: str) -> Path:
    """The key file of the copy with ``content``, beside ``manifest`` (results/prepared)."""
    manifest = Path(manifest)
    return manifest.parent / KEYS_DIR / copy_name(manifest.stem, content)


def mark_current_key(manifest: str | os.PathLike[str], content: str) -> Path:
    """Make ``content``'s key file the newest of its kind: written unless it already is (the
    copy's content did not change)."""
    key = key_path(manifest, content)
    others = key.parent.glob(f"{Path(manifest).stem}-*")
    newest = max(others, key=lambda p: p.stat().st_mtime_ns, default=None)
    if newest != key:
        write_json_atomic(key, {"content_sha256": content, "manifest": str(manifest)})
    return key


def current_key(manifest: str | os.PathLike[str], adopt: bool = True) -> Path | None:
    """The key file of the copy ``manifest`` names, None while there is none. ``adopt``: a
    manifest of an earlier version (no key files yet) gets its key file at the epoch, older
    than every model, so the upgrade retrains nothing."""
    content = prepared_content(manifest) if Path(manifest).is_file() else None
    if content is None:
        return None
    key = key_path(manifest, content)
    if not key.exists():
        if not adopt:
            return None
        write_json_atomic(key, {"content_sha256": content, "manifest": str(manifest)})
        os.utime(key, (0, 0))
    return key


def adopt_earlier_copy(manifest: Path, root: Path, which: str) -> bool:
    """A workflow prepared by a version without manifests (its copy at ``root/<which>``): the
    manifest naming that copy as what it was made from, written at the epoch. Train takes the
    manifest as ancient(), so an existing one triggers no finished training when prepare reruns
    after the upgrade (for its code); prepare rewrites it then (the same copy where its index
    and settings are the same: imagenet_ddp.data.prepare.shared_copy). True if written."""
    manifest, copy = Path(manifest), Path(root) / which
    if manifest.exists() or not (copy / PREPARED_JSON).is_file():
        return False
    try:
        made_from = json.loads(provenance_file(copy).read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not a complete copy of a known version: prepare decides
    if not isinstance(made_from, dict) or made_from.get("which") != which:
        return False
    write_manifest(manifest, copy, made_from, reused=True)
    os.utime(manifest, (0, 0))
    os.utime(key_path(manifest, content_digest(copy)), (0, 0))
    return True
