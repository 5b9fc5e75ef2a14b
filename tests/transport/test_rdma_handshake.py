"""The CONNECT_QP handshake frame and the data server's request counts: what can be checked
on any host (no RDMA device needed). The handshake for real is in test_rdma.py (soft-RoCE)."""

from __future__ import annotations

import socket

import pytest
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.types import Extent, NodeEndpoints, Replica
from kvpool.net.data_port import (
    QP_INFO,
    RESPONSE,
    FrameStatus,
    Op,
    decode_qp_info,
    encode_qp_info,
    encode_request,
)
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.memory import create_dram_segment

GID = "0000:0000:0000:0000:0000:ffff:0a00:020f"


@pytest.fixture
def served():
    seg = create_dram_segment("local", 0, 1 << 20)
    server = DataServer({seg.info.segment_id: seg}, shm=False)   # no rdma: refuses QPs
    server.start()
    yield server, seg
    server.stop()
    seg.close()


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        assert chunk, f"connection closed after {len(buf)} of {size} bytes"
        buf += chunk
    return buf


def connect(server: DataServer) -> socket.socket:
    host, _, port = server.tcp_endpoint.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def test_qp_info_round_trips_and_rejects_nonsense():
    payload = encode_qp_info(0x123456, 0xABCDEF, GID, 5)
    assert len(payload) == QP_INFO.size
    assert decode_qp_info(payload) == (0x123456, 0xABCDEF, GID, 5)
    with pytest.raises(ValueError):
        decode_qp_info(QP_INFO.pack(1, 2, bytes(16), 9))        # no such MTU
    with pytest.raises(ValueError):
        decode_qp_info(QP_INFO.pack(1, 1 << 24, bytes(16), 5))  # PSNs are 24 bits


def test_node_without_rdma_refuses_the_handshake_and_keeps_the_connection(served):
    server, seg = served
    with connect(server) as sock:
        sock.sendall(encode_request(Op.CONNECT_QP, "", 0, QP_INFO.size)
                     + encode_qp_info(7, 9, GID, 5))
        status, length = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
        assert status == FrameStatus.UNSUPPORTED
        assert b"no RDMA" in recv_exact(sock, length)
        # the same connection still serves reads
        sock.sendall(encode_request(Op.READ, seg.info.segment_id, 0, 4))
        status, length = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
        assert (status, length) == (FrameStatus.OK, 4)
        recv_exact(sock, 4)


def test_malformed_handshake_is_a_bad_request(served):
    server, _ = served
    with connect(server) as sock:
        sock.sendall(encode_request(Op.CONNECT_QP, "", 0, 3) + b"abc")
        status, _ = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
        assert status == FrameStatus.BAD_REQUEST


def test_request_counts_count_each_op(served):
    server, seg = served
    node = NodeEndpoints("local", "", server.tcp_endpoint)
    replica = Replica(node, Extent(seg.info.segment_id, 0, 8))
    transport = TCPTransport(timeout_s=5)
    try:
        assert transport.write([IoOp(replica, memoryview(b"12345678"))] * 3) == [None] * 3
        assert transport.read([IoOp(replica, memoryview(bytearray(8)))]) == [None]
    finally:
        transport.close()
    with connect(server) as sock:
        sock.sendall(encode_request(Op.CONNECT_QP, "", 0, QP_INFO.size)
                     + encode_qp_info(7, 9, GID, 5))
        _, length = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
        recv_exact(sock, length)
    assert server.request_counts() == {"WRITE": 3, "READ": 1, "CONNECT_QP": 1}
