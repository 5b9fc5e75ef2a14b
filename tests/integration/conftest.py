from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvpool.tools.cluster import LocalCluster

# Short timeouts so failure handling is observable in seconds.
NODE_TTL_S = 2.0
PUT_TIMEOUT_S = 2.0
QUARANTINE_S = 1.0
LEASE_TTL_S = 1.0
FAST_MASTER = ["--node-ttl", f"{NODE_TTL_S}s", "--put-timeout", f"{PUT_TIMEOUT_S}s",
               "--quarantine", f"{QUARANTINE_S}s", "--lease-ttl", f"{LEASE_TTL_S}s"]
FAST_NODE = ["--heartbeat-interval", "200ms"]


def run_cluster(tmp_path, *, nodes: int = 2, segment_size: str = "64MiB", master_args=(),
                node_args=(), **cluster_kw):
    """Yield a started LocalCluster with the fast timeouts (plus ``master_args``); on teardown
    stop it and fail if any process logged a traceback. For fixtures: ``yield from``.
    ``cluster_kw``: more LocalCluster options (``masters=3, ha=etcd_url``)."""
    c = LocalCluster(nodes=nodes, segment_size=segment_size,
                     master_args=[*FAST_MASTER, *master_args], node_args=[*FAST_NODE, *node_args],
                     log_dir=tmp_path / "logs", **cluster_kw)
    c.start()
    yield c
    c.stop()
    for log in (tmp_path / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), f"traceback in {log.name}"


def channel_to(cluster, role: str = "client", name: str = "default"):
    """A raw gRPC channel to ``cluster``'s master, as ``role``/``name`` (a certificate of its
    CA) when it is secure, plain otherwise: for tests that send what kvpool's clients cannot."""
    import grpc
    from kvpool.common import security
    if not cluster.secure:
        return grpc.insecure_channel(cluster.master)
    return security.load(cluster.credentials(role, name)).secure_channel(cluster.master)


class SessionSocket:
    """A raw connection of a lookup-port session of the cluster's default client (what an
    eavesdropper or a man in the middle sees and could send): the handshake done, frames
    sealed by hand. ``answer``: the OpenLookupSession answer to use (default: a new one)."""

    def __init__(self, cluster, port: int, answer=None, timeout_s: float = 5.0):
        import socket

        from kvpool.net import lookup_port
        from kvpool.rpc.master_client import MasterClient
        if answer is None:
            with MasterClient(cluster.master, retries=0) as mc:
                answer = mc.lookup_sessions(cluster.master)
        self.answer = answer
        self.sock = socket.create_connection((cluster.master.rpartition(":")[0], port),
                                             timeout_s)
        salt = lookup_port.new_salt()
        self.sock.sendall(lookup_port.encode_request(lookup_port.SESSION,
                                                     answer.session_id + salt))
        status, server_salt = self.answer_frame()
        assert status == 0, server_salt
        self.out, self.inn = lookup_port.session_seals(answer.key, salt, server_salt,
                                                       server=False)

    def answer_frame(self) -> tuple[int, bytes, bytes]:
        from kvpool.net import lookup_port
        from kvpool.net.sockets import recv_exact
        head = recv_exact(self.sock, lookup_port.RESPONSE.size)
        status, length = lookup_port.RESPONSE.unpack(head)
        self.head = head
        return status, recv_exact(self.sock, length)

    def frame(self, method: int, body: bytes, magic: bytes | None = None) -> bytes:
        from kvpool.net import lookup_port
        return self.out.seal(lookup_port.REQUEST, magic or lookup_port.MAGIC, method, body=body)

    def call(self, frame: bytes) -> tuple[int, bytes]:
        """Send ``frame``; the answer's status and body (opened, unless the master answered
        in clear: it could not open ours)."""
        from kvpool.net import lookup_port
        self.sock.sendall(frame)
        status, data = self.answer_frame()
        try:
            return status, self.inn.open(self.head, data)
        except lookup_port.Unsealed:
            return status, data

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def cluster(tmp_path):
    """A real master and 2 real store nodes (64 MiB each), stopped after the test."""
    yield from run_cluster(tmp_path)


@pytest.fixture
def bare_master(tmp_path):
    """A real master (subprocess), no nodes: the test runs its node in this process."""
    yield from run_cluster(tmp_path, nodes=0)


@pytest.fixture
def timeouts():
    """The master timeouts the ``cluster`` fixture runs with."""
    return SimpleNamespace(node_ttl_s=NODE_TTL_S, put_timeout_s=PUT_TIMEOUT_S,
                           quarantine_s=QUARANTINE_S, lease_ttl_s=LEASE_TTL_S)
