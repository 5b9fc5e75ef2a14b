"""The tcp data port against hostile and broken clients talking raw sockets.

Each malformed frame must cost only its own connection: the node answers BAD_REQUEST (where it
can), closes that connection, logs a fact (no traceback) and keeps serving everyone else.
"""

from __future__ import annotations

import socket
import struct

import pytest
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.tcp import TCPTransport
from kvpool.net.data_port import (
    MAGIC,
    REQUEST,
    RESPONSE,
    FrameStatus,
    Op,
    encode_request,
)


def connect(node) -> socket.socket:
    host, _, port = node.node.tcp_endpoint.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        assert chunk, f"connection closed after {len(buf)} of {size} bytes"
        buf += chunk
    return buf


def read_response(sock: socket.socket) -> tuple[FrameStatus, bytes]:
    status, length = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
    return FrameStatus(status), recv_exact(sock, length)


def assert_closed_by_node(sock: socket.socket) -> None:
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def assert_serving(node) -> None:
    """A fresh client on a fresh connection still gets served."""
    transport = TCPTransport(timeout_s=5)
    try:
        replica = node.replica(0, 123, 5)
        assert transport.write([IoOp(replica, memoryview(b"alive"))]) == [None]
        out = bytearray(5)
        assert transport.read([IoOp(replica, memoryview(out))]) == [None]
        assert out == b"alive"
    finally:
        transport.close()


def sid(node, index: int = 0) -> str:
    return node.segments[index].segment_id


MALFORMED = {
    "garbage": lambda node: b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)),
    "bad_magic": lambda node: REQUEST.pack(b"KVP0", Op.READ, 3, 0, 1) + b"abc",
    "unknown_op": lambda node: REQUEST.pack(MAGIC, 9, 3, 0, 1) + b"abc",
    "huge_segment_id_length": lambda node: REQUEST.pack(MAGIC, Op.READ, 65535, 0, 1)
    + b"a" * 2000,
    "non_utf8_segment_id": lambda node: REQUEST.pack(MAGIC, Op.READ, 2, 0, 1) + b"\xff\xfe",
}


@pytest.mark.parametrize("frame", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_frame_gets_bad_request_and_closed(node, frame):
    with connect(node) as sock:
        sock.sendall(frame(node))
        status, message = read_response(sock)
        assert status is FrameStatus.BAD_REQUEST
        assert message
        assert_closed_by_node(sock)
    assert_serving(node)


def test_malformed_frame_after_good_ones_still_answers_the_good_ones(node):
    with connect(node) as sock:
        sock.sendall(encode_request(Op.WRITE, sid(node), 0, 3) + b"abc"
                     + encode_request(Op.READ, sid(node), 0, 3)
                     + b"\x00" * REQUEST.size)
        assert read_response(sock) == (FrameStatus.OK, b"")
        assert read_response(sock) == (FrameStatus.OK, b"abc")
        assert read_response(sock)[0] is FrameStatus.BAD_REQUEST
        assert_closed_by_node(sock)
    assert_serving(node)


@pytest.mark.parametrize("cut", [1, REQUEST.size - 1, REQUEST.size, REQUEST.size + 2])
def test_truncated_frame_then_close(node, cut):
    frame = encode_request(Op.READ, sid(node), 0, 16)
    with connect(node) as sock:
        sock.sendall(frame[:cut])
    assert_serving(node)


def test_disconnect_mid_write_payload(node):
    with connect(node) as sock:
        # Far from the bytes assert_serving writes: the node may still be landing these 1000
        # bytes (zero-copy, straight into the segment) when the next client writes.
        sock.sendall(encode_request(Op.WRITE, sid(node), 4 << 20, 1 << 20) + b"z" * 1000)
    assert_serving(node)


def test_disconnect_before_reading_a_large_read(node):
    with connect(node) as sock:
        sock.sendall(encode_request(Op.READ, sid(node), 0, node.segments[0].size_bytes) * 4)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
    assert_serving(node)


def test_out_of_bounds_read_keeps_the_connection(node):
    size = node.segments[0].size_bytes
    with connect(node) as sock:
        sock.sendall(encode_request(Op.READ, sid(node), size - 1, 2)
                     + encode_request(Op.READ, "nope", 0, 2)
                     + encode_request(Op.READ, sid(node), size - 2, 2))
        status, message = read_response(sock)
        assert status is FrameStatus.OUT_OF_BOUNDS and b"outside" in message
        assert read_response(sock)[0] is FrameStatus.UNKNOWN_SEGMENT
        status, payload = read_response(sock)
        assert status is FrameStatus.OK and len(payload) == 2


def test_pipelined_reads_are_answered_in_order_around_refusals_and_writes(node):
    """READs that arrive together are answered in one send (the node holds each answer back
    while the next frame is read already): a refusal or another op among them still gets
    its answer in its place, after the READs before it."""
    size, at = node.segments[0].size_bytes, 2 << 20
    with connect(node) as sock:
        sock.sendall(encode_request(Op.WRITE, sid(node), at, 6) + b"abcdef")
        assert read_response(sock) == (FrameStatus.OK, b"")
        sock.sendall(encode_request(Op.READ, sid(node), at, 3)
                     + encode_request(Op.READ, sid(node), at + 3, 3)
                     + encode_request(Op.READ, sid(node), size - 1, 2)
                     + encode_request(Op.READ, sid(node), at, 6)
                     + encode_request(Op.WRITE, sid(node), at + 6, 2) + b"gh"
                     + encode_request(Op.READ, sid(node), at + 4, 4))
        assert read_response(sock) == (FrameStatus.OK, b"abc")
        assert read_response(sock) == (FrameStatus.OK, b"def")
        assert read_response(sock)[0] is FrameStatus.OUT_OF_BOUNDS
        assert read_response(sock) == (FrameStatus.OK, b"abcdef")
        assert read_response(sock) == (FrameStatus.OK, b"")
        assert read_response(sock) == (FrameStatus.OK, b"efgh")


def test_refused_write_answers_then_closes(node):
    size = node.segments[1].size_bytes
    with connect(node) as sock:
        sock.sendall(encode_request(Op.WRITE, sid(node, 1), size, 4096) + b"p" * 4096
                     + encode_request(Op.READ, sid(node, 1), 0, 1))
        assert read_response(sock)[0] is FrameStatus.OUT_OF_BOUNDS
        assert_closed_by_node(sock)   # the READ after it is not served on this stream
    assert_serving(node)


def test_huge_length_write_refused(node):
    with connect(node) as sock:
        sock.sendall(encode_request(Op.WRITE, sid(node), 0, (1 << 64) - 1) + b"p" * 100)
        assert read_response(sock)[0] is FrameStatus.OUT_OF_BOUNDS
        assert_closed_by_node(sock)
    assert_serving(node)


def test_misbehaviour_is_logged_as_facts_without_tracebacks(node):
    # runs after the tests above in this module (same node)
    text = node.stderr()
    assert "malformed_frame" in text
    assert "request_refused" in text
    assert "Traceback" not in text
    assert "connection_handler_failed" not in text
