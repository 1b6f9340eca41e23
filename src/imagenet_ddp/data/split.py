"""Stratified train/holdout split of the train set: exactly the common recipe's
``train_test_split`` (RandomState(seed), stratified) over torchvision's sample order
(= sample_id); 1.28M rows / 1000 classes take about a second."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split

from imagenet_ddp.data.layouts import SAME_COLUMNS
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import write_csv_atomic
from imagenet_ddp.provenance import provenance_path, write_provenance


def _ordered_index(train: pd.DataFrame, holdout_fraction: float) -> pd.DataFrame:
    """The train index in sample_id order, after the checks that need no counting."""
    if not 0.0 < float(holdout_fraction) < 1.0:
        raise InputError(
            f"split.holdout_fraction is {holdout_fraction}; it must be strictly between 0 and 1"
        )
    missing = {"sample_id", "class_index"} - set(train.columns)
    if missing:
        raise InputError(
            f"the train index lacks columns {sorted(missing)}; rebuild it with `imagenet-ddp index`"
        )
    ordered = train.sort_values("sample_id", kind="stable").reset_index(drop=True)
    if ordered["sample_id"].duplicated().any():
        raise InputError("the train index repeats sample_ids; rebuild it with `imagenet-ddp index`")
    return ordered


def _describe(ordered: pd.DataFrame, classes) -> str:
    """The first ten classes by wnid (where the index has it) and how many more."""
    if "wnid" in ordered.columns:
        names = ordered.groupby("class_index")["wnid"].first()
        shown = [f"{names[c]} (class {c})" for c in sorted(classes)[:10]]
    else:
        shown = [f"class {c}" for c in sorted(classes)[:10]]
    more = f" and {len(classes) - 10} more" if len(classes) > 10 else ""
    return ", ".join(shown) + more


def stratified_split(
    train: pd.DataFrame, holdout_fraction: float, seed: int
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train_part, holdout_part): row subsets of ``train`` (all columns), sorted by sample_id."""
    ordered = _ordered_index(train, holdout_fraction)
    targets = ordered["class_index"].to_numpy()
    n = len(targets)
    n_valid = int(round(n * holdout_fraction))
    n_train = n - n_valid
    counts = pd.Series(targets).value_counts()  # every class must give one image to each side
    too_small = counts.index[counts < 2].tolist()
    if too_small:
        raise InputError(
            f"classes {_describe(ordered, too_small)} have fewer than 2 training images, too few "
            "for a stratified split; check the train archive (re-download it) or its index"
        )
    if n_valid < len(counts) or n_train < len(counts):
        raise InputError(
            f"split.holdout_fraction {holdout_fraction} of {n} images gives {n_valid} holdout "
            f"and {n_train} train images, but a stratified split needs at least one per class "
            f"({len(counts)} classes) on each side; choose a fraction between "
            f"{len(counts) / n:.4g} and {1 - len(counts) / n:.4g}"
        )
    try:
        train_idx, valid_idx = train_test_split(
            np.arange(n),
            train_size=n_train,
            test_size=n_valid,
            random_state=np.random.RandomState(seed),
            shuffle=True,
            stratify=targets,
        )
    except ValueError as exc:  # anything the checks above did not anticipate
        raise InputError(
            f"stratified split with holdout_fraction {holdout_fraction} failed: {exc}; "
            f"smallest classes: {_describe(ordered, counts.nsmallest(5).index.tolist())}"
        ) from None
    return (
        ordered.iloc[np.sort(train_idx)].reset_index(drop=True),
        ordered.iloc[np.sort(valid_idx)].reset_index(drop=True),
    )


def split_index(index_dir: Path, out_dir: Path, holdout_fraction: float, seed: int) -> None:
    """The ``split`` stage: train.csv, holdout.csv, class_counts.csv in ``out_dir``."""
    train = pd.read_csv(Path(index_dir) / "train.csv", keep_default_na=False)
    # The sample columns only: the location columns differ between input layouts (the same
    # images give the same split files in every layout: imagenet_ddp.data.layouts).
    train = train[[c for c in SAME_COLUMNS if c in train.columns]]
    train_part, holdout = stratified_split(train, holdout_fraction, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out_dir / "train.csv", train_part)
    write_csv_atomic(out_dir / "holdout.csv", holdout)
    sizes = {"train": train_part, "holdout": holdout}
    counts = pd.DataFrame({k: v.groupby("class_index").size() for k, v in sizes.items()})
    write_csv_atomic(out_dir / "class_counts.csv", counts.reset_index())
    write_provenance(
        provenance_path(out_dir),
        "split",
        {"holdout_fraction": holdout_fraction},
        seeds={"split": seed},
        extra={"counts": {"train": len(train_part), "holdout": len(holdout)}},
    )
