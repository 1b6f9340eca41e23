"""One table across all runs: throughput, scaling, staging, accuracy, cost, provenance.

Scaling efficiency compares like with like: within a group of runs whose settings differ only in
geometry (:func:`scaling_key`), steady per-rank throughput over the group's smallest run's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from imagenet_ddp import __version__
from imagenet_ddp.io import write_csv_atomic, write_text_atomic
from imagenet_ddp.jobs.spec import staging_reports
from imagenet_ddp.provenance import provenance_path, write_provenance
from imagenet_ddp.report.target import time_to_target
from imagenet_ddp.settings.geometry import WORLD_KEYS
from imagenet_ddp.settings.kinds import declarations
from imagenet_ddp.settings.presets import REPORTED_MODEL, REPORTED_TOP1, default_target_top1
from imagenet_ddp.settings.run_checks import BATCHNORM_MIN_STEPS
from imagenet_ddp.training.metrics import loss_spike

# What a run cost (monitoring.cost, monitoring.telemetry, report.accounting); empty where not
# measured, never zero. docs/results.md "Cost and efficiency" says what each includes.
COST_COLUMNS = [
    "allocations", "gpu_hours", "core_hours", "gpu_hours_lost", "core_hours_lost",
    "gpu_hours_per_epoch", "core_hours_per_epoch", "gpu_utilization_percent", "gpu_peak_memory_gb",
    "gpu_power_watts", "energy_kwh", "energy_wh_per_1k_images", "slurm_job_id", "slurm_state",
    "slurm_elapsed_seconds", "slurm_gpu_hours", "slurm_core_hours", "slurm_max_rss_gb",
]  # fmt: skip

# What the run's preflight projected, beside what training measured; empty without one.
PREFLIGHT_COLUMNS = [
    "preflight_epoch_seconds", "preflight_images_per_s", "preflight_total_seconds",
    "preflight_allocations", "preflight_busbw_gbps", "preflight_loader_over_model",
    "preflight_compute_ms", "preflight_input_bound_pct", "epoch_seconds_over_preflight",
]  # fmt: skip

# The step-time breakdown's medians over epochs; mfu_pct NaN on CPU or a GPU of unknown peak.
BREAKDOWN_COLUMNS = ["data_wait_ms", "compute_ms", "input_bound_pct", "flops_per_image", "mfu_pct"]

# The EMA model's accuracy (empty without ema_decay), and the run's preset's published top-1
# (a fraction) with the column it compares with (presets.REPORTED_MODEL).
EMA_COLUMNS = [
    "holdout_top1_ema", "holdout_top5_ema", "test_top1_ema", "test_top5_ema", "published_top1",
    "published_compare_with",
]  # fmt: skip

# Time and GPU-hours to report.target_top1 (report.target), beside published_top1.
TARGET_COLUMNS = [
    "target_top1", "target_source", "target_epochs", "target_wall_seconds", "target_gpu_hours",
    "target_note",
]  # fmt: skip

COLUMNS = [
    "run", "best", "accuracy_flag", "accuracy_note", "model", "lr", "lr_used", "nodes",
    "world_size", "gpus", "gpu_type", "global_batch", "shape",
    "allocation_shapes", "throughput_by_shape", "precision", "epochs", "diverged",
    "pruned_at_epoch", "loss_spike",
    "staging_seconds", "staging_gb_per_s", "mean_epoch_seconds", "epoch_end_share", "images_per_s",
    "images_per_s_per_rank", "throughput_warmup_steps", "steady_images_per_s",
    "steady_images_per_s_per_rank", "steady_note",
    *BREAKDOWN_COLUMNS,
    "scaling_efficiency", "scaling_baseline", "scaling_note", "scaling_group", "holdout_top1",
    "holdout_top5", "test_top1", "test_top5",
    *EMA_COLUMNS,
    *TARGET_COLUMNS,
    "wall_seconds",
    *PREFLIGHT_COLUMNS,
    *COST_COLUMNS,
    "git_commit", "code_changed", "code_versions", "trained_by_other_code",
]  # fmt: skip


# Counts that may be unknown (a run from before they were kept): integers, empty where unknown.
INTEGER_COLUMNS = [
    "throughput_warmup_steps", "allocations", "preflight_allocations", "target_epochs",
]  # fmt: skip

BASELINE_NOTE = "baseline: smallest run of its group"
ALONE_NOTE = "only run of its group"


def _canonical(value: Any) -> Any:
    """Equal settings compare equal whatever the YAML spelled: 0 and 0.0, nested dicts."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def scaling_key(config: dict[str, Any]) -> str:
    """The scaling group of a run's config: runs with equal keys differ only in geometry
    (WORLD_KEYS) and in settings not compared (name, bookkeeping). GPUs enter per rank (1 rank
    on 1 GPU and 8 on 8 are one per-rank setup at two scales); gpu_type unset or "" is any
    type; a setting at its x-earlier value is left out (recorded before it existed or not)."""
    decl = declarations()
    ignore = {*WORLD_KEYS, *decl.not_compared()}
    kept = decl.without_earlier_values({k: v for k, v in config.items() if k not in ignore})
    settings = {k: _canonical(v) for k, v in kept.items()}
    if not settings.get("gpu_type", True):
        del settings["gpu_type"]
    if "gpus_per_node" in settings:
        gpus, tasks = settings.pop("gpus_per_node"), config.get("tasks_per_node") or 1
        settings["gpus_per_rank"] = _canonical(gpus / tasks) if gpus is not None else None
    return json.dumps(settings, sort_keys=True, default=str)


