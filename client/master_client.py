"""The client side of the master's gRPC API: deadlines, jittered retry, status -> exception.

Object calls return one result per key: a value, or the KVPoolError instance for that key
(the caller decides whether to raise it). Only transport-level failures raise here.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.client.grpc_client import GrpcClient
from kvpool.common import wire
from kvpool.common.errors import KVPoolError, UnknownNode, error_for_status
from kvpool.common.types import NodeEndpoints, ObjectView, Replica, SegmentInfo
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.protos.kvpool.v1 import master_pb2_grpc


class MasterClient(GrpcClient):
    """A blocking, thread-safe client of one master."""

    def __init__(self, address: str, timeout_s: float = 10.0, retries: int = 3):
        super().__init__(address, master_pb2_grpc.MasterStub, timeout_s=timeout_s,
                         retries=retries, name="master client")

    # -- membership (store nodes) --
    def mount_segment(self, node: NodeEndpoints, segment: SegmentInfo) -> None:
        self._call("MountSegment", pb.MountSegmentRequest(node=wire.node_to_pb(node),
                                                          segment=wire.segment_to_pb(segment)))

    def unmount_segment(self, node_id: str, segment_id: str) -> None:
        r = self._call("UnmountSegment", pb.UnmountSegmentRequest(node_id=node_id,
                                                                  segment_id=segment_id))
        if err := error_for_status(r.status, segment_id):
            raise err

    def heartbeat(self, node_id: str) -> None:
        r = self._call("Heartbeat", pb.HeartbeatRequest(node_id=node_id))
        if r.status == pb.STATUS_UNKNOWN_NODE:
            raise UnknownNode(f"master does not know node {node_id!r}")

    # -- objects --
    def put_start(self, keys: Sequence[str], sizes: Sequence[int], replicas: int = 0
                  ) -> tuple[list[tuple[Replica, ...] | KVPoolError], float]:
        r = self._call("PutStart", pb.PutStartRequest(keys=keys, sizes=sizes, replicas=replicas))
        placed = wire.replicas_from_columns(r.replicas, sizes)
        out = [error_for_status(s, k) or p for k, s, p in zip(keys, r.statuses, placed)]
        return out, r.put_timeout_s

    def put_end(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        return self._statuses("PutEnd", keys)

    def put_revoke(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        return self._statuses("PutRevoke", keys)

    def remove(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        return self._statuses("Remove", keys)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        r = self._call("Exists", pb.KeysRequest(keys=keys))
        return [s == pb.STATUS_OK for s in r.statuses]

    def get_replicas(self, keys: Sequence[str]) -> tuple[list[ObjectView | KVPoolError], float]:
        r = self._call("GetReplicas", pb.KeysRequest(keys=keys))
        sizes = list(r.sizes)
        located = wire.replicas_from_columns(r.replicas, sizes)
        out: list[ObjectView | KVPoolError] = [
            error_for_status(s, k) or ObjectView(k, size, version, replicas)
            for k, s, size, version, replicas in zip(keys, r.statuses, sizes, r.versions, located)]
        return out, r.lease_ttl_s

    def stats(self) -> pb.StatsResponse:
        return self._call("Stats", pb.StatsRequest())

    def _statuses(self, method: str, keys: Sequence[str]) -> list[KVPoolError | None]:
        r = self._call(method, pb.KeysRequest(keys=keys))
        return [error_for_status(s, k) for k, s in zip(keys, r.statuses)]
