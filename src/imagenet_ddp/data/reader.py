"""The one factory of the dataset a rank reads: training and its holdout probe
(training/worker.py, whose holdout training/accuracy.py evaluates), evaluation
(evaluation/evaluate.py) and the preflight (preflight/rank.py) all call
:func:`create_dataset`, as timm's ``create_dataset`` is its scripts' one.

Every input layout is prepared into the same training-ready copy (data/prepare.py), so a
rank has one reader, :class:`imagenet_ddp.data.dataset.PreparedImageDataset`; another reader
(another on-disk format of the prepared copy) is one entry of :data:`READERS` and its test.
"""

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
    """The samples ``sample_ids`` (None: all) of the prepared copy at ``root``.

    ``train``: encoded JPEGs, for the training transform to decode after drawing its crop
    (imagenet_ddp.data.jpeg). ``eval_size`` (resize, crop): uint8 evaluation crops
    (normalized on the device, training.accuracy), resized with ``interpolation``. Neither:
    decoded images, untransformed."""
    cls = READERS[reader]
    if train:
        return cls(Path(root), sample_ids, decode=False)
    transform = (
        None
        if eval_size is None
        else eval_transform(*eval_size, normalize=False, interpolation=interpolation)
    )
    return cls(Path(root), sample_ids, transform)
