"""The preflight job: stage the prepared copy on every node as training does, run the
preflight's ranks (:mod:`imagenet_ddp.preflight.rank`) on the run's geometry, and fail with one
line per problem (:mod:`imagenet_ddp.preflight.report`) so that a run whose ``train`` depends on
it (``preflight: true``) is never queued.

Torch-free: this runs in the rule's process, which only waits for the ranks.
"""

from __future__ import annotations

import json
import sys
import time

from imagenet_ddp.io import write_json_atomic
from imagenet_ddp.jobs.spec import PREFLIGHT_SPEC, PreflightJob, with_launcher, write_spec
from imagenet_ddp.preflight.report import FAILED
from imagenet_ddp.provenance import provenance_path, write_provenance


def preflight_job(job: PreflightJob) -> int:
    """Preflight ``job.run`` (the train rule's settings); 0 when it may go. The projection
    counts allocations of ``job.train_runtime_minutes`` (the train rule's limit; None: none)."""
    from imagenet_ddp.jobs.launch import run_staged
    from imagenet_ddp.jobs.launchers import resolve_launcher

    _ = job.geometry  # a run without its geometry is refused before anything is written
    job = with_launcher(job, resolve_launcher(job.execution.launcher))
    out, run = job.paths.out, job.run
    failed = out.with_name(FAILED)
    for stale in (out, failed):  # a failed preflight leaves no report that looks complete
        stale.unlink(missing_ok=True)
    started = time.time()
    code = run_staged(job, write_spec(out.parent / PREFLIGHT_SPEC, job))
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
    for line in report.get("warnings", []):  # the run may go, and trains input-bound
        print(f"preflight of run {run['run']!r}: warning: {line}", file=sys.stderr)
    write_json_atomic(out, report)
    write_provenance(provenance_path(out), "preflight", run, seeds={"preflight": run["seed"]})
    print(f"preflight of run {run['run']!r} passed in {report['wall_seconds']:.1f} s")
    return 0
