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


def lookup_socket(cluster, port: int, timeout_s: float = 5.0):
    """A connection to ``cluster``'s master's lookup ``port`` (TLS as the default client when
    the cluster is secure)."""
    import socket

    from kvpool.common import security
    sock = socket.create_connection((cluster.master.rpartition(":")[0], port), timeout_s)
    return security.load(cluster.client_credentials).wrap(sock) if cluster.secure else sock


@pytest.fixture
def cluster(tmp_path):
    """A real master and 2 real store nodes (64 MiB each), stopped after the test."""
    yield from run_cluster(tmp_path)


@pytest.fixture
def timeouts():
    """The master timeouts the ``cluster`` fixture runs with."""
    return SimpleNamespace(node_ttl_s=NODE_TTL_S, put_timeout_s=PUT_TIMEOUT_S,
                           quarantine_s=QUARANTINE_S, lease_ttl_s=LEASE_TTL_S)
