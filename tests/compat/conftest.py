"""Fixtures for the compat tests: real clusters, and Mooncake-API stores closed after each test."""

from __future__ import annotations

import pytest
from kvpool.compat.mooncake import MooncakeDistributedStore
from kvpool.tools.cluster import LocalCluster


@pytest.fixture
def cluster(tmp_path):
    """``cluster(nodes=1, segment_size="64MiB")``: a real master and store nodes, stopped after
    the test, which fails if any of them logged a traceback."""
    made: list[LocalCluster] = []

    def start(nodes: int = 1, segment_size: str = "64MiB", master_args=()) -> LocalCluster:
        c = LocalCluster(nodes=nodes, segment_size=segment_size, master_args=list(master_args),
                         node_args=["--heartbeat-interval", "200ms"],
                         log_dir=tmp_path / f"cluster{len(made)}")
        made.append(c)
        c.start()
        return c

    yield start
    for c in made:
        c.stop()
    for log in tmp_path.glob("cluster*/*.log"):
        assert "Traceback" not in log.read_text(), f"traceback in {log.name}"


@pytest.fixture
def store():
    """``store(master, segment=0)``: a MooncakeDistributedStore set up on ``master`` with
    Mooncake's positional form; every one is closed after the test."""
    made: list[MooncakeDistributedStore] = []

    def start(master: str, segment=0) -> MooncakeDistributedStore:
        s = MooncakeDistributedStore()
        made.append(s)
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", master) == 0
        return s

    yield start
    for s in made:
        s.close()
