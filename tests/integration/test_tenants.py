"""Tenants (issue 15; SECURITY.md "Tenants"): a tenant's keys live in its own namespace, on
every port (gRPC, the lookup port) and in the store nodes' manifests, against a real secure
master and store nodes. Each client holds a certificate of the cluster's CA naming its tenant."""

from __future__ import annotations

import socket
import time

import pytest
from kvpool.client import KVClient
from kvpool.client.router import Candidate, RouterClient
from kvpool.common import capabilities, tenants
from kvpool.common.errors import LimitExceeded, NoSpace, ObjectNotFound, QuotaExceeded
from kvpool.common.hashing import HashSpec, block_key
from kvpool.common.kv_events import AllBlocksCleared, BlockStored
from kvpool.net.data_port import RESPONSE, FrameStatus, Op, PutRecord, encode_record_request
from kvpool.net.sockets import recv_exact
from kvpool.rpc.master_client import MasterClient

from .conftest import run_cluster

QUOTA = 256 << 10
INSTANCES = 2   # serving instances per tenant in the routing index


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from run_cluster(tmp_path_factory.mktemp("tenants"),
                           master_args=["--tenant-quotas", f"tenant-q={QUOTA}",
                                        "--max-routing-instances-per-tenant",
                                        str(INSTANCES)])


def client(cluster, tenant: str) -> KVClient:
    return KVClient(cluster.master, credentials=str(cluster.credentials("client", tenant)))


def master_as(cluster, role: str, name: str) -> MasterClient:
    return MasterClient(cluster.master, timeout_s=5.0, retries=0,
                        credentials=str(cluster.credentials(role, name)))


def test_the_same_key_of_two_tenants_is_two_objects(cluster):
    with client(cluster, "tenant-a") as a, client(cluster, "tenant-b") as b, \
            KVClient(cluster.master) as default:
        a.put("same", b"A" * 4096)
        b.put("same", b"B" * 4096)
        default.put("same", b"D" * 4096)
        assert a.get("same") == b"A" * 4096
        assert b.get("same") == b"B" * 4096
        assert default.get("same") == b"D" * 4096
        # Batched, as engines read: the lookup port's GetReplicas is scoped too.
        assert a.batch_get(["same"]) == [b"A" * 4096]


def test_one_tenant_can_neither_see_read_remove_nor_pin_anothers_keys(cluster):
    with client(cluster, "tenant-a") as a, client(cluster, "tenant-b") as b:
        a.put("only-a", b"a" * 4096)
        assert b.exists("only-a") is False
        with pytest.raises(ObjectNotFound):
            b.get("only-a")
        assert isinstance(b.batch_remove(["only-a"])[0], ObjectNotFound)
        with master_as(cluster, "client", "tenant-b") as mb:
            assert isinstance(mb.pin(["only-a"])[0], ObjectNotFound)
            assert mb.locate(["only-a"]).found().tolist() == [False]
        # A key that names tenant-a's namespace itself is only another key of b's.
        assert b.exists(tenants.scoped("tenant-a", "only-a")) is False
        assert a.get("only-a") == b"a" * 4096


def test_a_default_key_that_looks_namespaced_stays_the_default_tenants(cluster):
    forged = tenants.scoped("tenant-a", "forged")
    with client(cluster, "tenant-a") as a, KVClient(cluster.master) as default:
        a.put("forged", b"a" * 4096)
        default.put(forged, b"d" * 4096)
        assert a.get("forged") == b"a" * 4096
        assert default.get(forged) == b"d" * 4096


def test_an_admin_names_stored_keys(cluster):
    with client(cluster, "tenant-a") as a, master_as(cluster, "admin", "ops") as admin:
        a.put("seen-by-ops", b"a" * 4096)
        assert admin.exists([tenants.scoped("tenant-a", "seen-by-ops")]) == [True]
        assert admin.exists(["seen-by-ops"]) == [False]


