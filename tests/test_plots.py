"""The report's figures: written from fake run outputs, valid images, clear errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from imagenet_ddp import cli
from imagenet_ddp.errors import InputError
from imagenet_ddp.io import write_csv_atomic
from imagenet_ddp.report import plots
from imagenet_ddp.report.aggregate import COLUMNS, aggregate_runs
from tests.fake_runs import write_run_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# (run, model, nodes, tasks per node, steady img/s per worker, other settings): a realistic
# multi-node sweep with three scaling groups, one of them a lone fp32 run.
FAKE_RUNS = [
    ("resnet18-1x1", "resnet18", 1, 1, 2900.0, {}),
    ("resnet18-1x4", "resnet18", 1, 4, 2800.0, {}),
    ("resnet18-2x4", "resnet18", 2, 4, 2550.0, {}),
    ("resnet18-4x4", "resnet18", 4, 4, 2300.0, {}),
    ("resnet50-1x4", "resnet50", 1, 4, 1150.0, {}),
    ("resnet50-2x4", "resnet50", 2, 4, 1100.0, {}),
    ("resnet50-4x4", "resnet50", 4, 4, 1010.0, {}),
    ("resnet50-fp32-1x1", "resnet50", 1, 1, 420.0, {"precision": "fp32"}),
]
GROUPS = ["resnet18", "resnet50 (precision=bf16)", "resnet50 (precision=fp32)"]


def make_fake_results(
    root: Path, runs=FAKE_RUNS, *, epochs: int = 8, num_classes: int = 100
) -> tuple[Path, list[Path]]:
    """Fake run directories, results/aggregate/runs.csv as aggregate.py writes it from them,
    and results/runs/<run>/{history,per_class}.csv."""
    rng = np.random.default_rng(1)
    run_dirs = []
    for run, model, nodes, tasks, per_worker, settings in runs:
        workers = nodes * tasks
        final = 0.55 + 0.1 * (model == "resnet50") + rng.normal(0, 0.01)
        run_dir = write_run_dir(
            root,
            run,
            nodes=nodes,
            tasks_per_node=tasks,
            steady_per_worker=per_worker,
            model=model,
            epochs=epochs,
            **settings,
        )
        epoch = np.arange(epochs)
        progress = 1 - np.exp(-(epoch + 1) / (epochs / 3))
        history = pd.DataFrame(
            {
                "epoch": epoch,
                "train_loss": 6.9 - (6.9 - 1.6) * progress + rng.normal(0, 0.03, epochs),
                "train_top1": final * 1.08 * progress,
                "images": 1_153_000,
                "epoch_seconds": 1_153_000 / (per_worker * workers),
                "images_per_s": per_worker * workers,
                "lr_end": 0.1 * (1 - progress),
                "holdout_top1": final * progress + rng.normal(0, 0.005, epochs),
                "holdout_top5": np.minimum(1, final * 1.4 * progress),
                "holdout_loss": 6.9 - (6.9 - 1.9) * progress + rng.normal(0, 0.03, epochs),
            }
        )
        history.to_csv(run_dir / "history.csv", index=False)
        test_top1 = np.clip(rng.normal(final - 0.03, 0.15, num_classes), 0, 1)
        pd.DataFrame(
            {
                "class_index": np.arange(num_classes),
                "wnid": [f"n{i:08d}" for i in range(num_classes)],
                "words": [f"class {i}, thing" for i in range(num_classes)],
                "holdout_top1": np.clip(test_top1 + rng.normal(0, 0.03, num_classes), 0, 1),
                "holdout_total": 13,
                "test_top1": test_top1,
                "test_total": 50,
            }
        ).to_csv(run_dir / "per_class.csv", index=False)
        run_dirs.append(run_dir)
    csv = root / "results/aggregate/runs.csv"
    write_csv_atomic(csv, aggregate_runs(run_dirs))
    return csv, run_dirs


def _outputs(out: Path, suffix: str = ".png") -> dict[str, Path]:
    return {
        name: out / f"{name}{suffix}"
        for name in ("throughput", "efficiency", "curves", "per_class", "cost", "to_target")
    }


def _assert_images(paths: dict[str, Path], suffix: str) -> None:
    for path in paths.values():
        data = path.read_bytes()
        assert len(data) > 5000, path
        if suffix == ".png":
            assert data.startswith(PNG_MAGIC), path
        else:
            assert b"<svg" in data[:2000] and data.rstrip().endswith(b"</svg>"), path
    # No temporaries left behind by the atomic writes.
    assert not [p for p in next(iter(paths.values())).parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_every_figure_is_written_and_valid(tmp_path, suffix):
    csv, run_dirs = make_fake_results(tmp_path)
    outputs = _outputs(tmp_path / "plots", suffix)
    plots.make_plots(csv, run_dirs, **outputs)
    _assert_images(outputs, suffix)


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_rerun_gives_identical_bytes(tmp_path, suffix):
    csv, run_dirs = make_fake_results(tmp_path)
    first, second = _outputs(tmp_path / "a", suffix), _outputs(tmp_path / "b", suffix)
    plots.make_plots(csv, run_dirs, **first)
    plots.make_plots(csv, run_dirs, **second)
    for name in first:
        assert first[name].read_bytes() == second[name].read_bytes(), name


def test_single_run_and_linear_axes(tmp_path):
    """The demo pipeline's shape: one model, 1 and 2 workers, few classes and epochs."""
    runs = [
        ("resnet18-1x2", "resnet18", 1, 2, 40.0, {}),
        ("resnet18-1x1", "resnet18", 1, 1, 55.0, {}),
    ]
    csv, run_dirs = make_fake_results(tmp_path, runs, epochs=3, num_classes=6)
    outputs = _outputs(tmp_path / "plots")
    plots.make_plots(csv, run_dirs, **outputs)
    _assert_images(outputs, ".png")
    one = _outputs(tmp_path / "one")
    plots.make_plots(csv, run_dirs[:1], **one)
    _assert_images(one, ".png")


