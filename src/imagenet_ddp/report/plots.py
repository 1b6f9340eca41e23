"""Figures for the report: scaling (throughput, efficiency), training curves, per-class accuracy,
cost. From the aggregate table (runs.csv) and each run's history.csv and per_class.csv; written
atomically as .png or .svg (the output's suffix), byte-identical for the same inputs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    FixedLocator,
    FuncFormatter,
    LogLocator,
    MaxNLocator,
    NullLocator,
    ScalarFormatter,
)

from imagenet_ddp.errors import InputError  # noqa: E402
from imagenet_ddp.io import atomic_path  # noqa: E402
from imagenet_ddp.report.target import cost_by_epoch  # noqa: E402

RUNS_COLUMNS = [
    "run",
    "model",
    "world_size",
    "images_per_s",
    "images_per_s_per_rank",
    "steady_images_per_s",
    "steady_images_per_s_per_rank",
    "scaling_efficiency",
    "scaling_group",
    "scaling_baseline",
]
TEXT_COLUMNS = ("run", "model", "class_index", "scaling_group", "scaling_baseline")
HISTORY_COLUMNS = ["epoch", "train_loss", "holdout_loss", "train_top1", "holdout_top1"]
# Absent in tables from before cost was measured: plotted as missing.
COST_PLOT_COLUMNS = ["gpu_hours_per_epoch", "core_hours_per_epoch", "energy_wh_per_1k_images"]
PER_CLASS_COLUMNS = ["class_index", "test_top1", "test_total"]

# Fixed style so the figures do not depend on a user's matplotlibrc.
STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 130,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 8.5,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.hashsalt": "imagenet-ddp",
    "svg.fonttype": "path",
}
# No dates, no version strings: identical inputs give identical bytes.
METADATA = {".png": {"Software": None}, ".svg": {"Date": None, "Creator": None}}


def _read_csv(
    path: Path, required: Sequence[str], what: str, fix: str, empty: bool = False
) -> pd.DataFrame:
    """``path`` as a frame with the ``required`` columns (numeric but TEXT_COLUMNS); ``fix``:
    what to do where it lacks some."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: {what} not found; run the rule that writes it first")
    try:
        frame = pd.read_csv(path, keep_default_na=False, na_values=["", "nan", "NaN"])
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read {what} as CSV ({exc})") from exc
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise InputError(f"{path}: {what} lacks column(s) {', '.join(missing)}; {fix}")
    if frame.empty and not empty:
        raise InputError(f"{path}: {what} has no rows")
    _numeric(frame, [c for c in required if c not in TEXT_COLUMNS], path)
    return frame


def _numeric(frame: pd.DataFrame, columns: Sequence[str], path: Path) -> None:
    for column in columns:
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = values.isna() & frame[column].notna()
        if bad.any():
            raise InputError(
                f"{path}: column {column!r} has non-numeric value "
                f"{frame[column][bad].iloc[0]!r} in row {_first(bad)}"
            )
        frame[column] = values


def read_runs(path: Path) -> pd.DataFrame:
    """The aggregate table, with the scaling groups and baselines aggregate.py assigned."""
    fix = "rewrite it with `snakemake --forcerun aggregate`"
    table = _read_csv(path, RUNS_COLUMNS, "aggregate runs table", fix)
    # empty: the run is its own group's baseline
    base = table["scaling_baseline"]  # all empty: read as float
    table["scaling_baseline"] = base.astype(object).where(base.notna(), table["run"])
    for column in ("run", "model", "scaling_group", "scaling_baseline"):
        table[column] = table[column].astype(str)
    group_of = table.set_index("run")["scaling_group"]
    orphan = ~table["scaling_baseline"].map(group_of).eq(table["scaling_group"])
    if orphan.any():
        row = table[orphan].iloc[0]
        raise InputError(
            f"{path}: run {row['run']!r} names baseline {row['scaling_baseline']!r}, which is not "
            f"a run of its group {row['scaling_group']!r}; rerun the aggregate rule"
        )
    return table


def _first(mask: pd.Series) -> int:
    """The CSV line number (header is line 1) of the first true row."""
    return int(mask.idxmax()) + 2