def test_a_tenants_sealed_put_is_its_own_after_a_master_restart(tmp_path):
    """A single put is sealed at its node (the master does not wait for the node): the record
    the node keeps must name the stored key, or a restarted master, rebuilding its index from
    the nodes' manifests, would give the object to the default tenant."""
    for c in run_cluster(tmp_path, nodes=1):
        with client(c, "tenant-a") as a:
            a.put("sealed", b"s" * 65536)
        c.kill_master()
        c.restart_master()
        with client(c, "tenant-a") as a, KVClient(c.master) as default, \
                master_as(c, "admin", "ops") as admin:
            deadline = time.monotonic() + 30
            while admin.stats().objects < 1:     # the node announces what it holds
                assert time.monotonic() < deadline, "the node never announced its object"
                time.sleep(0.05)
            assert default.exists("sealed") is False
            assert a.get("sealed") == b"s" * 65536


def test_a_put_past_its_tenants_quota_is_refused_before_anything_is_evicted(cluster):
    with client(cluster, "tenant-q") as q, client(cluster, "tenant-a") as a, \
            master_as(cluster, "admin", "ops") as admin:
        a.put("kept", b"k" * 4096)
        for i in range(3):
            q.put(f"q{i}", bytes([i]) * (64 << 10))
        evictions = admin.stats().evictions
        with pytest.raises(QuotaExceeded) as refused:
            q.put("big", b"b" * (128 << 10))
        assert isinstance(refused.value, NoSpace)        # what callers of NoSpace catch
        message = str(refused.value)
        assert "'big'" in message and "tenant 'tenant-q' holds 192.0 KiB in 3 objects" in message
        assert "256.0 KiB" in message and "--tenant-quotas" in message
        assert admin.stats().evictions == evictions
        assert a.get("kept") == b"k" * 4096 and q.exists("q0")
        # Another tenant (no quota) is not bound by it; the tenant itself fits once it frees.
        a.put("big", b"b" * (128 << 10))
        q.remove("q0")
        q.put("big", b"b" * (128 << 10))
        assert q.get("big") == b"b" * (128 << 10)
        assert q.batch_remove(["q1", "q2", "big"]) == [None] * 3   # the quota is free again


def test_a_client_is_told_of_its_own_tenant_and_an_admin_of_every_one(cluster):
    with client(cluster, "tenant-a") as a, client(cluster, "tenant-q") as q:
        a.put("counted", b"c" * 1000)
        q.put("counted", b"c" * 1000)
    with master_as(cluster, "client", "tenant-q") as mq:
        [own] = mq.stats().tenants
        assert own.tenant == "tenant-q" and own.quota_bytes == QUOTA and own.objects >= 1
    with master_as(cluster, "admin", "ops") as admin:
        by_name = {t.tenant: t for t in admin.stats().tenants}
    assert {"tenant-a", "tenant-q"} <= set(by_name)
    assert not by_name["tenant-a"].HasField("quota_bytes")
    assert by_name["tenant-q"].bytes <= QUOTA


def test_a_writer_cannot_record_another_tenants_key_at_its_node(cluster):
    """Tenant b, granted an extent for its own put, hands the node a record naming tenant a's
    stored key there (it would drop a's record at that node, and after a master restart give
    a's key b's bytes): refused, as the grant's record tag names b's key only."""
    victim = tenants.scoped("tenant-a", "victim")
    with client(cluster, "tenant-a") as a:
        a.put("victim", b"v" * 4096)
    with master_as(cluster, "client", "tenant-b") as mb:
        placed, _, grant = mb.put_start_grant(["mine"], [4096], fenced=True)
        [replica] = placed[0]
        host, _, port = replica.node.tcp_endpoint.rpartition(":")
        e = replica.extent
        for key, expected in ((victim, FrameStatus.DENIED),
                              (tenants.scoped("tenant-b", "mine"), FrameStatus.OK)):
            record = PutRecord(key, grant.versions[0], grant.epoch, 60.0)
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(encode_record_request(Op.RESERVE, e.segment_id, e.offset, e.length,
                                                record, capabilities.record_grant(replica.grant)))
                status, n = RESPONSE.unpack(recv_exact(s, RESPONSE.size))
                assert FrameStatus(status) is expected, recv_exact(s, n)
        mb.put_revoke(["mine"])
    with client(cluster, "tenant-a") as a:
        assert a.get("victim") == b"v" * 4096


