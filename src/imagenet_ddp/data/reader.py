"""The one factory of the dataset a rank reads (training, its holdout, evaluation, the
preflight), as timm's ``create_dataset``: every input layout is prepared into one format, so one
reader; another format would be one entry of :data:`READERS` and its test."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from imagenet_ddp.data.dataset import PreparedImageDataset, eval_transform

READERS = {"prepared": PreparedImageDataset}


def create_dataset(
    root: Path,
    sample_ids: Sequence[int] | None = None,
    *,
    train: bool = False,
    eval_size: tuple[int, int] | None = None,
    interpolation: str = "bilinear",
    reader: str = "prepared",
):
    """The samples ``sample_ids`` (None: all) of the prepared copy at ``root``: encoded JPEGs
    (``train``: the training transform decodes after its crop), uint8 evaluation crops
    (``eval_size``: resize, crop), or decoded images."""
    cls = READERS[reader]
    if train:
        return cls(Path(root), sample_ids, decode=False)
    transform = (
        None
        if eval_size is None
        else eval_transform(*eval_size, normalize=False, interpolation=interpolation)
    )
    return cls(Path(root), sample_ids, transform)
