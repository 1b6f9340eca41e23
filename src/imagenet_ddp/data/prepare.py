"""Writing the prepared copy (format: :mod:`imagenet_ddp.data.prepared_layout`): images converted
in a process pool, in order, into shards fixed by the index alone, so one job
(:func:`prepare_shared`) or K (:func:`prepare_chunk`, :func:`join_shared`) give the same bytes for
any ``workers``. The copy is content-addressed in prepare.dir, made once and reused by every
workflow of the same index and settings, and named by a manifest, the rule's output, so
Snakemake never deletes a copy in use."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import tarfile
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
from PIL import Image

from imagenet_ddp.data.layouts import find_layout
from imagenet_ddp.data.prepared_layout import (
    FORMAT,
    FORMAT_VERSION,
    PREPARED_JSON,
    SAMPLES_CSV,
    SHARD_DIR,
    copy_name,
    identity_digest,
    provenance_file,
    write_manifest,
)
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import (
    atomic_path,
    exclusive_lock,
    file_digest,
    lock_path_for,
    stops_noted,
    write_csv_atomic,
    write_json_atomic,
)
from imagenet_ddp.provenance import write_provenance

_TAR_END = bytes(2 * tarfile.BLOCKSIZE)
_CHUNK = 16  # images per task sent to a worker
PR_SET_PDEATHSIG = 1  # prctl(2)
INDEX_COLUMNS = ("sample_id", "class_index", "member", "name", "size", "member_offset", "offset")
ROW_COLUMNS = ["sample_id", "class_index", "shard", "offset", "length"]


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.tar"


def convert_image(data: bytes, short_side: int, quality: int) -> bytes:
    """Decode any image PIL reads, to RGB, shorter side -> ``short_side``, baseline JPEG."""
    with Image.open(io.BytesIO(data)) as image:
        w, h = image.size
        scale = short_side / min(w, h)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        if image.format == "JPEG" and scale < 1:
            image.draft(image.mode, size)  # DCT-domain downscale: decodes big JPEGs much faster
        rgb = image.convert("RGB")
    if rgb.size != size:
        rgb = rgb.resize(size, Image.Resampling.BICUBIC, reducing_gap=None)
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=quality, optimize=False, progressive=False)
    return out.getvalue()


def _convert_one(item: tuple[int, bytes, int, int]) -> tuple[int, bytes | None, str | None]:
    sample_id, data, short_side, quality = item
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Corrupt EXIF data": the pixels are fine
            return sample_id, convert_image(data, short_side, quality), None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return sample_id, None, f"{type(exc).__name__}: {exc}"


def _convert_chunk(items: list) -> list:
    return [_convert_one(item) for item in items]


def check_index(index: pd.DataFrame, which: str) -> pd.DataFrame:
    """The index sorted by sample_id; a clear error for one written without archive offsets."""
    missing = sorted(set(INDEX_COLUMNS) - set(index.columns))
    if missing:
        raise InputError(
            f"the {which} index lacks columns {missing} (it was written by an older version, "
            "without archive offsets); rebuild it: `imagenet-ddp index` (Snakemake reruns the "
            "index rule by itself)"
        )
    index = index.sort_values("sample_id", kind="stable").reset_index(drop=True)
    index["member"] = index["member"].fillna("").astype(str)
    return index


def _worker_signals() -> None:
    """A pool worker in a process group of its own: a Ctrl-C or a kill of the command's group
    reaches the parent alone, which ends the pool between chunks (a worker killed mid-write
    leaves the pool's pipes dirty: the parent hung for ever). SIGTERM to it alone (scancel)
    still ends it, and the kernel kills it when the parent dies."""
    os.setpgrp()
    with contextlib.suppress(OSError, AttributeError):  # Linux: killed with its parent
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler, inherited by fork


def _converted(items: Iterator, workers: int) -> Iterator[tuple[int, bytes | None, str | None]]:
    """Converted images in input order; at most 4 chunks per worker read ahead. A SIGINT or
    SIGTERM is raised between chunks (io.stops_noted): the queued chunks are cancelled, the
    running ones finish, and the caller's temporary copy is removed (io.atomic_path)."""
    pool, ahead, items = None, collections.deque(), iter(items)
    with stops_noted() as stop_if_noted:
        try:
            if workers <= 1:
                for item in items:
                    stop_if_noted()
                    yield _convert_one(item)
                return
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else None)
            pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_signals)
            while chunk := list(itertools.islice(items, _CHUNK)):
                stop_if_noted()
                ahead.append(pool.submit(_convert_chunk, chunk))
                if len(ahead) >= 4 * workers:
                    yield from _result(ahead.popleft(), stop_if_noted)
            while ahead:
                yield from _result(ahead.popleft(), stop_if_noted)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