def _figures(monkeypatch, csv: Path, run_dirs: list[Path], tmp_path: Path) -> dict:
    """The figures make_plots draws, by output name, instead of writing them."""
    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.setdefault(Path(path).stem, fig))
    plots.make_plots(csv, run_dirs, **_outputs(tmp_path / "plots"))
    return drawn


def _solid_lines(ax) -> list:
    return [line for line in ax.get_lines() if line.get_linestyle() == "-"]


def _legend_texts(legend) -> list[str]:
    return [text.get_text() for text in legend.get_texts()]


def test_throughput_draws_one_line_per_group(tmp_path, monkeypatch):
    csv, run_dirs = make_fake_results(tmp_path)
    ax = _figures(monkeypatch, csv, run_dirs, tmp_path)["throughput"].axes[0]
    assert _legend_texts(ax.get_legend()) == GROUPS
    steady = _solid_lines(ax)
    assert len(steady) == len(GROUPS)
    resnet18 = steady[0]
    assert list(resnet18.get_xdata()) == [1, 4, 8, 16]
    assert list(resnet18.get_ydata()) == pytest.approx([2900, 4 * 2800, 8 * 2550, 16 * 2300])
    # Ideal lines from each group's smallest run; none for the lone fp32 run.
    ideal = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert [list(line.get_ydata()) for line in ideal] == [
        pytest.approx([2900, 16 * 2900]),
        pytest.approx([4 * 1150, 16 * 1150]),
    ]
    # End-to-end (dotted) beside the steady-state line, per group.
    assert len([line for line in ax.get_lines() if line.get_linestyle() == ":"]) == len(GROUPS)
    labels = [t.get_text() for t in ax.texts]
    assert sorted(labels) == sorted(run for run, *_ in FAKE_RUNS)


@pytest.mark.parametrize("count", [1, 2, len(FAKE_RUNS)])
def test_throughput_legends_lie_outside_the_axes_and_no_run_label_under_them(
    tmp_path, monkeypatch, count
):
    """Issue 42: a single run's label sat under the style legend (upper left, in the axes).
    Both legends are outside the axes; no point label meets either, nor a group's line."""
    from matplotlib.legend import Legend

    csv, run_dirs = make_fake_results(tmp_path, FAKE_RUNS[:count])
    fig = _figures(monkeypatch, csv, run_dirs, tmp_path)["throughput"]
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)  # the extents as saved
    legends = [ax.get_legend(), *(a for a in ax.artists if isinstance(a, Legend))]
    assert len(legends) == 2 and legends[1].get_clip_on() is False  # drawn whole
    area = ax.get_window_extent(renderer)
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(labels) == count
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert not box.overlaps(area), _legend_texts(legend)
        assert not any(box.overlaps(label) for label in labels)
    # the style legend between the title and the axes, within the figure
    style = legends[1].get_window_extent(renderer)
    assert area.y1 <= style.y0 and style.y1 < ax.title.get_window_extent(renderer).y0 + 1
    plots.plt.close("all")  # _figures keeps them open


