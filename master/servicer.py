"""The thin gRPC layer: protobuf <-> domain calls on MasterState, exceptions -> per-key status.

Every handler runs on the server's one asyncio loop, so MasterState needs no locks.
"""

from __future__ import annotations

import grpc
from kvpool.common import wire
from kvpool.common.errors import (
    InvalidArgument,
    KVPoolError,
    UnknownNode,
    status_for_error,
)
from kvpool.common.logging import get_logger
from kvpool.master.state import MasterState
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.protos.kvpool.v1 import master_pb2_grpc

log = get_logger(__name__)
_MAX_BATCH = 65536


def _status(result: object) -> int:
    return status_for_error(result) if isinstance(result, KVPoolError) else pb.STATUS_OK


async def _check_batch(keys, context: grpc.aio.ServicerContext) -> None:
    if len(keys) > _MAX_BATCH:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"batch of {len(keys)} keys; the limit is {_MAX_BATCH}")


class MasterServicer(master_pb2_grpc.MasterServicer):
    def __init__(self, state: MasterState):
        self._state = state

    async def MountSegment(self, request, context):
        node, segment = wire.node_from_pb(request.node), wire.segment_from_pb(request.segment)
        if not node.node_id or not segment.segment_id or segment.size_bytes == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "node_id, segment_id and a non-zero size are required")
        try:
            self._state.mount_segment(node, segment)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("segment_mounted", node=node.node_id, segment=segment.segment_id,
                 size_bytes=segment.size_bytes, tcp=node.tcp_endpoint)
        return pb.MountSegmentResponse()

    async def UnmountSegment(self, request, context):
        try:
            self._state.unmount_segment(request.node_id, request.segment_id)
        except (UnknownNode, InvalidArgument) as e:
            return pb.UnmountSegmentResponse(status=status_for_error(e))
        log.info("segment_unmounted", node=request.node_id, segment=request.segment_id)
        return pb.UnmountSegmentResponse(status=pb.STATUS_OK)

    async def Heartbeat(self, request, context):
        try:
            self._state.heartbeat(request.node_id)
        except UnknownNode:
            return pb.HeartbeatResponse(status=pb.STATUS_UNKNOWN_NODE)
        return pb.HeartbeatResponse(status=pb.STATUS_OK)

    async def PutStart(self, request, context):
        await _check_batch(request.keys, context)
        if len(request.keys) != len(request.sizes):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.keys)} keys but {len(request.sizes)} sizes")
        results = self._state.put_start(list(request.keys), list(request.sizes),
                                        request.replicas or None)
        statuses, columns = [], wire.ReplicaColumnsWriter()
        for r in results:
            if isinstance(r, KVPoolError):
                statuses.append(status_for_error(r))
                columns.skip()
            else:
                statuses.append(pb.STATUS_OK)
                columns.add(r)
        return pb.PutStartResponse(put_timeout_s=self._state.config.put_timeout_s,
                                   statuses=statuses, replicas=columns.to_pb())

    async def PutEnd(self, request, context):
        await _check_batch(request.keys, context)
        return pb.StatusesResponse(statuses=map(_status, self._state.put_end(list(request.keys))))

    async def PutRevoke(self, request, context):
        await _check_batch(request.keys, context)
        return pb.StatusesResponse(statuses=map(_status, self._state.put_revoke(list(request.keys))))

    async def Remove(self, request, context):
        await _check_batch(request.keys, context)
        return pb.StatusesResponse(statuses=map(_status, self._state.remove(list(request.keys))))

    async def Exists(self, request, context):
        await _check_batch(request.keys, context)
        found = self._state.exists(list(request.keys))
        return pb.StatusesResponse(
            statuses=[pb.STATUS_OK if f else pb.STATUS_NOT_FOUND for f in found])

    async def GetReplicas(self, request, context):
        await _check_batch(request.keys, context)
        statuses, sizes, versions = [], [], []
        columns = wire.ReplicaColumnsWriter()
        for r in self._state.locate(list(request.keys)):
            if isinstance(r, KVPoolError):
                statuses.append(status_for_error(r))
                sizes.append(0)
                versions.append(0)
                columns.skip()
            else:
                statuses.append(pb.STATUS_OK)
                sizes.append(r[0])
                versions.append(r[1])
                columns.add_places(r[2], self._state.replica_in)
        return pb.GetReplicasResponse(lease_ttl_s=self._state.config.lease_ttl_s,
                                      statuses=statuses, sizes=sizes, versions=versions,
                                      replicas=columns.to_pb())

    async def Stats(self, request, context):
        s = self._state.stats()
        return pb.StatsResponse(
            segments=[pb.SegmentStats(node_id=g.node_id, segment=wire.segment_to_pb(g.info),
                                      used_bytes=g.used_bytes, quarantined_bytes=g.quarantined_bytes,
                                      objects=g.objects,
                                      node=wire.node_to_pb(g.node) if g.node else None)
                      for g in s.segments],
            objects=s.objects, pending_objects=s.pending_objects, hits=s.hits, misses=s.misses,
            evictions=s.evictions, nodes=s.nodes)
