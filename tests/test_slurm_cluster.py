"""The local SLURM cluster itself: distinct nodes, private scratch, fake GPUs, accounting.

The `slurm_cluster` fixture comes from tests/slurm_cluster/fixture.py (imported by conftest.py).
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def two_node_job(slurm_cluster, tmp_path_factory):
    """One sbatch job on both nodes: hostnames, the scratch filesystem and a marker in each
    node's scratch, what SLURM sets TMPDIR to, and the fake GPUs SLURM binds to 2 tasks per
    node (whole node's GPUs, and one per task)."""
    work = tmp_path_factory.mktemp("two-node-job")
    script = work / "job.sh"
    scratch = slurm_cluster.scratch
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        set -euo pipefail
        one="srun --ntasks=2 --ntasks-per-node=1"
        $one hostname > hostnames.txt
        $one bash -c 'echo "$(hostname) ${{SLURM_TMPDIR:-unset}} $TMPDIR"' > tmpdirs.txt
        $one bash -c 'echo "$(hostname) $(findmnt -n -o FSTYPE,SOURCE --target {scratch})"; \\
            touch {scratch}/from-$(hostname)' > mounts.txt
        $one bash -c 'echo "$(hostname) $(ls {scratch} | tr "\\n" " ")"' > listings.txt
        echo "batch $CUDA_VISIBLE_DEVICES" > gpus-batch.txt
        show='echo "$(hostname) $SLURM_LOCALID $CUDA_VISIBLE_DEVICES"'
        srun bash -c "$show" > gpus-node.txt
        srun --gpus-per-task=1 bash -c "$show" > gpus-task.txt
    """)
    )
    job_id = slurm_cluster.sbatch(
        "--nodes=2", "--ntasks-per-node=2", "--gres=gpu:2", "--time=5",
        f"--output={work}/slurm-%j.out", f"--chdir={work}", str(script),
    )  # fmt: skip
    state = slurm_cluster.wait_job(job_id, timeout=120)
    return {"id": job_id, "state": state, "dir": work}


def lines(path):
    return lines_of(path.read_text())


def test_srun_runs_on_both_nodes_with_their_own_hostnames(slurm_cluster, two_node_job):
    names = sorted(line[0] for line in lines(two_node_job["dir"] / "hostnames.txt"))
    assert names == sorted(slurm_cluster.node_names) == ["node1", "node2"]
    assert socket.gethostname() not in names  # UTS namespaces, not this machine's name


def test_each_node_has_its_own_private_scratch(slurm_cluster, two_node_job):
    """Each node's own tmpfs at one path, seen only in its namespace; nothing exports a
    scratch variable (slurmstepd's TMPDIR default, /tmp, is the host's disk)."""
    d, scratch = two_node_job["dir"], slurm_cluster.scratch
    tmpdir = os.environ.get("TMPDIR") or "/tmp"  # sbatch exports ours; else slurmstepd's /tmp
    assert lines(d / "tmpdirs.txt") == [["node1", "unset", tmpdir], ["node2", "unset", tmpdir]]
    assert lines(d / "mounts.txt") == [
        ["node1", "tmpfs", "scratch-node1"],
        ["node2", "tmpfs", "scratch-node2"],
    ]  # the same path on both nodes, each its own filesystem ...
    assert lines(d / "listings.txt") == [
        ["node1", "from-node1"],
        ["node2", "from-node2"],
    ]  # ... so each node sees only its own files
    for node in slurm_cluster.node_names:
        assert slurm_cluster.node_files(node) == [str(scratch / f"from-{node}")]
        slurm_cluster.on_node(node, "rm", str(scratch / f"from-{node}"))
    assert not any(scratch.iterdir())  # the host's view: the empty mount point


def test_fake_gpus_are_bound_like_real_ones(slurm_cluster, two_node_job):
    d = two_node_job["dir"]
    out = slurm_cluster.run("sinfo", "-h", "-N", "-p", "debug", "-o", "%N %G").stdout
    assert lines_of(out) == [["node1", "gpu:2"], ["node2", "gpu:2"]]
    assert (d / "gpus-batch.txt").read_text().split() == ["batch", "0,1"]
    # --gres=gpu:2 alone: every task sees both GPUs of its node (select cuda:SLURM_LOCALID) ...
    assert lines(d / "gpus-node.txt") == [[n, i, "0,1"] for n in ("node1", "node2") for i in "01"]
    # ... --gpus-per-task=1: each task sees only its own (select cuda:0).
    assert lines(d / "gpus-task.txt") == [[n, i, i] for n in ("node1", "node2") for i in "01"]
    alloc = slurm_cluster.run(
        "sacct", "-X", "-n", "-P", "-j", str(two_node_job["id"]), "-o", "AllocTRES"
    ).stdout
    assert "gres/gpu=4" in alloc  # AccountingStorageTRES=gres/gpu: sacct counts them


def lines_of(text):
    return sorted(line.split() for line in text.splitlines() if line.strip())


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


def test_what_the_batch_shell_leaves_dies_with_it_as_under_proctrack_cgroup(
    slurm_cluster, tmp_path
):
    """Most sites track processes with cgroups: once the batch shell dies (`scancel`, whose
    SIGTERM kills it; here `scancel -s TERM --batch`), slurmstepd SIGKILLs what is left in the
    batch step, a child that handles SIGTERM included, without a SIGTERM. The launcher of a
    multi-rank job lives there (docs/slurm-notes.md section 7)."""
    if slurm_cluster.proctrack != "cgroup":
        pytest.skip("no writable cgroup v1 freezer here: the cluster runs proctrack/linuxproc")
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: open('term', 'w').write('TERM'))\n"
        "open('child.pid', 'w').write(str(__import__('os').getpid()))\n"
        "time.sleep(300)\n"
    )
    (tmp_path / "child.py").write_text(child)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\n{sys.executable} child.py &\nsleep 300\n")
    job = slurm_cluster.sbatch("--nodes=1", "--time=5", f"--output={tmp_path}/out",
                               f"--chdir={tmp_path}", str(script))  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "child.pid").is_file():
        assert time.monotonic() < deadline, slurm_cluster.logs()
        time.sleep(0.5)
    pid = int((tmp_path / "child.pid").read_text())
    slurm_cluster.run("scancel", "-s", "TERM", "--batch", str(job))
    slurm_cluster.wait_job(job, timeout=60)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() and not (tmp_path / "term").exists()