def test_efficiency_draws_groups_with_a_baseline_and_names_lone_runs(tmp_path, monkeypatch):
    csv, run_dirs = make_fake_results(tmp_path)
    ax = _figures(monkeypatch, csv, run_dirs, tmp_path)["efficiency"].axes[0]
    assert _legend_texts(ax.get_legend()) == [
        "resnet18",
        "resnet50 (precision=bf16)",
        "resnet50 (precision=fp32): only one run",
    ]
    lines = _solid_lines(ax)
    assert len(lines) == 2
    assert list(lines[0].get_xdata()) == [1, 4, 8, 16]
    assert list(lines[0].get_ydata()) == pytest.approx([100, 2800 / 29, 2550 / 29, 2300 / 29])
    assert list(lines[1].get_ydata()) == pytest.approx([100, 1100 / 11.5, 1010 / 11.5])
    # Nowhere does the fp32 run meet the bf16 ones (it used to: 1150/420 = 274 %).
    assert max(max(line.get_ydata()) for line in lines) == pytest.approx(100)


def test_runs_without_steady_figure_still_plot(tmp_path, monkeypatch):
    """runs.csv aggregated from train_metrics.json files older than the steady-state window."""
    csv, run_dirs = make_fake_results(tmp_path, FAKE_RUNS[:3])
    table = pd.read_csv(csv)
    table[["steady_images_per_s", "steady_images_per_s_per_rank", "scaling_efficiency"]] = None
    table.to_csv(csv, index=False)
    figures = _figures(monkeypatch, csv, run_dirs, tmp_path)
    efficiency = figures["efficiency"].axes[0]
    assert _legend_texts(efficiency.get_legend()) == ["resnet18: no steady-state figure"]
    assert not _solid_lines(efficiency)
    throughput = figures["throughput"].axes[0]
    dotted = [line for line in throughput.get_lines() if line.get_linestyle() == ":"]
    assert list(dotted[0].get_ydata()) == pytest.approx(
        [0.9 * 2900, 0.9 * 4 * 2800, 0.9 * 8 * 2550]
    )


@pytest.mark.parametrize(
    ("change", "missing"),
    [
        # from before scaling groups: grouping by model would compare fp32 with bf16
        (lambda t: t.drop(columns=["scaling_group", "scaling_baseline"]),
         "scaling_group, scaling_baseline"),
        # from before `workers` (the rank count) became `world_size`
        (lambda t: t.rename(columns={"world_size": "workers",
                                     "images_per_s_per_rank": "images_per_s_per_worker"}),
         "world_size, images_per_s_per_rank"),
    ],
)  # fmt: skip
def test_table_of_an_earlier_version_is_refused_with_its_fix(tmp_path, change, missing):
    csv, run_dirs = make_fake_results(tmp_path)
    change(pd.read_csv(csv)).to_csv(csv, index=False)
    result = _run_module(*_argv(csv, run_dirs, tmp_path / "plots"))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"imagenet-ddp plots: error: {csv}: aggregate runs table lacks column(s) {missing}; "
        "rewrite it with `snakemake --forcerun aggregate`"
    )
    assert not (tmp_path / "plots").exists()


def test_baseline_outside_its_group_is_refused(tmp_path):
    csv, run_dirs = make_fake_results(tmp_path)
    table = pd.read_csv(csv)
    table.loc[table["run"] == "resnet18-4x4", "scaling_baseline"] = "resnet50-1x4"
    table.to_csv(csv, index=False)
    with pytest.raises(InputError, match=r"run 'resnet18-4x4' names baseline 'resnet50-1x4'"):
        plots.make_plots(csv, run_dirs, **_outputs(tmp_path / "plots"))


def test_main_cli_writes_figures(tmp_path):
    csv, run_dirs = make_fake_results(tmp_path)
    outputs = _outputs(tmp_path / "plots")
    argv = ["--runs-csv", str(csv), "--run-dirs", *map(str, run_dirs)]
    for name, path in outputs.items():
        argv += [f"--{name.replace('_', '-')}", str(path)]
    assert cli.main(["plots", *argv]) == 0
    _assert_images(outputs, ".png")