def _setting(settings: dict[str, Any], name: str) -> str:
    """One setting as a label shows it; files from older versions may not record it."""
    if name not in settings:
        return "(unset)"
    value = settings[name]
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def group_labels(keys: list[str]) -> dict[str, str]:
    """A short readable label per group key: the model, plus the settings that differ between
    that model's groups (``resnet18 (precision=bf16)``)."""
    settings = {key: json.loads(key) for key in set(keys)}
    labels: dict[str, str] = {}
    for model in sorted({str(s.get("model")) for s in settings.values()}):
        same_model = {k: s for k, s in settings.items() if str(s.get("model")) == model}
        names = sorted({name for s in same_model.values() for name in s})
        differing = [n for n in names if len({_setting(s, n) for s in same_model.values()}) > 1]
        for key, s in same_model.items():
            parts = [f"{n}={_setting(s, n)}" for n in differing]
            labels[key] = f"{model} ({', '.join(parts)})" if parts else model
    # Distinct settings can render alike (the string "1" and the number 1): number them.
    counts = pd.Series(labels).value_counts()
    for index, key in enumerate(sorted(labels)):
        if counts[labels[key]] > 1:
            labels[key] = f"{labels[key]} #{index + 1}"
    return labels


def _float(value: Any) -> float:
    return float("nan") if value is None else float(value)


def run_row(
    run_dir: Path, version: str = __version__, target_top1: float | None = None
) -> dict[str, Any]:
    """Collect one run's numbers from the files its train/evaluate rules wrote;
    ``target_top1``: its report.target_top1 in % (None: :func:`default_target_top1`)."""
    train = json.loads((run_dir / "train_metrics.json").read_text())
    evaluation = json.loads((run_dir / "eval.json").read_text())
    job = json.loads((run_dir / "job.json").read_text())
    provenance = json.loads(provenance_path(run_dir / "model.pt").read_text())
    staging = staging_reports(run_dir)
    cfg, recorded = train["config"], provenance["code"].get("package_version")
    gpus = sum(1 for r in train["ranks"] if r["device"].startswith("cuda"))
    stage_seconds = max((s["seconds"] for s in staging), default=float("nan"))
    stage_bytes = max((s["bytes"] for s in staging), default=0)
    history = train.get("epochs") or []
    return {
        "run": train["run"],
        "settings": cfg,  # every setting: runs.csv's columns after COLUMNS (aggregate_runs)
        **accuracy_flag(history, evaluation["holdout"]["top1"], train["global_batch"]),
        "model": cfg["model"],
        "lr": cfg.get("lr"),
        "lr_used": _float(train.get("lr_used")),  # after lr_scaling; absent in older files
        "nodes": train["nodes"],
        "world_size": train["world_size"],
        "gpus": gpus,
        "gpu_type": cfg.get("gpu_type", ""),  # asked of SLURM (gres); "": any type
        "global_batch": train["global_batch"],
        **shape_columns(train),
        "precision": cfg["precision"],
        "epochs": cfg["epochs"],
        # Stopped by the divergence guard (training.guard): where and why; "" otherwise.
        "diverged": diverged_cell(train.get("diverged")),
        # A pruned sweep's run stopped by its decision (settings.halving): the epoch; "" else.
        "pruned_at_epoch": _pruned_at(train.get("halving")),
        # An epoch far above chance, in warm-up or after (recovered or not): loss_spike.
        "loss_spike": loss_spike(train.get("epochs") or [], cfg.get("divergence_loss_factor", 2)),
        "staging_seconds": stage_seconds,
        "staging_gb_per_s": stage_bytes / stage_seconds / 1e9 if stage_seconds else float("nan"),
        "mean_epoch_seconds": train["mean_epoch_seconds"],
        # holdout evaluations and checkpoint holds / training time (metrics.EPOCH_END_NOTE)
        "epoch_end_share": _float(train.get("epoch_end_share")),
        "images_per_s": train["images_per_s"],
        # train_metrics.json keeps its "worker" keys: files of finished runs read the same.
        "images_per_s_per_rank": train["images_per_s_per_worker"],
        # Files written before the steady-state window existed lack these: NaN, never guessed.
        "throughput_warmup_steps": train.get("throughput_warmup_steps"),
        "steady_images_per_s": _float(train.get("steady_images_per_s")),
        "steady_images_per_s_per_rank": _float(train.get("steady_images_per_s_per_worker")),
        "steady_note": steady_note(train, history),
        # Where the time went (training.step_timing.BREAKDOWN_NOTE): medians over epochs.
        **{k: _float(train.get(k)) for k in BREAKDOWN_COLUMNS},
        "scaling_key": scaling_key(cfg),
        "holdout_top1": evaluation["holdout"]["top1"],
        "holdout_top5": evaluation["holdout"]["top5"],
        "test_top1": evaluation["test"]["top1"],
        "test_top5": evaluation["test"]["top5"],
        **published_columns(cfg.get("recipe"), evaluation),
        **target_columns(cfg, history, train.get("cost"), target_top1),
        "wall_seconds": job["wall_seconds"],
        **preflight_row(
            _read_optional(run_dir.parent.parent / "preflight" / run_dir.name / "preflight.json"),
            train["mean_epoch_seconds"],
        ),
        **cost_row(train.get("cost"), _read_optional(run_dir / "accounting.json")),
        "git_commit": provenance["code"].get("git_commit", "unknown"),
        **code_row(train.get("cost")),
        # No rule reruns a finished training for a code change: the table says so instead.
        "trained_by_other_code": None if recorded is None else recorded != version,
    }


