"""sacct accounting (a fake sacct here; the real one runs in the SLURM end-to-end tests) and the
cost columns of the runs table."""

from __future__ import annotations

import json
import math
import os
import stat

import pandas as pd
import pytest

from imagenet_ddp.cli import main
from imagenet_ddp.report.accounting import parse_sacct, query_sacct, run_accounting
from imagenet_ddp.report.aggregate import COST_COLUMNS, aggregate_runs
from tests.fake_runs import write_run_dir

SACCT = """\
123|imagenet_ddp_x|COMPLETED|0:0|3725|billing=64,cpu=64,gres/gpu=8,mem=256000M,node=2|2|1-02:03:04.500|
123.batch|batch|COMPLETED|0:0|3725|cpu=32,mem=128000M,node=1|1|00:01.234|2048K
123.extern|extern|COMPLETED|0:0|3725|billing=64,cpu=64,gres/gpu=8,mem=256000M,node=2|2|00:00:00|0
123.0|python|COMPLETED|0:0|60|cpu=64,mem=256000M,node=2|2|10:00.500|1.5G
123.1|python|COMPLETED|0:0|3600|cpu=64,gres/gpu=8,mem=256000M,node=2|2|1-01:00:00|30G
124|imagenet_ddp_y|TIMEOUT|0:0|60|billing=1,cpu=1,mem=4000M,node=1|1|00:30.000|
"""


def test_parse_folds_steps_into_the_job():
    jobs = parse_sacct(SACCT)
    job = jobs["123"]
    assert job["state"] == "COMPLETED" and job["elapsed_seconds"] == 3725
    assert job["alloc_tres"]["gres/gpu"] == "8" and job["nodes"] == 2
    assert job["gpu_hours"] == pytest.approx(8 * 3725 / 3600)
    assert job["core_hours"] == pytest.approx(64 * 3725 / 3600)
    assert job["max_rss_bytes"] == 30 * 1024**3  # the largest step
    assert job["total_cpu_seconds"] == pytest.approx(93784.5)
    assert [s["step"] for s in job["steps"]] == ["batch", "extern", "0", "1"]
    assert jobs["124"]["state"] == "TIMEOUT" and jobs["124"]["gpu_hours"] == 0
    assert jobs["124"]["max_rss_bytes"] is None  # not gathered: absent, not zero


def fake_sacct(tmp_path, body: str) -> str:
    path = tmp_path / "sacct"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_query_passes_the_job_ids_and_reads_the_answer(tmp_path):
    out = tmp_path / "argv"
    sacct = fake_sacct(tmp_path, f'echo "$@" > {out}\ncat <<"EOF"\n{SACCT}EOF')
    records, reason = query_sacct(["123", "124"], sacct=sacct)
    assert reason is None and set(records) == {"123", "124"}
    assert out.read_text().startswith("-j 123,124 --parsable2 --noheader --format=JobIDRaw,")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("sleep 10", "sacct did not answer within 0.5 s"),
        ("echo 'Slurm accounting storage is disabled' >&2; exit 1", "sacct failed (1): Slurm"),
    ],
)
def test_a_hanging_or_failing_sacct_gives_a_reason_not_an_error(tmp_path, body, reason):
    records, why = query_sacct(["1"], sacct=fake_sacct(tmp_path, body), timeout=0.5)
    assert records == {} and why.startswith(reason)


def test_no_sacct_on_path(tmp_path):
    assert query_sacct(["1"], sacct=str(tmp_path / "missing"))[1].endswith(
        "not found on PATH (no SLURM accounting here)"
    )