def read_run_dir(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    run_dir = Path(run_dir)
    # A run the divergence guard stopped in its first epoch has no epoch row (no curve).
    metrics = run_dir / "train_metrics.json"
    diverged = metrics.is_file() and bool(json.loads(metrics.read_text()).get("diverged"))
    fix = "rerun the rule that writes it"
    history = _read_csv(run_dir / "history.csv", HISTORY_COLUMNS, "training history", fix, diverged)
    per_class = _read_csv(run_dir / "per_class.csv", PER_CLASS_COLUMNS, "per-class accuracy", fix)
    return history.sort_values("epoch"), per_class


def _groups(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame, pd.Series]]:
    """(label, runs by world size, baseline row) per scaling group, in label order."""
    groups = []
    for label, rows in table.groupby("scaling_group", sort=True):
        rows = rows.sort_values(["world_size", "run"])
        base = rows[rows["run"] == rows["scaling_baseline"].iloc[0]].iloc[0]
        groups.append((str(label), rows, base))
    return groups


def _save(fig: Figure, path: Path) -> None:
    suffix = Path(path).suffix.lower()  # checked by make_plots
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=suffix[1:], metadata=METADATA[suffix], bbox_inches="tight")
    plt.close(fig)


def _colors(keys: Sequence[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10" if len(keys) <= 10 else "tab20")
    return {key: cmap(i % cmap.N) for i, key in enumerate(keys)}


def _rank_axis(ax, ranks: Sequence[int]) -> bool:
    """Log2 axis with the actual rank counts as ticks when they span 4x or more."""
    ranks = sorted({int(r) for r in ranks})
    log = ranks[-1] / ranks[0] >= 4
    if log:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_locator(FixedLocator(ranks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("DDP ranks")
    if not log:
        pad = max(0.5, 0.08 * (ranks[-1] - ranks[0]))
        ax.set_xlim(ranks[0] - pad, ranks[-1] + pad)
    return log


def _label_points(ax, table: pd.DataFrame, x: str, y: str) -> None:
    """Name each run next to its point (after the axes' limits): below right, or above right
    near the bottom axis."""
    if len(table) > 12:  # labels would pile up; the table in the report names the runs
        return
    to_axes = ax.transData + ax.transAxes.inverted()
    for row in table.itertuples():
        point = (getattr(row, x), getattr(row, y))
        near_bottom = to_axes.transform(point)[1] < 0.1
        ax.annotate(row.run, point, xytext=(6, 5 if near_bottom else -12),
                    textcoords="offset points", fontsize=7.5, color="0.3")  # fmt: skip


STEADY = {"linestyle": "-", "marker": "o"}
END_TO_END = {"linestyle": ":", "marker": "o", "markerfacecolor": "none", "alpha": 0.8}
IDEAL = {"linestyle": "--", "alpha": 0.7}


def _group_legend(ax, handles: list, title: str) -> None:
    """One entry per group, below the axes: group labels can be long."""
    wide = len(handles) > 3 or max(len(h.get_label()) for h in handles) > 40
    ax.legend(
        handles=handles,
        title=title,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=1 if wide else 2,
        frameon=False,
    )


def plot_throughput(table: pd.DataFrame, out: Path) -> None:
    """Steady-state and end-to-end throughput vs ranks per scaling group, with the ideal
    linear scaling from each group's smallest run."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        groups = _groups(table)
        colors = _colors([label for label, _, _ in groups])
        log = _rank_axis(ax, table["world_size"])
        handles, plotted = [], [table["images_per_s"], table["steady_images_per_s"]]
        for label, rows, base in groups:
            color = colors[label]
            ax.plot(rows["world_size"], rows["steady_images_per_s"], color=color, **STEADY)
            ax.plot(rows["world_size"], rows["images_per_s"], color=color, **END_TO_END)
            handles.append(Line2D([], [], color=color, linewidth=2, label=label))
            top = float(rows["world_size"].max())
            if top > base["world_size"] and np.isfinite(base["steady_images_per_s_per_rank"]):
                ideal_x = np.array([float(base["world_size"]), top])
                ideal_y = base["steady_images_per_s_per_rank"] * ideal_x
                ax.plot(ideal_x, ideal_y, color=color, **IDEAL)
                plotted.append(pd.Series(ideal_y))
        values = pd.concat(plotted).to_numpy(dtype=float)
        values = values[np.isfinite(values) & (values > 0)]
        if log and len(values):  # straight ideal lines; ticks at 1-2-5 steps, not powers of two
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.6g}"))
            ax.set_ylim(values.min() / 1.6, values.max() * 1.3)  # room for the point labels
        else:
            ax.set_ylim(bottom=0, top=(values.max() if len(values) else 1.0) * 1.15)
        # After the limits (placement depends on them); at the steady point where there is one.
        labelled = table.assign(label_y=table["steady_images_per_s"].fillna(table["images_per_s"]))
        _label_points(ax, labelled, "world_size", "label_y")
        ax.set_ylabel("Training throughput (images/s, all ranks)")
        ax.set_title("Training throughput vs ranks", pad=24)
        gray = {"color": "0.3"}
        styles = ax.legend(
            handles=[
                Line2D([], [], **gray, **STEADY, label="steady state (warm-up left out)"),
                Line2D([], [], **gray, **END_TO_END, label="end to end (whole epoch)"),
                Line2D([], [], **gray, **IDEAL, label="ideal linear scaling"),
            ],
            # between the title and the axes, not in them: no point or label falls under it
            loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, handlelength=2.5,
            frameon=False,
        )  # fmt: skip
        ax.add_artist(styles)
        styles.set_clip_on(False)  # add_artist clips to the axes
        _group_legend(ax, handles, "Scaling group (same settings, geometry varies)")
        _save(fig, out)


def plot_efficiency(table: pd.DataFrame, out: Path) -> None:
    """Scaling efficiency per group: steady-state per-rank throughput relative to the
    group's smallest run (drawn at 100 % with an open marker)."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        groups = _groups(table)
        colors = _colors([label for label, _, _ in groups])
        _rank_axis(ax, table["world_size"])
        ax.axhline(100, color="0.4", linestyle="--", linewidth=1)
        handles, top = [], 110.0
        for label, rows, base in groups:
            others = rows[(rows["run"] != base["run"]) & rows["scaling_efficiency"].notna()]
            if others.empty:  # one run, or no steady-state figure: nothing to compare
                reason = "only one run" if len(rows) == 1 else "no steady-state figure"
                handles.append(Line2D([], [], linestyle="none", label=f"{label}: {reason}"))
                continue
            color = colors[label]
            x = [base["world_size"], *others["world_size"]]
            y = [100.0, *(others["scaling_efficiency"] * 100)]
            ax.plot(x, y, color=color, **STEADY)
            ax.plot(x[:1], y[:1], color=color, marker="o", mfc="white", linestyle="none", zorder=3)
            handles.append(Line2D([], [], color=color, linewidth=2, label=label))
            top = max(top, max(y) * 1.1)
        ax.set_ylim(0, top)
        ax.set_ylabel("Scaling efficiency (%)")
        ax.set_title(
            "Scaling efficiency vs ranks\n"
            "(steady-state per-rank throughput / group's smallest run's)"
        )
        ax.legend(
            handles=[
                Line2D([], [], color="0.4", linestyle="--", linewidth=1, label="ideal (100 %)"),
                Line2D(
                    [],
                    [],
                    color="0.3",
                    marker="o",
                    markerfacecolor="white",
                    linestyle="none",
                    label="group's smallest run (baseline)",
                ),
            ],
            loc="lower left",
            frameon=False,
        )
        ax.add_artist(ax.get_legend())
        _group_legend(ax, handles, "Scaling group (same settings, geometry varies)")
        _save(fig, out)


def _curve_styles(max_epoch: int) -> dict[str, dict]:
    """The four curves' line styles: train and holdout loss, train and holdout top-1."""
    # Markers show where the measurements are; past a few dozen epochs they only add noise.
    size = 3.5 if max_epoch <= 20 else 0
    return {
        "train": {"linestyle": "-", "marker": "o", "markersize": size},
        "holdout": {"linestyle": "--", "marker": "s", "markersize": size},
        "train_acc": {"linestyle": ":", "alpha": 0.8},
        "holdout_acc": {"linestyle": "-", "marker": "s", "markersize": size},
    }


def _draw_curves(axes, histories: dict[str, pd.DataFrame], colors: dict, styles: dict) -> None:
    ax_loss, ax_acc = axes
    for run, history in histories.items():
        x = history["epoch"] + 1  # history counts from 0; plot epochs completed
        color = colors[run]
        ax_loss.plot(x, history["train_loss"], color=color, **styles["train"])
        # Epochs that eval_interval skips have no holdout figures: join the evaluated ones.
        evaluated = history["holdout_top1"].notna()
        holdout_loss = history["holdout_loss"][evaluated]
        ax_loss.plot(x[evaluated], holdout_loss, color=color, **styles["holdout"])
        holdout_top1 = history["holdout_top1"][evaluated] * 100
        ax_acc.plot(x[evaluated], holdout_top1, color=color, **styles["holdout_acc"])
        ax_acc.plot(x, history["train_top1"] * 100, color=color, **styles["train_acc"])


def _epoch_axes(axes, max_epoch: int) -> None:
    for ax in axes:
        ax.set_xlabel("Epochs completed")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True, min_n_ticks=1))
        ax.set_xlim(0.7 if max_epoch <= 20 else 0, max_epoch + (0.3 if max_epoch <= 20 else 0))


def _loss_scale(ax_loss, histories: dict[str, pd.DataFrame]) -> None:
    """Linear from 0, or logarithmic where the losses span more than 20x."""
    ax_loss.set_ylabel("Cross-entropy loss")
    losses = pd.concat([h[["train_loss", "holdout_loss"]] for h in histories.values()])
    losses = losses.to_numpy().ravel()
    losses = losses[np.isfinite(losses) & (losses > 0)]
    if len(losses) and losses.max() / losses.min() > 20:
        # An early spike (e.g. unsettled batch norm on the holdout) would flatten the rest.
        ax_loss.set_yscale("log")
        ax_loss.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.6g}"))
        ax_loss.set_ylabel("Cross-entropy loss (log scale)")
    else:
        ax_loss.set_ylim(bottom=0)


def _curve_legends(fig, axes, styles: dict, colors: dict) -> None:
    """The line styles' legends in each panel, the runs' colors below both."""
    ax_loss, ax_acc = axes
    labels = {"train": "train (mean over epoch)", "holdout": "holdout (end of epoch)"}
    labels |= {"train_acc": labels["train"], "holdout_acc": labels["holdout"]}
    for ax, keys, loc in (
        (ax_loss, ("train", "holdout"), "upper right"),
        (ax_acc, ("holdout_acc", "train_acc"), "upper left"),
    ):
        handles = [Line2D([], [], color="0.3", **styles[k], label=labels[k]) for k in keys]
        ax.legend(handles=handles, loc=loc, frameon=False)
    run_handles = [Line2D([], [], color=c, linewidth=2, label=r) for r, c in colors.items()]
    ncol = min(len(run_handles), 5)
    fig.legend(
        handles=run_handles,
        loc="lower center",
        ncol=ncol,
        frameon=False,
        title="Run",
        bbox_to_anchor=(0.5, -0.02),
    )
    fig.suptitle("Training curves")
    rows = -(-len(run_handles) // ncol)
    fig.tight_layout(rect=(0, 0.035 + 0.045 * rows, 1, 1))


def plot_curves(histories: dict[str, pd.DataFrame], out: Path) -> None:
    """Loss (train, holdout) and top-1 accuracy (train, holdout) per epoch, one color per run."""
    # default: only runs the divergence guard stopped in their first epoch (no rows)
    max_epoch = max((int(h["epoch"].max()) + 1 for h in histories.values() if len(h)), default=1)
    styles = _curve_styles(max_epoch)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
        ax_loss, ax_acc = axes
        colors = _colors(list(histories))
        _draw_curves(axes, histories, colors, styles)
        _epoch_axes(axes, max_epoch)
        _loss_scale(ax_loss, histories)
        ax_loss.set_title("Loss per epoch")
        ax_acc.set_ylabel("Top-1 accuracy (%)")
        ax_acc.set_ylim(0, 100)
        ax_acc.set_title("Top-1 accuracy per epoch")
        _curve_legends(fig, axes, styles, colors)
        _save(fig, out)


def _class_points(ax, positions, runs: list[str], values: list[np.ndarray]) -> None:
    """Every class as a dot (fixed jitter), each run's mean over classes as a diamond."""
    colors = _colors(runs)
    rng = np.random.default_rng(0)  # fixed jitter: deterministic output
    for pos, run, vals in zip(positions, runs, values, strict=True):
        jitter = rng.uniform(-0.18, 0.18, size=len(vals))
        alpha = 0.8 if len(vals) <= 100 else max(0.15, 60 / len(vals))
        ax.scatter(pos + jitter, vals, s=12, color=colors[run], alpha=alpha, zorder=3, linewidths=0)
        if len(vals):
            ax.scatter(
                pos, vals.mean(), marker="D", s=30, color="white", edgecolors="black", zorder=4
            )


def _per_class_legend(ax, chance: float) -> None:
    handles = [
        Line2D([], [], color="black", label="median (box: quartiles)"),
        Line2D(
            [],
            [],
            marker="D",
            linestyle="",
            markerfacecolor="white",
            markeredgecolor="black",
            label="mean over classes",
        ),
        Line2D([], [], marker="o", linestyle="", color="0.4", label="one class"),
        Line2D([], [], color="firebrick", linestyle=":", label=f"chance ({chance:.3g} %)"),
    ]
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False
    )


def plot_per_class(per_class: dict[str, pd.DataFrame], out: Path) -> None:
    """Spread of per-class test top-1 across classes: a box per run plus every class as a dot."""
    runs = list(per_class)
    values = []
    for run in runs:
        frame = per_class[run]
        values.append((frame.loc[frame["test_total"] > 0, "test_top1"].dropna() * 100).to_numpy())
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(runs) + 2.5), 4.6))
        positions = np.arange(1, len(runs) + 1)
        gray = {"color": "0.35"}
        ax.boxplot(
            values,
            positions=positions,
            widths=0.55,
            showfliers=False,
            medianprops={"color": "black"},
            boxprops=gray,
            whiskerprops=gray,
            capprops=gray,
        )
        _class_points(ax, positions, runs, values)
        n_classes = max(len(f) for f in per_class.values())
        chance = 100 / n_classes
        ax.axhline(chance, color="firebrick", linestyle=":", linewidth=1)
        _per_class_legend(ax, chance)
        ax.set_xticks(positions)
        ax.set_xticklabels(
            runs, rotation=20 if len(runs) > 3 else 0, ha="right" if len(runs) > 3 else "center"
        )
        ax.set_xlim(0.4, len(runs) + 0.6)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("Run")
        ax.set_ylabel("Per-class test top-1 accuracy (%)")
        ax.set_title(f"Per-class test top-1 accuracy ({n_classes} classes)")
        _save(fig, out)


