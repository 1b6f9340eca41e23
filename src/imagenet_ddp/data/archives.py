"""The ILSVRC2012 archives as downloaded from image-net.org: check them, and index them without
extracting an image::

    ILSVRC2012_img_train.tar       outer tar of 1000 per-class tars nXXXXXXXX.tar
    ILSVRC2012_img_val.tar         flat ILSVRC2012_val_000NNNNN.JPEG
    ILSVRC2012_devkit_t12.tar.gz   ILSVRC2012_devkit_t12/data/{meta.mat, ..._ground_truth.txt}
    md5sums                        optional, ``md5sum`` format: "<hex>  <file name>"

Class indices and sample order are ``torchvision.datasets.ImageNet``'s. The headers are read
with :mod:`tarfile` (15-35 us each: under a minute for ImageNet's 1.28 M), the data skipped."""

from __future__ import annotations

import gzip
import io
import os
import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from imagenet_ddp.data.archive_names import (  # noqa: F401 (re-exported)
    ARCHIVES,
    DEVKIT_ARCHIVE,
    IMAGE_SUFFIXES,
    INDEX_FORMAT_VERSION,
    MD5SUMS,
    TRAIN_ARCHIVE,
    VAL_ARCHIVE,
)
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import file_digest

DEVKIT_ROOT = "ILSVRC2012_devkit_t12"
META_MAT = f"{DEVKIT_ROOT}/data/meta.mat"
VAL_GROUND_TRUTH = f"{DEVKIT_ROOT}/data/ILSVRC2012_validation_ground_truth.txt"

# member_offset/member_size: the per-class tar in the outer train tar (val: 0, 0); offset: the
# image's data in it (val: in the val tar). prepare reads it at member_offset + offset.
SAMPLE_COLUMNS = [
    "sample_id", "class_index", "wnid", "member", "name", "size", "member_offset", "member_size",
    "offset",
]  # fmt: skip

_WNID = re.compile(r"n\d{8}")
_INNER_TAR = re.compile(r"(n\d{8})\.tar")
_VAL_IMAGE = re.compile(r"ILSVRC2012_val_\d{8}\.JPEG")
_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_TAR_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, ValueError)

# An archive member: (file name, size in bytes, absolute offset of its data in the archive file).
Entry = tuple[str, int, int]


def _redownload(path: Path) -> str:
    return f"re-download {path.name} from image-net.org (or regenerate the demo data)"


def _corrupt(path: Path, detail: str) -> InputError:
    return InputError(f"{path}: corrupt or truncated archive ({detail}); {_redownload(path)}")