def run_dirs(tmp_path):
    gpu = write_run_dir(tmp_path, "gpu-2x4", nodes=2, tasks_per_node=4, steady_per_worker=100.0)
    cpu = write_run_dir(tmp_path, "cpu-1x1", nodes=1, tasks_per_node=1, steady_per_worker=10.0)
    gone = write_run_dir(tmp_path, "gone-1x1", nodes=1, tasks_per_node=1, steady_per_worker=9.0)
    for run_dir, job_id in ((gpu, "123"), (cpu, None), (gone, "999")):
        metrics = json.loads((run_dir / "train_metrics.json").read_text())
        metrics["cost"] = {
            "gpu_hours": 8.0,
            "core_hours": 64.0,
            "gpu_hours_per_epoch": 1.0,
            "slurm_job_id": job_id,
            "gpu_telemetry": {"available": False},
        }
        if run_dir == gpu:
            metrics["cost"]["gpu_telemetry"] = {
                "available": True, "mean_utilization_percent": 93.0, "mean_power_watts": 2400.0,
                "peak_memory_gb_per_gpu": [30.0, 31.5], "energy_kwh_all_nodes": 4.0,
                "energy_wh_per_1k_images": 0.25,
            }  # fmt: skip
        (run_dir / "train_metrics.json").write_text(json.dumps(metrics))
    return gpu, cpu, gone


def test_accounting_per_run_and_cost_columns_of_the_table(tmp_path, monkeypatch):
    gpu, cpu, gone = run_dirs(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_sacct(bin_dir, f'cat <<"EOF"\n{SACCT}EOF')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert main(["accounting", "--run-dirs", str(gpu), str(cpu), str(gone)]) == 0
    records = {d.name: json.loads((d / "accounting.json").read_text()) for d in (gpu, cpu, gone)}
    assert records["gpu-2x4"]["available"] and records["gpu-2x4"]["job_id"] == "123"
    assert records["cpu-1x1"] == {"available": False, "reason": "not trained in a SLURM job"}
    assert records["gone-1x1"]["reason"] == "sacct has no record of job 999"

    table = aggregate_runs([gpu, cpu, gone]).set_index("run")
    row = table.loc["gpu-2x4"]
    assert (row["gpu_hours"], row["gpu_peak_memory_gb"], row["energy_kwh"]) == (8.0, 31.5, 4.0)
    assert row["slurm_state"] == "COMPLETED" and row["slurm_gpu_hours"] == pytest.approx(
        8.2778, 1e-4
    )
    assert row["slurm_max_rss_gb"] == pytest.approx(30 * 1024**3 / 1e9)
    cpu_row = table.loc["cpu-1x1"]
    for column in ("gpu_utilization_percent", "energy_kwh", "slurm_elapsed_seconds"):
        assert math.isnan(cpu_row[column]), column  # not measured: empty, not zero
    assert pd.isna(cpu_row["slurm_state"])


def test_runs_from_before_cost_existed_have_empty_cost_columns(tmp_path):
    run_dir = write_run_dir(tmp_path, "old", nodes=1, tasks_per_node=1, steady_per_worker=1.0)
    row = aggregate_runs([run_dir]).iloc[0]
    assert row[COST_COLUMNS].isna().all(), row[COST_COLUMNS]
    assert run_accounting([run_dir])[run_dir]["reason"] == "not trained in a SLURM job"


def test_every_allocation_of_a_run_is_queried_and_summed(tmp_path, monkeypatch):
    (run_dir,) = run_dirs(tmp_path)[:1]
    metrics = json.loads((run_dir / "train_metrics.json").read_text())
    metrics["cost"]["slurm_job_ids"] = ["124", "123"]  # a TIMEOUT, then the job that finished
    (run_dir / "train_metrics.json").write_text(json.dumps(metrics))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_sacct(bin_dir, f'echo "$@" > {tmp_path}/argv; cat <<"EOF"\n{SACCT}EOF')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    record = run_accounting([run_dir])[run_dir]
    assert "-j 123,124" in (tmp_path / "argv").read_text()
    assert record["allocations"] == 2 and record["job_ids"] == ["124", "123"]
    assert record["state"] == "COMPLETED" and record["elapsed_seconds"] == 3725 + 60
    assert record["core_hours"] == pytest.approx((64 * 3725 + 60) / 3600)
    assert [job["state"] for job in record["jobs"]] == ["TIMEOUT", "COMPLETED"]
