"""Hygiene that CI enforces: ruff, ruff format, snakefmt and `snakemake --lint` are clean."""

from __future__ import annotations

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
def test_clean(argv):
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
