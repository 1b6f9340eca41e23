"""Input layouts: the registry of the ways ``data.dir`` may hold the images (each class's
``summary``), named by ``data.layout`` or found (the first in ``LAYOUTS`` whose markers exist).
Every layout gives the same index for the same images (torchvision's order, equal
``SAME_COLUMNS``; tests/test_layouts.py). Standard library only at import: the dry-run checks
the structure without numpy or pandas."""

from __future__ import annotations

import collections
import csv
import functools
import hashlib
import itertools
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from imagenet_ddp.data.archive_names import (
    ARCHIVES,
    DEVKIT_ARCHIVE,
    IMAGE_SUFFIXES,
    TRAIN_ARCHIVE,
    VAL_ARCHIVE,
)
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import stops_noted

AUTO = "auto"
# The columns equal in every layout for the same images; the rest say where the bytes are.
SAME_COLUMNS = ["sample_id", "class_index", "wnid", "name", "size"]
SYNSET_MAPPING = "LOC_synset_mapping.txt"

# ILSVRC2012, recognised by the sha256 of its sorted wnids joined by "\n": its counts are checked
# (no official per-class train table: a class against the range, the set against the total).
ILSVRC2012_WNIDS_SHA256 = "385e0240499426c022b773be1ae4da780f057b89c9694c7f47199f62746b6edd"
ILSVRC2012_TRAIN_IMAGES = 1_281_167
ILSVRC2012_TRAIN_PER_CLASS = (732, 1300)
ILSVRC2012_VAL_PER_CLASS = 50

_IO_THREADS = 16  # stat/open calls per job: latency-bound on Lustre/GPFS/NFS, not CPU-bound
_JPEG_TAIL = 4096  # a JPEG's end-of-image marker must lie in its last 4 KiB


def check_imagenet_counts(where: str, train: dict[str, int], val: dict[str, int]) -> None:
    """For ILSVRC2012's classes only: its published counts (one line naming the class)."""
    if hashlib.sha256("\n".join(sorted(train)).encode()).hexdigest() != ILSVRC2012_WNIDS_SHA256:
        return
    (low, high), per_val = ILSVRC2012_TRAIN_PER_CLASS, ILSVRC2012_VAL_PER_CLASS
    problems = [
        f"class {n} has {c} train images, ILSVRC2012 has {low} to {high} per class"
        for n, c in sorted(train.items())
        if not low <= c <= high
    ]
    problems += [
        f"class {n} has {c} validation images, ILSVRC2012 has {per_val}"
        for n, c in sorted(val.items())
        if c != per_val
    ]
    if (total := sum(train.values())) != ILSVRC2012_TRAIN_IMAGES:
        problems.append(f"{total} train images, ILSVRC2012 has {ILSVRC2012_TRAIN_IMAGES}")
    if problems:
        raise InputError(
            f"{where}: {problems[0]}; the copy is incomplete: restore it or re-extract it"
        )


class Layout:
    """One way of keeping the images; it also has ``class_count``, ``verify``, ``build_index``,
    ``read_items`` ((sample_id, bytes) in index order, refusing data changed since indexing)
    and ``place`` (a sample's location, for a message)."""

    name: str
    summary: str
    markers: tuple[str, ...]  # paths under data.dir that all exist
    input_keys: tuple[str, ...]  # the rules' input names of the markers
    remedy: str  # what to do where a marker is missing

    def inputs(self, data_dir: str) -> dict[str, str]:
        """The rules' inputs (a change of one reruns verify and index)."""
        pairs = zip(self.input_keys, self.markers, strict=True)
        return {key: f"{data_dir}/{marker}" for key, marker in pairs}

    def check_structure(self, data_dir: Path) -> None:
        """Cheap checks for the dry-run (no file is opened): InputError on the first problem."""