def require_archives(data_dir: Path, names: tuple[str, ...] = ARCHIVES) -> None:
    """Raise one InputError naming every missing archive."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise InputError(
            f"data directory {data_dir} does not exist; set data.dir to the directory holding "
            f"{', '.join(ARCHIVES)} (or enable demo data)"
        )
    missing = [name for name in names if not (data_dir / name).is_file()]
    if missing:
        raise InputError(
            f"{', '.join(str(data_dir / n) for n in missing)} not found; download "
            f"{'it' if len(missing) == 1 else 'them'} from https://image-net.org "
            f"(ILSVRC2012) into {data_dir}, or enable demo data"
        )


def _members(tar: tarfile.TarFile, fileobj, length: int, path: Path, *, outer: bool) -> list:
    """The members of ``tar`` (in ``fileobj`` of ``length`` bytes), headers only: regular files
    within it; an ``outer`` (whole-file) tar must have members and its end-of-archive block."""
    members = []
    for member in tar:
        if not member.isreg():
            raise InputError(
                f"{path}: unexpected {'directory' if member.isdir() else 'non-file'} member "
                f"{member.name!r}; {_redownload(path)}"
            )
        if member.offset_data + member.size > length:
            raise _corrupt(path, f"member {member.name} runs past the end")
        members.append(member)
    if outer:
        if not members:
            raise _corrupt(path, "no members")
        fileobj.seek(tar.offset)
        if fileobj.read(_BLOCK) != _ZERO_BLOCK:
            raise _corrupt(path, "no end-of-archive block: the file was cut short")
    return members


def _list_flat_tar(path: Path) -> list[Entry]:
    """All regular-file members of the (uncompressed) tar at ``path``."""
    try:
        with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            members = _members(tar, f, path.stat().st_size, path, outer=True)
    except _TAR_ERRORS as exc:
        raise _corrupt(path, str(exc) or type(exc).__name__) from None
    return [(m.name, m.size, m.offset_data) for m in members]


@dataclass(frozen=True)
class TrainListing:
    """The train archive: per wnid (sorted), its inner tar name and its entries (sorted)."""

    path: Path
    wnids: list[str]
    members: list[str]
    member_offsets: list[int]  # where each inner tar's data starts in the outer tar
    member_sizes: list[int]
    entries: list[list[Entry]]  # offsets absolute in the outer tar


def list_train_archive(data_dir: Path) -> TrainListing:
    """List the outer train tar and every inner per-class tar, reading headers only."""
    path = Path(data_dir) / TRAIN_ARCHIVE
    per_wnid: dict[str, tuple[str, int, int, list[Entry]]] = {}
    try:
        with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as outer:
            inner_tars = _members(outer, f, path.stat().st_size, path, outer=True)
            for member in inner_tars:
                if not _INNER_TAR.fullmatch(member.name):
                    raise InputError(
                        f"{path}: unexpected member {member.name!r} (the train archive must hold "
                        f"only per-class tars nXXXXXXXX.tar); {_redownload(path)}"
                    )
            for member in inner_tars:
                label = Path(f"{path}:{member.name}")
                inner = outer.extractfile(member)
                with tarfile.open(fileobj=inner, mode="r:") as tar:
                    members = _members(tar, inner, member.size, label, outer=False)
                entries = [(m.name, m.size, member.offset_data + m.offset_data) for m in members]
                wnid = member.name[: -len(".tar")]
                for name, _, _ in entries:
                    if "/" in name or not name.lower().endswith(IMAGE_SUFFIXES):
                        raise InputError(
                            f"{label}: unexpected member {name!r} (expected flat image files "
                            f"like {wnid}_1234.JPEG); {_redownload(path)}"
                        )
                if wnid in per_wnid:
                    raise InputError(f"{path}: {member.name} occurs twice; {_redownload(path)}")
                entries.sort()
                per_wnid[wnid] = (member.name, member.offset_data, member.size, entries)
    except _TAR_ERRORS as exc:
        raise _corrupt(path, str(exc) or type(exc).__name__) from None
    wnids = sorted(per_wnid)
    return TrainListing(path, wnids, *map(list, zip(*(per_wnid[w] for w in wnids), strict=True)))


def list_val_archive(data_dir: Path) -> list[Entry]:
    """The val tar's images, sorted by name."""
    path = Path(data_dir) / VAL_ARCHIVE
    entries = sorted(_list_flat_tar(path))
    for name, _, _ in entries:
        if not _VAL_IMAGE.fullmatch(name):
            raise InputError(
                f"{path}: unexpected member {name!r} (the val archive must hold only "
                f"ILSVRC2012_val_NNNNNNNN.JPEG); {_redownload(path)}"
            )
    return entries


@dataclass(frozen=True)
class Devkit:
    idx_to_wnid: dict[int, str]  # ILSVRC2012_ID -> wnid (leaf classes only)
    wnid_to_words: dict[str, str]  # wnid -> "tench, Tinca tinca"
    val_ids: list[int]  # ILSVRC2012_ID per val image, in val file name order

    @property
    def wnids(self) -> list[str]:
        return sorted(self.wnid_to_words)


def _devkit_members(path: Path) -> dict[str, bytes]:
    """meta.mat and the ground truth from the devkit. All of the .gz is decompressed (2.5 MB),
    so that a damaged one fails on its CRC trailer even where the tar inside looks whole."""
    wanted = {META_MAT, VAL_GROUND_TRUTH}
    try:
        with gzip.open(path, "rb") as gz:
            data = gz.read()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            found = {
                m.name.removeprefix("./"): tar.extractfile(m).read()
                for m in tar
                if m.isreg() and m.name.removeprefix("./") in wanted
            }
    except (*_TAR_ERRORS, OSError) as exc:
        raise _corrupt(path, str(exc) or type(exc).__name__) from None
    missing = sorted(wanted - set(found))
    if missing:
        raise InputError(
            f"{path}: {', '.join(missing)} missing from the devkit; {_redownload(path)}"
        )
    return found