def test_cost_figure_draws_measured_runs_only(tmp_path, monkeypatch):
    csv, _ = make_fake_results(tmp_path)
    table = plots.read_runs(csv)
    table["gpu_hours_per_epoch"] = [0.5] + [float("nan")] * (len(table) - 1)
    table["energy_wh_per_1k_images"] = [2.0] + [float("nan")] * (len(table) - 1)
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    plots.plot_cost(table, tmp_path / "cost.png")
    left, right = figures[0].axes
    assert left.collections[0].get_offsets().tolist() == [[0.5, table["images_per_s"].iloc[0]]]
    assert right.collections[0].get_offsets().tolist() == [[2.0, table["images_per_s"].iloc[0]]]
    assert "GPU-hours per epoch" in left.get_xlabel()
    # No GPU run and no energy: core-hours, and the right panel says why it is empty.
    table["gpu_hours_per_epoch"] = 0.0
    table["core_hours_per_epoch"] = 0.25
    table["energy_wh_per_1k_images"] = float("nan")
    plots.plot_cost(table, tmp_path / "cost.png")
    left, right = figures[1].axes
    assert len(left.collections[0].get_offsets()) == len(table)
    assert "Core-hours" in left.get_xlabel() and not right.collections
    assert "no run had NVML GPU telemetry" in right.texts[0].get_text()


def _run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "imagenet_ddp.cli", "plots", *args], capture_output=True, text=True
    )


def _argv(csv: Path, run_dirs: list[Path], out: Path) -> list[str]:
    argv = ["--runs-csv", str(csv), "--run-dirs", *map(str, run_dirs)]
    for name, path in _outputs(out).items():
        argv += [f"--{name.replace('_', '-')}", str(path)]
    return argv


def test_missing_runs_csv_is_one_clear_line(tmp_path):
    csv, run_dirs = make_fake_results(tmp_path)
    csv.unlink()
    result = _run_module(*_argv(csv, run_dirs, tmp_path / "plots"))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"imagenet-ddp plots: error: {csv}: aggregate runs table not found; "
        "run the rule that writes it first"
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "plots").exists() or not any((tmp_path / "plots").iterdir())


def test_missing_history_names_the_file(tmp_path):
    csv, run_dirs = make_fake_results(tmp_path)
    (run_dirs[2] / "history.csv").unlink()
    with pytest.raises(InputError, match=r"resnet18-2x4/history\.csv: training history not found"):
        plots.make_plots(csv, run_dirs, **_outputs(tmp_path / "plots"))


def test_missing_column_is_named(tmp_path):
    csv, run_dirs = make_fake_results(tmp_path)
    pd.read_csv(csv).drop(columns="images_per_s").to_csv(csv, index=False)
    with pytest.raises(
        InputError,
        match=r"runs\.csv: aggregate runs table lacks column\(s\) images_per_s; rewrite",
    ):
        plots.make_plots(csv, run_dirs, **_outputs(tmp_path / "plots"))


def test_missing_per_class_column_is_named(tmp_path):
    csv, run_dirs = make_fake_results(tmp_path)
    path = run_dirs[0] / "per_class.csv"
    pd.read_csv(path).drop(columns="test_top1").to_csv(path, index=False)
    with pytest.raises(
        InputError,
        match=r"per_class\.csv: per-class accuracy lacks column\(s\) "
        r"test_top1",
    ):
        plots.make_plots(csv, run_dirs, **_outputs(tmp_path / "plots"))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "cannot read aggregate runs table as CSV"),
        (",".join(COLUMNS) + "\n", "aggregate runs table has no rows"),
    ],
)
def test_empty_runs_csv(tmp_path, content, message):
    csv, run_dirs = make_fake_results(tmp_path)
    csv.write_text(content)
    with pytest.raises(InputError, match=message):
        plots.make_plots(csv, run_dirs, **_outputs(tmp_path / "plots"))


def test_non_numeric_value_names_column_and_row(tmp_path):
    csv, run_dirs = make_fake_results(tmp_path)
    table = pd.read_csv(csv)
    table["images_per_s"] = table["images_per_s"].astype(object)
    table.loc[1, "images_per_s"] = "fast"
    table.to_csv(csv, index=False)
    with pytest.raises(
        InputError,
        match=r"column 'images_per_s' has non-numeric value 'fast' "
        r"in row 3",
    ):
        plots.make_plots(csv, run_dirs, **_outputs(tmp_path / "plots"))