class Archives(Layout):
    name = "archives"
    summary = f"the ILSVRC2012 archives ({', '.join(ARCHIVES)})"
    markers = (TRAIN_ARCHIVE, VAL_ARCHIVE, DEVKIT_ARCHIVE)
    input_keys = ("train", "val", "devkit")
    remedy = "download them from https://image-net.org (ILSVRC2012), or enable demo data"

    def class_count(self, data_dir: Path) -> int:
        return 1000  # the archives are ILSVRC2012's (verify checks its 1,000 classes)

    def verify(self, data_dir: Path, *, check_files: bool) -> dict:
        from imagenet_ddp.data.archives import build_index, verify_archives

        classes, train, val = index = build_index(data_dir)
        wnids = classes["wnid"].tolist()
        check_imagenet_counts(
            str(data_dir), _counts(wnids, train["wnid"]), _counts(wnids, val["wnid"])
        )  # before the md5 of ~150 GB
        return verify_archives(data_dir, check_md5=check_files, index=index)

    def build_index(self, data_dir: Path):
        from imagenet_ddp.data.archives import build_index

        return build_index(data_dir)

    def read_items(self, data_dir: Path, which: str, index) -> Iterator[tuple[int, bytes]]:
        from imagenet_ddp.data.archives import read_archive_items

        return read_archive_items(self._archive(data_dir, which), index)

    def place(self, data_dir: Path, which: str, member: str, name: str) -> str:
        return f"{self._archive(data_dir, which)}:{member + '/' if member else ''}{name}"

    @staticmethod
    def _archive(data_dir: Path, which: str) -> Path:
        return Path(data_dir) / (TRAIN_ARCHIVE if which == "train" else VAL_ARCHIVE)


class _Folders(Layout):
    """Extracted image files, a folder per train class. A subclass has ``words`` and
    ``val_files`` ((class, folder, file name) of each validation image)."""

    train_dir: str
    val_dir: str

    def check_structure(self, data_dir: Path) -> None:
        data_dir = Path(data_dir)
        classes = _class_folders(data_dir, self.train_dir)
        self.words(data_dir, classes)
        for name in classes:
            _require_not_empty(data_dir / self.train_dir / name)
        self.val_files(data_dir, classes)

    def class_count(self, data_dir: Path) -> int:
        return len(_class_folders(Path(data_dir), self.train_dir))

    def listing(self, data_dir: Path) -> tuple[list[str], list, list]:
        """Classes (sorted), and train and val as (class, folder, name) sorted by class, name."""
        data_dir = Path(data_dir)
        self.check_structure(data_dir)
        classes = _class_folders(data_dir, self.train_dir)
        skipped: list[str] = []  # non-image files, skipped as torchvision's ImageFolder does
        folders = [f"{self.train_dir}/{c}" for c in classes]  # one string per class, shared
        folder_files = functools.partial(_image_files, data_dir, skipped=skipped)
        per_class = [names for _, names in _threaded(folder_files, folders)]
        train = [
            (c, folder, name)
            for c, folder, names in zip(classes, folders, per_class, strict=True)
            for name in names
        ]
        rank = {c: i for i, c in enumerate(classes)}
        val = sorted(self.val_files(data_dir, classes, skipped), key=lambda s: (rank[s[0]], s[2]))
        if skipped:
            print(f"data.dir {data_dir}: skipped {len(skipped)} file(s) that are no image "
                  f"({', '.join(IMAGE_SUFFIXES)}), e.g. {min(skipped)}",
                  file=sys.stderr)  # fmt: skip
        return classes, train, val

    def verify(self, data_dir: Path, *, check_files: bool) -> dict:
        data_dir = Path(data_dir)
        classes, train, val = self.listing(data_dir)
        counts = [_counts(classes, (c for c, _, _ in samples)) for samples in (train, val)]
        check_imagenet_counts(str(data_dir), *counts)
        if check_files:
            _check_files(data_dir, [*train, *val])
        return {
            "layout": self.name,
            "data_dir": str(data_dir),
            "check_files": check_files,
            "counts": {"classes": len(classes), "train_images": len(train), "val_images": len(val)},
        }

    def build_index(self, data_dir: Path):
        import numpy as np
        import pandas as pd

        data_dir = Path(data_dir)
        classes, train, val = self.listing(data_dir)
        words = self.words(data_dir, classes)
        table = pd.DataFrame(
            {
                "class_index": np.arange(len(classes), dtype=np.int64),
                "wnid": classes,
                "words": [words[c] for c in classes],
            }
        )
        rank = {c: i for i, c in enumerate(classes)}
        return table, _sample_table(data_dir, train, rank), _sample_table(data_dir, val, rank)

    def read_items(self, data_dir: Path, which: str, index) -> Iterator[tuple[int, bytes]]:
        # On threads, 256 ahead: at an assumed 1 ms an open, serial would take 20 min a pass.
        columns = ("sample_id", "member", "name", "size")
        rows = zip(*(index[c].tolist() for c in columns), strict=True)
        read = functools.partial(_read_sample, Path(data_dir))
        for (sample_id, *_), data in _threaded(read, rows, batch=256):
            yield sample_id, data

    def place(self, data_dir: Path, which: str, member: str, name: str) -> str:
        return str(Path(data_dir) / member / name)