def _cost_panel(ax, table: pd.DataFrame, x: str, xlabel: str, empty: str) -> None:
    points = table[np.isfinite(table[x].astype(float)) & (table[x].astype(float) > 0)]
    ax.set_ylabel("Images/s, end to end (all ranks)")
    ax.set_xlabel(xlabel)
    if points.empty:
        ax.text(0.5, 0.5, empty, ha="center", va="center", wrap=True, transform=ax.transAxes)
        ax.set_xticks([])
        return
    ax.scatter(points[x], points["images_per_s"], color="C0", zorder=3)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    _label_points(ax, points, x, "images_per_s")


def plot_cost(table: pd.DataFrame, out: Path) -> None:
    """Throughput against what an epoch costs (GPU-hours; core-hours when no run has GPUs)
    and against the energy per 1,000 training images (NVML, GPU runs only)."""
    table = table.copy()
    for column in COST_PLOT_COLUMNS:  # tables from before cost was measured: not measured
        table[column] = pd.to_numeric(table.get(column, np.nan), errors="coerce")
    with plt.rc_context(STYLE):
        fig, (left, right) = plt.subplots(1, 2, figsize=(10.4, 4.4))
        if (table["gpu_hours_per_epoch"] > 0).any():
            xlabel = "GPU-hours per epoch (allocated GPUs x mean epoch time)"
            _cost_panel(left, table, "gpu_hours_per_epoch", xlabel, "")
            left.set_title("Throughput vs GPU-hours per epoch (runs with GPUs)")
        else:
            xlabel = "Core-hours per epoch (allocated cores x mean epoch time)"
            _cost_panel(left, table, "core_hours_per_epoch", xlabel, "no cost recorded")
            left.set_title("Throughput vs core-hours per epoch (no run had GPUs)")
        xlabel = "Energy per 1,000 training images (Wh; NVML, all nodes estimated)"
        empty = "energy not measured:\nno run had NVML GPU telemetry"
        _cost_panel(right, table, "energy_wh_per_1k_images", xlabel, empty)
        right.set_title("Throughput vs energy per 1k images")
        fig.tight_layout()
        _save(fig, out)


