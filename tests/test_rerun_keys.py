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
    # a setting a key leaves out at its earlier value shows as that value, not null
    loader = {**KEY, "settings": {**KEY["settings"], "loader": "dali"}}
    named = K.changes("r", KEY, loader, {"loader": "pytorch", "hflip": 0.5})
    assert named == "run 'r': loader pytorch -> dali"


def test_the_key_command_writes_a_key_only_where_its_digest_names_it(tmp_path, capsys):
    """The `key` rule's `imagenet-ddp key`: the canonical line at its own path; a key given for
    another path (a stale plan) is refused in one line, nothing written."""
    import json

    from imagenet_ddp.cli import main

    path = tmp_path / K.key_path("train", "r", KEY)
    assert main(["key", "--text", json.dumps(KEY), "--out", str(path)]) == 0
    assert K.read_key(path) == KEY and path.read_text() == K.key_text(KEY) + "\n"
    other = path.with_name("0000000000000000.json")
    assert main(["key", "--text", json.dumps(KEY), "--out", str(other)]) == 2
    assert not other.exists()
    assert f"the key given is {K.key_digest(KEY)}'s, not this path's" in capsys.readouterr().err
