"""Fixtures for the cluster-level RDMA tests: a real master and store nodes on soft-RoCE.

These run for real inside the soft-RoCE VM (``bash scripts/softroce/test.sh``) and skip, saying
why, wherever this host has no RDMA device.
"""

from __future__ import annotations

import json
import os

import pytest
from kvpool.net.rdma_probe import unavailable_reason
from kvpool.tools.cluster import LocalCluster

FAST_MASTER = ["--node-ttl", "3s", "--put-timeout", "60s", "--lease-ttl", "30s"]
FAST_NODE = ["--heartbeat-interval", "300ms"]


def _skip_without_rdma() -> None:
    if reason := unavailable_reason():
        pytest.skip(f"rdma: {reason} (run bash scripts/softroce/test.sh)")


@pytest.fixture(autouse=True)
def _needs_rdma():
    _skip_without_rdma()


@pytest.fixture
def report_figure():
    """``report_figure(name, value, unit)``: appends a measured figure to the JSON-lines file
    named by $KVPOOL_FIGURES_FILE, if set (scripts/softroce/vm-tests.sh prints it at the end).
    Figures are reported, never asserted: the VM is emulated."""
    path = os.environ.get("KVPOOL_FIGURES_FILE")

    def report(name: str, value: float, unit: str) -> None:
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"figure": name, "value": round(value, 1), "unit": unit})
                        + "\n")

    return report


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A master and 2 store nodes of 256 MiB each, every segment registered with rxe0.

    Module-scoped: each process start costs seconds under emulation. A test that kills a
    node must come last in its module."""
    _skip_without_rdma()   # module fixtures run before the autouse check above
    logs = tmp_path_factory.mktemp("logs")
    c = LocalCluster(nodes=2, segment_size="256MiB", master_args=FAST_MASTER,
                     node_args=FAST_NODE, log_dir=logs)
    c.start()
    yield c
    c.stop()
    for log in logs.glob("*.log"):
        assert "Traceback" not in log.read_text(), f"traceback in {log.name}"
