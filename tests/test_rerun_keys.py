"""The rerun keys (imagenet_ddp.jobs.rerun_keys): a path per content, the stale ones removed
once a job delivered, and the one line that names a change."""

from __future__ import annotations

from imagenet_ddp.jobs import rerun_keys as K

KEY = {"settings": {"lr": 0.2, "epochs": 2}, "data": "ab" * 32, "init_weights_sha256": ""}


def test_the_path_changes_exactly_with_the_content():
    same = {"init_weights_sha256": "", "data": "ab" * 32, "settings": {"epochs": 2, "lr": 0.2}}
    assert K.key_path("train", "r", KEY) == K.key_path("train", "r", same)  # order: no matter
    other = {**KEY, "settings": {"lr": 0.4, "epochs": 2}}
    assert K.key_path("train", "r", other) != K.key_path("train", "r", KEY)
    assert K.key_path("train", "r", KEY).startswith("results/keys/train/r/")


def test_a_delivered_job_keeps_only_its_own_key(tmp_path):
    """0.2 -> 0.4 -> 0.2: once the 0.4 training delivered, 0.2's key is gone, so going back
    is a missing key again (never one older than the model, which mtime would not rerun)."""
    keys = tmp_path / "results/keys/train/r"
    keys.mkdir(parents=True)
    own, stale = keys / "1111222233334444.json", keys / "aaaabbbbccccdddd.json"
    own.write_text(K.key_text(KEY))
    stale.write_text("{}")
    (tmp_path / "results/keys/train/other").mkdir()
    (tmp_path / "results/keys/train/other/x.json").write_text("{}")
    assert K.keep_only(own) == [stale]
    assert own.exists() and not stale.exists()
    assert (tmp_path / "results/keys/train/other/x.json").exists()  # another run's


def test_the_change_is_named_in_one_line():
    now = {**KEY, "settings": {"lr": 0.4, "epochs": 2}}
    assert K.changes("resnet18-1x1", KEY, now) == "run 'resnet18-1x1': lr 0.2 -> 0.4"
    assert K.changes("r", KEY, dict(KEY)) is None
    data = K.changes("r", KEY, {**KEY, "data": "cd" * 32})
    assert data == f"run 'r': data {'ab' * 8}... -> {'cd' * 8}..." and "\n" not in data
