"""Identities and roles (issue 15; SECURITY.md): one test per row of the attack table this
covers, each against a real master and store nodes started with their own CA (LocalCluster's
default), each refused where before it succeeded. The attackers hold certificates of the same
CA (a tenant's client, another node) or none at all."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from kvpool.client import KVClient
from kvpool.client.router import Candidate, RouterClient
from kvpool.common import pki, security
from kvpool.common.errors import (
    KVPoolError,
    MasterUnavailable,
    PermissionDenied,
    Unauthenticated,
)
from kvpool.common.hashing import HashSpec
from kvpool.common.types import ObjectRecord
from kvpool.net import lookup_port
from kvpool.net.sockets import recv_exact
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.protos.kvpool.v1 import routing_pb2 as routing_pb
from kvpool.rpc.grpc_client import map_status
from kvpool.rpc.lookup import LookupChannel, LookupLost
from kvpool.rpc.master_client import MasterClient
from kvpool.tools.cluster import ClusterError

from .conftest import SessionSocket, run_cluster

VALUE = b"v" * 4096


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A secure cluster (2 nodes) shared by the module; a few objects on each node."""
    tmp = tmp_path_factory.mktemp("auth")
    for c in run_cluster(tmp):
        with KVClient(c.master) as kv:
            for i in range(8):
                kv.put(f"owned/{i}", VALUE)
        yield c


def _as(cluster, role: str, name: str, **kw) -> MasterClient:
    """A master client holding a certificate of the cluster's CA for ``role``/``name``."""
    return MasterClient(cluster.master, timeout_s=5.0, retries=0,
                        credentials=str(cluster.credentials(role, name)), **kw)


def _all_there(cluster) -> None:
    """Every object the fixture put is still readable, unchanged (the attack changed nothing)."""
    with KVClient(cluster.master) as kv:
        assert all(kv.get(f"owned/{i}") == VALUE for i in range(8))
        assert kv.stats().nodes == 2


def _segment_of(cluster, node: str) -> str:
    with _as(cluster, "admin", "ops") as admin:
        return next(s.segment.segment_id for s in admin.stats().segments if s.node_id == node)


def test_put_get_remove_pin_without_credentials_are_refused(cluster):
    with MasterClient(cluster.master, timeout_s=2.0, retries=0, credentials=False) as anon:
        for call in (lambda: anon.put_start(["owned/new"], [len(VALUE)]),
                     lambda: anon.locate(["owned/0"]),
                     lambda: anon.remove(["owned/0"]),
                     lambda: anon.pin(["owned/0"])):
            with pytest.raises((MasterUnavailable, Unauthenticated)):
                call()
    _all_there(cluster)


def test_a_client_of_another_ca_is_refused(cluster, tmp_path):
    pki.make_ca(tmp_path / "other")
    creds = pki.issue(tmp_path / "other", "client", "default")
    with pytest.raises((MasterUnavailable, Unauthenticated)), \
            KVClient(cluster.master, timeout_s=2.0, credentials=str(creds)) as kv:
        kv.remove("owned/0")
    _all_there(cluster)


def test_mount_segment_with_another_nodes_id_is_refused(cluster):
    fake = pb.MountSegmentRequest(node=pb.NodeEndpoints(node_id="node0",
                                                        tcp_endpoint="127.0.0.1:9"),
                                  segment=pb.SegmentInfo(segment_id="evil/0",
                                                         size_bytes=1 << 40))
    with _as(cluster, "node", "node1") as node1, \
            pytest.raises(PermissionDenied, match="acts only as itself"):
        node1._call("MountSegment", fake)
    _all_there(cluster)


def test_a_client_cannot_mount_a_fake_node(cluster):
    fake = pb.MountSegmentRequest(node=pb.NodeEndpoints(node_id="mallory",
                                                        tcp_endpoint="127.0.0.1:9"),
                                  segment=pb.SegmentInfo(segment_id="mallory/0",
                                                         size_bytes=1 << 40, tier=pb.TIER_HBM))
    with _as(cluster, "client", "mallory") as client, \
            pytest.raises(PermissionDenied, match="for store nodes"):
        client._call("MountSegment", fake)
    _all_there(cluster)


def test_unmount_of_a_live_nodes_segment_by_a_client_or_another_node_is_refused(cluster):
    segment = _segment_of(cluster, "node0")
    with _as(cluster, "client", "mallory") as client, pytest.raises(PermissionDenied):
        client.unmount_segment("node0", segment)
    with _as(cluster, "node", "node1") as node1:
        with pytest.raises(PermissionDenied):
            node1.unmount_segment("node0", segment)
        # As itself, naming node0's segment: the master's own ownership check refuses it.
        with pytest.raises(KVPoolError):
            node1.unmount_segment("node1", segment)
    _all_there(cluster)


