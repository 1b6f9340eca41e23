"""SLURM hostlists expanded in Python (python-hostlist, through jobs.distributed), checked
against SLURM's own parser: ``scontrol show hostnames`` needs no daemon, only a config file it
can read (a minimal one here; without any it retries for 60 s, then fails)."""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest

from imagenet_ddp.jobs.distributed import expand_nodelist

EXPECTED = {
    "node[01-04]": ["node01", "node02", "node03", "node04"],
    "a,b": ["a", "b"],
    "rack[1-2]-n[01-02]": ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"],
    "gpu2n[1-3]": ["gpu2n1", "gpu2n2", "gpu2n3"],
    "n[8-11]": ["n8", "n9", "n10", "n11"],
    "n[098-101]": ["n098", "n099", "n100", "n101"],
    "n[1-03]": ["n1", "n2", "n3"],  # the width is LO's
    "n[01-2,5]": ["n01", "n02", "n5"],  # each range its own width
    "n[1-2],rack[1-2]-n[3]": ["n1", "n2", "rack1-n3", "rack2-n3"],
    "n[1-2],,n1": ["n1", "n2", "n1"],  # empty items skipped, duplicates kept
    "x[1-2]y[3]": ["x1y3", "x2y3"],
    "[1-2]": ["1", "2"],
    "node1": ["node1"],
    # Refused by SLURM 22.05's parser (text after the last bracket); expanded naturally here.
    "a[1,3-5]b": ["a1b", "a3b", "a4b", "a5b"],
}
INVALID = ["n[3-1]", "n[]", "n[1-2", "n[a]", "n[1 ,2]", "n[1-2]]"]


@pytest.mark.parametrize(("nodelist", "hosts"), EXPECTED.items())
def test_expands_like_slurm(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts  # what every rank calls, no scontrol


@pytest.mark.parametrize("nodelist", INVALID)
def test_invalid_hostlists_are_refused(nodelist):
    with pytest.raises(ValueError, match="invalid SLURM hostlist"):
        expand_nodelist(nodelist)


def _random_patterns(count: int, seed: int = 0) -> list[str]:
    """Hostlists of the shapes SLURM writes: prefixes with digits, one or two bracket groups
    (text between them), ranges and lists with zero padding, several items."""
    rng = random.Random(seed)

    def group():
        parts = []
        for _ in range(rng.randint(1, 3)):
            width, low = rng.randint(1, 3), rng.randint(0, 12)
            high = low + rng.randint(0, 4)
            parts.append(str(low).zfill(width) + ("" if high == low else f"-{high}"))
        return "[" + ",".join(parts) + "]"

    def item():
        prefix = rng.choice(["n", "node", "gpu2n", "a100-", "r1c", "x"])
        if rng.random() < 0.2:
            return prefix + str(rng.randint(0, 99))
        text = prefix + group()
        return text + rng.choice(["-n", "s", "."]) + group() if rng.random() < 0.4 else text

    return [",".join(item() for _ in range(rng.randint(1, 3))) for _ in range(count)]


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    if not shutil.which("scontrol"):
        pytest.skip("scontrol not installed")
    conf = tmp_path_factory.mktemp("hostlist") / "slurm.conf"
    conf.write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n"
    )

    def show(nodelist):
        result = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        # An invalid hostlist: "Invalid hostlist: ..." and exit status 0 (22.05).
        invalid = result.returncode != 0 or "Invalid hostlist" in result.stdout + result.stderr
        return None if invalid else result.stdout.split()

    return show


def test_agrees_with_scontrol_show_hostnames(scontrol):
    patterns = [p for p in EXPECTED if not p.endswith("]b")] + _random_patterns(120)
    for nodelist in patterns:
        assert expand_nodelist(nodelist) == scontrol(nodelist), nodelist
    assert scontrol("a[1,3-5]b") is None  # 22.05 refuses a suffix (see EXPECTED)
    for nodelist in INVALID[:2] + ["n[a]"]:
        assert scontrol(nodelist) is None, nodelist