def _result(future, stop_if_noted) -> list:
    """A chunk's results; a stop noted meanwhile first (a SIGTERM kills the workers)."""
    try:
        return future.result()  # BrokenProcessPool where a stop killed the workers
    finally:
        stop_if_noted()


def sample_key(sample_id: int) -> str:
    """The shard member stem of a sample (WebDataset groups members by it)."""
    return f"{sample_id:010d}"


def _tar_member(name: str, data: bytes) -> bytes:
    """One ustar member, fixed owner, mode and mtime: a shard's bytes depend on its samples."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0
    header = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    return header + data + bytes(-len(data) % tarfile.BLOCKSIZE)


class _ShardWriter:
    """One shard as a ustar tar file: per sample ``<key>.jpg`` and ``<key>.cls`` (the class
    index); ``write`` returns the JPEG's offset in it, ``record`` describes it once closed."""

    def __init__(self, path: Path):
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close)
        self._hash = hashlib.sha256()
        self.record = {"name": path.name, "bytes": 0, "samples": 0, "sha256": None}

    def _append(self, block: bytes) -> None:
        self._file.write(block)
        self._hash.update(block)
        self.record["bytes"] += len(block)

    def close(self) -> None:
        if not self._file.closed:
            self._append(_TAR_END)
            self._file.close()
            self.record["sha256"] = self._hash.hexdigest()

    def write(self, data: bytes, *, key: str, label: int) -> int:
        offset = self.record["bytes"] + tarfile.BLOCKSIZE
        self._append(
            _tar_member(f"{key}.jpg", data) + _tar_member(f"{key}.cls", str(int(label)).encode())
        )
        self.record["samples"] += 1
        return offset


