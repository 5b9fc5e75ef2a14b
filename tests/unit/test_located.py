"""The columnar GetReplicas answer (Located) describes exactly what the per-key decoding does."""

from __future__ import annotations

import dataclasses

import pytest
from kvpool.common import capabilities, checksum
from kvpool.common.errors import ObjectNotFound, TransportError
from kvpool.common.types import Extent, NodeEndpoints, ObjectView, Replica
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.rpc import wire
from kvpool.rpc.located import Located
from kvpool.rpc.master_client import located

A = NodeEndpoints("a", "boot", "127.0.0.1:1", "shm-a")
B = NodeEndpoints("b", "boot", "127.0.0.1:2", "", rdma_device="rxe0", rdma_gid="fe80::1",
                  rdma_port=1)


def _located(objects, statuses, sizes, packed: bool = False) -> Located:
    """The answer as the master words it (``packed``: KeysRequest.packed's form), sent and
    read back as the client reads it."""
    writer = wire.ReplicaColumnsWriter()
    for replicas in objects:
        writer.add(replicas) if replicas else writer.skip()
    grants = [bytes([j]) * capabilities.GRANT.size for j in range(len(writer.offsets))]
    versions = list(range(1, len(objects) + 1))
    sums = [checksum.encode(7)] + [0] * (len(objects) - 1)
    if packed:
        answer = pb.GetReplicasResponse(
            lease_ttl_s=1.0, replicas=writer.to_pb(grants, packed=True),
            packed=wire.pack_columns(statuses, sizes, versions, sums))
    else:
        answer = pb.GetReplicasResponse(lease_ttl_s=1.0, statuses=statuses, sizes=sizes,
                                        versions=versions, checksums=sums,
                                        replicas=writer.to_pb(grants))
    msg = pb.GetReplicasResponse.FromString(answer.SerializeToString())
    return located([f"k{i}" for i in range(len(objects))], msg)


@pytest.mark.parametrize("packed", [False, True])
def test_views_and_single_locations_match_the_replicas(packed):
    two = (Replica(A, Extent("sa", 128, 7)),
           Replica(B, Extent("sb", 64, 7), rdma_addr=4096, rdma_rkey=9, rdma_length=1 << 20))
    objects = [(Replica(A, Extent("sa", 0, 100)),), (), two,
               (Replica(B, Extent("sb", 0, 64), rdma_addr=4096, rdma_rkey=9,
                        rdma_length=1 << 20),), ()]
    ok, missing = pb.STATUS_OK, pb.STATUS_NOT_FOUND
    located = _located(objects, [ok, missing, ok, ok, missing], [100, 0, 7, 64, 0],
                       packed)
    granted = [tuple(dataclasses.replace(r, grant=bytes([j]) * capabilities.GRANT.size)
                     for j, r in enumerate(reps, first))
               for reps, first in zip(objects, (0, 1, 1, 3, 4))]
    assert located.view(0) == ObjectView("k0", 100, 1, granted[0], checksum=7)
    assert isinstance(located.view(1), ObjectNotFound)
    assert located.view(2) == ObjectView("k2", 7, 3, granted[2])
    assert located.view(3) == ObjectView("k3", 64, 4, granted[3])
    # Only found keys with one replica have a single location (-1 otherwise), the trailing
    # not-found key included (its first replica index is past the end).
    assert located.single_location().tolist() == [0, -1, -1, 1, -1]
    assert located.replicas.locations[1].extent.segment_id == "sb"


@pytest.mark.parametrize("packed", [False, True])
def test_nothing_found(packed):
    located = _located([(), ()], [pb.STATUS_NOT_FOUND] * 2, [0, 0], packed)
    assert located.single_location().tolist() == [-1, -1]
    assert not located.found().any()


def test_a_packed_answer_that_does_not_add_up_is_refused():
    good = _located([(Replica(A, Extent("sa", 0, 8)),)], [pb.STATUS_OK], [8], packed=True)
    assert good.found().all()
    writer = wire.ReplicaColumnsWriter()
    writer.add((Replica(A, Extent("sa", 0, 8)),))
    columns = writer.to_pb([b"g" * capabilities.GRANT.size], packed=True)
    per_key = wire.pack_columns([0], [8], [1], [0])
    for bad in (pb.GetReplicasResponse(replicas=columns, packed=per_key[:-8]),   # a column short
                pb.GetReplicasResponse(replicas=columns, packed=per_key + b"\0"),
                pb.GetReplicasResponse(packed=per_key, replicas=pb.ReplicaColumns(
                    locations=columns.locations, packed=wire.pack_columns([2], [0], [0]))),
                pb.GetReplicasResponse(packed=per_key, replicas=pb.ReplicaColumns(
                    locations=columns.locations, packed=wire.pack_columns([1], [5], [0]))),
                pb.GetReplicasResponse(packed=per_key, replicas=pb.ReplicaColumns(
                    locations=columns.locations, packed=columns.packed,
                    packed_grants=b"g" * (capabilities.GRANT.size + 1)))):
        with pytest.raises(TransportError, match="malformed answer"):
            located(["k"], bad)


def test_a_location_is_made_once_and_each_distinct_one_apart():
    a, b = (wire.replica_to_pb(Replica(node, Extent(sid, 0, 0))) for node, sid in
            ((A, "sa"), (B, "sb")))
    first = wire.location_from_pb(a)
    assert first == wire.replica_from_pb(a) and wire.location_from_pb(a) is first
    assert wire.location_from_pb(b) == wire.replica_from_pb(b) != first
    moved = pb.Replica()
    moved.CopyFrom(a)
    moved.node.tcp_endpoint = "127.0.0.1:3"   # the same segment, its node on a new port
    assert wire.location_from_pb(moved).node.tcp_endpoint == "127.0.0.1:3"
