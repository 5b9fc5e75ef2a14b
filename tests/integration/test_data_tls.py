"""TLS on the tcp data port (``kvpool store-node --data-tls``, net/data_tls.py): values cross
it encrypted, a client with the cluster's credentials follows the node's word, and nothing
answers a frame sent in clear."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.common.errors import KVPoolError
from kvpool.net.data_port import Op, encode_request
from kvpool.tools.cluster import LocalCluster


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    with LocalCluster(nodes=1, segment_size="256MiB", node_args=["--data-tls"],
                      log_dir=str(tmp_path_factory.mktemp("logs"))) as cluster:
        yield cluster


def _node(kv: KVClient):
    [segment] = kv.stats().segments
    return segment.node


def test_values_cross_a_tls_data_port_byte_for_byte(tls_cluster):
    values = {f"tls-{n}": os.urandom(n) for n in (1, 4096, 65536, 1 << 20, 3 << 20)}
    batch = {f"tls-batch-{i}": os.urandom(64 << 10) for i in range(64)}
    with KVClient(tls_cluster.master, transports=["tcp"]) as kv:
        assert _node(kv).tcp_tls
        for key, value in values.items():
            kv.put(key, value)
        assert kv.batch_put(list(batch), list(batch.values())) == [None] * len(batch)
        for key, value in values.items():
            assert kv.get(key) == value
        assert kv.batch_get(list(batch)) == list(batch.values())
        out = np.zeros(1 << 20, np.uint8)
        assert kv.get_into("tls-1048576", out) == 1 << 20
        assert out.tobytes() == values["tls-1048576"]


def test_a_frame_in_clear_gets_no_answer_from_a_tls_data_port(tls_cluster):
    with KVClient(tls_cluster.master, transports=["tcp"]) as kv:
        kv.put("clear", b"secret bytes")
        endpoint = _node(kv).tcp_endpoint
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(encode_request(Op.READ, "any", 0, 12))
        answer = b""
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert b"secret bytes" not in answer
    # No data-port reply (a status byte, three zeros): a TLS record (alert 21) or nothing.
    assert not answer or answer[0] in (21, 22), answer[:16]


def test_a_client_without_credentials_is_told_the_node_speaks_tls(tls_cluster):
    from kvpool.client.transport.tcp import TCPTransport
    with KVClient(tls_cluster.master, transports=[TCPTransport(timeout_s=5)]) as kv, \
            pytest.raises(KVPoolError, match="over TLS"):
        kv.put("untold", b"x" * 100)


def test_a_data_port_that_never_shakes_hands_is_a_transport_error(tls_cluster):
    # A handshake that times out (an OSError, not an SSLError) is the same TransportError,
    # and the socket is closed then, not left to the garbage collector.
    from kvpool.common import security
    from kvpool.common.errors import TransportError
    from kvpool.net import data_tls
    context = data_tls.client_context(security.resolve(tls_cluster.master))
    with socket.create_server(("127.0.0.1", 0)) as silent:   # accepts, never answers
        sock = socket.create_connection(silent.getsockname(), timeout=0.3)
        with pytest.raises(TransportError, match="TLS handshake failed"):
            data_tls.wrap(sock, context, "silent")
        assert sock.fileno() == -1
