"""Shared fixtures: one small demo ILSVRC2012 (built once per session) and its derived data.

Tests must treat these directories as read-only; use ``writable_archives`` to damage a copy.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm_cluster.fixture import slurm_cluster  # noqa: F401  (session: local SLURM)

# What the workflow writes in the checkout it runs in (the demo's outputs, Snakemake's state). A
# test that reads them passes or fails by what the user ran before; one that writes them damages
# the user's results: every test works in its own temporary directory instead.
REPO = Path(__file__).resolve().parents[1]
CHECKOUT_OUTPUTS = tuple(
    str(REPO / name) for name in ("results", "resources", "logs", ".snakemake")
)
# Importing Snakemake puts the relative .snakemake/pip-deployments on sys.path; torch's first
# lookup of its CUDA libraries (an import of timm, say) then probes paths below it. A library
# search, not a test reading outputs, whichever test happens to import first.
PIP_DEPLOYMENTS = str(REPO / ".snakemake" / "pip-deployments")
_outputs_read: list[str] = []
_recording = [False]  # off while the fixture lists the outputs itself


def _under_outputs(path) -> bool:
    path = os.path.abspath(os.fsdecode(path))
    return any(path == top or path.startswith(top + os.sep) for top in CHECKOUT_OUTPUTS)


def _record_reads(event: str, args: tuple) -> None:
    """Audit hook: this process opening or listing anything under the checkout's outputs (reads
    in subprocesses show only when they write; Snakemake always writes .snakemake/)."""
    if not _recording[0] or event not in ("open", "os.listdir", "os.scandir"):
        return
    if not isinstance(args[0], (str, bytes, os.PathLike)):
        return  # a file descriptor
    if os.fsdecode(args[0]) in sys.path:
        return  # the import system (and importlib.metadata) scanning a sys.path entry: importing
        # Snakemake adds the relative .snakemake/pip-deployments; not the test reading outputs
    path = os.path.abspath(os.fsdecode(args[0]))
    if path == PIP_DEPLOYMENTS or path.startswith(PIP_DEPLOYMENTS + os.sep):
        return
    if _under_outputs(args[0]):
        _outputs_read.append(os.fsdecode(args[0]))


sys.addaudithook(_record_reads)  # hooks cannot be removed: it records for the whole session


def _outputs_listing() -> dict[str, tuple[int, int]]:
    """Every path under the checkout's outputs with its mtime and size (os.lstat: a link is not
    followed)."""
    listing = {}
    for top in CHECKOUT_OUTPUTS:
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames + filenames:
                stat = os.lstat(os.path.join(dirpath, name))
                listing[os.path.join(dirpath, name)] = (stat.st_mtime_ns, stat.st_size)
    return listing


@pytest.fixture(autouse=True)
def _checkout_outputs_untouched(tmp_path):
    """Fails the test that read or wrote the checkout's results/, resources/, logs/ or
    .snakemake/ (CI runs the demo in its checkout first, so that there is something to read).
    Takes ``tmp_path`` so that it stops recording before pytest removes a passing test's
    tmp_path: rmtree opens names relative to a directory's descriptor, a ``results`` among them,
    which the hook would take for the checkout's."""
    before = _outputs_listing()
    del _outputs_read[:]
    _recording[0] = True
    yield
    _recording[0] = False
    read = sorted(set(_outputs_read))
    after = _outputs_listing()
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    if read or changed:
        pytest.fail(
            "the test touched the checkout's outputs instead of its temporary directory: "
            f"read {read[:5]}, created, changed or removed {changed[:5]}",
            pytrace=False,
        )


# CI runs the suite on 2 workers (pytest-xdist, the README's `-n 2`) as two chains, one per
# worker, both from the start: the files that build a pipeline in a module fixture (built once,
# not once per worker), in order, and the SLURM tests, in order (one cluster per worker). The
# other tests go to whichever worker is free. The SLURM tests left both cores idle about a third
# of their ~19 min (waiting for slurmctld's checks and the plugin's status polls, which back off
# to 3 min), which they spent alone at the end until 2026-12-07.
SERIAL_FILES = ("test_report.py", "test_resume.py", "test_workflow_local.py")


