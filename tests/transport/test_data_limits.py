"""The data server's connection limits, in this process: the cap, the idle timeout, a stalled
frame, and no thread per idle connection."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.host import local_boot_id
from kvpool.common.types import Extent, NodeEndpoints, Replica
from kvpool.store_node.data_server import DataLimits, DataServer
from kvpool.store_node.memory import create_dram_segment


@pytest.fixture
def serve():
    started = []

    def start(**limits) -> tuple[DataServer, Replica]:
        seg = create_dram_segment("n", 0, 1 << 20)
        server = DataServer({seg.info.segment_id: seg}, limits=DataLimits(**limits))
        server.start()
        started.append((server, seg))
        node = NodeEndpoints("n", local_boot_id(), server.tcp_endpoint, server.shm_endpoint)
        return server, Replica(node, Extent(seg.info.segment_id, 0, 4))

    yield start
    for server, seg in started:
        server.stop()
        seg.close()


def _connect(server: DataServer) -> socket.socket:
    host, _, port = server.tcp_endpoint.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _closed_by_node(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_cost_no_thread(serve):
    server, replica = serve()
    before = threading.active_count()
    idle = [_connect(server) for _ in range(300)]
    time.sleep(0.3)
    assert server.connections()["tcp"] == 300
    assert threading.active_count() < before + 8
    t = TCPTransport(timeout_s=5)
    assert t.write([IoOp(replica, memoryview(b"abcd"))]) == [None]
    t.close()
    for s in idle:
        s.close()


def test_at_the_cap_the_longest_idle_connection_makes_room(serve):
    server, replica = serve(max_connections=8)
    idle = []
    for _ in range(8):
        idle.append(_connect(server))
        time.sleep(0.01)    # in order of age
    time.sleep(0.2)
    t = TCPTransport(timeout_s=5)
    buf = bytearray(4)
    assert t.read([IoOp(replica, memoryview(buf))]) == [None]   # a new client gets in
    assert _closed_by_node(idle[0], 2)                           # the oldest idle made room
    assert server.connections()["tcp"] <= 8
    t.close()
    for s in idle:
        s.close()


def test_idle_connections_are_closed_after_the_timeout(serve):
    server, _replica = serve(idle_timeout_s=0.5)
    s = _connect(server)
    assert not _closed_by_node(s, 0.2)
    assert _closed_by_node(s, 3)
    s.close()


def test_a_frame_stalled_mid_way_ends_its_connection(serve):
    server, replica = serve(idle_timeout_s=0.5)
    s = _connect(server)
    s.sendall(b"KVP1")    # a quarter of a header, then nothing: holds a worker until...
    assert _closed_by_node(s, 3)
    s.close()
    t = TCPTransport(timeout_s=5)
    assert t.write([IoOp(replica, memoryview(b"abcd"))]) == [None]
    t.close()


def test_a_busy_connection_is_not_idle(serve):
    """A client that keeps calling is never closed as idle, even past the timeout."""
    _server, replica = serve(idle_timeout_s=0.5)
    t = TCPTransport(timeout_s=5, max_idle_per_endpoint=1)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert t.write([IoOp(replica, memoryview(b"abcd"))]) == [None]
        time.sleep(0.1)
    t.close()


@pytest.mark.parametrize("limits", [{"max_connections": 0}, {"idle_timeout_s": 0},
                                    {"shm_writers": ("user:1",)}])
def test_bad_limits_are_refused(limits):
    with pytest.raises(ValueError):
        DataLimits(**limits)
