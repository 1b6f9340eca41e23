"""Each run setting is declared once, with its kind (workflow/schemas/config.schema.yaml,
x-kind), and what the code and the docs say about settings derives from that declaration
(imagenet_ddp.settings.kinds). Fast: reads files; no workflow runs."""

from __future__ import annotations

import re

import pytest
import yaml

from imagenet_ddp.settings.kinds import (
    KINDS,
    DeclarationError,
    Declarations,
    declarations,
    load_schema,
)
from tests.workflow_helpers import REPO, SCHEMA


def test_the_packaged_schema_is_the_workflows():
    """A rank keys its checkpoints by the package's copy (imagenet_ddp/config.schema.yaml, a
    link in the source tree); the workflow validates with its own."""
    from imagenet_ddp.settings import kinds as settings

    assert settings.SCHEMA.read_text() == SCHEMA.read_text()


def test_every_setting_is_declared_once_with_a_kind():
    schema = load_schema(SCHEMA)  # raises on a key given twice
    properties = schema["definitions"]["run_settings"]["properties"]
    assert {spec.get("x-kind") for spec in properties.values()} <= set(KINDS)
    assert declarations(SCHEMA).kind("lr") is KINDS["weights"]


def test_a_setting_declared_twice_or_without_a_kind_is_refused(tmp_path):
    text = SCHEMA.read_text()
    anchor = "      lr: {x-kind: weights,"
    assert anchor in text
    twice = tmp_path / "twice.yaml"
    twice.write_text(text.replace(anchor, "      lr: {x-kind: weights, type: number}\n" + anchor))
    assert yaml.safe_load(twice.read_text())  # plain YAML would keep the last one silently
    with pytest.raises(DeclarationError, match=r"twice.yaml:\d+: 'lr' is given twice"):
        load_schema(twice)
    schema = load_schema(SCHEMA)
    del schema["definitions"]["run_settings"]["properties"]["lr"]["x-kind"]
    with pytest.raises(DeclarationError, match="run setting 'lr' has x-kind None; declare one"):
        Declarations.of_schema(schema)


