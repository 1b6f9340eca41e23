"""The runs so far (the ``progress`` rule, also while the workflow runs): a finished run's full
row (:func:`imagenet_ddp.report.aggregate.run_row`), and for every other run its state from
what it has written: epochs, throughput and ETA from ``progress.json``, the outcome and first
error of its last attempt (``attempts.json``), or not started."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pandas as pd

from imagenet_ddp.io import write_csv_atomic, write_text_atomic
from imagenet_ddp.jobs import attempts as A
from imagenet_ddp.jobs.spec import PROGRESS, TRAIN_SPEC
from imagenet_ddp.provenance import provenance_path
from imagenet_ddp.report.aggregate import aggregate_runs, number, to_markdown

# What a finished run has written (aggregate.run_row reads them; accounting.json is optional).
FINISHED_FILES = ("train_metrics.json", "eval.json", "job.json")
OTHER_COLUMNS = ["run", "state", "epochs_done", "epochs", "images_per_s", "eta_hours", "note"]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def finished(run_dir: Path) -> bool:
    return all((run_dir / name).is_file() for name in FINISHED_FILES) and (
        provenance_path(run_dir / "model.pt").is_file()
    )


def _last_attempt(checkpoint_root: Path) -> dict[str, Any] | None:
    try:
        attempts = A.load(checkpoint_root)
    except (OSError, ValueError):
        return None
    return max(attempts, key=lambda a: a.get("started") or 0, default=None)


def _training(run_dir: Path) -> dict[str, Any]:
    """Epochs done, the last epoch's throughput, the ETA at its pace (epoch end included), the
    worst loss spike so far."""
    progress = _read(run_dir / PROGRESS) or {}
    spec = _read(run_dir / TRAIN_SPEC) or {}
    epochs = (spec.get("run") or {}).get("epochs")
    done = progress.get("epoch", -1) + 1
    parts = ("epoch_seconds", "eval_seconds", "checkpoint_seconds")
    pace = sum(progress.get(k) or 0.0 for k in parts)
    eta = (epochs - done) * pace / 3600 if epochs and done > 0 else math.nan
    return {
        "epochs_done": done if done > 0 else 0,
        "epochs": epochs,
        "images_per_s": progress.get("images_per_s", math.nan),
        "eta_hours": eta,
        "spike": progress.get("loss_spike"),
    }


def run_state(run: str, run_dir: Path, checkpoint_root: Path, now: float) -> dict[str, Any]:
    """A row for a run that has not finished: its last attempt's state, its worst loss spike."""
    row = {"run": run, **_training(run_dir)}
    state, note = _state(checkpoint_root, _last_attempt(checkpoint_root), now)
    return {**row, "state": state, "note": "; ".join(p for p in (note, row["spike"]) if p)}


def _state(checkpoint_root: Path, last: dict[str, Any] | None, now: float) -> tuple[str, str]:
    if last is None:
        return "not started", ""
    outcome = last.get("outcome")
    if outcome == "running" and last.get("ended") is None:
        alive = now - A.last_sign(checkpoint_root, last)  # its heartbeat file
        job = last.get("slurm_job_id") or "local"
        return "training", f"job {job}, last sign of life {alive / 60:.0f} min ago"
    if outcome in ("failed", "refused", "killed"):
        error = (last.get("error") or "").splitlines()[:1]
        note = f"attempt {last.get('attempt')}: {error[0] if error else 'no error recorded'}"
        return outcome, note[:160]
    if outcome == "stopped":
        return "stopped", "checkpointed; resumes in its next job"
    return "trained", "not evaluated yet"  # completed


def progress_tables(
    runs: list[str], run_dirs: list[Path], checkpoint_roots: list[Path], now: float | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the finished runs' table, as aggregate's; a row for every other run)."""
    now = time.time() if now is None else now
    done = [d for d in run_dirs if finished(d)]
    table = aggregate_runs(done) if done else pd.DataFrame()
    others = [
        run_state(run, run_dir, root, now)
        for run, run_dir, root in zip(runs, run_dirs, checkpoint_roots, strict=True)
        if run_dir not in done
    ]
    return table, pd.DataFrame(others, columns=OTHER_COLUMNS)


def _epochs(row: pd.Series) -> str:
    """Epochs done of all ("10/90"); the count alone where the total is unknown (no spec yet)."""
    done, total = int(row["epochs_done"]), number(".0f")(row["epochs"])
    return f"{done}/{total}" if total else (str(done) if done else "")


def others_markdown(others: pd.DataFrame) -> str:
    rows = [
        [
            row["run"],
            row["state"],
            _epochs(row),
            number(".0f")(row["images_per_s"]),
            number(".1f")(row["eta_hours"]),
            row["note"],
        ]
        for _, row in others.iterrows()
    ]
    headings = ["run", "state", "epochs", "img/s (last epoch)", "ETA h", "note"]
    frame = pd.DataFrame(rows, columns=headings, dtype=object)
    return frame.to_markdown(index=False, disable_numparse=True)


def write_progress(
    runs: list[str], run_dirs: list[Path], checkpoint_roots: list[Path], csv: Path,
    markdown: Path,
) -> None:  # fmt: skip
    """results/progress/: runs.csv (every run) and runs.md (finished runs, then the others)."""
    table, others = progress_tables(runs, run_dirs, checkpoint_roots)
    csv.parent.mkdir(parents=True, exist_ok=True)
    finished_rows = table.assign(state="finished") if len(table) else table
    write_csv_atomic(csv, pd.concat([finished_rows, others], ignore_index=True))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    parts = [f"# Runs so far ({stamp})", f"Finished: {len(table)} of {len(runs)}."]
    if len(table):
        parts.append(to_markdown(table).rstrip())
    if len(others):
        parts += ["## Not finished", others_markdown(others)]
    write_text_atomic(markdown, "\n\n".join(parts) + "\n")
    for _, row in others.iterrows():
        print(f"{row['run']}: {row['state']} {row['note']}".rstrip(), flush=True)