class ImageFolder(_Folders):
    name = "imagefolder"
    summary = "an ImageFolder tree (train/<class>/*, val/<class>/*)"
    markers = ("train", "val")
    input_keys = ("train", "val")
    remedy = "extract both (valprep.sh sorts val/ into class folders)"
    train_dir, val_dir = "train", "val"

    def words(self, data_dir: Path, classes: list[str]) -> dict[str, str]:
        path = Path(data_dir) / SYNSET_MAPPING
        if not path.is_file():
            return {c: c for c in classes}
        return _read_synset_mapping(path, classes)

    def val_files(self, data_dir: Path, classes: list[str], skipped=None) -> list[tuple]:
        val_classes = _class_folders(data_dir, self.val_dir, unlabelled=True)
        _same_classes(data_dir, classes, val_classes)
        folders = {c: f"{self.val_dir}/{c}" for c in classes}  # one string per class, shared
        listed = _threaded(lambda c: _image_files(data_dir, folders[c], skipped), classes)
        return [(c, folders[c], f) for c, names in listed for f in names]


class Kaggle(_Folders):
    name = "kaggle"
    summary = (
        "Kaggle's ILSVRC tree (ILSVRC/Data/CLS-LOC/train/<wnid>/*, ILSVRC/Data/CLS-LOC/val/*, "
        f"LOC_val_solution.csv, {SYNSET_MAPPING})"
    )
    markers = (
        "ILSVRC/Data/CLS-LOC/train",
        "ILSVRC/Data/CLS-LOC/val",
        "LOC_val_solution.csv",
        SYNSET_MAPPING,
    )
    input_keys = ("train", "val", "val_solution", "synsets")
    remedy = "download the whole Kaggle ImageNet Object Localization Challenge data"
    train_dir, val_dir = "ILSVRC/Data/CLS-LOC/train", "ILSVRC/Data/CLS-LOC/val"

    def words(self, data_dir: Path, classes: list[str]) -> dict[str, str]:
        path = Path(data_dir) / SYNSET_MAPPING
        words = _read_synset_mapping(path, None)
        if sorted(words) != classes:
            _same_classes(data_dir, sorted(words), classes, first=str(path))
        return words

    def val_files(self, data_dir: Path, classes: list[str], skipped=None) -> list[tuple]:
        labels = _read_val_solution(Path(data_dir) / "LOC_val_solution.csv", set(classes))
        names = _image_files(data_dir, self.val_dir, skipped)
        unlabelled = [n for n in names if Path(n).stem not in labels]
        if unlabelled:
            raise InputError(
                f"{Path(data_dir) / self.val_dir / unlabelled[0]}: no label in "
                f"{Path(data_dir) / 'LOC_val_solution.csv'} ({len(unlabelled)} validation images "
                "unlabelled); restore the csv from Kaggle, or remove images that are not ILSVRC's"
            )
        if len(names) != len(labels):
            missing = sorted(set(labels) - {Path(n).stem for n in names})
            raise InputError(
                f"{Path(data_dir) / self.val_dir}: {missing[0]} (and {len(missing) - 1} more "
                "labelled in LOC_val_solution.csv) not found; the copy is incomplete: "
                "restore it from Kaggle"
            )
        return [(labels[Path(n).stem], self.val_dir, n) for n in names]