def _doc_kinds() -> dict[str, set[str]]:
    """kind -> the settings its row of docs/configuration.md "Reruns" lists."""
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text.split("## Reruns", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in KINDS:
            rows[cells[0]] = set(re.findall(r"`([a-z0-9_]+)`", cells[1]))
    return rows


def test_the_reruns_table_lists_each_kinds_settings():
    settings = declarations(SCHEMA)
    declared = {kind: {RANK.get(k, k) for k in settings.keys(kind)} for kind in KINDS}
    assert _doc_kinds() == declared


RANK = {"run": "name"}  # the rank's name of the declared `name`

# The checkpoint fingerprints of runs resolved as the demo's are (train_defaults below), taken
# before the kinds were declared in the schema: a checkpoint resumes only under an equal one.
# A new setting that changes them needs `x-earlier` (the value every earlier run had); a
# changed default of a weights setting changes them on purpose (update them then).
TRAIN_DEFAULTS = {"epochs": 3, "batch_size": 32, "lr": 0.4, "crop_size": 32, "eval_resize": 36,
                  "throughput_warmup_steps": 5, "tasks_per_node": 2}  # fmt: skip
FINGERPRINTS = {
    "a": ({}, "53563a174e5534d1"),
    "b": ({"tasks_per_node": 1}, "134e35858671246f"),
    "c": ({"hflip": 0.3, "crop_scale": [0.2, 1.0]}, "04f5c97fc18241ad"),
    "d": (
        {
            "gpu_type": "a100",
            "gpus_per_node": 2,
            "mlflow_uri": "x",
            "log_interval": 3,
            "workers": 2,
        },
        "b10b966bec43b7c6",
    ),  # fmt: skip
    "e": ({"device": "cpu", "backend": "gloo", "precision": "bf16"}, "599c6e6f6633fc8e"),
    "p-ffcv-resnet50": ({"recipe": "ffcv-resnet50"}, "c7cc2d0144e0827b"),
    "p-torchvision-resnet50-v1": ({"recipe": "torchvision-resnet50-v1"}, "be4dfc025a73d474"),
    "p-torchvision-resnet50-v2": ({"recipe": "torchvision-resnet50-v2"}, "42e99a4065e722a6"),
}


@pytest.mark.parametrize("name", sorted(FINGERPRINTS))
def test_checkpoint_fingerprints_stay_those_of_earlier_versions(name):
    from imagenet_ddp.settings.kinds import TrainConfig
    from imagenet_ddp.settings.runs import resolve_run, run_defaults

    entry, fingerprint = FINGERPRINTS[name]
    run = resolve_run(run_defaults(load_schema(SCHEMA)), TRAIN_DEFAULTS, {"name": name, **entry})
    cfg = TrainConfig.from_dict(declarations(SCHEMA).rank_settings(run))
    assert cfg.fingerprint() == fingerprint, (
        "the checkpoint fingerprint changed: earlier checkpoints would not resume; a new "
        "setting declares x-earlier in the schema"
    )


def test_a_new_setting_at_its_earlier_value_changes_no_key():
    """What a newer version's setting does (x-earlier): at that value it is in no checkpoint
    key and no rerun trigger; at another value it is in both."""
    schema = load_schema(SCHEMA)
    properties = schema["definitions"]["run_settings"]["properties"]
    properties["new_knob"] = {"x-kind": "weights", "type": "number", "default": 0.0,
                              "x-earlier": 0.0}  # fmt: skip
    settings = Declarations.of_schema(schema)
    run = {"name": "r", "lr": 0.1, "log_interval": 5, "nodes": 1, "new_knob": 0.0}
    assert settings.weight_settings(settings.rank_settings(run)) == {"run": "r", "lr": 0.1}
    assert settings.rerun_settings(run) == {"lr": 0.1, "nodes": 1}
    changed = {**run, "new_knob": 0.5}
    assert settings.rerun_settings(changed) == {"lr": 0.1, "nodes": 1, "new_knob": 0.5}


def test_train_reruns_exactly_when_its_checkpoint_key_changes():
    """The rerun params hold the settings of the checkpoint key: the fingerprint's (but the
    run's name, the wildcard) and the geometry's; no bookkeeping, speed, site or preset."""
    from imagenet_ddp.settings.runs import resolve_run, run_defaults

    settings = declarations(SCHEMA)
    run = resolve_run(run_defaults(load_schema(SCHEMA)), TRAIN_DEFAULTS, {"name": "r"})
    rerun = set(settings.rerun_settings(run))
    keyed = set(settings.weight_settings(settings.rank_settings(run))) - {"run"}
    # accumulation, at the value of every earlier run (x-earlier 1), reruns nothing
    assert rerun == keyed | set(settings.keys("geometry")) - {"accumulation"}
    assert "accumulation" in settings.rerun_settings({**run, "accumulation": 2})
    assert not rerun & {"log_interval", "max_allocations", "gpu_type", "recipe", "preflight"}


def _plain(text: str) -> str:
    """A description as prose: markdown links and code marks dropped, spaces collapsed."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "").replace("\\|", "|")
    return re.sub(r"\s+", " ", text).strip().rstrip(".")


def _reference_rows() -> dict[str, str]:
    """docs/configuration.md "All settings": key -> meaning."""
    doc = (REPO / "docs" / "configuration.md").read_text()
    section = doc.split("## All settings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| .*? \| (.*) \|$", section, flags=re.M)
    return dict(rows)


def _described() -> dict[str, str]:
    """Every setting the schema describes, by the reference's name for it."""
    schema = yaml.safe_load(SCHEMA.read_text())
    found = {}
    for section, spec in schema["properties"].items():
        for key, sub in (spec.get("properties") or {}).items():
            found[f"{section}.{key}"] = sub.get("description")
    for key, sub in schema["definitions"]["eval_settings"]["properties"].items():
        found[f"evaluate.{key}"] = sub.get("description")
    for key, sub in schema["definitions"]["run_settings"]["properties"].items():
        found[key] = sub.get("description")
    return found


def test_the_settings_reference_says_what_the_schema_says():
    """A knob is described in one place: where the schema describes a setting, the reference
    table's meaning is that description (as markdown: code marks and links added), so the two
    never drift; every row names a setting of the schema."""
    rows, described = _reference_rows(), _described()
    sections = set(yaml.safe_load(SCHEMA.read_text())["properties"])
    runs = {f"runs[].{key}" for key in described}  # a run entry's own keys
    assert not [key for key in rows if key not in set(described) | sections | runs]
    drift = {
        key: (text, rows.get(key))
        for key, text in described.items()
        if text and _plain(rows.get(key, "")) != _plain(text)
    }
    assert not drift, f"docs/configuration.md differs from the schema's description: {drift}"
