"""The stratified split selects exactly what the common sklearn recipe selects."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from sklearn.model_selection import train_test_split

from imagenet_ddp.data.split import stratified_split
from imagenet_ddp.errors import InputError


def recipe(targets, holdout_fraction, seed):
    """The literal recipe, over torchvision's sample order."""
    n = len(targets)
    n_valid = int(round(n * holdout_fraction))
    n_train = n - n_valid
    return train_test_split(
        np.arange(n),
        train_size=n_train,
        test_size=n_valid,
        random_state=np.random.RandomState(seed),
        shuffle=True,
        stratify=targets,
    )


def synthetic(counts, shuffle_rows=True) -> pd.DataFrame:
    class_index = np.repeat(np.arange(len(counts)), counts)
    frame = pd.DataFrame(
        {
            "sample_id": np.arange(len(class_index)),
            "class_index": class_index,
            "wnid": [f"n{1000000 + c:08d}" for c in class_index],
            "name": [f"img_{i}.JPEG" for i in range(len(class_index))],
        }
    )
    if shuffle_rows:  # input row order must not matter, only sample_id
        frame = frame.sample(frac=1.0, random_state=0)
    return frame


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_matches_the_sklearn_recipe(fraction, seed):
    frame = synthetic([13, 40, 7, 22, 9, 31])
    train_part, holdout = stratified_split(frame, fraction, seed)
    train_idx, valid_idx = recipe(np.repeat(np.arange(6), [13, 40, 7, 22, 9, 31]), fraction, seed)
    assert train_part.sample_id.tolist() == sorted(train_idx.tolist())
    assert holdout.sample_id.tolist() == sorted(valid_idx.tolist())


def test_matches_the_recipe_on_the_demo_index(demo_index):
    _, train, _ = demo_index
    train_part, holdout = stratified_split(train, 0.25, 0)
    _, valid_idx = recipe(train.class_index.to_numpy(), 0.25, 0)
    assert holdout.sample_id.tolist() == sorted(valid_idx.tolist())
    assert train_part.columns.tolist() == train.columns.tolist()
    pd.testing.assert_frame_equal(
        holdout, train.set_index("sample_id").loc[holdout.sample_id].reset_index()
    )


def test_parts_partition_the_input_and_keep_proportions():
    counts = [13, 40, 7, 22, 9, 31, 100]
    frame = synthetic(counts)
    train_part, holdout = stratified_split(frame, 0.2, 7)
    assert set(train_part.sample_id).isdisjoint(holdout.sample_id)
    assert len(train_part) + len(holdout) == len(frame)
    assert (
        train_part.sample_id.is_monotonic_increasing and holdout.sample_id.is_monotonic_increasing
    )
    assert list(train_part.columns) == list(frame.columns)
    assert len(holdout) == round(len(frame) * 0.2)
    per_class = holdout.groupby("class_index").size().reindex(range(len(counts)), fill_value=0)
    expected = np.array(counts) * len(holdout) / len(frame)
    assert np.all(np.abs(per_class.to_numpy() - expected) <= 1)


def test_deterministic_and_seed_dependent():
    frame = synthetic([30, 30, 30])
    a = stratified_split(frame, 0.2, 0)[1]
    assert a.equals(stratified_split(frame, 0.2, 0)[1])
    assert not a.equals(stratified_split(frame, 0.2, 1)[1])


def test_class_with_one_image_is_named():
    frame = synthetic([10, 1, 10, 1])
    with pytest.raises(
        InputError, match=r"n01000001 \(class 1\), n01000003 \(class 3\) have fewer"
    ):
        stratified_split(frame, 0.3, 0)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_fraction_out_of_range(fraction):
    with pytest.raises(InputError, match="strictly between 0 and 1"):
        stratified_split(synthetic([10, 10]), fraction, 0)


def test_holdout_smaller_than_number_of_classes():
    with pytest.raises(InputError, match="at least one per class .*choose a fraction between"):
        stratified_split(synthetic([10] * 5), 0.05, 0)  # 2 holdout images for 5 classes


def test_full_imagenet_scale_is_stratified():
    """Correctness at full scale; speed and memory are measured by bench_index_split.py."""
    rng = np.random.default_rng(0)
    counts = rng.integers(732, 1301, size=1000)
    counts = (counts * 1_281_167 / counts.sum()).astype(int)
    class_index = np.repeat(np.arange(1000), counts)
    frame = pd.DataFrame({"sample_id": np.arange(len(class_index)), "class_index": class_index})
    train_part, holdout = stratified_split(frame, 0.01, 0)
    assert len(train_part) + len(holdout) == len(frame) > 1_270_000
    per_class = holdout.groupby("class_index").size().reindex(range(1000), fill_value=0)
    assert (np.abs(per_class.to_numpy() - counts * 0.01) <= 1).all()
