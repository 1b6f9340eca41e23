"""The local SLURM cluster itself: distinct nodes, private scratch, accounting.

The `slurm_cluster` fixture comes from tests/slurm_cluster/fixture.py (imported by conftest.py).
"""

from __future__ import annotations

import socket
import textwrap

import pytest

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def two_node_job(slurm_cluster, tmp_path_factory):
    """One sbatch job on both nodes: hostnames, SLURM_TMPDIR and a marker in each scratch."""
    work = tmp_path_factory.mktemp("two-node-job")
    script = work / "job.sh"
    script.write_text(
        textwrap.dedent("""\
        #!/bin/bash
        set -euo pipefail
        srun hostname > hostnames.txt
        srun bash -c 'echo "$(hostname) $SLURM_TMPDIR"; touch "$SLURM_TMPDIR/from-$(hostname)"' \\
            > tmpdirs.txt
        srun bash -c 'echo "$(hostname) $(ls "$SLURM_TMPDIR" | tr "\\n" " ")"' > listings.txt
    """)
    )
    job_id = slurm_cluster.sbatch(
        "--nodes=2", "--ntasks-per-node=1", "--time=5", f"--output={work}/slurm-%j.out",
        f"--chdir={work}", str(script),
    )  # fmt: skip
    state = slurm_cluster.wait_job(job_id, timeout=120)
    return {"id": job_id, "state": state, "dir": work}


def lines(path):
    return sorted(line.split() for line in path.read_text().splitlines() if line.strip())


def test_srun_runs_on_both_nodes_with_their_own_hostnames(slurm_cluster, two_node_job):
    names = sorted(line[0] for line in lines(two_node_job["dir"] / "hostnames.txt"))
    assert names == sorted(slurm_cluster.node_names) == ["node1", "node2"]
    assert socket.gethostname() not in names  # UTS namespaces, not this machine's name


def test_each_node_has_its_own_private_scratch(slurm_cluster, two_node_job):
    job_dir = slurm_cluster.scratch / f"job_{two_node_job['id']}"
    assert lines(two_node_job["dir"] / "tmpdirs.txt") == [
        ["node1", str(job_dir)],
        ["node2", str(job_dir)],
    ]  # the same path on both nodes ...
    assert lines(two_node_job["dir"] / "listings.txt") == [
        ["node1", "from-node1"],
        ["node2", "from-node2"],
    ]  # ... but each node sees only its own files
    for node in slurm_cluster.node_names:
        host_view = slurm_cluster.node_scratch(node) / f"job_{two_node_job['id']}"
        assert sorted(p.name for p in host_view.iterdir()) == [f"from-{node}"]
    assert not any(slurm_cluster.scratch.iterdir())  # the mount point itself stays empty here


def test_sacct_shows_the_job_completed_on_both_nodes(slurm_cluster, two_node_job):
    assert two_node_job["state"] == "COMPLETED"
    # NNodes, not NodeList: right after the end, sacct -X may still list only the first node.
    out = slurm_cluster.run(
        "sacct", "-n", "-P", "-j", str(two_node_job["id"]), "-o", "JobID,State,NNodes",
    ).stdout.split()  # fmt: skip
    job_id = two_node_job["id"]
    assert f"{job_id}|COMPLETED|2" in out  # the allocation
    assert f"{job_id}.0|COMPLETED|2" in out  # the first srun step spanned both nodes


def test_a_failing_job_is_failed_in_sacct(slurm_cluster, tmp_path):
    job_id = slurm_cluster.sbatch(
        "--nodes=1", "--time=1", f"--output={tmp_path}/out", "--wrap", "exit 3", cwd=tmp_path
    )
    assert slurm_cluster.wait_job(job_id, timeout=60) == "FAILED"
