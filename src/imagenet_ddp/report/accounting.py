"""SLURM's own accounting of each run's training jobs, read with ``sacct`` after they ended
(the ``accounting`` rule: ``<run dir>/accounting.json``): per run, over every allocation
``cost.slurm_job_ids`` names, state, elapsed time, TRES, CPU time, the largest MaxRSS, and the
GPU- and core-hours SLURM bills. ``sacct`` hangs where slurmdbd is down: it runs with a timeout,
and a run without an answer gets ``available: false`` and why. It never fails the workflow."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from imagenet_ddp.io import write_json_atomic

FIELDS = (
    "JobIDRaw",
    "JobName",
    "State",
    "ExitCode",
    "ElapsedRaw",
    "AllocTRES",
    "NNodes",
    "TotalCPU",
    "MaxRSS",
)
TIMEOUT_SECONDS = 30
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def _bytes(value: str) -> int | None:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", value.strip())
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def _seconds(value: str) -> float | None:
    """sacct's [D-][HH:]MM:SS[.mmm] (TotalCPU) as seconds."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", value.strip())
    if not match:
        return None
    days, hours, minutes, seconds = match.groups()
    return ((int(days or 0) * 24 + int(hours or 0)) * 60 + int(minutes)) * 60 + float(seconds)


def parse_sacct(text: str) -> dict[str, dict[str, Any]]:
    """``sacct --parsable2 --noheader --format=<FIELDS>`` output: one record per job id, its
    steps folded in."""
    jobs: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != len(FIELDS):
            continue
        row = dict(zip(FIELDS, parts, strict=True))
        job_id, _, step = row["JobIDRaw"].partition(".")
        job = jobs.setdefault(job_id, {"job_id": job_id, "max_rss_bytes": None, "steps": []})
        rss = _bytes(row["MaxRSS"]) if row["MaxRSS"] else None
        if rss:  # 0 or empty: not gathered for this step
            job["max_rss_bytes"] = max(rss, job["max_rss_bytes"] or 0)
        if step:
            job["steps"].append({"step": step, "name": row["JobName"], "state": row["State"]})
            continue
        tres = dict(item.split("=", 1) for item in row["AllocTRES"].split(",") if "=" in item)
        elapsed = int(row["ElapsedRaw"]) if row["ElapsedRaw"].isdigit() else None
        gpus, cpus = int(tres.get("gres/gpu", 0)), int(tres.get("cpu", 0))
        job.update(
            state=row["State"],
            exit_code=row["ExitCode"],
            elapsed_seconds=elapsed,
            alloc_tres=tres,
            nodes=int(row["NNodes"]) if row["NNodes"].isdigit() else None,
            total_cpu_seconds=_seconds(row["TotalCPU"]),
            gpu_hours=None if elapsed is None else gpus * elapsed / 3600,
            core_hours=None if elapsed is None else cpus * elapsed / 3600,
        )
    return jobs


def query_sacct(
    job_ids: list[str], *, sacct: str = "sacct", timeout: float = TIMEOUT_SECONDS
) -> tuple[dict[str, dict[str, Any]], str | None]:
    """(records by job id, None) or ({}, why not)."""
    if not job_ids:
        return {}, None
    if shutil.which(sacct) is None:
        return {}, f"{sacct} not found on PATH (no SLURM accounting here)"
    argv = [sacct, "-j", ",".join(job_ids), "--parsable2", "--noheader",
            f"--format={','.join(FIELDS)}"]  # fmt: skip
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}, f"sacct did not answer within {timeout:g} s (slurmdbd down or missing?)"
    if result.returncode != 0:
        return {}, f"sacct failed ({result.returncode}): {result.stderr.strip()[:300]}"
    return parse_sacct(result.stdout), None


def job_ids_of(cost: dict[str, Any] | None) -> list[str]:
    """Every SLURM job the run trained in (files from before name only the last)."""
    cost = cost or {}
    ids = cost.get("slurm_job_ids") or [cost.get("slurm_job_id")]
    return [str(j) for j in ids if j]


def summed(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's record over its jobs: the last one's state; times summed; the largest MaxRSS."""
    last = jobs[-1]

    def total(key):
        values = [j.get(key) for j in jobs]
        return None if any(v is None for v in values) else sum(values)

    rss = [j["max_rss_bytes"] for j in jobs if j.get("max_rss_bytes")]
    return {
        **{k: last.get(k) for k in ("job_id", "state", "exit_code", "alloc_tres", "nodes")},
        "allocations": len(jobs),
        "job_ids": [j["job_id"] for j in jobs],
        "elapsed_seconds": total("elapsed_seconds"),
        "total_cpu_seconds": total("total_cpu_seconds"),
        "gpu_hours": total("gpu_hours"),
        "core_hours": total("core_hours"),
        "max_rss_bytes": max(rss) if rss else None,
        "jobs": jobs,
    }


def run_accounting(run_dirs: list[Path], **query) -> dict[Path, dict[str, Any]]:
    """Each run's accounting record, or ``available: false`` with the reason."""
    job_ids = {}
    for run_dir in run_dirs:
        metrics = json.loads((run_dir / "train_metrics.json").read_text())
        job_ids[run_dir] = job_ids_of(metrics.get("cost"))
    every = sorted({j for ids in job_ids.values() for j in ids})
    records, reason = query_sacct(every, **query)
    queried = {"queried_at": datetime.now(UTC).isoformat(timespec="seconds"),
               "fields": list(FIELDS)}  # fmt: skip
    out = {}
    for run_dir, ids in job_ids.items():
        missing = [j for j in ids if j not in records]
        if not ids:
            out[run_dir] = {"available": False, "reason": "not trained in a SLURM job"}
        elif not missing:
            out[run_dir] = {"available": True, **summed([records[j] for j in ids]), **queried}
        else:
            why = reason or f"sacct has no record of job {', '.join(missing)}"
            out[run_dir] = {"available": False, "reason": why, "job_id": ids[-1],
                            "job_ids": ids, **queried}  # fmt: skip
    return out


def write_accounting(run_dirs: list[Path]) -> None:
    """``<run dir>/accounting.json`` of every run (``imagenet-ddp accounting``, the rule)."""
    for run_dir, record in run_accounting(run_dirs).items():
        write_json_atomic(run_dir / "accounting.json", record)
        print(f"{run_dir}: {record.get('state') or record.get('reason')}", flush=True)