def read_devkit(data_dir: Path) -> Devkit:
    """Leaf classes and val labels from the devkit, parsed as torchvision's ImageNet parses them
    (torchvision.datasets.imagenet.parse_devkit_archive, which insists on the official md5)."""
    import scipy.io as sio

    path = Path(data_dir) / DEVKIT_ARCHIVE
    members = _devkit_members(path)
    try:
        synsets = sio.loadmat(io.BytesIO(members[META_MAT]), squeeze_me=True)["synsets"]
        # (ILSVRC2012_ID, WNID, words, gloss, num_children, ...): the leaves are the classes
        leaves = [s for s in synsets if s[4] == 0]
        idx_to_wnid = {int(s[0]): str(s[1]) for s in leaves}
        wnid_to_words = {str(s[1]): str(s[2]) for s in leaves}
    except Exception as exc:  # scipy raises many kinds on a bad .mat
        raise InputError(
            f"{path}: {META_MAT} is not a valid ILSVRC2012 meta.mat ({exc}); {_redownload(path)}"
        ) from None
    try:
        val_ids = [int(line) for line in members[VAL_GROUND_TRUTH].decode().splitlines()]
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(
            f"{path}: {VAL_GROUND_TRUTH} must hold one class id per line ({exc}); "
            f"{_redownload(path)}"
        ) from None
    if len(set(idx_to_wnid.values())) != len(idx_to_wnid):
        raise InputError(f"{path}: meta.mat lists a wnid twice; {_redownload(path)}")
    bad = sorted(w for w in idx_to_wnid.values() if not _WNID.fullmatch(w))
    if bad:
        raise InputError(f"{path}: meta.mat has malformed wnids {bad[:5]}; {_redownload(path)}")
    unknown = sorted(set(val_ids) - set(idx_to_wnid))
    if unknown:
        raise InputError(
            f"{path}: the val ground truth uses class ids {unknown[:5]} that meta.mat does not "
            f"define as leaf classes; {_redownload(path)}"
        )
    return Devkit(idx_to_wnid, wnid_to_words, val_ids)


def _check_consistent(data_dir: Path, devkit: Devkit, train: TrainListing, val) -> None:
    data_dir = Path(data_dir)
    if train.wnids != devkit.wnids:
        only_train = sorted(set(train.wnids) - set(devkit.wnids))
        only_devkit = sorted(set(devkit.wnids) - set(train.wnids))
        raise InputError(
            f"{data_dir / TRAIN_ARCHIVE} and {data_dir / DEVKIT_ARCHIVE} disagree on the classes "
            f"({len(train.wnids)} vs {len(devkit.wnids)}; only in train: {only_train[:5]}, only "
            f"in devkit: {only_devkit[:5]}); the train archive may be truncated: re-download it"
        )
    empty = [w for w, e in zip(train.wnids, train.entries, strict=True) if not e]
    if empty:
        raise InputError(
            f"{data_dir / TRAIN_ARCHIVE}: classes {empty[:5]} have no images; "
            f"{_redownload(data_dir / TRAIN_ARCHIVE)}"
        )
    if val is not None and len(val) != len(devkit.val_ids):
        raise InputError(
            f"{data_dir / VAL_ARCHIVE} holds {len(val)} images but the ground truth in "
            f"{data_dir / DEVKIT_ARCHIVE} has {len(devkit.val_ids)} lines; one of them is "
            "truncated or from another release: re-download both"
        )


def read_md5sums(path: Path) -> dict[str, str]:
    """``md5sum`` output -> {file name: hex digest}."""
    sums = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"\\?([0-9a-fA-F]{32}) [ *](.+)", line.strip())
        if match is None:
            raise InputError(
                f'{path}:{number}: not md5sum format ("<md5>  <file name>"); fix or delete it'
            )
        sums[Path(match.group(2)).name] = match.group(1).lower()
    return sums


def verify_archives(data_dir: Path, *, check_md5: bool = True, index=None) -> dict:
    """Check presence, structure (every header) and, last, md5 of the three archives:
    InputError on the first problem, else a JSON-able report. ``index``: :func:`build_index`'s
    tables where the caller read them (every header is read once)."""
    data_dir = Path(data_dir)
    classes, train, val = index or build_index(data_dir)

    md5sums_path = data_dir / MD5SUMS
    expected = read_md5sums(md5sums_path) if md5sums_path.is_file() else None
    files = {}
    for name in ARCHIVES:
        path = data_dir / name
        record = {"size": path.stat().st_size, "md5": None, "md5_expected": None}
        if not check_md5:
            record["md5_status"] = "skipped"
        elif expected is None:
            record["md5_status"] = "no md5sums file"
        elif name not in expected:
            record["md5_status"] = "not listed in md5sums"
        else:
            record["md5"] = file_digest(path, "md5")
            record["md5_expected"] = expected[name]
            if record["md5"] != expected[name]:
                raise InputError(
                    f"{path}: md5 mismatch (expected {expected[name]} from {md5sums_path}, "
                    f"actual {record['md5']}); the file is damaged: {_redownload(path)}"
                )
            record["md5_status"] = "ok"
        files[name] = record
    return {
        "data_dir": str(data_dir),
        "md5sums": str(md5sums_path) if expected is not None else None,
        "check_md5": check_md5,
        "files": files,
        "counts": {"classes": len(classes), "train_images": len(train), "val_images": len(val)},
    }