def test_announce_objects_pinned_by_a_client_is_refused(cluster):
    segment = _segment_of(cluster, "node0")
    record = ObjectRecord("pinned/forever", segment, 60 << 20, 1 << 20, None, 1, pinned=True)
    with _as(cluster, "client", "mallory") as client, pytest.raises(PermissionDenied):
        client.announce_objects("node0", [record], done=False)
    _all_there(cluster)


def test_watch_and_ack_manifest_as_node0_from_another_identity_are_refused(cluster):
    for role, name in (("client", "mallory"), ("node", "node1")):
        with _as(cluster, role, name) as other:
            with pytest.raises(PermissionDenied):
                other._call("AckManifest", pb.AckManifestRequest(node_id="node0", seq=1 << 40))
            with pytest.raises(PermissionDenied):
                next(iter(other.watch_manifest("node0", 2.0)))
    _all_there(cluster)


@contextlib.contextmanager
def _lookup_channel(cluster, role: str, name: str):
    """A lookup-port channel whose sessions are opened as ``role``/``name``."""
    with _as(cluster, role, name) as mc:
        port = mc._call("GetReplicas", pb.KeysRequest()).lookup_port
        channel = LookupChannel(cluster.master, port, 5.0, map_status,
                                sessions=mc.lookup_sessions)
        try:
            yield channel
        finally:
            channel.close()


def test_on_the_lookup_port_a_client_cannot_open_a_nodes_stream_nor_a_node_read(cluster):
    with _lookup_channel(cluster, "client", "mallory") as client, \
            _lookup_channel(cluster, "node", "node1") as node:
        conn = client.open_stream(lookup_port.WATCH_MANIFEST,
                                  pb.WatchManifestRequest(node_id="node0"))
        with pytest.raises(PermissionDenied):
            client.read_stream_frame(conn, pb.ManifestChanges)
        conn.close()
        with pytest.raises(PermissionDenied):
            node.call(lookup_port.GET_REPLICAS, pb.KeysRequest(keys=["owned/0"]),
                      pb.GetReplicasResponse)
        # The client's own calls are answered there, in its tenant's namespace (the default
        # tenant's "owned/0" is not mallory's).
        assert client.call(lookup_port.GET_REPLICAS, pb.KeysRequest(keys=["owned/0"]),
                           pb.GetReplicasResponse).statuses == [pb.STATUS_NOT_FOUND]


def _lookup_port(cluster) -> tuple[str, int]:
    with MasterClient(cluster.master, retries=0) as mc:
        return cluster.master.rpartition(":")[0], mc._call("GetReplicas",
                                                           pb.KeysRequest()).lookup_port


def _answer(sock) -> tuple[int, bytes]:
    status, length = lookup_port.RESPONSE.unpack(recv_exact(sock, lookup_port.RESPONSE.size))
    return status, recv_exact(sock, length)


def test_the_lookup_port_refuses_a_peer_without_a_session(cluster):
    """Plain frames, a TLS handshake (what the port took before sessions), a session id the
    master never issued: each answered UNAUTHENTICATED in clear, and the connection closed."""
    address = _lookup_port(cluster)
    plain = LookupChannel(cluster.master, address[1], 2.0, map_status)
    with pytest.raises(LookupLost, match="session"):
        plain.call(lookup_port.PUT_REVOKE, pb.KeysRequest(keys=["owned/0"]), pb.StatusesResponse)
    plain.close()
    tls = ssl.create_default_context(cafile=str(cluster.credentials_dir / "ca.pem"))
    with socket.create_connection(address, timeout=5) as raw, pytest.raises(ssl.SSLError):
        tls.wrap_socket(raw, server_hostname=security.MASTER_NAME)
    for first in (lookup_port.encode_request(lookup_port.SESSION, os.urandom(32)),
                  lookup_port.encode_request(lookup_port.GET_REPLICAS, pb.KeysRequest(
                      keys=["owned/0"]).SerializeToString())):
        with socket.create_connection(address, timeout=5) as s:
            s.sendall(first)
            assert _answer(s)[0] == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert s.recv(1) == b""   # closed
    _all_there(cluster)