def num_shards(num_samples: int, shard_samples: int) -> int:
    """Shard ``s`` holds index positions ``[s * shard_samples, (s + 1) * shard_samples)``:
    fixed by the index alone, so independent jobs can write any range of shards."""
    return -(-num_samples // shard_samples)


def chunk_shards(total_shards: int, chunk: int, chunks: int) -> range:
    """The shards of job ``chunk`` of ``chunks``: contiguous, sizes differ by at most one."""
    return range(total_shards * chunk // chunks, total_shards * (chunk + 1) // chunks)


def write_shard_parts(
    data_dir: Path,
    index: pd.DataFrame,
    parts_dir: Path,
    shards: range,
    *,
    which: str,
    short_side: int,
    quality: int,
    shard_samples: int,
    workers: int,
    on_corrupt: str,
) -> tuple[list[tuple[int, int, int, int, int]], list[dict], list[dict]]:
    """Convert the images of ``shards`` (of a ``check_index``-ed index) into ``parts_dir/<s>/``,
    one writer a shard. Returns rows (ROW_COLUMNS), one record per non-empty shard (the
    writer's, plus ``shard`` s and ``part``: its file in parts_dir) and the skipped images."""
    layout = find_layout(data_dir)
    start = shards.start * shard_samples
    part = index.iloc[start : min(len(index), shards.stop * shard_samples)]
    class_index = part["class_index"].tolist()
    rows: list[tuple[int, int, int, int, int]] = []
    skipped: list[dict] = []
    writers: dict[int, _ShardWriter] = {}
    read = layout.read_items(data_dir, which, part)  # refuses data changed since indexing
    converted = _converted(((i, data, short_side, quality) for i, data in read), workers)
    try:
        for position, (sample_id, data, error) in enumerate(converted):
            if data is None:
                row = part.iloc[position]
                if on_corrupt == "fail":
                    raise InputError(
                        f"{layout.place(data_dir, which, row['member'], row['name'])} (sample "
                        f"{sample_id}) cannot be decoded ({error}); replace it (re-download the "
                        "archive), or set prepare.on_corrupt: skip to leave such images out"
                    )
                skipped.append({"sample_id": sample_id, "member": row["member"],
                                "name": row["name"], "error": error})  # fmt: skip
                continue
            shard = (start + position) // shard_samples
            writer = writers.get(shard)
            if writer is None:  # a new shard: the previous ones are done (images come in order)
                for previous in writers.values():
                    previous.close()
                (parts_dir / f"{shard:05d}").mkdir(parents=True)
                writer = _ShardWriter(parts_dir / f"{shard:05d}" / shard_name(0))
                writers[shard] = writer
            label = class_index[position]
            offset = writer.write(data, key=sample_key(sample_id), label=label)
            rows.append((sample_id, label, shard, offset, len(data)))
    finally:
        converted.close()  # stops the pool now, also on error
        for writer in writers.values():
            writer.close()
    records = [
        {**w.record, "shard": s, "part": f"{s:05d}/{w.record['name']}"}
        for s, w in sorted(writers.items())
    ]
    return rows, records, skipped


def finish_prepared(
    tmp: Path,
    parts: list[tuple[Path, dict]],
    rows: list[tuple[int, int, int, int, int]],
    skipped: list[dict],
    settings: dict,
    *,
    move: bool,
) -> dict:
    """Place ``parts`` ((parts_dir, record), in shard order) as ``shards/shard_name(i)``, i
    among the non-empty, and write samples.csv and prepared.json (returned) into ``tmp``."""
    (tmp / SHARD_DIR).mkdir(exist_ok=True)
    position, shards = {}, []
    for i, (parts_dir, record) in enumerate(parts):
        position[record["shard"]] = i
        name = shard_name(i)
        src, dest = parts_dir / record["part"], tmp / SHARD_DIR / name
        if move:
            os.replace(src, dest)
        else:  # a hard link where on one filesystem
            try:
                os.link(src, dest)
            except OSError:
                shutil.copyfile(src, dest)
        shards.append(
            {**{k: v for k, v in record.items() if k not in ("shard", "part")}, "name": name}
        )
    samples = pd.DataFrame(rows, columns=ROW_COLUMNS).astype("int64")
    samples["shard"] = samples["shard"].map(position).astype("int64")
    write_csv_atomic(tmp / SAMPLES_CSV, samples)
    info = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **{k: settings[k] for k in ("which", "short_side", "quality", "num_classes")},
        "num_samples": len(rows),
        "num_skipped": len(skipped),
        "skipped": skipped,
        "total_bytes": sum(s["bytes"] for s in shards),
        "shard_samples": settings["shard_samples"],
        "shards": shards,
        "samples_csv_sha256": file_digest(tmp / SAMPLES_CSV, "sha256"),
    }
    write_json_atomic(tmp / PREPARED_JSON, info)
    return info


def prepare_split(
    data_dir: Path, index: pd.DataFrame, out_dir: Path, *, which: str, num_classes: int,
    workers: int, **settings,
) -> dict:  # fmt: skip
    """The prepared copy of ``index`` in ``out_dir``, with no lock or reuse
    (:func:`prepare_shared`'s); returns prepared.json's content plus ``out_dir``."""
    index = check_index(index, which)
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    shards = range(num_shards(len(index), settings["shard_samples"]))
    with atomic_path(out_dir, is_dir=True) as tmp:
        parts_dir = tmp / ".parts"
        rows, records, skipped = write_shard_parts(
            data_dir, index, parts_dir, shards, which=which, workers=workers, **settings
        )
        info = finish_prepared(
            tmp, [(parts_dir, r) for r in records], rows, skipped,
            {**settings, "which": which, "num_classes": num_classes}, move=True,
        )  # fmt: skip
        shutil.rmtree(parts_dir, ignore_errors=True)
    return {**info, "out_dir": str(out_dir)}


CLASSES_CSV = "classes.csv"
CHUNK_JSON = "chunk.json"
CHUNK_ROWS = "rows.csv"
CHUNK_PARTS = "parts"


def _sha256(path: Path) -> str:
    try:
        return file_digest(path, "sha256")
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


def _build_once(prepared_dir: Path, manifest: Path, wanted: dict, jobs: int, build) -> Path:
    """``build(out)`` (returning the summary) into the content-addressed copy of ``wanted`` in
    prepare.dir ``prepared_dir``, under its lock, unless it is there; then ``manifest`` naming it.
    Killed writers' temporaries (tens of GB) are removed first: every writer holds the lock
    while its temporary exists."""
    out = shared_copy(prepared_dir, wanted)
    with exclusive_lock(lock_path_for(out)):
        reused = is_prepared(out, wanted)
        if not reused:
            for stale in out.parent.glob(f".{out.name}.tmp-*"):
                print(f"removing {stale}: a killed prepare's temporary copy", flush=True)
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
            extra = {"summary": build(out), "jobs": jobs}
            write_provenance(provenance_file(out), "prepare", wanted, extra=extra)
    write_manifest(manifest, out, wanted, reused)
    print(f"{manifest} names {out}" + (" (reused: same index and settings)" if reused else ""))
    return out


def prepare_shared(
    data_dir: Path, index_dir: Path, which: str, manifest: Path, prepared_dir: Path, **settings
) -> Path:
    """Decode ``which`` into its copy in prepare.dir ``prepared_dir`` (made once, reused by every
    workflow of the same index and settings), then ``manifest`` naming it. ``settings``:
    short_side, quality, on_corrupt, shard_samples, workers."""

    def build(out: Path) -> dict:
        index, num_classes = _read_inputs(index_dir, which)
        return prepare_split(data_dir, index, out, which=which, num_classes=num_classes, **settings)

    return _build_once(prepared_dir, manifest, identity(index_dir, which, settings), 1, build)


def prepare_chunk(
    data_dir: Path,
    index_dir: Path,
    which: str,
    chunk_dir: Path,
    *,
    chunk: int,
    chunks: int,
    workers: int,
    prepared_dir: Path | None = None,
    **settings,
) -> dict:
    """Job ``chunk`` of ``chunks``: convert its shard range into ``chunk_dir`` (atomically);
    nothing where ``prepared_dir`` (prepare.dir) holds the copy already (the join reuses it)."""
    if not 0 <= chunk < chunks:
        raise InputError(f"chunk {chunk} of {chunks}: use 0 <= chunk < chunks (prepare.jobs)")
    find_layout(data_dir)
    wanted = identity(index_dir, which, settings)
    record = {"identity": wanted, "chunk": chunk, "chunks": chunks}
    with atomic_path(chunk_dir, is_dir=True) as tmp:
        if prepared_dir is not None and is_prepared(shared_copy(prepared_dir, wanted), wanted):
            record["reuses"] = True
        else:
            index, num_classes = _read_inputs(index_dir, which)
            shards = chunk_shards(num_shards(len(index), settings["shard_samples"]), chunk, chunks)
            rows, records, skipped = write_shard_parts(
                data_dir, index, tmp / CHUNK_PARTS, shards, which=which, workers=workers, **settings
            )
            write_csv_atomic(tmp / CHUNK_ROWS, pd.DataFrame(rows, columns=ROW_COLUMNS))
            record.update(
                num_classes=num_classes,
                shards=[shards.start, shards.stop],
                records=records,
                skipped=skipped,
            )
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


def join_shared(chunk_dirs: list[Path], manifest: Path, prepared_dir: Path) -> Path:
    """Join finished chunks into their copy in prepare.dir ``prepared_dir`` (as
    :func:`prepare_shared` writes it) unless it is there; then ``manifest`` naming it."""
    chunks = _read_chunks(chunk_dirs)
    wanted = chunks[0]["identity"]

    def build(out: Path) -> dict:
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
        return {**info, "out_dir": str(out)}

    return _build_once(prepared_dir, manifest, wanted, len(chunks), build)


def shared_copy(root: Path, wanted: dict) -> Path:
    """The content-addressed folder in prepare.dir ``root`` of the copy made from ``wanted``."""
    return Path(root) / copy_name(wanted["which"], identity_digest(wanted))
