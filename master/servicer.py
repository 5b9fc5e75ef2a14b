"""The thin gRPC layer: protobuf <-> domain calls on MasterState, exceptions -> per-key status.

Every handler runs on the server's one asyncio loop, so MasterState needs no locks. Every RPC
is either declared read-only (``READ_ONLY``) or runs under ``@mutation``, which applies the
effects MasterState recorded (manifest changes) in one place; tests/unit/test_servicer_effects.py
checks each RPC of the service is one or the other.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
from collections.abc import AsyncIterator

import grpc
from kvpool.common import capabilities, checksum
from kvpool.common.errors import (
    InvalidArgument,
    KVPoolError,
    QuotaExceeded,
    UnknownNode,
    status_for_error,
)
from kvpool.common.logging import get_logger
from kvpool.master.auth import CALLER
from kvpool.master.grants import GrantMinter
from kvpool.master.lookup_sessions import LookupSessions
from kvpool.master.manifest_log import ManifestDelta
from kvpool.master.manifest_watch import ManifestWatchers
from kvpool.master.state import MasterState
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.protos.kvpool.v1 import master_pb2_grpc
from kvpool.rpc import wire

log = get_logger(__name__)
MAX_BATCH = 65536
# RPCs that change nothing a store node's manifest records: reads (leases, the eviction order,
# hit counters and promotions started are this master's soft state, rebuilt after a restart)
# and the manifest stream's own plumbing.
READ_ONLY = frozenset({"GetReplicas", "Exists", "Stats", "WatchManifest", "AckManifest",
                       "OpenLookupSession"})   # (a session changes no stored state)


def mutation(handler=None, *, wait: bool | str = True):
    """Run an RPC that changes the index, then apply its effects (:meth:`MasterServicer.
    apply_effects`): if it recorded manifest changes, every change queued for the nodes is
    pushed, and (``wait``) the answer goes only once the nodes have applied them, so a master
    killed right after answering loses nothing it acknowledged (master/manifest_watch.py).
    Every queued change, not only this call's: the removal of an evicted object must reach its
    node before the commit of a new object of the same key on another node is acknowledged, or
    a restarted master could index the old one. ``wait=False``: for RPCs of a node's own
    session (mount, announce), whose changes repeat what the nodes hold, and whose caller may
    not have its stream open yet. ``wait="put"``: PutStart and PutEnd, which need not wait when
    their writer fences and seals at the nodes (:meth:`MasterServicer.put_waits`)."""
    def wrap(handler):
        @functools.wraps(handler)
        async def run(self, request, context):
            mark = self._state.manifest_mark()
            response = await handler(self, request, context)
            await self.apply_effects(mark, (self.put_waits(request) or None) if wait == "put"
                                     else wait)
            return response
        run.applies_effects = True
        return run
    return wrap if handler is None else wrap(handler)


def _status(result: object) -> int:
    return status_for_error(result) if isinstance(result, KVPoolError) else pb.STATUS_OK


def _check_batch(keys) -> None:
    if len(keys) > MAX_BATCH:
        raise InvalidArgument(f"batch of {len(keys)} keys; the limit is {MAX_BATCH}")


async def _check_rpc_batch(keys, context: grpc.aio.ServicerContext) -> None:
    await _answer(_check_batch, keys, context)


async def _answer(call, request, context: grpc.aio.ServicerContext):
    """``call(request)``'s answer over gRPC: a malformed request (InvalidArgument) aborts the
    call with INVALID_ARGUMENT, as the lookup port answers it."""
    try:
        return call(request)
    except InvalidArgument as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def _changes(delta: ManifestDelta, seq: int, now: float) -> pb.ManifestChanges:
    return pb.ManifestChanges(committed=wire.records_to_pb(delta.committed),
                              removed_keys=[k for k, _ in delta.removed],
                              removed_versions=[v for _, v in delta.removed], seq=seq,
                              reserved=wire.reservations_to_pb(delta.reserved, now))


class _Descriptors:
    """Each mounted segment's descriptor as answers carry it (``wire.descriptor``), made once
    while the cluster's membership stays as it is, not per answer: a single key's lookup
    spent longer describing its segment than finding its object."""

    def __init__(self, state: MasterState) -> None:
        self._state = state
        self._version = -1
        self._made: dict[str, pb.Replica] = {}

    def __call__(self, segment_id: str) -> pb.Replica:
        if (version := self._state.descriptors_version) != self._version:
            self._made.clear()
            self._version = version
        made = self._made.get(segment_id)
        if made is None:
            made = self._made[segment_id] = wire.descriptor(self._state.replica_in(segment_id))
        return made


class MasterServicer(master_pb2_grpc.MasterServicer):
    def __init__(self, state: MasterState, epoch: int | None = None):
        self._state = state
        self._watchers = ManifestWatchers(state)
        self.lookup_port = 0   # named in GetReplicas answers once the lookup port is bound
        # The lookup port's sessions, where its frames are sealed (a master with credentials).
        self.lookup_sessions: LookupSessions | None = None
        # This master's epoch: nodes refuse a writer's reservation or seal of another one, so
        # a late writer of a master that died is fenced at the node (store_node/manifest.py).
        self.epoch = epoch if epoch is not None else secrets.randbits(63) | 1
        # Keys per node, and a grant per replica of each placement and location: a node serves
        # a tcp READ or WRITE only of an extent granted for it (common/capabilities.py).
        self._grants = GrantMinter(state.node_of)
        self._descriptors = _Descriptors(state)

    @mutation(wait=False)
    async def MountSegment(self, request, context):
        node, segment = wire.node_from_pb(request.node), wire.segment_from_pb(request.segment)
        if not node.node_id or not segment.segment_id or segment.size_bytes == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "node_id, segment_id and a non-zero size are required")
        try:
            self._state.mount_segment(node, segment, keeps_manifest=request.keeps_manifest,
                                      recovering=request.recovering)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.keeps_manifest:
            self._watchers.expect(node.node_id)
        log.info("segment_mounted", node=node.node_id, segment=segment.segment_id,
                 size_bytes=segment.size_bytes, tcp=node.tcp_endpoint)
        return pb.MountSegmentResponse(epoch=self.epoch,
                                       data_key=self._grants.key_for(node.node_id))

    @mutation
    async def UnmountSegment(self, request, context):
        try:
            self._state.unmount_segment(request.node_id, request.segment_id)
        except (UnknownNode, InvalidArgument) as e:
            return pb.UnmountSegmentResponse(status=status_for_error(e))
        log.info("segment_unmounted", node=request.node_id, segment=request.segment_id)
        return pb.UnmountSegmentResponse(status=pb.STATUS_OK)

    @mutation   # moved objects' new records reach the manifests before the answer
    async def Heartbeat(self, request, context):
        try:
            if request.moves_done or request.moves_failed:
                self._state.heartbeat(request.node_id, take_manifest=False)
                self._state.moves_finished(request.node_id, list(request.moves_done),
                                           list(request.moves_failed))
            # A watching node gets its changes on its stream, in order: not here as well.
            delta = self._state.heartbeat(
                request.node_id, take_manifest=not self._watchers.delivers(request.node_id))
        except UnknownNode:
            return pb.HeartbeatResponse(status=pb.STATUS_UNKNOWN_NODE)
        moves = [wire.move_to_pb(m) for m in self._state.take_moves(request.node_id)]
        suspects = self._state.take_rechecks(request.node_id)
        verify = {"verify_keys": [k for k, _, _ in suspects],
                  "verify_versions": [v for _, v, _ in suspects],
                  "verify_segment_ids": [s for _, _, s in suspects]}
        if delta is None:
            return pb.HeartbeatResponse(status=pb.STATUS_OK, moves=moves, **verify)
        return pb.HeartbeatResponse(status=pb.STATUS_OK,
                                    committed=wire.records_to_pb(delta.committed),
                                    removed_keys=[k for k, _ in delta.removed],
                                    removed_versions=[v for _, v in delta.removed], moves=moves,
                                    **verify)

    def manifest_lag(self) -> tuple[dict[str, int], int]:
        """Unacknowledged manifest messages per watching node, and how many calls were
        answered without waiting out every node's acknowledgement (master/manifest_watch.py)."""
        return self._watchers.unacked(), self._watchers.wait_timeouts

    def close_streams(self) -> None:
        """End the open WatchManifest streams (before the server stops)."""
        self._watchers.close()

    async def WatchManifest(self, request, context):
        try:
            messages = self.watch_manifest(request)
            # aclosing: a cancelled stream must unregister its watch now, not when collected.
            async with contextlib.aclosing(messages):
                async for message in messages:
                    await context.write(message)
        except UnknownNode as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))

    async def watch_manifest(self, request) -> AsyncIterator[pb.ManifestChanges]:
        """WatchManifest's messages (also streamed on the lookup port); UnknownNode first
        for a node this master does not know."""
        self._state.heartbeat(request.node_id, take_manifest=False)
        async with contextlib.aclosing(self._watchers.stream(request.node_id)) as deltas:
            async for seq, delta in deltas:
                yield _changes(delta, seq, self._state.now())

    async def AckManifest(self, request, context):
        self.ack_manifest(request)
        return pb.AckManifestResponse()

    def ack_manifest(self, request) -> None:
        """AckManifest (also sent on a manifest stream of the lookup port)."""
        self._watchers.ack(request.node_id, request.seq)

    @mutation(wait=False)
    async def AnnounceObjects(self, request, context):
        records = wire.records_from_pb(request.objects)
        await _check_rpc_batch(records, context)
        try:
            results = self._state.announce_objects(
                request.node_id, records, request.done,
                wire.reservations_from_pb(request.reserved, self._state.now()))
        except UnknownNode as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        indexed = sum(r is None for r in results)
        log.info("objects_announced", node=request.node_id, indexed=indexed,
                 refused=len(results) - indexed, done=request.done)
        refused = [str(r) for r in results if r is not None]
        if refused:
            log.warning("announced_objects_refused", node=request.node_id, count=len(refused),
                        reasons=refused[:8])
        return pb.AnnounceObjectsResponse(statuses=map(_status, results))

    @mutation
    async def ReportCorrupt(self, request, context):
        await _check_rpc_batch(request.keys, context)
        if not len(request.keys) == len(request.versions) == len(request.segment_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "keys, versions and segment_ids must be parallel")
        node = request.node_id or None   # a node's own re-check, else a reader's report
        results = self._state.report_corrupt(list(request.keys), list(request.versions),
                                             list(request.segment_ids), node)
        log.warning("corrupt_replicas_dropped" if node else "corrupt_replicas_reported",
                    node=node, keys=list(request.keys)[:8],
                    segments=sorted(set(request.segment_ids)))
        return pb.StatusesResponse(statuses=map(_status, results))

    async def apply_effects(self, mark: int, wait: bool | None = True) -> None:
        """Apply what a call changed since ``mark`` (``manifest_mark()`` before it): push the
        manifest changes queued for the nodes, and (``wait``) wait until they applied them.
        ``wait=None``: push them within PUSH_SOON_S, one message for every call meanwhile:
        they only confirm what the nodes hold already (a fenced or sealed put's), and a
        message per put would take the CPU from the next puts."""
        if self._state.manifest_mark() != mark:
            nodes = self._state.nodes_with_changes()
            if wait is None:
                self._watchers.push_soon(nodes)
            elif wait:
                await self._watchers.flush(nodes)
            else:
                self._watchers.push(nodes)

    def with_effects(self, call):
        """``call`` (request -> response, changing the index) as a coroutine that applies its
        effects as ``@mutation`` does: the lookup port's put calls (master/lookup_server.py)."""
        async def run(request):
            mark = self._state.manifest_mark()
            response = call(request)
            await self.apply_effects(mark, self.put_waits(request) or None)
            return response
        return run

    def put_waits(self, request) -> bool:
        """Whether a put call answers only once the nodes applied what it changed. Not when
        its writer fences (PutStart ``fenced``: it reserves each extent at the node, checked
        against this master's epoch, before writing) or sealed (PutEnd ``sealed``: the node
        holds each replica's record, checked against the bytes): the node then learns the
        change from the writer, and the master's own message, sent with the stream's next
        one, only confirms it. Unless a
        removal is still on its way to a node: an object evicted (or removed) must be out of
        its manifest before a put over its space, or of its key, is acknowledged."""
        writer_told_nodes = getattr(request, "fenced", False) or getattr(request, "sealed", False)
        return not writer_told_nodes or self._watchers.removals_outstanding()

    @mutation(wait="put")   # unfenced: evictions' removals and reservations reach nodes first
    async def PutStart(self, request, context):
        return await _answer(self.put_start, request, context)

    def put_start(self, request) -> pb.PutStartResponse:
        """PutStart's answer (also served on the lookup port); InvalidArgument if malformed."""
        _check_batch(request.keys)
        if len(request.keys) != len(request.sizes):
            raise InvalidArgument(f"{len(request.keys)} keys but {len(request.sizes)} sizes")
        if request.parents and len(request.parents) != len(request.keys):
            raise InvalidArgument(f"{len(request.keys)} keys but {len(request.parents)} parents")
        results = self._state.put_start_extents(list(request.keys), list(request.sizes),
                                                request.replicas or None,
                                                list(request.parents) if request.parents
                                                else None, slots=request.slots)
        statuses, counts, segment_ids, offsets = [], [], [], []
        for r in results:
            if isinstance(r, KVPoolError):
                statuses.append(status_for_error(r))
                counts.append(0)
            else:
                statuses.append(pb.STATUS_OK)
                counts.append(len(r))
                segment_ids += [e.segment_id for e in r]
                offsets += [e.offset for e in r]
        columns = wire.ReplicaColumnsWriter()
        columns.add_columns(counts, segment_ids, offsets, self._descriptors)
        summary = self._state.space_summary() if pb.STATUS_NO_SPACE in statuses else ""
        quota = next((str(r) for r in results if isinstance(r, QuotaExceeded)), "")
        pending = self._state.pending_version
        config = self._state.config
        versions = [pending(k) if s == pb.STATUS_OK else 0
                    for k, s in zip(request.keys, statuses)]
        # A write grant lasts as long as the put may: its space is reclaimed after that.
        # Each with its record tag: the writer's RESERVE and SEAL name this (stored) key.
        grants = self._grants.mint(capabilities.WRITE, counts, segment_ids, offsets,
                                   request.sizes, versions, config.put_timeout_s,
                                   request.keys)
        # READ_HELD grants over the same extents: the writer reads its objects again at them.
        held = self._grants.mint(capabilities.READ_HELD, counts, segment_ids, offsets,
                                 request.sizes, versions, capabilities.HELD_GRANT_S,
                                 joined=True) if request.held and segment_ids else b""
        return pb.PutStartResponse(put_timeout_s=config.put_timeout_s,
                                   statuses=statuses, replicas=columns.to_pb(grants),
                                   space_summary=summary, quota_summary=quota,
                                   epoch=self.epoch,
                                   versions=versions,
                                   hold_s=config.put_timeout_s + config.quarantine_s,
                                   held_grants=held)

    @mutation(wait="put")   # unsealed: the nodes holding the new objects were told first
    async def PutEnd(self, request, context):
        return await _answer(self.put_end, request, context)

    def put_end(self, request) -> pb.StatusesResponse:
        """PutEnd's answer (also served on the lookup port); InvalidArgument if malformed."""
        _check_batch(request.keys)
        sums = [checksum.decode(c) for c in request.checksums] if request.checksums else None
        if sums is not None and len(sums) != len(request.keys):
            raise InvalidArgument(f"{len(request.keys)} keys but {len(sums)} checksums")
        if not request.as_keys:
            return pb.StatusesResponse(statuses=map(_status, self._state.put_end(
                list(request.keys), sums)))
        return pb.StatusesResponse(statuses=map(_status, self._state.put_end(
            list(request.keys), sums, list(request.as_keys), list(request.sizes),
            list(request.parents) if request.parents else None)))

    @mutation
    async def PutRevoke(self, request, context):
        return await _answer(self.put_revoke, request, context)

    def put_revoke(self, request) -> pb.StatusesResponse:
        """PutRevoke's answer (also served on the lookup port)."""
        _check_batch(request.keys)
        return pb.StatusesResponse(statuses=map(_status,
                                                self._state.put_revoke(list(request.keys))))

    @mutation
    async def Remove(self, request, context):
        await _check_rpc_batch(request.keys, context)
        results = self._state.remove(list(request.keys))
        return pb.StatusesResponse(statuses=map(_status, results))

    @mutation   # hard pins are in the manifests (restored after a restart) once acknowledged
    async def Pin(self, request, context):
        await _check_rpc_batch(request.keys, context)
        if request.unpin:
            results = self._state.unpin(list(request.keys))
        elif request.ttl_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ttl_s must be >= 0")
        else:   # NaN or infinity: INVALID_ARGUMENT, as the lookup port would answer
            results = await _answer(lambda r: self._state.pin(list(r.keys), r.ttl_s or None),
                                    request, context)
        return pb.StatusesResponse(statuses=map(_status, results))

    async def Exists(self, request, context):
        return await _answer(self.exists, request, context)

    def exists(self, request) -> pb.StatusesResponse:
        """Exists' answer (also served on the lookup port: master/lookup_server.py)."""
        _check_batch(request.keys)
        return pb.StatusesResponse(statuses=[pb.STATUS_OK if f else pb.STATUS_NOT_FOUND
                                             for f in self._state.exists(list(request.keys))])

    async def GetReplicas(self, request, context):
        response = await _answer(self.get_replicas, request, context)
        response.lookup_port = self.lookup_port
        return response

    def get_replicas(self, request) -> pb.GetReplicasResponse:
        """GetReplicas' answer (also served on the lookup port: master/lookup_server.py)."""
        _check_batch(request.keys)
        located = self._state.locate_columns(list(request.keys))
        statuses = [pb.STATUS_OK] * len(located.sizes)
        for i, error in located.errors.items():
            statuses[i] = status_for_error(error)
        columns = wire.ReplicaColumnsWriter()
        columns.add_columns(located.counts, located.segment_ids, located.offsets,
                            self._descriptors)
        # The shortest lease granted (max_lease_s caps a lease re-read for long).
        lease_s = self._state.config.lease_ttl_s if located.lease_s is None else located.lease_s
        grant_s = max(lease_s, capabilities.READ_GRANT_MIN_S)
        if request.packed:   # the columns as arrays (wire.pack_columns), each converted once
            offsets, sizes, versions = (wire.u64_array(c) for c in (
                located.offsets, located.sizes, located.versions))
            grants = self._grants.mint(capabilities.READ, located.counts, located.segment_ids,
                                       offsets, sizes, versions, grant_s, joined=True)
            return pb.GetReplicasResponse(
                lease_ttl_s=lease_s, replicas=columns.to_pb(grants, packed=True),
                packed=wire.pack_columns(statuses, sizes, versions, located.checksums))
        grants = self._grants.mint(capabilities.READ, located.counts, located.segment_ids,
                                   located.offsets, located.sizes, located.versions, grant_s)
        held = self._grants.mint(capabilities.READ_HELD, located.counts, located.segment_ids,
                                 located.offsets, located.sizes, located.versions,
                                 capabilities.HELD_GRANT_S, joined=True) \
            if request.held else b""
        return pb.GetReplicasResponse(lease_ttl_s=lease_s,
                                      statuses=statuses, sizes=located.sizes,
                                      versions=located.versions, replicas=columns.to_pb(grants),
                                      checksums=located.checksums, held_grants=held)

    async def OpenLookupSession(self, request, context):
        sessions, identity = self.lookup_sessions, CALLER.get()
        if sessions is None or identity is None:   # plain frames (a master without credentials)
            return pb.OpenLookupSessionResponse()
        session_id, session = sessions.open(identity)
        return pb.OpenLookupSessionResponse(session_id=session_id, key=session.key,
                                            ttl_s=sessions.ttl_s)

    async def Stats(self, request, context):
        s = self._state.stats(audit=request.audit)
        return pb.StatsResponse(
            segments=[pb.SegmentStats(node_id=g.node_id, segment=wire.segment_to_pb(g.info),
                                      used_bytes=g.used_bytes, quarantined_bytes=g.quarantined_bytes,
                                      objects=g.objects,
                                      node=wire.node_to_pb(g.node) if g.node else None,
                                      indexed_bytes=g.indexed_bytes or 0)
                      for g in s.segments],
            objects=s.objects, pending_objects=s.pending_objects, hits=s.hits, misses=s.misses,
            evictions=s.evictions, nodes=s.nodes, demotions=s.demotions,
            promotions=s.promotions, hit_bytes=s.hit_bytes, committed=s.committed,
            committed_bytes=s.committed_bytes,
            tenants=[pb.TenantStats(tenant=t, objects=n, bytes=b, quota_bytes=q)
                     for t, n, b, q in s.tenants])