def _chain(path_or_nodeid: str) -> str | None:
    """'slurm' or 'serial' for a test of one of the two chains, else None."""
    name = str(path_or_nodeid).split("::", 1)[0].rsplit("/", 1)[-1]
    if name.startswith("test_slurm_"):
        return "slurm"
    return "serial" if name in SERIAL_FILES else None


def pytest_collection_modifyitems(config, items):
    """The chains first, in order (the scheduler below hands each to one worker at once), then
    the other pipeline runs (``e2e``): the last of them, started late, was the suite's tail."""
    chains = [item for item in items if _chain(item.nodeid)]
    rest = [item for item in items if not _chain(item.nodeid)]
    rest.sort(key=lambda item: item.get_closest_marker("e2e") is None)  # stable
    items[:] = chains + rest


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without it, not called
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with one scope per chain and one per test for the others: the
    two largest scopes, the chains, go first, one to each worker (xdist orders scopes by their
    number of tests). Not `--dist loadgroup`: pytest-xdist 3.8.0 marks a group in the test id by
    setting ``item._nodeid``, which pytest 9 no longer reads."""
    from xdist.scheduler import LoadScopeScheduling

    class TwoChains(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _chain(nodeid) or nodeid

    return TwoChains(config, log)


# The prepare settings the fixtures and tests use where they do not test them.
PREPARE_SETTINGS = {"quality": 90, "workers": 1, "on_corrupt": "fail"}

DEMO_KWARGS = {
    "num_classes": 4,
    "train_per_class": 12,
    "val_per_class": 2,
    "image_size": 32,
    "seed": 0,
}


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory) -> Iterator[Path]:
    """A directory for the runs a module's tests share (their checkpoints: 0.3-2 GB), removed
    when the module ends with no test failed in this process, kept to read otherwise, as pytest
    keeps a failed test's tmp_path (pyproject.toml, tmp_path_retention_policy)."""
    failed = request.session.testsfailed
    path = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    yield path
    if request.session.testsfailed == failed:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_archives(tmp_path_factory) -> Path:
    """Directory with the demo's three ILSVRC2012 archives and md5sums (4 classes, 32 px)."""
    from imagenet_ddp.data.demo import make_demo_dataset

    out = tmp_path_factory.mktemp("demo") / "ILSVRC2012"
    make_demo_dataset(out, **DEMO_KWARGS)
    return out


@pytest.fixture(scope="session")
def demo_index(demo_archives):
    """(classes, train, val) DataFrames of the demo archives."""
    from imagenet_ddp.data.archives import build_index

    return build_index(demo_archives)


@pytest.fixture(scope="session")
def prepared_demo(demo_archives, demo_index, tmp_path_factory) -> dict[str, Path]:
    """{"train": dir, "val": dir}: the demo prepared at short_side 24 (16-image shards)."""
    from imagenet_ddp.data.prepare import prepare_split

    root = tmp_path_factory.mktemp("prepared")
    classes, train, val = demo_index
    out = {}
    for which, index in (("train", train), ("val", val)):
        out[which] = root / which
        prepare_split(
            demo_archives,
            index,
            out[which],
            which=which,
            short_side=24,
            num_classes=len(classes),
            shard_samples=16,
            **PREPARE_SETTINGS,
        )
    return out


@pytest.fixture(scope="session")
def demo_split(demo_index, tmp_path_factory) -> Path:
    """A split dir (train.csv, holdout.csv) of the demo: 25 % stratified holdout, seed 0."""
    from imagenet_ddp.data.split import stratified_split
    from imagenet_ddp.io import write_csv_atomic

    train_part, holdout = stratified_split(demo_index[1], 0.25, seed=0)
    out = tmp_path_factory.mktemp("split")
    write_csv_atomic(out / "train.csv", train_part)
    write_csv_atomic(out / "holdout.csv", holdout)
    return out


@pytest.fixture
def writable_archives(demo_archives, tmp_path) -> Path:
    """A private copy of the demo archives, for tests that damage them."""
    return Path(shutil.copytree(demo_archives, tmp_path / "ILSVRC2012"))


def prepared_copy(manifest: Path) -> Path:
    """The copy in prepare.dir that a `prepare` or `prepare-join` manifest names."""
    return Path(json.loads(Path(manifest).read_text())["dir"])