# The precedence where data.dir holds several (torchvision extracts beside the archives).
LAYOUTS: dict[str, Layout] = {
    layout.name: layout for layout in (Archives(), ImageFolder(), Kaggle())
}
NAMES = (AUTO, *LAYOUTS)


def expected() -> str:
    return "; or ".join(f"{layout.summary}" for layout in LAYOUTS.values())


def _missing(data_dir: Path, layout: Layout) -> list[str]:
    return [m for m in layout.markers if not (data_dir / m).exists()]


def find_layout(data_dir: str | os.PathLike[str], named: str = AUTO) -> Layout:
    """The layout ``named`` (it must be complete) or the first complete one; one line if none."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise InputError(
            f"data.dir {data_dir} does not exist; set data.dir to a directory holding "
            f"{expected()} (or enable demo data)"
        )
    if named != AUTO:
        if named not in LAYOUTS:
            raise InputError(f"data.layout {named!r} is not one of {', '.join(NAMES)}")
        missing = _missing(data_dir, LAYOUTS[named])
        if missing:
            raise InputError(
                f"data.dir {data_dir} (data.layout: {named}) lacks {', '.join(missing)}; "
                f"expected {LAYOUTS[named].summary}"
            )
        return LAYOUTS[named]
    for layout in LAYOUTS.values():
        if not _missing(data_dir, layout):
            return layout
    partial = [lay for lay in LAYOUTS.values() if len(_missing(data_dir, lay)) < len(lay.markers)]
    if len(partial) == 1:  # the one it looks like: what it lacks, and where to get it
        missing = ", ".join(str(data_dir / m) for m in _missing(data_dir, partial[0]))
        raise InputError(
            f"data.dir {data_dir} holds part of {partial[0].summary}: {missing} not found; "
            f"{partial[0].remedy}"
        )
    raise InputError(
        f"data.dir {data_dir}: no input layout recognised; expected {expected()}; "
        "or set demo.enabled: true"
    )


def dry_run_layout(data_dir: str, named: str = AUTO) -> Layout:
    """The layout the jobs will read, after its structure checks; the jobs find it from
    data.dir themselves, so a named layout must be the one found first."""
    layout = find_layout(data_dir, named)
    first = find_layout(data_dir)
    if first is not layout:
        raise InputError(
            f"data.dir {data_dir} holds {first.summary} as well as data.layout {named}'s "
            f"files; the jobs read {first.name} first: set data.layout: {first.name} (or auto), "
            f"or point data.dir at a directory holding only {layout.summary}"
        )
    layout.check_structure(Path(data_dir))
    return layout


def _entries(folder: Path, most: int | None = None) -> list[os.DirEntry]:
    """The entries of ``folder`` by name (with ``most``: the first that many listed)."""
    try:
        with os.scandir(folder) as it:
            return sorted(itertools.islice(it, most), key=lambda e: e.name)
    except OSError as exc:
        raise InputError(f"{folder}: cannot be listed ({exc.strerror or exc})") from None


def _class_folders(data_dir: Path, root: str, *, unlabelled: bool = False) -> list[str]:
    """The class folder names under ``data_dir/root``; a file there is stray (or, in a
    validation folder, an unlabelled image)."""
    folder = Path(data_dir) / root
    entries = _entries(folder)
    files = [e.name for e in entries if not e.is_dir()]
    if files:
        what = "an unlabelled validation image" if unlabelled else "a stray file"
        raise InputError(
            f"{folder / files[0]}: {what} ({len(files)} files beside the class folders; "
            f"{folder} must hold only one folder per class): move it into its class folder "
            "or remove it"
        )
    classes = [e.name for e in entries]
    if not classes:
        raise InputError(f"{folder} is empty; it must hold one folder per class")
    return classes


def _require_not_empty(folder: Path) -> None:
    if not _entries(folder, 1):  # one entry listed: cheap for the dry-run's 1,000 folders
        raise InputError(f"{folder} is empty; remove the class folder or restore its images")


def _image_files(data_dir: Path, folder: str, skipped: list[str] | None = None) -> list[str]:
    """The image file names in ``folder``, sorted; other files are left out as ImageFolder
    leaves them (their paths added to ``skipped``); a folder there is refused."""
    path = Path(data_dir) / folder
    names, others = [], []
    for entry in _entries(path):
        if entry.is_dir():
            raise InputError(
                f"{path / entry.name}: a stray folder (a class folder holds only images: "
                f"{', '.join(IMAGE_SUFFIXES)}); remove it"
            )
        image = entry.name.lower().endswith(IMAGE_SUFFIXES)
        (names if image else others).append(entry.name)
    if skipped is not None:
        skipped.extend(str(path / name) for name in others)
    if not names:
        raise InputError(
            f"{path} is empty (no {', '.join(IMAGE_SUFFIXES)} file); remove the class folder "
            "or restore its images"
        )
    return names


def _same_classes(data_dir, train: list[str], other: list[str], *, first: str = "") -> None:
    if train == other:
        return
    only_first = sorted(set(train) - set(other))
    only_other = sorted(set(other) - set(train))
    a = first or "the train folder"
    raise InputError(
        f"data.dir {data_dir}: class folders differ between {a} and the "
        f"{'train' if first else 'validation'} folders (missing {only_first[:3] or only_other[:3]}"
        f"{' ...' if len(only_first) + len(only_other) > 3 else ''}: "
        f"{len(only_first)} only in {a}, {len(only_other)} only in the other); "
        "restore the missing class folders"
    )


def _read_synset_mapping(path: Path, classes: list[str] | None) -> dict[str, str]:
    """``<class> <words>`` per line; every class of the tree must be there."""
    words = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot be read ({exc})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        name, _, text = line.strip().partition(" ")
        if name in words:
            raise InputError(f"{path}:{number}: {name} is listed twice; fix the file")
        words[name] = text.strip() or name
    if classes is not None:
        missing = [c for c in classes if c not in words]
        if missing:
            raise InputError(
                f"{path}: no line for the class folders {missing[:3]}; add '<class> <words>' "
                "lines or remove the file (the folder names are then the words)"
            )
        return {c: words[c] for c in classes}
    return words


def _read_val_solution(path: Path, classes: set[str]) -> dict[str, str]:
    """Kaggle's LOC_val_solution.csv: ImageId -> the first wnid of its PredictionString."""
    labels = {}
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"{path}: cannot be read ({exc}); restore it from Kaggle") from None
    if not rows or rows[0][:2] != ["ImageId", "PredictionString"]:
        raise InputError(f"{path}: not Kaggle's LOC_val_solution.csv (header ImageId,...)")
    for number, row in enumerate(rows[1:], start=2):
        tokens = row[1].split() if len(row) == 2 else []
        if not tokens or tokens[0] not in classes:
            raise InputError(
                f"{path}:{number}: no known class in {row!r} (the classes are "
                f"{SYNSET_MAPPING}'s); restore the file from Kaggle"
            )
        labels[row[0]] = tokens[0]
    return labels


