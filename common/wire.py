"""Conversions between protobuf messages and the domain types, used by master and client alike."""

from __future__ import annotations

from kvpool.common.types import Extent, NodeEndpoints, Replica, SegmentInfo
from kvpool.protos.kvpool.v1 import master_pb2 as pb

# Batches of hundreds of blocks with descriptors exceed gRPC's 4 MiB default.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]

_TIERS = {"dram": pb.TIER_DRAM, "hbm": pb.TIER_HBM, "disk": pb.TIER_DISK}
_TIER_NAMES = {v: k for k, v in _TIERS.items()}


def node_to_pb(node: NodeEndpoints) -> pb.NodeEndpoints:
    return pb.NodeEndpoints(node_id=node.node_id, boot_id=node.boot_id,
                            tcp_endpoint=node.tcp_endpoint, shm_endpoint=node.shm_endpoint)


def node_from_pb(msg: pb.NodeEndpoints) -> NodeEndpoints:
    return NodeEndpoints(node_id=msg.node_id, boot_id=msg.boot_id,
                         tcp_endpoint=msg.tcp_endpoint, shm_endpoint=msg.shm_endpoint)


def segment_to_pb(seg: SegmentInfo) -> pb.SegmentInfo:
    return pb.SegmentInfo(segment_id=seg.segment_id, size_bytes=seg.size_bytes, tier=_TIERS[seg.tier])


def segment_from_pb(msg: pb.SegmentInfo) -> SegmentInfo:
    return SegmentInfo(segment_id=msg.segment_id, size_bytes=msg.size_bytes,
                       tier=_TIER_NAMES.get(msg.tier, "dram"))


def replica_to_pb(r: Replica) -> pb.Replica:
    return pb.Replica(node=node_to_pb(r.node), segment_id=r.extent.segment_id,
                      offset=r.extent.offset, length=r.extent.length)


def replica_from_pb(msg: pb.Replica) -> Replica:
    return Replica(node=node_from_pb(msg.node),
                   extent=Extent(segment_id=msg.segment_id, offset=msg.offset, length=msg.length))
