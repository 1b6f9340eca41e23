"""The preflight job: stage the prepared copy on every node as training does, run the
preflight's ranks (:mod:`imagenet_ddp.preflight_rank`) on the run's geometry, and fail with one
line per problem (:mod:`imagenet_ddp.preflight_report`) so that a run whose ``train`` depends on
it (``preflight: true``) is never queued.

Torch-free: this runs in the rule's process, which only waits for the ranks.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from imagenet_ddp.io import write_json_atomic
from imagenet_ddp.job_spec import write_spec
from imagenet_ddp.preflight_report import FAILED, PREFLIGHT_SPEC
from imagenet_ddp.provenance import provenance_path, write_provenance


def preflight_job(
    run: dict[str, Any],
    *,
    prepared_train: Path,
    split_dir: Path,
    out: Path,
    execution: dict[str, Any],
    train_runtime_minutes: float | None,
    checkpoint_root: Path | None = None,
) -> int:
    """Preflight ``run`` (its settings as the train rule passes them); 0 when it may go.

    ``train_runtime_minutes``: the train rule's SLURM time limit (None: none, e.g. locally);
    the projection counts the allocations of that length the run needs. ``checkpoint_root``:
    the run's checkpoint directory, whose write rate the projection uses (None: ``out``'s)."""
    from imagenet_ddp.launch import run_staged

    out = Path(out)
    failed = out.with_name(FAILED)
    for stale in (out, failed):  # a failed preflight leaves no report that looks complete
        stale.unlink(missing_ok=True)
    spec = {
        "kind": "preflight",
        "run": run,
        "paths": {
            "prepared_train": str(prepared_train),
            "split_dir": str(split_dir),
            "run_dir": str(out.parent),
            "out": str(out),
            "checkpoint_root": str(checkpoint_root or out.parent),
        },
        "execution": execution,
        "preflight": {
            "train_runtime_minutes": train_runtime_minutes,
            "max_allocations": run["max_allocations"],
        },
    }
    started = time.time()
    code = run_staged(spec, write_spec(out.parent / PREFLIGHT_SPEC, spec))
    if code != 0:
        return code
    report = json.loads(out.read_text())
    report["wall_seconds"] = time.time() - started  # staging, start-up and every measurement
    if report["problems"]:
        write_json_atomic(failed, report)
        out.unlink()
        for line in report["problems"]:
            print(f"preflight of run {run['run']!r}: {line}", file=sys.stderr)
        return 1
    write_json_atomic(out, report)
    write_provenance(provenance_path(out), "preflight", run, seeds={"preflight": run["seed"]})
    print(f"preflight of run {run['run']!r} passed in {report['wall_seconds']:.1f} s")
    return 0
