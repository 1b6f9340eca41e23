"""pytest fixture: one local SLURM cluster per test session.

Use it from tests/conftest.py with ``from tests.slurm_cluster.fixture import slurm_cluster``
(re-exported there, pytest finds it by name). Tests that take it are skipped, with the reason,
where no cluster can run: not root, no namespaces, or the packages of .ci/install-slurm.sh
missing. Set SLURM_TEST_CLUSTER_KEEP=1 to keep its files (logs, state) after the session.
"""

from __future__ import annotations

import os

import pytest

from tests.slurm_cluster.cluster import Cluster, ClusterError, start_cluster, unavailable_reason


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Cluster:
    """The running cluster; SLURM_CONF points at it for the whole session (subprocesses too)."""
    reason = unavailable_reason()
    if reason:
        message = f"local SLURM cluster unavailable: {reason}"
        if os.environ.get("IMAGENET_DDP_REQUIRE_SLURM") == "1":  # CI: must run, never skip
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    keep = os.environ.get("SLURM_TEST_CLUSTER_KEEP") == "1"
    workdir = tmp_path_factory.mktemp("slurm")
    try:
        cluster = start_cluster(workdir, keep_files=keep)
    except ClusterError as first:  # one retry (a loaded machine); the second error is final
        print(f"\nlocal SLURM cluster failed to start, retrying once: {str(first)[:2000]}")
        cluster = start_cluster(workdir, keep_files=keep)
    print(f"\nlocal SLURM cluster up in {cluster.startup_seconds:.1f}s ({cluster.root})")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        cluster.stop()
