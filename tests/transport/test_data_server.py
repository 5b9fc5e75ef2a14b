"""DataServer and DramSegment behaviour that needs the server in this process."""

from __future__ import annotations

import errno
import os
import time

import pytest
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.shm import SHMTransport
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.errors import InvalidArgument, SegmentBoundsError, TransportError
from kvpool.common.host import local_boot_id
from kvpool.common.types import Extent, NodeEndpoints, Replica
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.disk import DiskSegment
from kvpool.store_node.memory import DramSegment, create_dram_segment, new_segment_id


@pytest.fixture
def served():
    segments = {}
    for i in range(2):
        seg = create_dram_segment("local", i, 1 << 20)
        segments[seg.info.segment_id] = seg
    server = DataServer(segments)
    server.start()
    node = NodeEndpoints("local", local_boot_id(), server.tcp_endpoint, server.shm_endpoint)
    yield server, segments, node
    server.stop()
    for seg in segments.values():
        seg.close()


@pytest.fixture(params=["shm", "tcp"])
def transport(request):
    t = SHMTransport(timeout_s=5) if request.param == "shm" else TCPTransport(timeout_s=5)
    yield t
    t.close()


def test_segments_are_looked_up_per_request(served, transport):
    _server, segments, node = served
    late = create_dram_segment("local", 2, 4096)
    replica = Replica(node, Extent(late.info.segment_id, 0, 4))
    assert isinstance(transport.write([IoOp(replica, memoryview(b"late"))])[0], SegmentBoundsError)
    segments[late.info.segment_id] = late    # mounted while serving
    assert transport.write([IoOp(replica, memoryview(b"late"))]) == [None]
    assert bytes(late.buffer[:4]) == b"late"     # the node sees what the client wrote
    del segments[late.info.segment_id]
    late.close()


def test_unmounted_segment_is_refused_over_tcp(served):
    _server, segments, node = served
    sid = next(iter(segments))
    transport = TCPTransport(timeout_s=5)
    replica = Replica(node, Extent(sid, 0, 4))
    assert transport.read([IoOp(replica, memoryview(bytearray(4)))]) == [None]
    segment = segments.pop(sid)
    segment.close()
    assert isinstance(transport.read([IoOp(replica, memoryview(bytearray(4)))])[0],
                      SegmentBoundsError)
    transport.close()


@pytest.mark.parametrize("kind", ["dram", "disk"])
def test_a_segment_closed_while_still_mounted_is_refused(served, kind, tmp_path):
    """An unmount closes a segment just as a request finds it: the request is refused (the
    client tries another replica) and the connection keeps serving."""
    _server, segments, node = served
    seg = create_dram_segment("local", 3, 4096) if kind == "dram" else \
        DiskSegment("local/4-test", 4096, tmp_path / "segment")
    segments[seg.info.segment_id] = seg
    seg.close()
    transport = TCPTransport(timeout_s=5)
    try:
        closed = Replica(node, Extent(seg.info.segment_id, 0, 4))
        assert isinstance(transport.read([IoOp(closed, memoryview(bytearray(4)))])[0],
                          SegmentBoundsError)
        assert isinstance(transport.write([IoOp(closed, memoryview(b"gone"))])[0],
                          SegmentBoundsError)
        live = Replica(node, Extent(next(iter(segments)), 0, 4))
        assert transport.read([IoOp(live, memoryview(bytearray(4)))]) == [None]
    finally:
        transport.close()
        del segments[seg.info.segment_id]


def test_stop_closes_client_connections(served, transport):
    server, segments, node = served
    replica = Replica(node, Extent(next(iter(segments)), 0, 4))
    assert transport.write([IoOp(replica, memoryview(b"abcd"))]) == [None]
    server.stop()
    server.stop()   # idempotent
    (result,) = transport.read([IoOp(replica, memoryview(bytearray(4)))])
    assert isinstance(result, TransportError) and not isinstance(result, SegmentBoundsError)


def test_stop_without_start_and_shm_disabled():
    DataServer({}).stop()
    server = DataServer({}, shm=False)
    server.start()
    try:
        assert server.shm_endpoint == ""
        assert server.tcp_endpoint.startswith("127.0.0.1:")
        assert not server.tcp_endpoint.endswith(":0")
    finally:
        server.stop()