def test_route_sees_only_the_store_of_the_callers_tenant(cluster):
    """A prompt's blocks stored by tenant a are store hits to a's Route and none to b's: no
    tenant learns through the router which prompts another's store holds."""
    spec = HashSpec.of(16, model="tenants")
    hashes = spec.hashes(list(range(3 * 16)))
    with client(cluster, "tenant-a") as a:
        for h in hashes:
            a.put(block_key(h), b"k" * 1024)
    hits = {}
    for tenant in ("tenant-a", "tenant-b"):
        creds = str(cluster.credentials("client", tenant))
        with RouterClient(cluster.master, credentials=creds) as router:
            router.register(spec)
            for _ in range(2):   # gRPC, then the lookup port
                hits.setdefault(tenant, []).append(router.route(
                    block_hashes=hashes, candidates=[Candidate("engine")]).hits["store"])
    assert hits == {"tenant-a": [3, 3], "tenant-b": [0, 0]}


def test_a_tenants_engines_and_their_caches_are_its_own_to_route_to(cluster):
    """Tenant a's engine publishes its cache; tenant b naming an engine of the same id routes to
    an engine of its own (which holds nothing), lists none of a's, and its own events under that
    id do not touch a's engine."""
    spec = HashSpec.of(16, model="tenants")
    hashes = spec.hashes(list(range(100, 100 + 4 * 16)))

    def router(tenant):
        return RouterClient(cluster.master,
                            credentials=str(cluster.credentials("client", tenant)))

    with router("tenant-a") as a, router("tenant-b") as b:
        a.register(spec)
        a.publish("engine", [BlockStored(tuple(hashes))])
        a_view = a.route(block_hashes=hashes, candidates=[Candidate("engine")])
        b_view = b.route(block_hashes=hashes, candidates=[Candidate("engine")])
        assert (a_view.instance_id, a_view.hits["gpu"]) == ("engine", 4)
        assert (b_view.instance_id, b_view.hits["gpu"]) == ("engine", 0)
        assert "engine" in {i.instance_id for i in a.list_instances()}
        assert "engine" not in {i.instance_id for i in b.list_instances()}
        b.publish("engine", [AllBlocksCleared()])
        assert a.route(block_hashes=hashes, candidates=[Candidate("engine")]).hits["gpu"] == 4
        # With no candidates named, a tenant routes among its own engines.
        b.publish("b-engine", [BlockStored(tuple(hashes[:1]))])
        assert b.route(block_hashes=hashes).instance_id == "b-engine"   # its only hit
        assert a.route(block_hashes=hashes).instance_id == "engine"
        assert "b-engine" not in {i.instance_id for i in a.list_instances()}


def test_one_tenants_publishers_cannot_fill_the_routing_index(cluster):
    def router(tenant):
        return RouterClient(cluster.master,
                            credentials=str(cluster.credentials("client", tenant)))

    h = HashSpec.of(16, model="tenants").hashes(list(range(4 * 16)))
    with router("tenant-c") as c, router("tenant-d") as d:
        for i in range(INSTANCES):
            c.publish(f"c{i}", [BlockStored((h[i],))])
        with pytest.raises(LimitExceeded, match="tenant 'tenant-c' has 2 serving instances"):
            c.publish("one-more", [BlockStored((h[2],))])
        c.publish("c0", [BlockStored((h[3],))])   # its own instances still publish
        d.publish("d0", [BlockStored((h[0],))])   # and another tenant's are let in
        assert {i.instance_id for i in c.list_instances()} == {"c0", "c1"}
        assert {i.instance_id for i in d.list_instances()} == {"d0"}
