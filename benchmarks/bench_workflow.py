"""Snakemake planning overhead: a job's own parse, a newcomer's first dry-run, a dry-run with
200 runs, and a no-op rerun of a finished pipeline.

    .venv/bin/python benchmarks/bench_workflow.py [--quick] [--repeats 5] [--runs 200]

* **a job's own parse**: what a SLURM job's own Snakemake does before its command runs (the
  plugin's jobstep arguments, ``tests/workflow_helpers.job_snakemake``: ``--mode remote
  --target-jobs train:run=... -n``) on the demo config; baseline: the one-rule Snakefile's
  ``-n``. Target (issue 41): within 1.3x of the baseline, no torch imported.
* **first dry-run**: ``snakemake -n`` of the shipped config in a fresh copy with an empty
  ``$HOME`` (nothing cached anywhere: a newcomer's first command). Target: under 10 s.
* **dry-run, 200 runs**: ``snakemake -n --profile profiles/local`` on a copy of the workflow
  (``tests/workflow_helpers.copy_workflow``) whose config lists 200 runs (nothing computed yet:
  every job is planned). Target: under 5 s once warm.
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
    parser.add_argument("--runs", type=int, default=None, help="default 200 (--quick: 20)")
    args = parser.parse_args(argv)
    args.runs = args.runs or (20 if args.quick else 200)
    repeats = args.repeats or (1 if args.quick else 5)

    import os

    from tests.workflow_helpers import copy_workflow, job_snakemake, read_config, write_config

    with tempfile.TemporaryDirectory(prefix="bench-workflow-") as tmp:
        tmp = Path(tmp)
        trivial = tmp / "trivial"
        trivial.mkdir()
        (trivial / "Snakefile").write_text(TRIVIAL)
        base_dry = wall(trivial, ["-n", "--cores", "1"], repeats)
        smk(trivial, "--cores", "1")
        base_noop = wall(trivial, ["--cores", "1"], repeats)

        job = copy_workflow(tmp / "job", as_shipped=True)
        first_home = tmp / "home"
        first_home.mkdir()
        env_before = dict(os.environ)
        os.environ.update(HOME=str(first_home), XDG_CACHE_HOME=str(first_home / ".cache"))
        try:
            first = [C.timed(lambda: smk(job, "-n"))]  # the very first: nothing cached
        finally:
            os.environ.clear()
            os.environ.update(env_before)
        run = read_config(job)["runs"][0]["name"]
        job_snakemake(job, f"train:run={run}", check=True)  # warm-up
        job_parse = [
            C.timed(lambda: job_snakemake(job, f"train:run={run}", check=True))
            for _ in range(repeats)
        ]
        imports = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "snakemake", "-n", "--cores", "1"],
            cwd=job, capture_output=True, text=True,
        ).stderr  # fmt: skip
        torch_free = not re.search(r"\|\s+torch$", imports, re.M)

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
            "metric": "a job's own parse (jobstep, -n), s",
            "ours": C.median(job_parse),
            "baseline": C.median(base_dry),
            "unit": "s",
            "ratio": C.median(base_dry) / C.median(job_parse),
            "target": "<= 1.3x baseline",
            "met": C.median(job_parse) <= 1.3 * C.median(base_dry),
        },
        {
            "metric": "first dry-run, shipped config, empty $HOME, s",
            "ours": C.median(first),
            "baseline": C.median(base_dry),
            "unit": "s",
            "ratio": C.median(base_dry) / C.median(first),
            "target": "< 10 s",
            "met": C.median(first) < 10.0,
        },
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
            f"jobs; rerun had nothing to do: {nothing}; the parse imported no torch: "
            f"{torch_free}",
            "baseline = same command on a trivial one-rule Snakefile (Snakemake start-up)",
        ],
        json_out=args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