def test_segment_ids_are_unique_and_bounded():
    assert new_segment_id("n", 0) != new_segment_id("n", 0)
    assert new_segment_id("n", 3).startswith("n/3-")
    with pytest.raises(InvalidArgument):
        new_segment_id("x" * 2000, 0)
    with pytest.raises(InvalidArgument):
        new_segment_id("", 0)


def test_dram_segment_lifecycle():
    seg = create_dram_segment("n", 0, 1 << 16)
    assert seg.info.size_bytes == 1 << 16 and seg.info.tier == "dram"
    assert seg.buffer.nbytes == 1 << 16 and not seg.buffer.readonly and seg.buffer.format == "B"
    seg.buffer[:3] = b"abc"
    assert os.pread(seg.fd, 3, 0) == b"abc"     # the fd and the mapping are the same memory
    with pytest.raises(OSError) as info:          # sealed: a client cannot shrink it under us
        os.ftruncate(seg.fd, 0)
    assert info.value.errno == errno.EPERM
    view = seg.buffer[:3]                          # a request in flight
    seg.close()
    seg.close()
    assert bytes(view) == b"abc"                   # still mapped until its view is released
    view.release()
    with pytest.raises(ValueError):
        _ = seg.buffer
    with pytest.raises(InvalidArgument):
        DramSegment("n/0-x", 0)


def test_a_node_polls_for_the_frame_behind_a_write_not_after_a_read(monkeypatch):
    """A worker polls ($KVPOOL_SPIN_US, here its longest) only where the client's next frame
    follows at once: behind a WRITE (its SEAL), not after a READ, whose next frame comes after
    a master round trip and would meet a node busy polling on the client's cores."""
    monkeypatch.setenv("KVPOOL_SPIN_US", "100000")
    seg = create_dram_segment("local", 0, 1 << 20)
    server = DataServer({seg.info.segment_id: seg})
    server.start()
    transport = TCPTransport(timeout_s=5)
    try:
        node = NodeEndpoints("local", local_boot_id(), server.tcp_endpoint, "")
        op = IoOp(Replica(node, Extent(seg.info.segment_id, 0, 4)), memoryview(bytearray(4)))

        def cpu_after(call) -> float:
            """The CPU this process spends in the 0.3 s after ``call`` answered (this
            thread sleeps: it is the node's worker's)."""
            assert call([op]) == [None]
            before = time.process_time()
            time.sleep(0.3)
            return time.process_time() - before

        after_read = cpu_after(transport.read)
        after_write = cpu_after(transport.write)
        assert after_read < 0.02, after_read      # slept on the connection
        assert after_write > 0.03, after_write    # polled for up to 0.1 s
    finally:
        transport.close()
        server.stop()
        seg.close()


def test_a_disk_segment_is_read_through_tls_not_around_it(tmp_path):
    """Over TLS (--data-tls) a disk segment's READ goes through the TLS layer (its
    sendfile(2) would put clear bytes on an encrypted stream), and a client's WRITE too (no
    sendmsg on a TLS socket)."""
    from kvpool.common import pki, security
    from kvpool.net import data_tls
    pki.make_local(tmp_path / "creds", "127.0.0.1")
    node_creds = security.load(pki.ensure(tmp_path / "creds", "node", "local"))
    client_creds = security.load(tmp_path / "creds" / "client.yaml")
    seg = DiskSegment("local/5-tls", 1 << 20, tmp_path / "segment")
    server = DataServer({seg.info.segment_id: seg}, shm=False,
                        tls=data_tls.server_context(node_creds))
    server.start()
    transport = TCPTransport(timeout_s=5, tls=client_creds)
    try:
        node = NodeEndpoints("local", local_boot_id(), server.tcp_endpoint, tcp_tls=True)
        replica = Replica(node, Extent(seg.info.segment_id, 4096, 200_000))
        value = os.urandom(200_000)
        assert transport.write([IoOp(replica, memoryview(value))]) == [None]
        out = bytearray(200_000)
        assert transport.read([IoOp(replica, memoryview(out))]) == [None]
        assert out == value
    finally:
        transport.close()
        server.stop()
        seg.close()