def cost_curve(run_dir: Path) -> pd.DataFrame:
    """A run's holdout top-1 per evaluated epoch against the allocations' wall hours and
    GPU-hours to that epoch's end (report.target.cost_by_epoch); no rows without an attempt
    record."""
    path = Path(run_dir) / "train_metrics.json"
    train = json.loads(path.read_text()) if path.is_file() else {}
    history = train.get("epochs") or []
    costs = cost_by_epoch(history, (train.get("cost") or {}).get("attempts") or [])
    rows = [
        {"epoch": h["epoch"], "holdout_top1": h["holdout_top1"], "wall_hours": wall / 3600,
         "gpu_hours": gpu}
        for h, (wall, gpu) in zip(history, costs or [], strict=False)
        if h.get("holdout_top1") is not None
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=["epoch", "holdout_top1", "wall_hours", "gpu_hours"])


def plot_to_target(curves: dict[str, pd.DataFrame], table: pd.DataFrame, out: Path) -> None:
    """Holdout top-1 of every run against the GPU-hours spent to each evaluated epoch (the
    allocations' wall hours where no run had GPUs), each run's target dotted."""
    gpu = any((c["gpu_hours"] > 0).any() for c in curves.values())
    column = "gpu_hours" if gpu else "wall_hours"
    given = table.set_index("run").get("target_top1")  # absent in tables from before it
    targets = None if given is None else pd.to_numeric(given, errors="coerce")
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(7.4, 4.6))
        colors = _colors(list(curves))
        for run, curve in curves.items():
            ax.plot(curve[column], 100 * curve["holdout_top1"], marker="o", ms=3,
                    color=colors[run], label=run)  # fmt: skip
            target = None if targets is None else targets.get(run)
            if target is not None and not np.isnan(target):
                ax.axhline(100 * target, color=colors[run], linestyle=":", linewidth=1)
        if not any(len(c) for c in curves.values()):
            ax.text(0.5, 0.5, "no epoch with an attempt record", ha="center",
                    transform=ax.transAxes)  # fmt: skip
        ax.set_xlabel(
            "GPU-hours to the epoch's end, every allocation"
            if gpu
            else "Allocation hours to the epoch's end (no run had GPUs)"
        )
        ax.set_ylabel("Holdout top-1 (%)")
        ax.set_ylim(0, 100)
        ax.set_title("Holdout top-1 vs cost (dotted: each run's target)")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, frameon=False)
        _save(fig, out)