def test_a_sessions_frames_cannot_be_read_altered_replayed_or_moved(cluster):
    """What an attacker on the path between a client and the lookup port can do with the
    frames it sees: the keys and grants are not in them; a changed byte, a frame sent again
    and a frame of another connection of the same session are each refused, and end that
    connection; the client's own next call on a fresh connection is answered."""
    address = _lookup_port(cluster)
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]
    first = SessionSocket(cluster, address[1])
    lookup = first.frame(lookup_port.GET_REPLICAS,
                         pb.KeysRequest(keys=["owned/3"]).SerializeToString())
    first.sock.sendall(lookup)
    _, sealed = first.answer_frame()
    answer = pb.GetReplicasResponse.FromString(first.inn.open(first.head, sealed))
    assert answer.statuses == [pb.STATUS_OK]
    assert b"owned/3" not in lookup and b"owned/3" not in sealed
    grants = answer.replicas.grants
    assert grants and not any(g in sealed for g in grants)
    assert first.call(lookup)[0] == unauthenticated   # the same frame again
    assert first.sock.recv(1) == b""
    for change in ("body", "header"):
        s = SessionSocket(cluster, address[1], first.answer)
        frame = bytearray(s.frame(lookup_port.EXISTS,
                                  pb.KeysRequest(keys=["owned/1"]).SerializeToString()))
        frame[-1 if change == "body" else 4] ^= 1   # a byte of the tag; the method
        assert s.call(bytes(frame))[0] == unauthenticated
        assert s.sock.recv(1) == b""
        s.sock.close()
    a, b = (SessionSocket(cluster, address[1], first.answer) for _ in range(2))
    frame = a.frame(lookup_port.EXISTS, pb.KeysRequest(keys=["owned/1"]).SerializeToString())
    assert b.call(frame)[0] == unauthenticated   # moved to another connection
    status, body = a.call(frame)                 # on its own, it is answered
    assert (status, pb.StatusesResponse.FromString(body).statuses) == (0, [pb.STATUS_OK])
    for s in (first, a, b):
        s.sock.close()
    _all_there(cluster)


def test_a_session_acts_as_whoever_opened_it_and_a_client_renews_its_own(cluster):
    """A node's session is refused a client's read and a client's session a node's stream
    (above); here: a tenant's session sees its tenant's keys only, and a client whose session
    the master no longer knows opens another and goes on (a master restart does that)."""
    with _as(cluster, "client", "tenant-s") as mc:
        mc.put_start(["mine"], [16])
        channel = LookupChannel(cluster.master, _lookup_port(cluster)[1], 5.0, map_status,
                                sessions=mc.lookup_sessions)
        assert channel.call(lookup_port.EXISTS, pb.KeysRequest(keys=["owned/2"]),
                            pb.StatusesResponse).statuses == [pb.STATUS_NOT_FOUND]
        held = channel._session
        channel.close()
        # As if the master had restarted: the session held names an id it does not know.
        channel = LookupChannel(cluster.master, _lookup_port(cluster)[1], 5.0, map_status,
                                sessions=mc.lookup_sessions)
        channel._session = dataclasses.replace(held, session_id=os.urandom(16))
        assert channel.call(lookup_port.EXISTS, pb.KeysRequest(keys=["owned/2"]),
                            pb.StatusesResponse).statuses == [pb.STATUS_NOT_FOUND]
        assert channel._session.session_id not in (held.session_id, b"")
        channel.close()
        mc.put_revoke(["mine"])


def test_register_client_from_a_non_client_is_refused(cluster):
    creds = str(cluster.credentials("node", "node1"))
    with RouterClient(cluster.master, timeout_s=5.0, credentials=creds) as router, \
            pytest.raises(PermissionDenied, match="for clients"):
        router._call("RegisterClient", routing_pb.RegisterClientRequest(
            client_id="x", spec=routing_pb.HashSpec(block_size=3)))


def test_admin_calls_from_a_client_are_refused_and_an_admin_makes_them(cluster):
    with _as(cluster, "client", "mallory") as client:
        with pytest.raises(PermissionDenied, match="admins"):
            client.stats(audit=True)
        assert client.stats().nodes == 2   # the plain figures are a client's
    with _as(cluster, "admin", "ops") as admin:
        assert admin.stats(audit=True).objects >= 8


