"""The role table (master/auth.py), the re-check queue (master/rechecks.py), bearer tokens and
where credentials are found (common/security.py), without a server."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpool.common import pki, security, tenants
from kvpool.common.security import Identity, Tokens
from kvpool.master.auth import NODE_METHODS, Refused, check, scope, scope_frame
from kvpool.master.rechecks import Rechecks
from kvpool.protos.kvpool.v1 import master_pb2 as pb

NODE0, NODE1 = Identity("node", "node0"), Identity("node", "node1")
CLIENT, ADMIN = Identity("client", "tenant-a"), Identity("admin", "ops")


def _node_request(method: str, node: str):
    if method == "MountSegment":
        return pb.MountSegmentRequest(node=pb.NodeEndpoints(node_id=node))
    return {"UnmountSegment": pb.UnmountSegmentRequest, "Heartbeat": pb.HeartbeatRequest,
            "AnnounceObjects": pb.AnnounceObjectsRequest,
            "WatchManifest": pb.WatchManifestRequest,
            "AckManifest": pb.AckManifestRequest}[method](node_id=node)


def _refused(method, identity, request=None) -> grpc.StatusCode | None:
    try:
        check(method, identity, request)
    except Refused as e:
        return e.code
    return None


@pytest.mark.parametrize("method", sorted(NODE_METHODS))
def test_node_rpcs_only_from_that_node(method):
    request = _node_request(method, "node0")
    assert _refused(method, NODE0, request) is None
    assert _refused(method, NODE1, request) == grpc.StatusCode.PERMISSION_DENIED
    assert _refused(method, CLIENT, request) == grpc.StatusCode.PERMISSION_DENIED
    assert _refused(method, ADMIN, request) == grpc.StatusCode.PERMISSION_DENIED
    assert _refused(method, None, request) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("method", ["PutStart", "PutEnd", "PutRevoke", "Remove", "Pin",
                                    "Exists", "RegisterClient", "PublishKVEvents", "Route"])
def test_client_rpcs_not_from_nodes(method):
    assert _refused(method, CLIENT, None) is None
    assert _refused(method, ADMIN, None) is None
    assert _refused(method, NODE0, None) == grpc.StatusCode.PERMISSION_DENIED


def test_an_empty_get_replicas_learns_the_lookup_port_for_anyone():
    assert _refused("GetReplicas", NODE0, pb.KeysRequest()) is None
    assert _refused("GetReplicas", NODE0, pb.KeysRequest(keys=["k"])) is not None
    assert _refused("GetReplicas", None, pb.KeysRequest()) == grpc.StatusCode.UNAUTHENTICATED


def test_stats_audit_is_for_admins():
    assert _refused("Stats", CLIENT, pb.StatsRequest()) is None
    assert _refused("Stats", CLIENT, pb.StatsRequest(audit=True)) is not None
    assert _refused("Stats", ADMIN, pb.StatsRequest(audit=True)) is None


def test_report_corrupt_naming_a_node_is_that_nodes_alone():
    reader = pb.ReportCorruptRequest(keys=["k"], versions=[1], segment_ids=["s"])
    confirmed = pb.ReportCorruptRequest(keys=["k"], versions=[1], segment_ids=["s"],
                                        node_id="node0")
    assert _refused("ReportCorrupt", CLIENT, reader) is None
    assert _refused("ReportCorrupt", CLIENT, confirmed) is not None
    assert _refused("ReportCorrupt", NODE1, confirmed) is not None
    assert _refused("ReportCorrupt", NODE0, confirmed) is None


def test_rechecks_are_handed_out_once_and_bounded():
    r = Rechecks(per_node=2)
    for suspect in [("a", 1, "s0"), ("a", 1, "s0"), ("b", 1, "s0"), ("c", 1, "s0")]:
        r.ask("node0", suspect)
    assert r.take("node0") == [("a", 1, "s0"), ("b", 1, "s0")]
    assert r.dropped == 1
    assert r.take("node0") == []


def test_a_token_names_only_what_it_is_bound_to():
    tokens = Tokens([(CLIENT, hashlib.sha256(b"secret").digest())])
    assert tokens.identify("Bearer secret") == CLIENT
    assert tokens.identify("Bearer secrets") is None
    assert tokens.identify("secret") is None
    assert tokens.identify(None) is None


def test_made_credentials_name_their_identity(tmp_path):
    master = security.load(pki.make_local(tmp_path, "127.0.0.1"))
    assert master.identity == Identity("master", "master")
    assert security.load(tmp_path / "client.yaml").identity == Identity("client", "default")
    node = security.load(pki.ensure(tmp_path, "node", "node7"))
    assert node.identity == Identity("node", "node7")
    assert all(os.stat(p).st_mode & 0o077 == 0 for p in tmp_path.glob("*.key"))
    token = security.load(pki.make_token(tmp_path, "client", "tenant-t"))
    assert Tokens.load(tmp_path / "tokens.yaml").identify(f"Bearer {token.token}") == \
        Identity("client", "tenant-t")
    with pytest.raises(ValueError):
        pki.issue(tmp_path, "root", "x")


def test_a_local_cluster_is_found_by_its_address_only_in_a_private_directory(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("KVPOOL_CLUSTERS_DIR", str(tmp_path / "clusters"))
    monkeypatch.delenv(security.ENV, raising=False)
    creds = tmp_path / "creds"
    pki.make_local(creds, "127.0.0.1")
    creds.chmod(0o700)
    security.register(["127.0.0.1:5"], creds)
    assert security.resolve("127.0.0.1:5").identity == Identity("client", "default")
    assert security.resolve("127.0.0.1:5", role="admin").identity.role == "admin"
    assert security.resolve("127.0.0.1:5", role="node", name="n1").identity == \
        Identity("node", "n1")
    assert security.resolve("127.0.0.1:9,127.0.0.1:5") is not None   # a list of standbys
    assert security.resolve("127.0.0.1:6") is None
    (tmp_path / "clusters").chmod(0o777)   # writable by others: not trusted
    assert security.resolve("127.0.0.1:5") is None
    (tmp_path / "clusters").chmod(0o700)
    security.unregister(["127.0.0.1:5"])
    assert security.resolve("127.0.0.1:5") is None


def test_a_dead_clusters_entry_is_not_used_for_its_port(tmp_path, monkeypatch):
    """A cluster killed before it could unregister leaves its entry behind; a plain master that
    later takes the port must not be dialled with the dead cluster's credentials (CI saw a TLS
    handshake against one)."""
    clusters = tmp_path / "clusters"
    monkeypatch.setenv("KVPOOL_CLUSTERS_DIR", str(clusters))
    monkeypatch.delenv(security.ENV, raising=False)
    creds = tmp_path / "creds"
    pki.make_local(creds, "127.0.0.1")
    creds.chmod(0o700)
    register = ("import sys; from kvpool.common import security; "
                "security.register([sys.argv[1]], sys.argv[2])")
    subprocess.run([sys.executable, "-c", register, "127.0.0.1:5", str(creds)], check=True,
                   env={**os.environ, "KVPOOL_CLUSTERS_DIR": str(clusters)}, timeout=60)
    assert len(list(clusters.iterdir())) == 1        # the owner exited without unregistering
    assert security.resolve("127.0.0.1:5") is None
    assert list(clusters.iterdir()) == []            # and its entry is gone
    # An entry another kvpool wrote in its own format names no owner: not trusted either.
    (clusters / "127.0.0.1%3A6").write_text(str(creds))
    assert security.resolve("127.0.0.1:6") is None
    security.register(["127.0.0.1:5"], creds)        # a live owner's entry is used
    assert security.resolve("127.0.0.1:5") is not None


@given(keys=st.lists(st.text(alphabet="ab/\x1d", max_size=6), min_size=1, max_size=4),
       as_keys=st.lists(st.text(alphabet="ab/\x1d", max_size=6), max_size=4),
       name=st.sampled_from(["default", "tenant-a"]))
def test_a_frame_is_scoped_as_its_request_would_be(keys, as_keys, name):
    """The lookup port's shortcut (scope_frame: the default tenant's body without the mark's
    byte is left alone) scopes every request exactly as scope does."""
    identity = Identity("client", name)
    request = pb.PutEndRequest(keys=keys, as_keys=as_keys[:len(keys)])
    expected, got = pb.PutEndRequest(), pb.PutEndRequest()
    expected.CopyFrom(request)
    got.CopyFrom(request)
    scope("PutEnd", identity, expected)
    scope_frame("PutEnd", identity, got, request.SerializeToString())
    assert got == expected
    if name == "default" and any(k.startswith(tenants.MARK) for k in keys):
        assert list(got.keys) != keys   # such a key of the default tenant is namespaced