def make_plots(
    runs_csv: Path,
    run_dirs: Sequence[Path],
    *,
    throughput: Path,
    efficiency: Path,
    curves: Path,
    per_class: Path,
    cost: Path | None = None,
    to_target: Path | None = None,
) -> None:
    for path in (throughput, efficiency, curves, per_class, cost or per_class,
                 to_target or per_class):  # fmt: skip
        if Path(path).suffix.lower() not in METADATA:
            raise InputError(f"{path}: unsupported figure format; use one of {tuple(METADATA)}")
    if not run_dirs:
        raise InputError("no run directories given (--run-dirs)")
    table = read_runs(runs_csv)
    histories, per_class_tables = {}, {}
    for run_dir in run_dirs:
        name = Path(run_dir).name
        if name in histories:
            raise InputError(f"{run_dir}: run {name!r} given twice in --run-dirs")
        histories[name], per_class_tables[name] = read_run_dir(run_dir)
    plot_throughput(table, throughput)
    plot_efficiency(table, efficiency)
    plot_curves(histories, curves)
    plot_per_class(per_class_tables, per_class)
    if cost is not None:
        plot_cost(table, cost)
    if to_target is not None:
        plot_to_target({Path(d).name: cost_curve(d) for d in run_dirs}, table, to_target)