def _kvpool(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvpool", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_a_cluster_from_kvpool_up_works_with_no_flags(tmp_path):
    env = {**os.environ, "KVPOOL_CLUSTERS_DIR": str(tmp_path / "clusters")}
    env.pop(security.ENV, None)
    up = _kvpool("up", "--nodes", "1", "--segment-size", "64MiB", env=env)
    try:
        lines = []
        while not any(line.startswith("master:") for line in lines):
            line = up.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        master = lines[-1].split(":", 1)[1].strip()
        creds = next(line for line in iter(up.stdout.readline, "")
                     if line.startswith(security.ENV))
        assert security.load(creds.split("=", 1)[1].strip()).identity.role == "client"
        stat = subprocess.run([sys.executable, "-m", "kvpool", "stat", "--master", master],
                              capture_output=True, text=True, env=env, timeout=60, check=False)
        assert stat.returncode == 0, stat.stdout + stat.stderr
        # A process of another user finds nothing: here, one without the registry.
        other = subprocess.run(
            [sys.executable, "-m", "kvpool", "stat", "--master", master],
            capture_output=True, text=True, timeout=60, check=False,
            env={**env, "KVPOOL_CLUSTERS_DIR": str(tmp_path / "elsewhere")})
        assert other.returncode != 0
    finally:
        up.terminate()
        up.wait(30)


def test_a_master_reachable_from_other_hosts_needs_credentials_or_insecure():
    refused = subprocess.run([sys.executable, "-m", "kvpool", "master", "--host", "0.0.0.0",
                              "--port", "0"], capture_output=True, text=True, timeout=60,
                             check=False)
    assert refused.returncode != 0
    assert "--insecure" in refused.stderr and "Traceback" not in refused.stderr
    insecure = _kvpool("master", "--host", "0.0.0.0", "--port", "0", "--insecure")
    try:
        out = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(l.startswith("master:") for l in out):
            out.append(insecure.stdout.readline())
        assert any("insecure_master" in line for line in out), out
    finally:
        insecure.terminate()
        insecure.wait(30)


def test_report_corrupt_of_good_bytes_drops_nothing_and_a_node_confirms_only_its_own(cluster):
    """A reader's ReportCorrupt on a good, hard-pinned, 2-replica object only asks each node to
    re-check: the bytes are good, so nothing is dropped. A node may confirm only replicas in
    its own segments."""
    with KVClient(cluster.master, replicas=2) as kv:
        kv.put("pinned/good", VALUE)
        kv.pin("pinned/good")
        located = kv._master.locate(["pinned/good"])
        view = located.views()[0]
        segments = [r.extent.segment_id for r in view.replicas]
        assert len(segments) == 2
        # A reader of the object's own tenant (another tenant's report names its own key).
        with _as(cluster, "client", "default") as client:
            for _ in range(3):
                client.report_corrupt(["pinned/good"] * 2, [view.version] * 2, segments)
        time.sleep(1.0)   # several heartbeats: each node re-checked and found the bytes good
        assert len(kv._master.locate(["pinned/good"]).views()[0].replicas) == 2
        assert kv.get("pinned/good", verify=True) == VALUE
        # A node "confirming" damage in another node's segment is refused.
        owner = {s.segment.segment_id: s.node_id for s in kv.stats().segments}
        other = next(s for s in segments if owner[s] != "node1")
        with _as(cluster, "node", "node1") as node1:
            assert isinstance(node1.report_corrupt(["pinned/good"], [view.version], [other],
                                                   node_id="node1")[0], KVPoolError)
            with pytest.raises(PermissionDenied):
                node1.report_corrupt(["pinned/good"], [view.version], [other],
                                     node_id=owner[other])
        assert len(kv._master.locate(["pinned/good"]).views()[0].replicas) == 2


def _lookup_calls(cluster) -> int:
    """Calls the master answered on its lookup port (its metrics)."""
    with urllib.request.urlopen(f"http://{cluster.metrics_addresses['master']}/metrics",
                                timeout=5) as r:
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                       if line.startswith("kvpool_master_lookup_port_calls_total{")))


