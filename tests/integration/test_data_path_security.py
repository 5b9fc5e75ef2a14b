"""The data path against careless and hostile same-host clients (issue 15), on real processes:
idle connections, the shm hand-off's trust, and the byte ranges a client may touch."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from kvpool.client import KVClient
from kvpool.rpc.master_client import MasterClient

from .conftest import run_cluster

MiB = 1 << 20
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 3.0


@pytest.fixture
def capped(tmp_path):
    """A cluster whose nodes take at most MAX_CONNECTIONS data connections, idle for at most
    IDLE_TIMEOUT_S."""
    yield from run_cluster(tmp_path, node_args=["--max-connections", str(MAX_CONNECTIONS),
                                                "--idle-timeout", f"{IDLE_TIMEOUT_S}s"])


def _proc(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _tcp_endpoint(master: str) -> tuple[str, int]:
    with MasterClient(master) as mc:
        nodes = {r.node.tcp_endpoint for v in mc.locate(["seed"]).views() for r in v.replicas}
    host, _, port = min(nodes).rpartition(":")
    return host, int(port)


@pytest.mark.parametrize("scheme", ["tcp", "shm"])
def test_idle_connections_cost_no_thread_and_lock_no_client_out(capped, scheme):
    """8 x the cap of idle tcp connections to a node: no thread each, the fd limit is never
    near, a client still puts and gets (tcp and shm), and idle ones go after the timeout."""
    with KVClient(capped.master, replicas=2) as kv:
        kv.put("seed", b"x" * 4096)
    host, port = _tcp_endpoint(capped.master)
    pid = next(p for p in capped.nodes if f"tcp={host}:{port}" in p.ready).popen.pid
    threads_before, fds_before = _proc(pid, "Threads"), _fds(pid)
    idle = []
    try:
        for _ in range(8 * MAX_CONNECTIONS):
            idle.append(socket.create_connection((host, port), timeout=10))
        time.sleep(0.5)
        # Not a thread per connection, and never past the cap: the node keeps its fds.
        assert _proc(pid, "Threads") < threads_before + 16
        assert _fds(pid) <= fds_before + MAX_CONNECTIONS + 4
        with KVClient(capped.master, transports=[scheme], replicas=2) as kv:
            for i in range(20):
                kv.put(f"k{i}", bytes([i]) * (64 << 10))
            for i in range(20):
                assert kv.get(f"k{i}") == bytes([i]) * (64 << 10)
        # The idle ones are closed after the timeout: each sees EOF.
        time.sleep(IDLE_TIMEOUT_S + 1.5)
        survivors = idle[-MAX_CONNECTIONS // 2:]
        for s in survivors:
            s.settimeout(5)
            assert s.recv(1) == b""
        assert _fds(pid) <= fds_before + 8
    finally:
        for s in idle:
            s.close()
