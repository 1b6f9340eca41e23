"""Smoke test of benchmarks/: every script runs in --quick mode and prints its ratio table.

No speed is asserted (benchmarks are measurements; see benchmarks/README.md for numbers).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
NAMES = [
    "staging",
    "loader",
    "index_split",
    "train_step",
    "workflow",
    "gpu",
    "eval",
    "monitor",
    "epoch_end",
    "breakdown",
]
RATIO_LINE = re.compile(r"\s\d+\.\d\dx\s.*\s(PASS|MISS|-)\s*$", re.MULTILINE)


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_runs_quick_and_prints_a_ratio(name, tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"bench_{name}.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"== bench_{name}" in result.stdout
    assert RATIO_LINE.search(result.stdout), result.stdout