def _counts(classes: list[str], labels) -> dict[str, int]:
    """Images per class (``labels``: one class name per image), every class listed."""
    return {**dict.fromkeys(classes, 0), **collections.Counter(labels)}


def _file_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole image file (unreadable, empty, a JPEG without its end
    marker), without decoding it; None when it looks whole."""
    try:
        with open(path, "rb") as f:
            head = f.read(3)
            if not head:
                return "an empty file"
            if head != b"\xff\xd8\xff":
                return None  # not a JPEG (e.g. ILSVRC's PNG under a .JPEG name): prepare decodes
            size = os.fstat(f.fileno()).st_size
            tail = os.pread(f.fileno(), _JPEG_TAIL, max(0, size - _JPEG_TAIL))
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return None if b"\xff\xd9" in tail else "a truncated JPEG (no end-of-image marker)"


def _read_sample(data_dir: Path, row: tuple[int, str, str, int]) -> bytes:
    """One image's bytes; it must have the size the index says."""
    _, member, name, size = row
    path = data_dir / member / name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(
            f"{path}: cannot be read ({exc.strerror or exc}); restore it, or rebuild the "
            "index (`imagenet-ddp index`) if it was removed on purpose"
        ) from None
    if len(data) != size:
        raise InputError(
            f"{path} has {len(data)} bytes, the index says {size} (the file changed "
            "since the index was built); rebuild the index (`imagenet-ddp index`)"
        )
    return data


