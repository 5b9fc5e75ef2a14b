"""The columnar GetReplicas answer (Located) describes exactly what the per-key decoding does."""

from __future__ import annotations

import numpy as np
from kvpool.common import checksum
from kvpool.common.errors import ObjectNotFound
from kvpool.common.types import Extent, NodeEndpoints, ObjectView, Replica
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.rpc import wire
from kvpool.rpc.located import Located

A = NodeEndpoints("a", "boot", "127.0.0.1:1", "shm-a")
B = NodeEndpoints("b", "boot", "127.0.0.1:2", "", rdma_device="rxe0", rdma_gid="fe80::1",
                  rdma_port=1)


def _located(objects, statuses, sizes) -> Located:
    writer = wire.ReplicaColumnsWriter()
    for replicas in objects:
        writer.add(replicas) if replicas else writer.skip()
    msg = pb.GetReplicasResponse.FromString(pb.GetReplicasResponse(
        replicas=writer.to_pb()).SerializeToString())
    keys = [f"k{i}" for i in range(len(objects))]
    return Located(keys=keys, statuses=np.array(statuses, dtype=np.int32),
                   sizes=np.array(sizes, dtype=np.uint64),
                   versions=np.arange(1, len(objects) + 1, dtype=np.uint64),
                   checksums=np.array([checksum.encode(7)] + [0] * (len(objects) - 1),
                                      dtype=np.uint64),
                   replicas=wire.replica_arrays(msg.replicas), lease_ttl_s=1.0)


def test_views_and_single_locations_match_the_replicas():
    two = (Replica(A, Extent("sa", 128, 7)),
           Replica(B, Extent("sb", 64, 7), rdma_addr=4096, rdma_rkey=9, rdma_length=1 << 20))
    objects = [(Replica(A, Extent("sa", 0, 100)),), (), two,
               (Replica(B, Extent("sb", 0, 64), rdma_addr=4096, rdma_rkey=9,
                        rdma_length=1 << 20),), ()]
    ok, missing = pb.STATUS_OK, pb.STATUS_NOT_FOUND
    located = _located(objects, [ok, missing, ok, ok, missing], [100, 0, 7, 64, 0])
    assert located.view(0) == ObjectView("k0", 100, 1, objects[0], checksum=7)
    assert isinstance(located.view(1), ObjectNotFound)
    assert located.view(2) == ObjectView("k2", 7, 3, two)
    assert located.view(3) == ObjectView("k3", 64, 4, objects[3])
    # Only found keys with one replica have a single location (-1 otherwise), the trailing
    # not-found key included (its first replica index is past the end).
    assert located.single_location().tolist() == [0, -1, -1, 1, -1]
    assert located.replicas.locations[1].extent.segment_id == "sb"


def test_nothing_found():
    located = _located([(), ()], [pb.STATUS_NOT_FOUND] * 2, [0, 0])
    assert located.single_location().tolist() == [-1, -1]
    assert not located.found().any()
