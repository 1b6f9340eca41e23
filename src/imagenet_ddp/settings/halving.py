"""Successive halving of a sweep (``sweep[i].prune``; Jamieson & Talwalkar 2016): every run of
the sweep trains to the first rung's epoch (``min_epochs``), the best ``max(1, n // eta)`` by the
metric go on to ``min_epochs * eta``, and so on; the survivors of the last rung below the
runs' ``epochs`` train to the end. A rung's training is the run's own schedule stopped early
(a job spec's ``stop_epoch``, jobs.spec), resumed by the next rung: a survivor's final model is
the one it has unpruned.

Each decision (the workflow's ``prune`` checkpoint) ranks the figures of the runs that reached
its rung, higher first and ties by run name, so it is the same whatever order the runs finish
in. Torch-free (the workflow's parse imports it).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagenet_ddp.io import write_json_atomic
from imagenet_ddp.settings.runs import expand_sweep

RUNG_OUTPUTS = ("model.pt", "train_metrics.json", "history.csv", "job.json",
                "model.pt.provenance.json")  # fmt: skip


@dataclass(frozen=True)
class Halving:
    """One pruned sweep: its index (the folder results/sweeps/<index>/), runs in expansion
    order, rung epochs and the runs' shared ``epochs``."""

    index: int
    runs: tuple[str, ...]
    eta: int
    rungs: tuple[int, ...]
    epochs: int
    metric: str = "holdout_top1"

    @property
    def stages(self) -> tuple[int, ...]:
        """The epochs a run of the sweep may be trained to: each rung's, then the end."""
        return (*self.rungs, self.epochs)

    def kept(self, alive: int) -> int:
        return max(1, alive // self.eta)

    def plan(self) -> list[tuple[int, int]]:
        """(epoch, runs trained to it) for each stage, as the decisions will keep them."""
        alive, plan = len(self.runs), []
        for epoch in self.stages:
            plan.append((epoch, alive))
            alive = self.kept(alive)
        return plan

    def planned_epochs(self) -> int:
        """The epochs the plan trains in all, against len(runs) x epochs unpruned."""
        done, total = 0, 0
        for epoch, alive in self.plan():
            total += alive * (epoch - done)
            done = epoch
        return total


def rungs(min_epochs: int, eta: int, epochs: int) -> tuple[int, ...]:
    """min_epochs * eta**k for k = 0, 1, ... while below ``epochs``."""
    out, epoch = [], min_epochs
    while epoch < epochs:
        out.append(epoch)
        epoch *= eta
    return tuple(out)


def halvings(
    config: Mapping[str, Any], written: Mapping[str, Any], runs: Mapping[str, Mapping]
) -> tuple[dict[int, Halving], list[str]]:
    """Each pruned sweep's Halving by index, and one line per problem. ``config``: validated
    (prune's defaults filled); ``written``: settings.runs.written_settings; ``runs``: resolved."""
    found, problems = {}, []
    for index, sweep in enumerate(config.get("sweep") or []):
        prune = sweep.get("prune")
        if not prune:
            continue
        expanded = expand_sweep(written["sweep"][index], index, written["train_defaults"])
        names = [entry["name"] for entry, _ in expanded]
        where = f"config.yaml: sweep[{index}].prune"
        epochs = sorted({runs[name]["epochs"] for name in names})
        if len(epochs) > 1:
            problems.append(f"{where}: its runs train {epochs} epochs; successive halving "
                            "needs one epochs for every run: take epochs off the axes")  # fmt: skip
            continue
        steps = rungs(prune["min_epochs"], prune["eta"], epochs[0])
        if not steps:
            problems.append(f"{where}: min_epochs {prune['min_epochs']} is not below the runs' "
                            f"epochs {epochs[0]}: lower it, or remove prune")  # fmt: skip
            continue
        found[index] = Halving(index, tuple(names), prune["eta"], steps, epochs[0],
                               prune["metric"])  # fmt: skip
    return found, problems


def by_run(found: Mapping[int, Halving]) -> dict[str, Halving]:
    return {name: halving for halving in found.values() for name in halving.runs}


def previous_stage(halving: Halving, epoch: int) -> int | None:
    """The stage before ``epoch`` (None for the first rung)."""
    stages = halving.stages
    position = stages.index(epoch)
    return stages[position - 1] if position else None


def plan_lines(found: Mapping[int, Halving], runs: Mapping[str, Mapping]) -> list[str]:
    """The dry-run's lines: each sweep's rungs, runs per rung, the run-epochs planned against
    the full grid's and, where its runs share a GPU count, the GPU-epochs (GPU-hours at one
    epoch's time, which the preflight measures)."""
    lines = []
    for halving in found.values():
        stages = ", ".join(f"{alive} to epoch {epoch}" for epoch, alive in halving.plan())
        planned, full = halving.planned_epochs(), len(halving.runs) * halving.epochs
        line = (
            f"sweep[{halving.index}] prune (eta {halving.eta}): {stages}; "
            f"{planned} run-epochs planned, {full} unpruned ({planned / full:.0%})"
        )
        gpus = {runs[n]["nodes"] * runs[n].get("gpus_per_node", 0) for n in halving.runs}
        if len(gpus) == 1 and (g := gpus.pop()) > 0:
            line += f"; {g} GPUs a run: {planned * g} GPU-epochs against {full * g}"
        lines.append(line)
    return lines


def decide(halving: Halving, epoch: int, metrics: Mapping[str, str | Path]) -> dict[str, Any]:
    """The decision at rung ``epoch`` from each alive run's rung train_metrics.json: the
    ranking (figure high to low, ties by name; a run without a figure last), the survivors."""
    figures = {}
    for name, path in metrics.items():
        history = json.loads(Path(path).read_text())["epochs"]
        value = history[-1].get(halving.metric) if history else None
        ok = isinstance(value, (int, float)) and not math.isnan(value)
        figures[name] = float(value) if ok else None
    ranking = sorted(figures, key=lambda n: (figures[n] is None, -(figures[n] or 0.0), n))
    kept = ranking[: halving.kept(len(ranking))]
    return {
        "sweep": halving.index,
        "epoch": epoch,
        "metric": halving.metric,
        "eta": halving.eta,
        "ranking": [{"run": name, halving.metric: figures[name]} for name in ranking],
        "survivors": sorted(kept),
        "pruned": sorted(set(ranking) - set(kept)),
    }


def survivors(decision_path: str | Path) -> list[str]:
    return json.loads(Path(decision_path).read_text())["survivors"]


# --------------------------------------------------------------------------- the CLI's stages


def write_decision(
    sweep: int, epoch: int, eta: int, metric: str, runs: list[str], metrics: list[Path], out: Path
) -> None:
    """`imagenet-ddp prune`: the decision at one rung, results/sweeps/<sweep>/rung-<epoch>.json."""
    halving = Halving(sweep, tuple(runs), eta, (epoch,), epoch + 1, metric)
    write_json_atomic(out, decide(halving, epoch, dict(zip(runs, metrics, strict=True))))


def deliver_stage(rung_dir: Path, run_dir: Path, epoch: int, epochs: int) -> None:
    """`imagenet-ddp rung-final`: a pruned sweep's run's outputs in its run folder, copied from
    its last stage's (``epoch``; ``epochs``: the schedule's end). train_metrics.json gains
    ``halving``: the epoch it stopped at and whether it was pruned there."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in RUNG_OUTPUTS:
        shutil.copyfile(rung_dir / name, run_dir / name)
    metrics = json.loads((run_dir / "train_metrics.json").read_text())
    metrics["halving"] = {"stopped_at_epoch": epoch, "pruned": epoch < epochs, "epochs": epochs}
    write_json_atomic(run_dir / "train_metrics.json", metrics)
