"""The columnar replica encoding of PutStart / GetReplicas answers round-trips exactly."""

from __future__ import annotations

from kvpool.common import wire
from kvpool.common.types import Extent, NodeEndpoints, Replica
from kvpool.protos.kvpool.v1 import master_pb2 as pb

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


def test_add_places_describes_each_segment_once():
    calls = []

    def replica_in(segment_id: str) -> Replica:
        calls.append(segment_id)
        return Replica(A, Extent(segment_id, 0, 0))

    writer = wire.ReplicaColumnsWriter()
    writer.add_places([("sa", 0)], replica_in)
    writer.add_places([("sa", 64), ("sb", 0)], replica_in)
    assert calls == ["sa", "sb"]
    got = wire.replicas_from_columns(writer.to_pb(), [64, 32])
    assert got == [(Replica(A, Extent("sa", 0, 64)),),
                   (Replica(A, Extent("sa", 64, 32)), Replica(A, Extent("sb", 0, 32)))]