def _threaded(function, items: Iterator, batch: int = 4096) -> Iterator[tuple]:
    """(item, function(item)) in order, ``_IO_THREADS`` at a time, in batches (Executor.map
    would submit a million futures at once). A Ctrl-C is raised between items, never inside the
    pool's calls (io.stops_noted); the queued calls are cancelled, the running ones finish."""
    items, pool = iter(items), ThreadPoolExecutor(_IO_THREADS)
    with stops_noted() as stop_if_noted:
        try:
            while chunk := list(itertools.islice(items, batch)):
                for done in zip(chunk, pool.map(function, chunk), strict=True):
                    stop_if_noted()
                    yield done
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _check_files(data_dir: Path, samples: list[tuple[str, str, str]]) -> None:
    """Open every image (on threads); the first problem in sample order is refused."""
    paths = (Path(data_dir) / folder / name for _, folder, name in samples)
    for path, problem in _threaded(_file_problem, paths):
        if problem:
            raise InputError(
                f"{path}: {problem}; replace it with a whole copy, or remove it "
                "(the index lists what is on disk)"
            )


def _sample_table(data_dir: Path, samples: list[tuple[str, str, str]], rank: dict[str, int]):
    """The index rows of ``samples`` (sizes from one stat each; nothing decoded)."""
    import numpy as np
    import pandas as pd

    paths = (Path(data_dir) / folder / name for _, folder, name in samples)
    sizes = [size for _, size in _threaded(lambda p: p.stat().st_size, paths)]
    n = len(samples)
    return pd.DataFrame(
        {
            "sample_id": np.arange(n, dtype=np.int64),
            "class_index": np.array([rank[c] for c, _, _ in samples], dtype=np.int64),
            "wnid": [c for c, _, _ in samples],
            "member": [folder for _, folder, _ in samples],
            "name": [name for _, _, name in samples],
            "size": np.array(sizes, dtype=np.int64),
            "member_offset": np.zeros(n, dtype=np.int64),
            "member_size": np.zeros(n, dtype=np.int64),
            "offset": np.zeros(n, dtype=np.int64),
        }
    )


def write_verify_report(data_dir: Path, report: Path, *, check_md5: bool, layout: str = AUTO):
    """The ``verify`` stage for any layout: its report (``layout`` added) and provenance."""
    from imagenet_ddp.io import write_json_atomic
    from imagenet_ddp.provenance import provenance_path, write_provenance

    found = find_layout(data_dir, layout)
    result = {"layout": found.name, **found.verify(Path(data_dir), check_files=check_md5)}
    write_json_atomic(report, result)
    write_provenance(
        provenance_path(report),
        "verify",
        {"data_dir": str(data_dir), "check_md5": check_md5, "layout": found.name},
    )


def write_index(data_dir: Path, out_dir: Path, *, layout: str = AUTO) -> None:
    """The ``index`` stage for any layout: classes.csv, train.csv, val.csv and provenance.json
    in ``out_dir``, all or none (a Ctrl-C while they are written leaves no partial index)."""
    from imagenet_ddp.io import atomic_path, write_csv_atomic
    from imagenet_ddp.provenance import provenance_path, write_provenance

    found = find_layout(data_dir, layout)
    ours = {"classes.csv", "train.csv", "val.csv", "provenance.json"}
    if Path(out_dir).is_dir() and not {p.name for p in Path(out_dir).iterdir()} <= ours:
        raise InputError(  # before the listing: minutes on 1.28 M images
            f"{out_dir} holds files that are no index's; give the index a folder of its own"
        )
    classes, train, val = found.build_index(Path(data_dir))
    with atomic_path(out_dir, is_dir=True) as tmp:  # replaces an earlier index whole
        for name, frame in (("classes", classes), ("train", train), ("val", val)):
            write_csv_atomic(tmp / f"{name}.csv", frame)
        write_provenance(
            provenance_path(tmp),
            "index",
            {"data_dir": str(data_dir), "layout": found.name},
            extra={"counts": {"classes": len(classes), "train": len(train), "val": len(val)}},
        )
