"""Snakemake planning overhead: dry-run with 50 runs, and a no-op rerun of a finished pipeline.

    .venv/bin/python benchmarks/bench_workflow.py [--quick] [--repeats 5] [--runs 50]

* **dry-run, 50 runs**: ``snakemake -n --profile profiles/local`` on a copy of the workflow
  (``tests/workflow_helpers.copy_workflow``) whose config lists 50 runs (nothing computed yet:
  every job is planned, 50 train + 50 evaluate + data + report jobs).
* **no-op rerun**: ``snakemake --profile profiles/local`` (not ``-n``) after the tiny demo
  pipeline with 2 runs completed (1 epoch): what every re-invocation on a finished workdir
  costs (Snakemake reads the config, parses rules, checks every output and its metadata).
  With ``--quick`` the finished pipeline stops at ``split`` (``--until split``) and the no-op
  rerun targets the same, so the smoke test stays fast.
* **baseline**: the same command on a trivial one-rule Snakefile (``-n``: one job planned;
  no-op: its output exists): Snakemake's own start-up cost, the floor for any workflow.

Wall time of the whole process, median of the repetitions (one warm-up run first).
Target: each <= 5 s. Ratio = baseline / ours (1.0 = no cost above Snakemake's start-up).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SNAKEMAKE = [sys.executable, "-m", "snakemake"]

TRIVIAL = """rule all:
    input:
        "out.txt",


rule make:
    output:
        "out.txt",
    shell:
        "echo hi > {output}"
"""


def smk(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [*SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"snakemake {' '.join(args)} in {workdir} failed:\n{out.stdout[-3000:]}\n"
            f"{out.stderr[-3000:]}"
        )
    return out


def wall(workdir: Path, args: list[str], repeats: int) -> list[float]:
    smk(workdir, *args)  # warm-up (imports in the page cache, .snakemake/ created)
    return [C.timed(lambda: smk(workdir, *args)) for _ in range(repeats)]


def main(argv: list[str] | None = None) -> int:
    parser = C.quick_flag()
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)

    from tests.workflow_helpers import copy_workflow, read_config, write_config

    with tempfile.TemporaryDirectory(prefix="bench-workflow-") as tmp:
        tmp = Path(tmp)
        trivial = tmp / "trivial"
        trivial.mkdir()
        (trivial / "Snakefile").write_text(TRIVIAL)
        base_dry = wall(trivial, ["-n", "--cores", "1"], repeats)
        smk(trivial, "--cores", "1")
        base_noop = wall(trivial, ["--cores", "1"], repeats)

        many = copy_workflow(
            tmp / "runs50",
            runs=[
                {"name": f"run{i:02d}", "tasks_per_node": 1 + i % 2, "lr": 0.05 + 0.001 * i}
                for i in range(args.runs)
            ],
        )
        dry = wall(many, ["-n", "--profile", "profiles/local"], repeats)
        planned = smk(many, "-n", "--profile", "profiles/local")
        jobs = [
            line.split()[-1]
            for line in planned.stdout.splitlines()
            if line.strip().startswith("total")
        ]

        done = copy_workflow(tmp / "done")
        config = read_config(done)
        config["train_defaults"]["epochs"] = 1
        write_config(done, config)
        target = ["--until", "split"] if args.quick else []
        smk(done, "--profile", "profiles/local", *target)
        noop = wall(done, ["--profile", "profiles/local", *target], repeats)
        check = smk(done, "-n", "--profile", "profiles/local", *target)
        text = check.stdout + check.stderr
        nothing = "Nothing to be done" in text or bool(re.search(r"^total\s+0\s*$", text, re.M))

    rows = [
        {
            "metric": f"snakemake -n, {args.runs} runs, s",
            "ours": C.median(dry),
            "baseline": C.median(base_dry),
            "unit": "s",
            "ratio": C.median(base_dry) / C.median(dry),
            "target": "<= 5 s",
            "met": C.median(dry) <= 5.0,
        },
        {
            "metric": "no-op rerun"
            + (" (--until split)" if args.quick else ", 2 runs done")
            + ", s",
            "ours": C.median(noop),
            "baseline": C.median(base_noop),
            "unit": "s",
            "ratio": C.median(base_noop) / C.median(noop),
            "target": "<= 5 s",
            "met": C.median(noop) <= 5.0,
        },
    ]
    C.report(
        "bench_workflow: Snakemake planning overhead",
        rows,
        notes=[
            f"median of {repeats} (after 1 warm-up); dry-run planned {jobs[0] if jobs else '?'} "
            f"jobs; rerun had nothing to do: {nothing}",
            "baseline = same command on a trivial one-rule Snakefile (Snakemake start-up)",
        ],
        json_out=args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
