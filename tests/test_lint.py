"""Hygiene that CI enforces: ruff, ruff format, snakefmt and `snakemake --lint` are clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SNAKEFILES = [
    "Snakefile",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "workflow/rules").glob("*.smk")),
]


@pytest.mark.parametrize(
    "argv",
    [
        [str(BIN / "ruff"), "check", "src", "tests", "benchmarks"],
        [str(BIN / "ruff"), "format", "--check", "src", "tests", "benchmarks"],
        [str(BIN / "snakefmt"), "--check", *SNAKEFILES],
        [sys.executable, "-m", "snakemake", "--lint"],
    ],
    ids=["ruff", "ruff-format", "snakefmt", "snakemake-lint"],
)
def test_clean(argv, tmp_path):
    cwd = REPO
    if "snakemake" in argv:  # on a copy: Snakemake writes .snakemake/ where it runs, and the
        cwd = tmp_path  # workflow reads results/ (the preflight's records) while it parses
        shutil.copy(REPO / "Snakefile", cwd / "Snakefile")
        shutil.copy(REPO / "config.yaml", cwd / "config.yaml")
        for name in ("workflow", "profiles"):
            shutil.copytree(REPO / name, cwd / name, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
