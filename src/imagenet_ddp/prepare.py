"""The prepare stage: build a prepared copy once, in one job or in K independent jobs joined.

One job (:func:`prepare`) or K jobs (:func:`prepare_chunk` for each k, then :func:`join_chunks`)
give the same directory byte for byte: job k converts the shard range
:func:`imagenet_ddp.prepared.chunk_shards` of the fixed shard plan into its own chunk directory,
and the join places the whole shard files (hard link, else copy) and rebuilds samples.csv and
prepared.json from the chunks' rows, exactly as the one-job path does with its own parts.

The final copy may live on storage shared by several workflows: writers hold a lock beside it,
it appears by an atomic rename, and a complete copy made from the same index, classes and
settings (its provenance says so) is reused instead of rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd

from imagenet_ddp.errors import InputError
from imagenet_ddp.io import (
    atomic_path,
    exclusive_lock,
    lock_path_for,
    write_csv_atomic,
    write_json_atomic,
)
from imagenet_ddp.prepared import (
    FORMAT_VERSION,
    PREPARED_JSON,
    archive_of,
    check_index,
    chunk_shards,
    finish_prepared,
    num_shards,
    prepare_split,
    write_shard_parts,
)
from imagenet_ddp.provenance import write_provenance

CLASSES_CSV = "classes.csv"
CHUNK_JSON = "chunk.json"
CHUNK_ROWS = "rows.csv"
CHUNK_PARTS = "parts"


def provenance_file(out: Path) -> Path:
    """Beside the prepared directory, not inside: the directory holds exactly the data (staged
    to every node and fingerprinted), and is replaced as a whole by an atomic rename."""
    out = Path(out)
    return out.with_name(out.name + ".provenance.json")


def _sha256(path: Path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        raise InputError(f"{path} not found; run `imagenet-ddp index` first") from None


def identity(index_dir: Path, which: str, settings: dict) -> dict:
    """What a prepared copy is made from: the settings and the index and classes files."""
    index_dir = Path(index_dir)
    return {
        "which": which,
        **{k: settings[k] for k in ("short_side", "quality", "on_corrupt", "shard_samples")},
        "index_sha256": _sha256(index_dir / f"{which}.csv"),
        "classes_sha256": _sha256(index_dir / CLASSES_CSV),
        "format_version": FORMAT_VERSION,  # a copy in an older format is rebuilt, not reused
    }


def _read_inputs(index_dir: Path, which: str) -> tuple[pd.DataFrame, int]:
    """The sorted, checked index and the class count of classes.csv."""
    index = pd.read_csv(Path(index_dir) / f"{which}.csv", keep_default_na=False)
    classes = pd.read_csv(Path(index_dir) / CLASSES_CSV, keep_default_na=False)
    return check_index(index, which), len(classes)


def is_prepared(out: Path, wanted: dict) -> bool:
    """A complete copy at ``out`` made from ``wanted`` (see :func:`identity`)."""
    provenance = provenance_file(out)
    if not ((Path(out) / PREPARED_JSON).is_file() and provenance.is_file()):
        return False
    try:
        return json.loads(provenance.read_text()).get("config") == wanted
    except json.JSONDecodeError:
        return False


def prepare(data_dir: Path, index_dir: Path, which: str, out: Path, **settings) -> bool:
    """Build ``out`` in this job unless an identical copy is there. True if it was reused.

    settings: short_side, quality, on_corrupt, shard_samples, workers.
    """
    wanted = identity(index_dir, which, settings)
    with exclusive_lock(lock_path_for(out)):
        if is_prepared(out, wanted):
            return True
        index, num_classes = _read_inputs(index_dir, which)
        summary = prepare_split(
            data_dir, index, out, which=which, num_classes=num_classes, **settings
        )
        write_provenance(
            provenance_file(out), "prepare", wanted, extra={"summary": summary, "jobs": 1}
        )
    return False


def prepare_chunk(
    data_dir: Path,
    index_dir: Path,
    which: str,
    chunk_dir: Path,
    *,
    chunk: int,
    chunks: int,
    workers: int,
    **settings,
) -> dict:
    """Job ``chunk`` of ``chunks``: convert its shard range into ``chunk_dir`` (atomically)."""
    if not 0 <= chunk < chunks:
        raise InputError(f"chunk {chunk} of {chunks}: use 0 <= chunk < chunks (prepare.jobs)")
    archive_of(data_dir, which)
    wanted = identity(index_dir, which, settings)
    index, num_classes = _read_inputs(index_dir, which)
    shards = chunk_shards(num_shards(len(index), settings["shard_samples"]), chunk, chunks)
    with atomic_path(chunk_dir, is_dir=True) as tmp:
        rows, records, skipped = write_shard_parts(
            data_dir, index, tmp / CHUNK_PARTS, shards, which=which, workers=workers, **settings
        )
        columns = ["sample_id", "class_index", "shard", "offset", "length"]
        write_csv_atomic(tmp / CHUNK_ROWS, pd.DataFrame(rows, columns=columns))
        record = {
            "identity": wanted,
            "num_classes": num_classes,
            "chunk": chunk,
            "chunks": chunks,
            "shards": [shards.start, shards.stop],
            "records": records,
            "skipped": skipped,
        }
        write_json_atomic(tmp / CHUNK_JSON, record)
    return record


def _read_chunks(chunk_dirs: list[Path]) -> list[dict]:
    chunks = []
    for chunk_dir in chunk_dirs:
        path = Path(chunk_dir) / CHUNK_JSON
        try:
            chunks.append({**json.loads(path.read_text()), "dir": Path(chunk_dir)})
        except (FileNotFoundError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: not a finished prepare chunk ({exc}); rerun it") from None
    chunks.sort(key=lambda c: c["chunk"])
    count = chunks[0]["chunks"] if chunks else 0
    if [c["chunk"] for c in chunks] != list(range(count)) or any(
        c["chunks"] != count for c in chunks
    ):
        raise InputError(
            f"the chunks {[str(d) for d in chunk_dirs]} are not jobs 0..K-1 of one K; "
            "rerun prepare with the same prepare.jobs"
        )
    if any(c["identity"] != chunks[0]["identity"] for c in chunks):
        raise InputError(
            f"the chunks in {chunks[0]['dir'].parent} were made from different indexes or "
            "settings; delete them and rerun prepare"
        )
    return chunks


def join_chunks(chunk_dirs: list[Path], out: Path) -> bool:
    """Join finished chunks into ``out`` (as :func:`prepare` would have written it) unless an
    identical copy is there. True if it was reused. The chunks are left as they are."""
    chunks = _read_chunks(chunk_dirs)
    wanted = chunks[0]["identity"]
    with exclusive_lock(lock_path_for(out)):
        if is_prepared(out, wanted):
            return True
        rows = pd.concat(
            [pd.read_csv(c["dir"] / CHUNK_ROWS, dtype="int64") for c in chunks],
            ignore_index=True,
        )
        settings = {
            **{k: wanted[k] for k in ("which", "short_side", "quality", "shard_samples")},
            "num_classes": chunks[0]["num_classes"],
        }
        parts = [(c["dir"] / CHUNK_PARTS, r) for c in chunks for r in c["records"]]
        skipped = [s for c in chunks for s in c["skipped"]]
        with atomic_path(out, is_dir=True) as tmp:
            info = finish_prepared(
                tmp, parts, list(rows.itertuples(index=False)), skipped, settings, move=False
            )
        summary = {**info, "out_dir": str(out)}
        write_provenance(
            provenance_file(out), "prepare", wanted, extra={"summary": summary, "jobs": len(chunks)}
        )
    return False