def test_unsupported_format_is_refused_before_any_work(tmp_path):
    csv, run_dirs = make_fake_results(tmp_path)
    outputs = _outputs(tmp_path / "plots")
    outputs["curves"] = tmp_path / "plots/curves.jpeg"
    with pytest.raises(InputError, match=r"curves\.jpeg: unsupported figure format"):
        plots.make_plots(csv, run_dirs, **outputs)
    assert not (tmp_path / "plots").exists()


def test_failed_figure_leaves_no_partial_file(tmp_path, monkeypatch):
    csv, run_dirs = make_fake_results(tmp_path)
    outputs = _outputs(tmp_path / "plots")

    def broken_savefig(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", broken_savefig)
    with pytest.raises(RuntimeError, match="disk full"):
        plots.make_plots(csv, run_dirs, **outputs)
    assert not [p for p in (tmp_path / "plots").iterdir()]


def test_loss_spike_and_collapsed_scaling_still_plot(tmp_path):
    """What the 2-core demo really produces: a 1000x holdout-loss spike in epoch 1 and a
    2-rank run slower than the 1-rank one (log loss axis, efficiency far below 100 %)."""
    runs = [
        ("resnet18-1x1", "resnet18", 1, 1, 115.0, {}),
        ("resnet18-1x2", "resnet18", 1, 2, 6.1, {}),
    ]
    csv, run_dirs = make_fake_results(tmp_path, runs, epochs=3, num_classes=6)
    history = pd.read_csv(run_dirs[1] / "history.csv")
    history.loc[0, "holdout_loss"] = 3729.0
    history.to_csv(run_dirs[1] / "history.csv", index=False)
    outputs = _outputs(tmp_path / "plots")
    plots.make_plots(csv, run_dirs, **outputs)
    _assert_images(outputs, ".png")


def test_a_run_diverged_in_its_first_epoch_plots_no_curve_and_stops_nothing(tmp_path):
    """The divergence guard's run without an epoch row: history.csv is the header alone;
    another run's empty history is still refused."""
    import json

    import matplotlib

    from imagenet_ddp.report import plots
    from imagenet_ddp.training.metrics import history_frame

    matplotlib.use("Agg")
    history_frame([]).to_csv(tmp_path / "history.csv", index=False)
    (tmp_path / "per_class.csv").write_text("class_index,test_top1,test_total\n0,0.5,10\n")
    with pytest.raises(InputError, match="training history has no rows"):
        plots.read_run_dir(tmp_path)
    (tmp_path / "train_metrics.json").write_text(json.dumps({"diverged": {"epoch": 0}}))
    history, _ = plots.read_run_dir(tmp_path)
    plots.plot_curves({"diverged": history}, tmp_path / "curves.png")
    assert history.empty and (tmp_path / "curves.png").stat().st_size > 0


def test_holdout_against_gpu_hours_draws_every_run_and_its_target(tmp_path, monkeypatch):
    """Each run's holdout top-1 per evaluated epoch against the GPU-hours to its end
    (report.target.cost_by_epoch), its target dotted; a run without an attempt record draws
    no point."""
    csv, run_dirs = make_fake_results(tmp_path, epochs=3)
    metrics_path = run_dirs[0] / "train_metrics.json"
    metrics = json.loads(metrics_path.read_text())
    metrics["epochs"] = [
        {"epoch": e, "holdout_top1": top1, "epoch_seconds": 3600.0, "eval_seconds": 0.0}
        for e, top1 in enumerate([0.2, None, 0.6])  # epoch 1 not evaluated
    ]
    attempt = {"attempt": 1, "wall_seconds": 3 * 3600.0, "gpu_hours": 3 * 8.0,
               "lost_seconds": 0.0, "last_checkpoint": {"epoch": 3, "step": 0}}  # fmt: skip
    metrics["cost"] = {"attempts": [attempt]}
    metrics_path.write_text(json.dumps(metrics))
    table = pd.read_csv(csv)
    table["target_top1"] = [0.5] + [float("nan")] * (len(table) - 1)
    table.to_csv(csv, index=False)
    figure = _figures(monkeypatch, csv, run_dirs, tmp_path)["to_target"]
    (ax,) = figure.axes
    lines = _solid_lines(ax)
    first = lines[0]
    assert first.get_label() == run_dirs[0].name
    assert first.get_xdata().tolist() == [8.0, 24.0] and first.get_ydata().tolist() == [20.0, 60.0]
    assert all(len(line.get_xdata()) == 0 for line in lines[1:])  # no attempt record
    dotted = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert [line.get_ydata()[0] for line in dotted] == [50.0]
    assert "GPU-hours" in ax.get_xlabel()