def _class_table(devkit) -> pd.DataFrame:
    wnids = devkit.wnids
    return pd.DataFrame(
        {
            "class_index": np.arange(len(wnids), dtype=np.int64),
            "wnid": wnids,
            "words": [devkit.wnid_to_words[w] for w in wnids],
        }
    )


def _train_table(wnids: list[str], listing) -> pd.DataFrame:
    """One row per image of the train archive's per-class members, in the listing's order."""
    counts = [len(e) for e in listing.entries]
    class_of_sample = np.repeat(np.arange(len(wnids), dtype=np.int64), counts)
    names, sizes, absolute = zip(*(e for entries in listing.entries for e in entries), strict=True)
    member_offsets = np.asarray(listing.member_offsets, dtype=np.int64)[class_of_sample]
    return pd.DataFrame(
        {
            "sample_id": np.arange(len(names), dtype=np.int64),
            "class_index": class_of_sample,
            "wnid": np.asarray(wnids, dtype=object)[class_of_sample],
            "member": np.asarray(listing.members, dtype=object)[class_of_sample],
            "name": list(names),
            "size": np.array(sizes, dtype=np.int64),
            "member_offset": member_offsets,
            "member_size": np.asarray(listing.member_sizes, dtype=np.int64)[class_of_sample],
            "offset": np.array(absolute, dtype=np.int64) - member_offsets,
        }
    )


def _val_table(devkit, val_entries) -> pd.DataFrame:
    """One row per val image, by class (the devkit's ground truth), then by file name."""
    wnids = devkit.wnids
    wnid_index = {w: i for i, w in enumerate(wnids)}
    val_class = np.array(
        [wnid_index[devkit.idx_to_wnid[i]] for i in devkit.val_ids], dtype=np.int64
    )
    order = np.argsort(val_class, kind="stable")  # val_entries are sorted by name already
    return pd.DataFrame(
        {
            "sample_id": np.arange(len(val_entries), dtype=np.int64),
            "class_index": val_class[order],
            "wnid": np.asarray(wnids, dtype=object)[val_class[order]],
            "member": "",
            "name": [val_entries[i][0] for i in order],
            "size": np.array([val_entries[i][1] for i in order], dtype=np.int64),
            "member_offset": 0,
            "member_size": 0,
            "offset": np.array([val_entries[i][2] for i in order], dtype=np.int64),
        }
    )


def build_index(data_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(classes, train, val) tables from the archives' headers: class_index, wnid, words and
    SAMPLE_COLUMNS, by class index then file name (val's member "", member_offset 0), after
    checking the devkit and both archives describe the same classes and images."""
    data_dir = Path(data_dir)
    require_archives(data_dir)
    devkit = read_devkit(data_dir)
    val, train = list_val_archive(data_dir), list_train_archive(data_dir)
    _check_consistent(data_dir, devkit, train, val)
    train, val = _train_table(devkit.wnids, train), _val_table(devkit, val)
    return _class_table(devkit), train[SAMPLE_COLUMNS], val[SAMPLE_COLUMNS]


def header_matches(header: bytes, name: str, size: int) -> bool:
    """Whether ``header`` (the 512 bytes before a member's data) describes ``name``, ``size``
    (a long name is stored cut to 100 bytes: a prefix matches)."""
    if len(header) != _BLOCK:
        return False
    try:
        info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")  # checksum checked
    except tarfile.HeaderError:
        return False
    return info.size == size and bool(info.name) and name.startswith(info.name)


def read_archive_items(archive: Path, index: pd.DataFrame) -> Iterator[tuple[int, bytes]]:
    """(sample_id, raw bytes) in index order from ``archive``: one pread per image, its header
    included, which must name the same file and size (an archive changed since indexing fails
    here, never decodes wrong)."""
    require_archives(archive.parent, (archive.name,))
    columns = ("sample_id", "member", "name", "size", "member_offset", "offset")
    fd = os.open(archive, os.O_RDONLY)
    try:
        for sample_id, member, name, size, member_offset, offset in zip(
            *(index[c].tolist() for c in columns), strict=True
        ):
            start = member_offset + offset - _BLOCK
            raw = os.pread(fd, _BLOCK + size, start) if start >= 0 else b""
            if len(raw) != _BLOCK + size or not header_matches(raw[:_BLOCK], name, size):
                raise InputError(
                    f"{archive}: {member + '/' if member else ''}{name} has another size or "
                    "place in the archive than the index says (the archive changed since the "
                    "index was built); rebuild the index (`imagenet-ddp index`)"
                )
            yield sample_id, raw[_BLOCK:]
    finally:
        os.close(fd)