def test_bearer_tokens_on_the_token_port(tmp_path):
    """A client that cannot hold a certificate: a bearer token bound to its role and name, on
    the master's token port (TLS without client certificates). A wrong token or none is
    UNAUTHENTICATED; a token of a client is still only a client."""
    creds = tmp_path / "creds"
    pki.make_ca(creds)
    token = pki.make_token(creds, "client", "tenant-t")
    cluster = run_cluster(tmp_path, nodes=1, credentials_dir=creds, metrics=True,
                          master_args=["--tokens", str(creds / "tokens.yaml")])
    c = next(cluster)
    try:
        address = c.master_proc.wait_ready("tokens")
        with KVClient(address, timeout_s=5.0, credentials=str(token)) as kv:
            kv.put("by-token", VALUE)
            assert kv.get("by-token", verify=True) == VALUE
            with pytest.raises(PermissionDenied):
                kv._master.stats(audit=True)
            # The data path's master calls went to the lookup port, in a session opened on the
            # token port with the token (net/lookup_port.py, "Sessions"), not over gRPC.
            assert kv._master._lookups.channel._session is not None
            before = _lookup_calls(c)
            for i in range(3):
                kv.put(f"by-token-{i}", VALUE)
                assert kv.get(f"by-token-{i}") == VALUE
            # PutEnd (each put fills a slot: client/slots.py), GetReplicas each
            assert _lookup_calls(c) - before >= 6
        # The gateway's Route, sent from its event loop, opens its session the same way.
        with RouterClient(address, timeout_s=5.0, credentials=str(token)) as router:
            router.register(HashSpec.of(16, model="m"))

            async def routes() -> list[str]:
                return [(await router.route_async(block_hashes=[b"x" * 32],
                                                  candidates=[Candidate("e")])).instance_id
                        for _ in range(2)]
            assert asyncio.run(routes()) == ["e", "e"]
            assert router._lookups.channel._idle_async, "Route did not use the lookup port"
        forged = tmp_path / "forged.yaml"
        forged.write_text(f"ca: {creds / 'ca.pem'}\ntoken: not-the-token\n")
        with pytest.raises(Unauthenticated), \
                MasterClient(address, retries=0, credentials=str(forged)) as mc:
            mc.locate(["by-token"])
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(
                (creds / "ca.pem").read_bytes()), options=security.GRPC_CHANNEL_OPTIONS) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/kvpool.v1.Master/Remove")(
                    pb.KeysRequest(keys=["by-token"]).SerializeToString(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        with pytest.raises(StopIteration):   # stops it; fails on a traceback in a log
            next(cluster)


def _cert_manager_directory(cluster, directory, pod: str):
    """What cert-manager's csi-driver mounts in a store-node pod with the chart's
    ``security.nodeCertificates: certManager``: a key of that pod's own and its certificate
    from the CA Issuer (the cluster's CA), for the subject the chart's volume attributes ask
    (OU=node, CN=the pod's name), as ca.crt, tls.crt and tls.key."""
    import shutil
    issued = security.load(pki.issue(cluster.credentials_dir, "node", pod))
    directory.mkdir()
    for source, name in ((issued.ca_file, "ca.crt"), (issued.cert_file, "tls.crt"),
                         (issued.key_file, "tls.key")):
        shutil.copyfile(source, directory / name)
    return directory


def test_a_store_node_with_a_key_of_its_own_from_cert_manager_acts_only_as_itself(tmp_path):
    """The Helm chart's per-pod node certificates (security.nodeCertificates: certManager): a
    store node started with the directory cert-manager's csi-driver mounts (no credentials
    file) joins as the node its certificate names, and serves; with the same directory neither
    a node process nor a hand-made call can act as another pod's node."""
    for c in run_cluster(tmp_path, nodes=0):
        own = _cert_manager_directory(c, tmp_path / "pod-0", "kv-kvpool-store-node-0")
        assert security.load(own).identity == security.Identity("node", "kv-kvpool-store-node-0")
        c.add_node("kv-kvpool-store-node-0", ["--credentials", str(own)])
        with KVClient(c.master) as kv:
            kv.put("on-a-pod-of-its-own", VALUE)
            assert kv.get("on-a-pod-of-its-own") == VALUE
            assert [s.node_id for s in kv.stats().segments] == ["kv-kvpool-store-node-0"]
        # The node itself refuses to start as another, and the master refuses it if it tried.
        with pytest.raises(ClusterError, match="is not the one .* names"):
            c.add_node("kv-kvpool-store-node-1", ["--credentials", str(own)])
        other = pb.MountSegmentRequest(
            node=pb.NodeEndpoints(node_id="kv-kvpool-store-node-1", tcp_endpoint="127.0.0.1:9"),
            segment=pb.SegmentInfo(segment_id="kv-kvpool-store-node-1/0", size_bytes=1 << 30))
        with MasterClient(c.master, timeout_s=5.0, retries=0, credentials=str(own)) as node, \
                pytest.raises(PermissionDenied, match="acts only as itself"):
            node._call("MountSegment", other)
        with KVClient(c.master) as kv:
            assert [s.node_id for s in kv.stats().segments] == ["kv-kvpool-store-node-0"]
