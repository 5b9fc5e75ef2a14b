"""The columnar replica encoding of PutStart / GetReplicas answers round-trips exactly."""

from __future__ import annotations

from kvpool.common.types import Extent, NodeEndpoints, Replica
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.rpc import wire

A = NodeEndpoints("a", "boot", "127.0.0.1:1", "shm-a")
B = NodeEndpoints("b", "boot", "127.0.0.1:2", "", rdma_device="rxe0", rdma_gid="fe80::1",
                  rdma_port=1)


def test_replica_columns_round_trip():
    objects = [
        (Replica(A, Extent("sa", 0, 100)),),
        (),                                                    # an object with an error status
        (Replica(A, Extent("sa", 128, 7)), Replica(B, Extent("sb", 64, 7), rdma_addr=4096,
                                                   rdma_rkey=9, rdma_length=1 << 20)),
        (Replica(B, Extent("sb", 0, 64), rdma_addr=4096, rdma_rkey=9, rdma_length=1 << 20),),
    ]
    writer = wire.ReplicaColumnsWriter()
    for replicas in objects:
        writer.add(replicas) if replicas else writer.skip()
    msg = pb.GetReplicasResponse.FromString(
        pb.GetReplicasResponse(replicas=writer.to_pb()).SerializeToString())
    assert len(msg.replicas.locations) == 2          # each segment described once
    lengths = [100, 0, 7, 64]
    assert wire.replicas_from_columns(msg.replicas, lengths) == [tuple(o) for o in objects]


def test_add_columns_describes_each_segment_once():
    calls = []

    def descriptor_of(segment_id: str):
        calls.append(segment_id)
        return wire.descriptor(Replica(A, Extent(segment_id, 0, 0)))

    writer = wire.ReplicaColumnsWriter()
    writer.add_columns([1, 0], ["sa"], [0], descriptor_of)
    writer.add_columns([2], ["sa", "sb"], [64, 0], descriptor_of)
    assert calls == ["sa", "sb"]
    got = wire.replicas_from_columns(writer.to_pb(), [64, 0, 32])
    assert got == [(Replica(A, Extent("sa", 0, 64)),), (),
                   (Replica(A, Extent("sa", 64, 32)), Replica(A, Extent("sb", 0, 32)))]


def test_object_records_carry_parents_and_read_old_messages_without_them():
    from kvpool.common.types import ObjectRecord
    recs = [ObjectRecord("c", "s", 64, 10, 7, 2, "p"),
            ObjectRecord("p", "s", 0, 10, None, 1, pinned=True)]
    msg = pb.ObjectRecords.FromString(wire.records_to_pb(recs).SerializeToString())
    assert list(msg.parents) == ["p", ""] and list(msg.pinned) == [False, True]
    assert wire.records_from_pb(msg) == recs
    plain = [ObjectRecord("p", "s", 0, 10, None, 1)]
    assert list(wire.records_to_pb(plain).parents) == []   # nothing sent for no parents
    assert list(wire.records_to_pb(plain).pinned) == []
    old = wire.records_to_pb(recs)
    del old.parents[:]                                     # as a sender without the fields
    del old.pinned[:]
    assert [(r.parent, r.pinned) for r in wire.records_from_pb(old)] == [(None, False)] * 2