def steady_note(train: dict[str, Any], history: list[dict[str, Any]]) -> str:
    """Why a run has no steady img/s (training.metrics.THROUGHPUT_NOTE); "" where it has one."""
    if train.get("steady_images_per_s") is not None:
        return ""
    warmup = train.get("throughput_warmup_steps")
    if warmup is None:
        return "trained before it was measured"
    steps = steps_per_epoch(history, train["global_batch"])
    if steps is not None and steps <= warmup:
        return f"{steps} steps per epoch <= throughput_warmup_steps {warmup}"
    return "no epoch finished" if not history else "not measured"


def steps_per_epoch(history: list[dict[str, Any]], global_batch: int) -> int | None:
    """The fewest optimizer steps of an epoch (its images / the global batch); None unknown."""
    steps = [int(h["images"]) // global_batch for h in history if h.get("images") is not None]
    return min(steps) if steps else None


# A run whose holdout top-1 is within this share of the way from chance to 100 %: at chance.
NEAR_CHANCE = 0.05
# Train top-1 this share of the way from chance to 100 % is "high"; a holdout loss above
# HIGH_LOSS_FACTOR x ln(classes) beside it is far above chance.
HIGH_TRAIN, HIGH_LOSS_FACTOR = 0.5, 2.0


def accuracy_flag(
    history: list[dict[str, Any]], holdout_top1: float, global_batch: int
) -> dict[str, str]:
    """``accuracy_flag`` ("at chance", "holdout loss high" or "") and ``accuracy_note``: the
    figures and the likely cause. From the last evaluated epoch of history (its chance_loss is
    ln(classes)); empty for a history from before chance_loss was kept."""
    rows = [h for h in history if h.get("chance_loss") is not None]
    if not rows:
        return {"accuracy_flag": "", "accuracy_note": ""}
    last = rows[-1]
    evaluated = [h for h in rows if h.get("holdout_loss") is not None]
    chance_loss = float(last["chance_loss"])
    classes = round(math.exp(chance_loss))
    chance = 1 / classes
    train_top1 = _float(last.get("train_top1"))
    loss = _float(evaluated[-1]["holdout_loss"]) if evaluated else math.nan
    at_chance = holdout_top1 <= chance + NEAR_CHANCE * (1 - chance)
    learned = train_top1 >= chance + HIGH_TRAIN * (1 - chance)
    high_loss = learned and loss > HIGH_LOSS_FACTOR * chance_loss
    if not (at_chance or high_loss):
        return {"accuracy_flag": "", "accuracy_note": ""}
    steps = sum(int(h.get("images") or 0) // global_batch for h in history)
    said = [f"holdout top-1 {100 * holdout_top1:.1f} %, chance {100 * chance:.1f} % ({classes} "
            f"classes)"] if at_chance else []  # fmt: skip
    if high_loss:
        said.append(f"holdout loss {loss:.2f} against chance ln({classes}) = {chance_loss:.2f}")
    said.append(f"train top-1 {100 * train_top1:.0f} %")
    if learned and steps < BATCHNORM_MIN_STEPS:
        cause = (
            f"likely cause: {steps} optimizer steps, too few for BatchNorm's running statistics "
            f"(evaluation uses them; fewer than {BATCHNORM_MIN_STEPS}): more epochs or a "
            "smaller global batch"
        )
    elif learned:
        cause = "likely cause: evaluation unlike training (BatchNorm statistics, transforms)"
    else:
        cause = f"it did not learn in {steps} optimizer steps: lr_used, warm-up or steps"
    return {
        "accuracy_flag": "at chance" if at_chance else "holdout loss high",
        "accuracy_note": ", ".join(said) + "; " + cause,
    }


def target_columns(
    cfg: dict[str, Any],
    history: list[dict[str, Any]],
    cost: dict[str, Any] | None,
    target_top1: float | None,
) -> dict[str, Any]:
    """TARGET_COLUMNS of one run: its target (a fraction) and where it comes from, and the
    epochs, allocation time and GPU-hours its holdout took to reach it (report.target)."""
    source = "set"
    if target_top1 is None:
        target_top1, source = default_target_top1(cfg.get("recipe"), cfg["model"])
    target = None if target_top1 is None else target_top1 / 100
    reached = time_to_target(history, (cost or {}).get("attempts") or [], target)
    return {"target_top1": _float(target), "target_source": source, **reached}


def diverged_cell(diverged: dict[str, Any] | None) -> str:
    """train_metrics.json's ``diverged`` as one cell: epoch, step, loss, LR and reason."""
    if not diverged:
        return ""
    return (
        f"epoch {diverged['epoch']} step {diverged['step']}: {diverged['reason']} (loss "
        f"{diverged['loss']}, lr {diverged['lr']})"
    )


def shape_columns(train: dict[str, Any]) -> dict[str, Any]:
    """Which shape (nodes x ranks per node) each allocation of the run ran on, from its cost
    block's attempts, and each shape's own throughput: the run's throughput columns are its
    last job's shape's (``shape``), never an average across shapes (an elastic resume)."""
    allocations: dict[str, list[str]] = {}
    for attempt in (train.get("cost") or {}).get("attempts") or []:
        shape = attempt.get("shape") or "?"  # "?": recorded before shapes were
        allocations.setdefault(shape, []).append(str(attempt["attempt"]))
    figures = train.get("throughput_by_shape") or {}
    return {
        "shape": train.get("shape", ""),
        "allocation_shapes": "; ".join(f"{s}: {', '.join(a)}" for s, a in allocations.items()),
        "throughput_by_shape": "; ".join(
            f"{s}: {number('.0f')(f['steady_images_per_s'])} img/s steady, "
            f"{number('.0f')(f['images_per_s'])} end to end ({f['epochs']} epochs)"
            for s, f in figures.items()
        ),
    }


def code_row(cost: dict[str, Any] | None) -> dict[str, Any]:
    """Whether the run's allocations ran different code (a run resubmitted over days runs what
    is checked out at each submission) and each one's code; empty for runs trained before the
    attempt record kept it."""
    versions = (cost or {}).get("code_versions")
    if versions is None:
        return {"code_changed": None, "code_versions": None}
    return {"code_changed": bool(cost.get("code_changed")), "code_versions": " ".join(versions)}


def published_columns(recipe: str | None, evaluation: dict[str, Any]) -> dict[str, Any]:
    """EMA_COLUMNS of one run (eval.json files from before the EMA was evaluated: NaN)."""
    ema = evaluation.get("ema") or {}
    row = {
        f"{split}_{k}_ema": _float(ema.get(split, {}).get(k))
        for split in ("holdout", "test")
        for k in ("top1", "top5")
    }
    reported = REPORTED_TOP1.get(recipe or "none")
    row["published_top1"] = _float(None if reported is None else reported / 100)
    which = REPORTED_MODEL.get(recipe or "none")
    row["published_compare_with"] = {"ema": "test_top1_ema", "model": "test_top1"}.get(which)
    return row


def preflight_row(report: dict[str, Any] | None, epoch_seconds: float | None) -> dict[str, Any]:
    """The preflight's projection of a run (NaN without one) and measured / projected."""
    if report is None:
        return dict.fromkeys(PREFLIGHT_COLUMNS, float("nan"))
    projection = report["projection"]
    step = projection.get("step_breakdown") or {}  # preflight.json before 2026-11-24: none
    return {
        "preflight_epoch_seconds": projection["epoch_seconds"],
        "preflight_images_per_s": projection["images_per_s"],
        "preflight_total_seconds": projection["total_seconds"],
        "preflight_allocations": _float(projection["allocations"]),
        "preflight_busbw_gbps": report["allreduce"]["busbw_gbps"],
        "preflight_loader_over_model": report["loader_over_model"],
        # preflight.report.step_breakdown: per step as training counts it (history.csv's terms)
        "preflight_compute_ms": _float(step.get("compute_ms")),
        "preflight_input_bound_pct": _float(step.get("input_bound_pct")),
        "epoch_seconds_over_preflight": _float(epoch_seconds) / projection["epoch_seconds"],
    }


def _read_optional(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def cost_row(cost: dict[str, Any] | None, accounting: dict[str, Any] | None) -> dict[str, Any]:
    """The cost columns of one run: from the cost block of train_metrics.json and the run's
    accounting.json; NaN/None where a figure was not measured."""
    cost = cost or {}
    gpu = cost.get("gpu_telemetry") or {}
    gpu = gpu if gpu.get("available") else {}
    slurm = accounting if accounting and accounting.get("available") else {}
    peak = gpu.get("peak_memory_gb_per_gpu")
    rss = slurm.get("max_rss_bytes")
    return {
        # over every allocation of the run (imagenet_ddp.jobs.attempts); lost: after the newest
        # checkpoint of each interrupted allocation
        "allocations": _float(cost.get("allocations")),
        "gpu_hours": _float(cost.get("gpu_hours")),
        "core_hours": _float(cost.get("core_hours")),
        "gpu_hours_lost": _float(cost.get("gpu_hours_lost")),
        "core_hours_lost": _float(cost.get("core_hours_lost")),
        "gpu_hours_per_epoch": _float(cost.get("gpu_hours_per_epoch")),
        "core_hours_per_epoch": _float(cost.get("core_hours_per_epoch")),
        "gpu_utilization_percent": _float(gpu.get("mean_utilization_percent")),
        "gpu_peak_memory_gb": _float(max(peak) if peak else None),
        "gpu_power_watts": _float(gpu.get("mean_power_watts")),
        "energy_kwh": _float(gpu.get("energy_kwh_all_nodes")),
        "energy_wh_per_1k_images": _float(gpu.get("energy_wh_per_1k_images")),
        "slurm_job_id": cost.get("slurm_job_id"),
        "slurm_state": slurm.get("state"),
        "slurm_elapsed_seconds": _float(slurm.get("elapsed_seconds")),
        "slurm_gpu_hours": _float(slurm.get("gpu_hours")),
        "slurm_core_hours": _float(slurm.get("core_hours")),
        "slurm_max_rss_gb": _float(None if rss is None else rss / 1e9),
    }


def add_scaling(table: pd.DataFrame) -> pd.DataFrame:
    """Group, baseline, efficiency and note per run (``table`` needs ``scaling_key``)."""
    table = table.copy()
    labels = group_labels(list(table["scaling_key"]))
    table["scaling_group"] = table["scaling_key"].map(labels)
    ordered = table.sort_values(["world_size", "run"])
    baseline = ordered.groupby("scaling_key")["run"].first()
    size = table.groupby("scaling_key")["run"].size()
    per_rank = table.set_index("run")["steady_images_per_s_per_rank"]
    table["scaling_baseline"] = table["scaling_key"].map(baseline)
    efficiency, notes = [], []
    for row in table.itertuples():
        base = row.scaling_baseline
        if size[row.scaling_key] == 1:
            efficiency.append(math.nan)
            notes.append(ALONE_NOTE)
        elif row.run == base:
            efficiency.append(math.nan)
            notes.append(BASELINE_NOTE)
        else:
            value = row.steady_images_per_s_per_rank / per_rank[base]
            efficiency.append(value)
            missing = [r for r in (row.run, base) if not math.isfinite(per_rank[r])]
            notes.append(
                f"relative to {base}"
                if not missing
                else f"relative to {base}; no steady-state throughput in {', '.join(missing)}"
            )
    table["scaling_efficiency"] = efficiency
    table["scaling_note"] = notes
    # empty where the run is its own baseline (a group's smallest or only run): runs.csv names
    # only another run
    table["scaling_baseline"] = table["scaling_baseline"].where(
        table["scaling_baseline"] != table["run"]
    )
    return table


def _setting_value(value: Any) -> Any:
    """A setting as one CSV cell: lists and mappings as JSON."""
    return json.dumps(value, sort_keys=True) if isinstance(value, dict | list | tuple) else value


def aggregate_runs(
    run_dirs: list[Path], target_top1: dict[str, float] | None = None
) -> pd.DataFrame:
    """COLUMNS, then every setting of the runs not among them (by name); ``target_top1``:
    report.target_top1 in % by run name (others: their default)."""
    targets = target_top1 or {}
    rows = [run_row(d, target_top1=targets.get(d.name)) for d in run_dirs]
    settings = pd.DataFrame(
        [
            {k: _setting_value(v) for k, v in row.pop("settings").items() if k not in COLUMNS}
            for row in rows
        ]
    )
    table = add_scaling(pd.DataFrame(rows))
    for column in INTEGER_COLUMNS:  # counts: 3, not 3.0; empty where unknown
        table[column] = table[column].astype("Int64")
    # The best by holdout top-1, ties by name; a table of one run names none.
    ranked = table[table["holdout_top1"].notna()].sort_values(
        ["holdout_top1", "run"], ascending=[False, True]
    )
    table["best"] = table["run"] == (ranked["run"].iloc[0] if len(ranked) > 1 else None)
    table = pd.concat([table[COLUMNS], settings[sorted(settings.columns)]], axis=1)
    return table.sort_values(["scaling_group", "world_size", "run"]).reset_index(drop=True)


# runs.md: the figures a person compares first, as (heading, alignment, how to show a row);
# every other figure stays in runs.csv and the HTML report.
def _percent(value: Any) -> str:
    return "" if pd.isna(value) else f"{100 * value:.1f} %"


def number(fmt: str) -> Any:
    """A cell formatter: ``fmt`` (and a unit), empty where unknown (None or NaN)."""
    return lambda value, unit="": "" if pd.isna(value) else format(value, fmt) + unit


def _shapes(row: pd.Series) -> str:
    """The last job's nodes x ranks, then (an elastic run) each other shape its allocations
    ran on."""
    mine = f"{row['nodes']} x {row['world_size'] // row['nodes']}"
    listed = row.get("allocation_shapes")
    others = [] if pd.isna(listed) or not listed else [p.split(":")[0] for p in listed.split("; ")]
    others = [s.replace("x", " x ") for s in others if s not in ("?", mine.replace(" ", ""))]
    return mine + "".join(f" (+ {s})" for s in others)


def _flag(row: pd.Series, column: str) -> bool:
    """A yes/no column that may be unknown (empty)."""
    return not pd.isna(row[column]) and bool(row[column])


def _efficiency(row: pd.Series) -> str:
    """A group's baseline says so; a group's only run stays empty (runs.csv: scaling_note)."""
    if row["scaling_note"] == BASELINE_NOTE:
        return "baseline"
    return _percent(row["scaling_efficiency"])


def _input_bound(row: pd.Series) -> str:
    """The measured input-bound share, and the preflight's projection beside it where both
    exist (no preflight, or one from before the projected breakdown: the measured alone)."""
    measured = number(".0f")(row["input_bound_pct"], " %")
    projected = row["preflight_input_bound_pct"]
    if not measured or pd.isna(projected):
        return measured
    return f"{measured} (preflight {projected:.0f} %)"


def _target(row: pd.Series) -> str:
    """The run's target and where it comes from; a published figure beside a set target."""
    if pd.isna(row["target_top1"]):
        return ""
    source = row["target_source"]
    published = row["published_top1"]
    shown = source.split(" (")[0]  # "published (recipe)": the recipe is in its own column
    if source == "set" and not pd.isna(published):
        shown += f"; published {_percent(published)}"
    return f"{_percent(row['target_top1'])} ({shown})"


def _to_target(row: pd.Series) -> str:
    """Epochs, allocation time and GPU-hours to the target, or why not."""
    if pd.isna(row["target_epochs"]):
        return row["target_note"]
    cell = f"{row['target_epochs']} ep"
    if not pd.isna(row["target_wall_seconds"]):
        hours = number(".3g")(row["target_gpu_hours"])
        return f"{cell}, {_wall(row['target_wall_seconds'])}, {hours} GPU-h"
    return f"{cell} ({row['target_note']})"


def _wall(seconds: Any) -> str:
    if pd.isna(seconds):
        return ""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


SHORT_COLUMNS: list[tuple[str, str, Any]] = [
    (
        "run",
        "left",
        lambda row: (
            row["run"]
            + (" *" if _flag(row, "code_changed") else "")
            + (" †" if _flag(row, "trained_by_other_code") else "")
            + (" (diverged)" if row["diverged"] else "")
            + (
                f" (pruned at epoch {row['pruned_at_epoch']})" if row.get("pruned_at_epoch") else ""
            )  # fmt: skip
            + (" (loss spike)" if row.get("loss_spike") else "")
            + (f" ({row['accuracy_flag']})" if row.get("accuracy_flag") else "")
            + (" (best)" if _flag(row, "best") else "")
        ),
    ),
    ("model", "left", lambda row: row["model"]),
    ("nodes x ranks", "right", _shapes),
    ("GPUs", "right", lambda row: str(row["gpus"])),
    ("global batch", "right", lambda row: str(row["global_batch"])),
    ("precision", "left", lambda row: row["precision"]),
    ("epochs", "right", lambda row: str(row["epochs"])),
    ("img/s (steady)", "right", lambda row: number(".0f")(row["steady_images_per_s"])),
    ("scaling eff.", "right", _efficiency),
    # the diagnosis of a slow run: the share of step time its most input-bound rank waited
    ("input-bound", "right", _input_bound),
    ("holdout top-1", "right", lambda row: _percent(row["holdout_top1"])),
    ("test top-1", "right", lambda row: _percent(row["test_top1"])),
    ("target top-1", "right", lambda row: _target(row)),
    ("to target", "right", lambda row: _to_target(row)),
    ("GPU-h", "right", lambda row: number(".3g")(row["gpu_hours"])),
    ("wall h:mm:ss", "right", lambda row: _wall(row["wall_seconds"])),
]

DIVERGED_NOTE = (
    "(diverged): stopped by the divergence guard, its accuracy that of its last good "
    'checkpoint (docs/reliability.md "Divergence"): '
)
LOSS_SPIKE_NOTE = (
    "(loss spike): an epoch's mean training loss above divergence_loss_factor x ln(classes) "
    "(chance, a uniform guess's), even where the run recovered: an LR too high for its warm-up "
    "(docs/configuration.md#warm-up-and-batch-size): "
)
ACCURACY_NOTE = (
    "(at chance), (holdout loss high): a holdout top-1 within 5 % of the way from chance (1 / "
    "classes) to 100 %, or a holdout loss above 2 x ln(classes) while train top-1 is high, and "
    "the likely cause: "
)
BEST_NOTE = "(best): the highest holdout top-1 of the table (ties: the first by name): "
STEADY_NOTE = "img/s (steady) and scaling eff. empty: "
CODE_CHANGED = "\\* allocations of the run ran different code (checked out at each submission): "

OTHER_CODE = (
    "† trained by another imagenet-ddp version than this one (no upgrade reruns a finished "
    'training; docs/configuration.md "Code changes" says how to retrain one): '
)

# What each column of runs.md is and why a cell may be empty or 0, under the table.
LEGEND = [
    ("run", "its name in config.yaml; a mark after it (\\*, †, diverged, loss spike, at "
     "chance, holdout loss high, best) is explained above"),
    ("settings that differ", "the columns after run: each setting whose value differs between "
     "the runs of the table (a sweep's axes first; lr_used, the LR after lr_scaling, beside "
     "lr); runs.csv holds every setting of every run"),
    ("model", "torchvision name, or timm/<name>"),
    ("nodes x ranks", "nodes x ranks per node of the last training job; (+ N x M): other "
     "shapes an elastic run's allocations ran on"),
    ("GPUs", "GPUs the ranks trained on; 0: on CPU"),
    ("global batch", "images per optimizer step: batch_size x ranks x accumulation"),
    ("precision", "fp32, or autocast to bf16 / fp16"),
    ("epochs", "the run's epochs setting"),
    ("img/s (steady)", "training images per second over all ranks, median over epochs of the "
     "slowest rank, each epoch's first throughput_warmup_steps steps left out; holdout "
     "evaluation, checkpoints and staging not included; empty: no steady-state window, the reason "
     "named above (an epoch of no more steps than throughput_warmup_steps, or trained before it "
     "was measured)"),
    ("scaling eff.", "steady img/s per rank relative to the group's baseline, its smallest run "
     "(same settings but nodes and ranks; 100 %: linear scaling); `baseline` for that run; "
     "empty for a group's only run (nothing to compare with; runs.csv: scaling_note) and where "
     "the run or its baseline has no steady img/s"),
    ("input-bound", "share of step time the most input-bound rank waited for its next batch "
     "(median over epochs): a few % means the loader keeps up, a high share needs more loader "
     "workers (cpus_per_task); (preflight N %): what the preflight projected; empty: not "
     "measured"),
    ("holdout top-1", "top-1 on the images split.holdout_fraction held out of the train set, "
     "by the evaluate job on the final weights"),
    ("test top-1", "top-1 on the official validation set (the test set here), likewise"),
    ("target top-1", "report.target_top1: set, the recipe's published top-1 (published), or "
     "MLPerf's 75.9 % for a ResNet-50 (MLPerf); empty: none"),
    ("to target", "epochs until the holdout top-1 of an evaluated epoch first reached the "
     "target, the allocations' wall time and GPU-hours to that epoch's end (every allocation "
     "before it, staging and lost work included); else why not"),
    ("GPU-h", "allocated GPUs x wall time, summed over every allocation of the run (staging, "
     "warm-up, holdout evaluation, checkpoints and lost work included); 0: no GPU allocated "
     "(a CPU run); empty: not recorded"),
    ("wall h:mm:ss", "the last training job's wall time, launch to end, staging included"),
]  # fmt: skip

MORE_FIGURES = (
    "Every figure of these runs (end-to-end and per-rank throughput, scaling groups and "
    "baselines, staging, the step-time breakdown and MFU, top-5, the EMA model's accuracy "
    "and the published figure, preflight, "
    "cost and SLURM accounting, git commit, code changed between allocations) is in "
    "runs.csv beside this file and in the HTML report (`snakemake --report report.html`, "
    "under Tables); docs/results.md says what each includes."
)


# Settings shown elsewhere in runs.md (their own column, nodes x ranks) or that do not say how
# runs differ in what they learn or measure (bookkeeping, site: settings.kinds).
_SHOWN = {"model", "precision", "epochs", "lr", "lr_used"}


def differing_settings(table: pd.DataFrame, axes: list[str] = ()) -> list[str]:
    """The settings whose values differ between the table's runs: ``axes`` (a sweep's) first,
    then by name; lr and lr_used together where either differs."""
    decl = declarations()
    skip = {*WORLD_KEYS, *decl.not_compared(), "gpus_per_node", *_SHOWN}
    candidates = [c for c in table.columns if c not in COLUMNS and c not in skip]
    differ = [c for c in candidates if table[c].astype(str).nunique() > 1]
    ordered = [a for a in axes if a in differ] + sorted(c for c in differ if c not in axes)
    lr_differs = any(table[c].astype(str).nunique() > 1 for c in ("lr", "lr_used"))
    if lr_differs:
        before = axes[: axes.index("lr")] if "lr" in axes else []  # an lr axis keeps its place
        at = len([a for a in before if a in ordered])
        ordered[at:at] = ["lr", "lr_used"]
    return ordered


def _setting_cell(value: Any) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else format(value, ".4g")
    return "" if value is None else str(value)


def to_markdown(table: pd.DataFrame, axes: list[str] = ()) -> str:
    """runs.md: the run, the settings that differ between runs, :data:`SHORT_COLUMNS` of
    every run, then where the rest is. Empty cells, not "nan": a group's only run has no
    efficiency, an old run no steady figure."""
    shown = [
        (name, "right", lambda row, name=name: _setting_cell(row[name]))
        for name in differing_settings(table, list(axes))
    ]
    columns = [SHORT_COLUMNS[0], *shown, *SHORT_COLUMNS[1:]]
    rows = [[show(row) for *_, show in columns] for _, row in table.iterrows()]
    headings = [heading for heading, *_ in columns]
    align = [side for _, side, _ in columns]
    short = pd.DataFrame(rows, columns=headings, dtype=object)
    text = short.to_markdown(index=False, disable_numparse=True, colalign=align)
    rows = [row for _, row in table.iterrows()]
    notes = (  # (note, the runs it names, how it names one, separator)
        (CODE_CHANGED, [r for r in rows if _flag(r, "code_changed")],
         lambda r: f"{r['run']} ({r['code_versions']})", ", "),
        (OTHER_CODE, [r for r in rows if _flag(r, "trained_by_other_code")],
         lambda r: r["run"], ", "),
        (DIVERGED_NOTE, [r for r in rows if r["diverged"]],
         lambda r: f"{r['run']}: {r['diverged']}", "; "),
        (LOSS_SPIKE_NOTE, [r for r in rows if r.get("loss_spike")],
         lambda r: f"{r['run']}: {r['loss_spike']}", "; "),
        (ACCURACY_NOTE, [r for r in rows if r.get("accuracy_flag")],
         lambda r: f"{r['run']}: {r['accuracy_note']}", "; "),
        (STEADY_NOTE, [r for r in rows if r.get("steady_note")],
         lambda r: f"{r['run']}: {r['steady_note']}", "; "),
        (BEST_NOTE, [r for r in rows if _flag(r, "best")], lambda r: r["run"], ", "),
    )  # fmt: skip
    for note, named, show, separator in notes:
        if named:
            text += "\n\n" + note + separator.join(map(show, named))
    legend = "\n".join(f"- {heading}: {text}" for heading, text in LEGEND)
    return text + "\n\nColumns:\n\n" + legend + "\n\n" + MORE_FIGURES + "\n"


def write_aggregate(
    run_dirs: list[Path], csv: Path, markdown: Path, report_settings: str = "{}"
) -> None:
    """The ``aggregate`` stage: runs.csv, runs.md and the provenance beside the CSV.
    ``report_settings``: JSON of settings.run_checks.report_settings (the sweeps' axes,
    report.target_top1 by run)."""
    settings = json.loads(report_settings)
    table = aggregate_runs(run_dirs, settings.get("target_top1"))
    write_csv_atomic(csv, table)
    write_text_atomic(markdown, to_markdown(table, settings.get("axes", [])))
    write_provenance(
        provenance_path(csv),
        "aggregate",
        {"run_dirs": [str(d) for d in run_dirs], "report": settings},
    )


def _pruned_at(halving: dict | None) -> int | str:
    """A pruned run's epoch (train_metrics.json's ``halving``, settings.halving), else ""."""
    return halving["stopped_at_epoch"] if halving and halving.get("pruned") else ""
