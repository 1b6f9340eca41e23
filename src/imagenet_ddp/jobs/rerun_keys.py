"""What reruns a run's train and evaluate, by path: its rerun key (the settings that change the
model, the data's content digest, the weights file's sha256) named by its own digest,
``results/keys/<kind>/<run>/<digest>.json``. The path changes exactly when the content does, so
Snakemake sees a change under every rerun trigger set that includes mtime (a missing input its
`all` asks for), and a data rerun that makes the same bytes reruns nothing. A job that delivers
removes its run's other keys of its kind: a setting changed back to an earlier value is then a
missing key again, not one older than the model. Torch-free (the workflow's parse imports it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

KEYS = "results/keys"


def key_text(key: Mapping[str, Any]) -> str:
    """The key as one line of canonical JSON: a frozen format (its digest names the file)."""
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(key_text(key).encode()).hexdigest()[:16]


def key_path(kind: str, run: str, key: Mapping[str, Any]) -> str:
    return f"{KEYS}/{kind}/{run}/{key_digest(key)}.json"


def read_key(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def keep_only(path: str | Path) -> list[Path]:
    """Remove the other keys beside ``path`` (its run's, of its kind), once its job delivered;
    returns what it removed."""
    path = Path(path)
    gone = [p for p in sorted(path.parent.glob("*.json")) if p.name != path.name]
    for other in gone:
        other.unlink(missing_ok=True)
    return gone


def _short(value: Any) -> str:
    text = (
        value
        if isinstance(value, str)
        else json.dumps(value, sort_keys=True, separators=(",", ":"))
    )
    return text if len(text) <= 40 else text[:16] + "..."


def changes(run: str, recorded: Mapping[str, Any], now: Mapping[str, Any],
            omitted: Mapping[str, Any] | None = None) -> str | None:  # fmt: skip
    """One line naming what differs between the key the run's last delivered job recorded and
    the one it has now (``run 'x': lr 0.2 -> 0.4``); None when nothing does. ``omitted``: the
    value of a setting a key leaves out (its earlier value, not null)."""
    flat = [
        {**(omitted or {}), **dict(key.get("settings", {})),
         **{k: v for k, v in key.items() if k != "settings"}}
        for key in (recorded, now)
    ]  # fmt: skip
    differ = [
        f"{k} {_short(flat[0].get(k))} -> {_short(flat[1].get(k))}"
        for k in sorted(set(flat[0]) | set(flat[1]))
        if flat[0].get(k) != flat[1].get(k)
    ]
    return f"run {run!r}: " + ", ".join(differ) if differ else None
