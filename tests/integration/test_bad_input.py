"""Bad input gets a clear typed error, and the cluster keeps serving."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.common.errors import (
    AlreadyExists,
    ClientClosed,
    InvalidArgument,
    ObjectNotFound,
    ValueTooLarge,
)
from kvpool.net.data_port import (
    MAGIC,
    REQUEST,
    RESPONSE,
    FrameStatus,
    Op,
    encode_request,
)
from kvpool.rpc.master_client import MasterClient


@pytest.fixture
def kv(cluster):
    with KVClient(cluster.master) as client:
        client.put("sentinel", b"still here")
        yield client
        assert client.get("sentinel") == b"still here"   # the cluster kept serving


def test_empty_key(kv):
    with pytest.raises(InvalidArgument, match="empty"):
        kv.put("", b"x")
    with pytest.raises(InvalidArgument):
        kv.get("")


def test_key_over_1kib(kv):
    with pytest.raises(InvalidArgument, match="1024"):
        kv.put("k" * 1025, b"x")
    kv.put("k" * 1024, b"x")            # exactly at the limit is fine
    assert kv.get("k" * 1024) == b"x"


def test_zero_byte_value_is_refused(kv):
    with pytest.raises(InvalidArgument, match="empty value"):
        kv.put("zero", b"")
    assert not kv.exists("zero")


def test_value_larger_than_any_segment(kv):
    with pytest.raises(ValueTooLarge):
        kv.put("huge", np.zeros(65 << 20, dtype=np.uint8))   # segments are 64 MiB
    assert not kv.exists("huge")


def test_unknown_key(kv):
    with pytest.raises(ObjectNotFound):
        kv.get("nope")
    with pytest.raises(ObjectNotFound):
        kv.get_into("nope", bytearray(10))
    with pytest.raises(ObjectNotFound):
        kv.remove("nope")
    assert kv.exists("nope") is False


def test_second_put_never_overwrites(kv):
    kv.put("once", b"first")
    with pytest.raises(AlreadyExists):
        kv.put("once", b"second")
    assert kv.get("once") == b"first"


def test_buffer_too_small_and_read_only(kv):
    kv.put("ten", b"0123456789")
    with pytest.raises(InvalidArgument, match="smaller"):
        kv.get_into("ten", bytearray(5))
    with pytest.raises(InvalidArgument, match="read-only"):
        kv.get_into("ten", b"0" * 10)


def test_batch_results_are_per_key(kv):
    res = kv.batch_put(["a1", "", "a2"], [b"1", b"2", b""])
    assert res[0] is None
    assert isinstance(res[1], InvalidArgument) and isinstance(res[2], InvalidArgument)
    got = kv.batch_get_into(["a1", "missing"], [bytearray(1), bytearray(1)])
    assert got[0] == 1 and isinstance(got[1], ObjectNotFound)


def test_use_after_close(cluster):
    kv = KVClient(cluster.master)
    kv.close()
    kv.close()   # idempotent
    with pytest.raises(ClientClosed):
        kv.get("x")
    with pytest.raises(ClientClosed):
        kv.put("x", b"x")


def _data_endpoint(cluster) -> tuple[str, int, str]:
    with MasterClient(cluster.master) as mc:
        [view] = mc.locate(["sentinel"]).views()
    r = view.replicas[0]
    host, _, port = r.node.tcp_endpoint.rpartition(":")
    return host, int(port), r.extent.segment_id


def _response(sock: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < RESPONSE.size:
        chunk = sock.recv(RESPONSE.size - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    status, n = RESPONSE.unpack(head)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return status, body


def test_tcp_request_outside_segment(kv, cluster):
    host, port, seg = _data_endpoint(cluster)
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(encode_request(Op.READ, seg, (64 << 20) - 10, 100))
        status, msg = _response(s)
        assert status == FrameStatus.OUT_OF_BOUNDS and msg
        s.sendall(encode_request(Op.READ, "no-such-segment", 0, 10))
        assert _response(s)[0] == FrameStatus.UNKNOWN_SEGMENT
        with MasterClient(cluster.master) as mc:   # the same connection still serves...
            [view] = mc.locate(["sentinel"]).views()
        e = view.replicas[0].extent
        s.sendall(encode_request(Op.READ, seg, e.offset, e.length, view.replicas[0].grant))
        assert _response(s)[0] == FrameStatus.OK
        s.sendall(encode_request(Op.READ, seg, 0, 16))      # ...extents the master granted
        assert _response(s)[0] == FrameStatus.DENIED


def test_malformed_frames_on_data_port(kv, cluster):
    host, port, _ = _data_endpoint(cluster)
    for garbage in [b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64,
                    REQUEST.pack(b"NOPE", Op.READ, 4, 0, 1) + b"abcd",
                    REQUEST.pack(MAGIC, 99, 4, 0, 1) + b"abcd",
                    REQUEST.pack(MAGIC, Op.READ, 60000, 0, 1),
                    MAGIC + b"\x01"]:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(garbage)
            s.shutdown(socket.SHUT_WR)
            try:
                status, _ = _response(s)
                assert status == FrameStatus.BAD_REQUEST
            except ConnectionError:
                pass   # a truncated frame may simply be dropped
            assert s.recv(1) == b""   # the server closed this connection
