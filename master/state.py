"""The master's authoritative index, sans-IO: one method per RPC plus ``tick``.

No grpc, no asyncio, no threads: the servicer calls these methods from one event loop, and time
comes from an injected clock, so every rule below is tested with a hand-advanced fake clock.

Batch methods return one result per key, in order; per-key errors are exception *instances*
in the result list, never raised, so one bad key fails only its own slot.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvpool.common import checksum
from kvpool.common.config import MasterConfig
from kvpool.common.errors import (
    AlreadyExists,
    Conflict,
    InvalidArgument,
    KVPoolError,
    NoSpace,
    NotPending,
    ObjectNotFound,
    UnknownNode,
    ValueTooLarge,
)
from kvpool.common.types import (
    TIER_RANK,
    Extent,
    Move,
    NodeEndpoints,
    ObjectRecord,
    ObjectState,
    ObjectView,
    Replica,
    Reservation,
    SegmentInfo,
    validate_key,
)
from kvpool.master.allocator import RangeAllocator
from kvpool.master.eviction import EvictionPolicy, make_eviction_policy
from kvpool.master.placement import choose_segments

PENDING, COMPLETE = ObjectState.PENDING, ObjectState.COMPLETE
_MAX_SHARED_SIZES = 1024
# Children waiting for a parent that is not stored yet (see _put_end_one); past this many,
# new ones are plain chain heads. Bounds the master's memory against parents that never come.
_MAX_WAITING = 1 << 16
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SegmentStats:
    node_id: str
    info: SegmentInfo
    used_bytes: int          # aligned bytes held by indexed objects (PENDING and COMPLETE)
    quarantined_bytes: int   # aligned bytes awaiting a deferred free (lease or put quarantine)
    objects: int             # indexed objects with a replica here (PENDING and COMPLETE)
    node: NodeEndpoints | None = None   # how clients reach the segment's node
    # With ``stats(audit=True)``: the aligned bytes of those objects, summed one by one; equal
    # to ``used_bytes`` unless the allocator leaked (or double-freed) space. None otherwise.
    indexed_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class MasterStats:
    segments: tuple[SegmentStats, ...]
    objects: int             # COMPLETE objects
    pending_objects: int
    hits: int
    misses: int
    evictions: int
    nodes: int
    demotions: int = 0       # moves one tier down completed (objects kept, not evicted)
    promotions: int = 0      # moves one tier up completed


@dataclass(frozen=True, slots=True)
class LocatedColumns:
    """:meth:`MasterState.locate_columns`' answer: per key (in request order) its size,
    version, encoded checksum (common/checksum.py) and replica count, all 0 for a key in
    ``errors``; then per replica, key by key, its segment id and offset."""

    errors: dict[int, KVPoolError]   # position in the request -> why that key was not found
    sizes: list[int]
    versions: list[int]
    checksums: list[int]
    counts: list[int]
    segment_ids: list[str]
    offsets: list[int]


@dataclass(frozen=True, slots=True)
class ManifestDelta:
    """What changed in one node's segments since its last heartbeat: objects committed there,
    ``(key, version)`` of objects dropped from there (applied after the commits), and space a
    restarted master must not reuse for a while (``Reservation``, on this master's clock)."""

    committed: list[ObjectRecord]
    removed: list[tuple[str, int]]
    reserved: list[Reservation] = ()


@dataclass(eq=False, slots=True)
class _Node:
    endpoints: NodeEndpoints
    last_seen: float
    segment_ids: set[str] = field(default_factory=set)
    # For a node that keeps a manifest: ObjectRecords committed and (key, version) dropped in
    # its segments, in order, until its next heartbeat takes them. None: it keeps none.
    manifest_log: list | None = None


@dataclass(eq=False, slots=True)
class _Segment:
    node_id: str
    info: SegmentInfo
    allocator: RangeAllocator
    keys: set[str] = field(default_factory=set)   # indexed objects with a replica here
    quarantined_bytes: int = 0
    manifest_log: list | None = None   # its node's (shared), to append to without a lookup
    moving_out_bytes: int = 0   # aligned bytes of in-flight moves out of here (leaving soon)
    draining: bool = False      # passed the high watermark, not yet down to the low one


@dataclass(eq=False, slots=True)
class _MoveInFlight:
    """A copy a node was told to make; the index switches to ``dst`` when it reports done."""

    obj: _Object
    src: Extent
    dst: Extent
    src_seg: _Segment
    dst_seg: _Segment
    deadline: float


@dataclass(eq=False, slots=True)
class _Object:
    """One index entry, kept small: a master indexes millions of them. The first replica lives
    inline (segment id and offset; every replica is ``size`` bytes long), further ones in
    ``more``; ``replicas`` builds the Extents on demand."""

    key: str
    size: int
    version: int
    segment_id: str          # the first replica's segment ("" once every replica is gone)
    offset: int
    more: tuple[Extent, ...] = ()
    state: ObjectState = PENDING
    lease_until: float = 0.0
    pinned: bool = False
    checksum: int | None = None   # CRC-32C of the bytes, as the writer computed it
    # The block this one extends (None: none), from PutStart until PutEnd hands it to the
    # policy, then cleared: the request's copy of the parent's key would cost a str per object.
    parent: str | None = None

    @property
    def replicas(self) -> list[Extent]:
        """Extents in mounted segments only: dropped segments are stripped."""
        if not self.segment_id:
            return []
        first = Extent(self.segment_id, self.offset, self.size)
        return [first, *self.more] if self.more else [first]

    @replicas.setter
    def replicas(self, extents: Sequence[Extent]) -> None:
        first = extents[0] if extents else Extent("", 0, self.size)
        self.segment_id, self.offset, self.more = first.segment_id, first.offset, tuple(extents[1:])


class MasterState:
    """Segments, nodes and the object index, with leases, deferred frees and eviction."""

    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic,
                 policy: EvictionPolicy | None = None,
                 on_evict: Callable[[str, int], None] | None = None) -> None:
        """``policy``: the eviction order; by default the one ``config.eviction`` names
        ("prefix": a chain's tail before its parents, shared parents last, plain LRU for
        objects without a parent). ``on_evict(key, version)``: told of each object evicted
        (the server logs it, so an auditor can tell evictions from losses)."""
        self._config = config
        self._clock = clock
        self._policy = policy if policy is not None else make_eviction_policy(config.eviction)
        # Objects on a disk tier are ordered apart, by a policy of the same kind: there they
        # can only be dropped, and a chain block whose children all went down to disk must
        # become demotable itself (to the main policy, a child on disk is still a child).
        self._disk_policy = make_eviction_policy(config.eviction)
        # Chain links waiting for their parent to enter the child's policy (a child announced
        # before its parent after a restart, a block on another tier than its parent): parent
        # key -> children, and child -> parent. Linked when the parent arrives there; dropped
        # with the parent (or the child) leaving the index, and once recovery ends.
        self._waiting: dict[str, list[str]] = {}
        self._waiting_for: dict[str, str] = {}
        self._on_evict = on_evict
        self._nodes: dict[str, _Node] = {}
        self._segments: dict[str, _Segment] = {}
        self._objects: dict[str, _Object] = {}
        # (free_at, seq, [(segment, extent)]): lease-deferred removals and put quarantine alike.
        self._deferred: list[tuple[float, int, list[tuple[_Segment, Extent]]]] = []
        # (deadline, seq, objects): one entry per PutStart batch, not per object.
        self._put_deadlines: list[tuple[float, int, list[_Object]]] = []
        self._versions = itertools.count(1)
        self._seq = itertools.count()
        self._pending = 0
        # One int object per distinct object size, shared by every entry of that size (KV
        # blocks mostly have one size): 28 bytes less per indexed object.
        self._sizes: dict[int, int] = {}
        self._hits = self._misses = self._evictions = 0
        self._demotions = self._promotions = 0
        # Tiers (see "-- tiers"): copies handed to nodes and not reported yet, by move id; the
        # key of each object with one in flight; instructions not yet taken, per node; disk
        # segment ids (a set lookup on the read path); disk objects read once, and when.
        self._moves: dict[int, _MoveInFlight] = {}
        self._moving: dict[str, int] = {}
        self._outbox: dict[str, list[Move]] = {}
        self._disk_segments: set[str] = set()
        self._disk_reads: dict[str, float] = {}
        # Pins (see ``pin``): soft ones by key with their end (and a heap of ends to expire
        # them), and the bytes hard pins hold against their quota.
        self._soft_pins: dict[str, float] = {}
        self._soft_pin_expiry: list[tuple[float, str]] = []
        self._hard_pinned_bytes = 0
        # Segments whose node is still announcing what they hold: no new object goes there.
        self._recovering: set[str] = set()
        # Segments this master dropped because their node went silent (partition, crash). If
        # the node comes back and announces what they hold, this index stays authoritative for
        # them: only replicas of objects still indexed are taken back, so an object removed
        # or evicted meanwhile does not return (a restarted master, knowing none, takes all).
        self._expired_segments: set[str] = set()
        # Objects removed, evicted or dropped as corrupt while nodes may still be announcing
        # (key -> version): until twice node_ttl_s after the first mount (every live node has
        # re-mounted and announced by then) and while a segment recovers. Another node's
        # replica announced later must not bring such an object back.
        self._tombstones: dict[str, int] = {}
        self._announcing_until: float | None = None
        # Nodes silent for a third of node_ttl_s (as of the last tick): probably dead, so new
        # objects go elsewhere while the TTL runs out, instead of failing their writes there.
        # Their next heartbeat clears them; if every node is silent, none is avoided.
        self._silent: set[str] = set()

    @property
    def config(self) -> MasterConfig:
        return self._config

    def now(self) -> float:
        """This master's clock (reservations travel as seconds from now)."""
        return self._clock()

    # -- membership -----------------------------------------------------------------------

    def mount_segment(self, node: NodeEndpoints, segment: SegmentInfo, *,
                      keeps_manifest: bool = False, recovering: bool = False) -> None:
        """Register ``segment`` on ``node`` (registering or updating the node); a heartbeat too.

        ``keeps_manifest``: the node wants to hear what is committed in and dropped from its
        segments (``heartbeat`` returns it). ``recovering``: the node will announce objects it
        already holds there (``announce_objects``); nothing new is placed in the segment until
        it says it is done.

        Idempotent for the same (node, segment). InvalidArgument for a segment id mounted by
        another node or with another size/tier, an empty id, or a segment below the alignment.
        """
        if not node.node_id or not segment.segment_id:
            raise InvalidArgument("node_id and segment_id must not be empty")
        if segment.size_bytes < self._config.alignment_bytes:
            raise InvalidArgument(f"segment {segment.segment_id!r} has {segment.size_bytes} "
                                  f"bytes; at least {self._config.alignment_bytes} are needed")
        seg = self._segments.get(segment.segment_id)
        if seg is not None and seg.node_id != node.node_id:
            raise InvalidArgument(f"segment {segment.segment_id!r} is mounted by node "
                                  f"{seg.node_id!r}")
        if seg is not None and seg.info != segment:
            raise InvalidArgument(f"segment {segment.segment_id!r} is mounted as {seg.info}")
        now = self._clock()
        if self._announcing_until is None:
            self._announcing_until = now + 2 * self._config.node_ttl_s
        n = self._nodes.get(node.node_id)
        if n is not None and n.endpoints != node:
            # Endpoints are fixed for a node process's life: new ones mean the node restarted
            # (within node_ttl_s, so it never looked dead). Its old segments are gone with it.
            for sid in list(n.segment_ids):
                self._drop_segment(self._segments[sid])
            seg = None
        if n is None:
            n = self._nodes[node.node_id] = _Node(node, now)
        n.endpoints, n.last_seen = node, now
        self._silent.discard(node.node_id)
        if keeps_manifest and n.manifest_log is None:
            n.manifest_log = []
        if seg is None:
            alloc = RangeAllocator(segment.size_bytes, self._config.alignment_bytes)
            seg = self._segments[segment.segment_id] = _Segment(node.node_id, segment, alloc)
            n.segment_ids.add(segment.segment_id)
            if segment.tier == "disk":
                self._disk_segments.add(segment.segment_id)
            if recovering:
                self._recovering.add(segment.segment_id)
        seg.manifest_log = n.manifest_log

    def unmount_segment(self, node_id: str, segment_id: str) -> None:
        """Drop a segment and every replica in it; a no-op if it is not mounted (retries)."""
        self._live_node(node_id)
        seg = self._segments.get(segment_id)
        if seg is not None and seg.node_id != node_id:
            raise InvalidArgument(f"segment {segment_id!r} is mounted by node {seg.node_id!r}")
        if seg is not None:
            self._drop_segment(seg)

    def heartbeat(self, node_id: str, take_manifest: bool = True) -> ManifestDelta | None:
        """Keep ``node_id`` alive; UnknownNode tells the node to mount its segments again.
        For a node that keeps a manifest, what changed in its segments since it was last taken
        (unless ``take_manifest`` is False: the changes go another way, ``take_manifest``)."""
        self._live_node(node_id)
        return self.take_manifest(node_id) if take_manifest else None

    def take_manifest(self, node_id: str) -> ManifestDelta | None:
        """What was committed in and dropped from the node's segments since the last take;
        None for an unknown node or one that keeps no manifest."""
        n = self._nodes.get(node_id)
        if n is None or n.manifest_log is None:
            return None
        log, n.manifest_log[:] = list(n.manifest_log), []
        return ManifestDelta([e for e in log if type(e) is ObjectRecord],
                             [e for e in log if type(e) is tuple],
                             [e for e in log if type(e) is Reservation])

    def requeue_manifest(self, node_id: str, delta: ManifestDelta) -> None:
        """Put a taken delta back in front of the node's queue (its stream broke before the
        node acknowledged it): the next take sends it again, before anything newer."""
        n = self._nodes.get(node_id)
        if n is not None and n.manifest_log is not None:
            n.manifest_log[:0] = [*delta.reserved, *delta.committed, *delta.removed]

    def nodes_with_changes(self) -> list[str]:
        """The nodes whose manifest changes have not been taken yet."""
        return [nid for nid, n in self._nodes.items() if n.manifest_log]

    def heard_from(self, node_id: str) -> bool:
        """Whether ``node_id`` is known and was heard from within a third of node_ttl_s (not
        probably dead)."""
        n = self._nodes.get(node_id)
        return n is not None and self._clock() - n.last_seen <= self._config.node_ttl_s / 3

    def announce_objects(self, node_id: str, records: Sequence[ObjectRecord],
                         done: bool = False, reserved: Sequence[Reservation] = ()
                         ) -> list[KVPoolError | None]:
        """Index again objects a node holds (after a master restart): each one is COMPLETE at
        exactly its announced extent, a replica of an indexed object of the same key, version
        and size, or refused with Conflict (overlapping extent, other version) and the node
        forgets it. ``reserved`` (with ``done``): space the previous master had handed to a
        put or freed under a lease, kept out of reuse until each one's end (``until``, on this
        master's clock); one overlapping an object is stale and ignored. ``done``: the node has
        announced everything; its recovering segments take new objects from now on."""
        n = self._live_node(node_id)
        out = [_attempt(self._announce_one, node_id, r) for r in records]
        for r in reserved:
            seg = self._segments.get(r.segment_id)
            if seg is not None and seg.node_id == node_id and r.size > 0 \
                    and seg.allocator.allocate_at(r.offset, r.size):
                self._free_later([Extent(r.segment_id, r.offset, r.size)], r.until)
        if done:
            self._recovering.difference_update(n.segment_ids)
            if not self._recovering:   # every node announced: parents not indexed never come
                for parent in [p for p in self._waiting if p not in self._objects]:
                    for child in self._waiting.pop(parent):
                        if self._waiting_for.get(child) == parent:
                            del self._waiting_for[child]
        return out

    def report_corrupt(self, keys: Sequence[str], versions: Sequence[int],
                       segment_ids: Sequence[str]) -> list[KVPoolError | None]:
        """Drop replicas whose bytes failed the checksum; an object left without replicas is
        removed. A report about another version of the key, or a replica already gone, is
        a no-op (reports race with removals and with other readers' reports)."""
        now = self._clock()
        return [_attempt(self._drop_corrupt_one, k, v, sid, now)
                for k, v, sid in zip(keys, versions, segment_ids)]

    # -- objects ----------------------------------------------------------------------------

    def put_start(self, keys: Sequence[str], sizes: Sequence[int],
                  replicas: int | None = None, parents: Sequence[str | None] | None = None
                  ) -> list[tuple[Replica, ...] | KVPoolError]:
        """Allocate replicas for each new key (PENDING); returns where to write each one.

        ``parents``: parallel to ``keys`` (or None): the key of the block each object extends,
        None or "" for none. The eviction policy learns it at PutEnd; a parent that is not
        stored by then is not linked (the object counts as a chain head).

        Raises InvalidArgument only when ``keys`` and ``sizes`` (or ``parents``) differ in
        length.
        """
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        if parents is not None and len(parents) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(parents)} parents")
        n = self._config.default_replicas if replicas is None else replicas
        now = self._clock()
        seen: set[str] = set()
        started: list[_Object] = []
        out = [_attempt(self._put_one, key, size, n, now, seen, started,
                        parents[i] if parents is not None else None)
               for i, (key, size) in enumerate(zip(keys, sizes))]
        if started:
            heapq.heappush(self._put_deadlines,
                           (now + self._config.put_timeout_s, next(self._seq), started))
        return out

    def put_end(self, keys: Sequence[str], checksums: Sequence[int | None] | None = None
                ) -> list[KVPoolError | None]:
        """Commit PENDING objects: readable and evictable from now on. ``checksums``: the
        CRC-32C of each object's bytes as the writer computed it (None: not computed)."""
        if checksums is None:
            return [_attempt(self._put_end_one, key, None) for key in keys]
        if len(checksums) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(checksums)} checksums")
        return [_attempt(self._put_end_one, key, c) for key, c in zip(keys, checksums)]

    def put_revoke(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        """Abandon PENDING objects; their space is free at once (the writer says it stopped)."""
        return [_attempt(self._put_revoke_one, key) for key in keys]

    def get_replicas(self, keys: Sequence[str]) -> list[ObjectView | KVPoolError]:
        """Where each complete object lives; each one found is leased for ``lease_ttl_s``."""
        return [r if isinstance(r, KVPoolError) else
                ObjectView(key, r[0], r[1], tuple(self._replica(Extent(sid, offset, r[0]))
                                                  for sid, offset in r[2]), r[3])
                for key, r in zip(keys, self.locate(keys))]

    def locate(self, keys: Sequence[str]
               ) -> list[tuple[int, int, tuple[tuple[str, int], ...], int | None] | KVPoolError]:
        """``get_replicas`` in raw form: per key ``(size, version, ((segment_id, offset), ...),
        checksum)`` or the error (:meth:`locate_columns` key by key).
        :meth:`replica_in` describes each segment."""
        c = self.locate_columns(keys)
        out: list = []
        decode, places = checksum.decode, zip(c.segment_ids, c.offsets)
        for i, count in enumerate(c.counts):
            error = c.errors.get(i)
            out.append(error if error is not None else
                       (c.sizes[i], c.versions[i], tuple(itertools.islice(places, count)),
                        decode(c.checksums[i])))
        return out

    def locate_columns(self, keys: Sequence[str]) -> LocatedColumns:
        """Where each complete object lives, in columns (GetReplicas' form): each one found is
        leased for ``lease_ttl_s``, touched in the eviction order and counted as a hit; a miss
        is counted and explained in ``errors``. The per-key work is done by comprehensions
        over the objects found, not a tuple per key: a lookup of a prompt is hundreds."""
        now = self._clock()
        lease_until = now + self._config.lease_ttl_s
        get, touch = self._objects.get, self._policy.on_access
        disk = self._disk_segments
        # None: a miss, explained in ``errors``. Keys are strs, the index's keys too: any
        # other hashable key finds nothing (and an unhashable one is looked at alone).
        try:
            objs: list[_Object | None] = list(map(get, keys))
        except TypeError:
            objs = [get(k) if isinstance(k, str) else None for k in keys]
        errors: dict[int, KVPoolError] = {}
        for i, obj in enumerate(objs):
            if obj is None or obj.state is not COMPLETE:   # only the misses learn why
                errors[i] = _attempt(self._get_one, keys[i], now)
                objs[i] = None
                continue
            if obj.lease_until < lease_until:   # noqa: PLR1730 (max() costs a call per key)
                obj.lease_until = lease_until
            if disk:   # a read may promote: touch in order, as locate does
                touch(obj.key)
                if obj.segment_id in disk or obj.more:
                    self._note_disk_read(obj, now)
        found = [o for o in objs if o is not None] if errors else objs
        if not disk:   # the indexed strs, not the request's equal copies
            self._policy.on_access_many([o.key for o in found])
        self._hits += len(found)
        present = checksum.PRESENT   # checksum.encode, inlined
        if errors:   # a miss holds zeros (and no replica) in its slot
            sizes = [0 if o is None else o.size for o in objs]
            versions = [0 if o is None else o.version for o in objs]
            sums = [0 if o is None or o.checksum is None else present | o.checksum
                    for o in objs]
        else:
            sizes = [o.size for o in found]
            versions = [o.version for o in found]
            sums = [0 if o.checksum is None else present | o.checksum for o in found]
        if any(o.more for o in found):   # extra replicas (rare): built key by key
            counts = [0 if o is None else 1 + len(o.more) for o in objs]
            segment_ids, offsets = [], []
            for o in found:
                segment_ids.append(o.segment_id)
                offsets.append(o.offset)
                segment_ids += [e.segment_id for e in o.more]
                offsets += [e.offset for e in o.more]
        else:
            counts = [0 if o is None else 1 for o in objs] if errors else [1] * len(found)
            segment_ids = [o.segment_id for o in found]
            offsets = [o.offset for o in found]
        return LocatedColumns(errors, sizes, versions, sums, counts, segment_ids, offsets)

    def replica_in(self, segment_id: str, offset: int = 0, length: int = 0) -> Replica:
        """The descriptor of ``[offset, offset + length)`` in a mounted segment."""
        return self._replica(Extent(segment_id, offset, length))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is a complete object (no lease, no LRU touch, no hit counted)."""
        return [isinstance(k, str) and (o := self._objects.get(k)) is not None
                and o.state is COMPLETE for k in keys]

    def remove(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        """Remove complete objects; a leased one vanishes now but its space waits for the lease."""
        now = self._clock()
        return [_attempt(self._remove_one, key, now) for key in keys]

    def pin(self, keys: Sequence[str], ttl_s: float | None = None
            ) -> list[KVPoolError | None]:
        """Pin complete objects (not against remove or node loss).

        ``ttl_s=None``: a hard pin: never evicted nor demoted, until ``unpin``; all hard pins
        together hold at most ``pin_quota_fraction`` of the cluster's capacity (NoSpace past
        it). ``ttl_s > 0``: a soft pin for that long: evicted (or demoted) only after every
        unpinned candidate; pinning again extends it. A hard-pinned object stays hard."""
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgument(f"a soft pin needs a ttl_s > 0, not {ttl_s!r}")
        now = self._clock()
        return [_attempt(self._pin_one, key, ttl_s, now) for key in keys]

    def unpin(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        """Drop hard and soft pins (pins do not nest)."""
        return [_attempt(self._unpin_one, key) for key in keys]

    def stats(self, audit: bool = False) -> MasterStats:
        """Exact accounting of segments, objects and counters. ``audit``: also sum each
        segment's indexed objects one by one (``indexed_bytes``; O(objects), for checkers)."""
        def indexed(s: _Segment) -> int | None:
            if not audit:
                return None
            return sum(s.allocator.aligned_size(self._objects[k].size) for k in s.keys)

        segs = tuple(
            SegmentStats(s.node_id, s.info, s.allocator.used_bytes - s.quarantined_bytes,
                         s.quarantined_bytes, len(s.keys), self._nodes[s.node_id].endpoints,
                         indexed_bytes=indexed(s))
            for s in self._segments.values())
        return MasterStats(segs, len(self._objects) - self._pending, self._pending,
                           self._hits, self._misses, self._evictions, len(self._nodes),
                           self._demotions, self._promotions)

    def tick(self) -> list[tuple[str, float, int]]:
        """Expire silent nodes, reclaim timed-out puts, run due frees, evict above watermarks.
        Returns the nodes expired now: (node id, seconds silent, objects left without any
        replica and so dropped with it)."""
        now = self._clock()
        expired = self._expire_nodes(now)
        self._end_tombstones(now)
        self._reclaim_pending(now)
        self._expire_moves(now)
        self._expire_soft_pins(now)
        self._release_deferred(now)
        self._evict_above_watermark(now)
        return expired

    # -- per-key operations -----------------------------------------------------------------

    def _put_one(self, key: str, size: int, n: int, now: float, seen: set[str],
                 started: list[_Object], parent: str | None = None) -> tuple[Replica, ...]:
        validate_key(key)
        # Before any other check, so a repeated key is refused whatever happened to the first.
        if key in seen:
            raise AlreadyExists(f"{key!r} appears more than once in this put")
        seen.add(key)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidArgument(f"{key!r}: size must be an int >= 1, not {size!r}")
        if not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"replicas must be >= 1, not {n!r}")
        if parent:
            validate_key(parent)
            if parent == key:
                raise InvalidArgument(f"{key!r} names itself as its parent")
        if key in self._objects:
            raise AlreadyExists(f"{key!r} already exists")
        segments = self._open_segments(n)
        nodes = {s.node_id for s in segments}
        if len(nodes) < n:
            raise NoSpace(f"{key!r}: {n} replicas asked but only {len(nodes)} live nodes "
                          "have segments")
        fits = [s for s in segments
                if s.allocator.capacity_bytes >= s.allocator.aligned_size(size)]
        if not fits:
            raise ValueTooLarge(f"{key!r}: {size} bytes is larger than every segment")
        if len({s.node_id for s in fits}) < n:
            # Checked up front: otherwise eviction would flush the cache for a put that can
            # never succeed.
            raise NoSpace(f"{key!r}: fewer than {n} nodes have a segment of {size} bytes")
        extents = self._place(size, n, fits, now)
        if extents is None:
            raise NoSpace(f"{key!r}: no room for {size} bytes x{n}, even after eviction: "
                          + self._space_summary(segments))
        if len(self._sizes) < _MAX_SHARED_SIZES:
            size = self._sizes.setdefault(size, size)
        obj = _Object(key, size, next(self._versions), extents[0].segment_id, extents[0].offset,
                      tuple(extents[1:]), parent=parent or None)
        self._objects[key] = obj
        # Until its writer is surely done (its put reclaimed, then quarantined), a restarted
        # master must not hand this space out: the nodes keep a reservation of it.
        until = now + self._config.put_timeout_s + self._config.quarantine_s
        for e in extents:
            seg = self._segments[e.segment_id]
            seg.keys.add(key)
            if seg.manifest_log is not None:
                seg.manifest_log.append(Reservation(key, e.segment_id, e.offset, e.length, until))
        self._pending += 1
        started.append(obj)
        return self._replicas(obj)

    def space_summary(self) -> str:
        """How much room the cluster has for new objects, for a NoSpace message."""
        return self._space_summary(self._open_segments())

    def _space_summary(self, segments) -> str:
        segments = list(segments)
        free = sum(s.allocator.free_bytes - s.quarantined_bytes for s in segments)
        total = sum(s.allocator.capacity_bytes for s in segments)
        largest = max((s.allocator.largest_free_bytes for s in segments), default=0)
        # What is left is held by pending, pinned or leased objects, which are never evicted.
        return (f"the cluster has {free} of {total} bytes free in {len(segments)} segments "
                f"(largest free range {largest} bytes), the rest held by objects that are "
                f"pending, pinned or leased ({self._pending} pending)")

    def _open_segments(self, replicas: int = 1):
        """The segments new objects may go to: all but those still being announced, and
        those of nodes gone silent unless ``replicas`` distinct nodes need them."""
        if not self._recovering and not self._silent:
            return self._segments.values()
        open_ = [s for sid, s in self._segments.items() if sid not in self._recovering]
        if self._silent:
            fresh = [s for s in open_ if s.node_id not in self._silent]
            if len({s.node_id for s in fresh}) >= replicas:
                return fresh
        return open_

    def _place(self, size: int, n: int, fits: list[_Segment], now: float) -> list[Extent] | None:
        extents = choose_segments(self._open_segments(n), size, n)
        if extents is not None:
            return extents
        # Only objects with a replica in a segment that could hold this one make room for it,
        # and only a node's last tier drops data (a tier above it demotes instead: tick).
        fit_ids = {s.info.segment_id for s in fits if self._lower_tier(s) is None}
        if not fit_ids:
            return None
        for key in self._victims(now, fit_ids):
            obj = self._objects.get(key)
            if obj is None or not self._evictable(obj, now):
                continue
            if not any(e.segment_id in fit_ids for e in obj.replicas):
                continue
            self._evict(obj)
            extents = choose_segments(self._open_segments(n), size, n)
            if extents is not None:
                return extents
        return None

    def _get_one(self, key: str, now: float
                 ) -> tuple[int, int, tuple[tuple[str, int], ...], int | None]:
        try:
            obj = self._complete(key)
        except ObjectNotFound:
            self._misses += 1
            raise
        self._hits += 1
        obj.lease_until = max(obj.lease_until, now + self._config.lease_ttl_s)
        self._policy.on_access(obj.key)   # the indexed str, not the request's equal copy
        where = ((obj.segment_id, obj.offset),)
        if obj.more:
            where += tuple((e.segment_id, e.offset) for e in obj.more)
        return obj.size, obj.version, where, obj.checksum

    def _put_end_one(self, key: str, checksum: int | None) -> None:
        obj = self._pending_object(key)
        obj.state = COMPLETE
        obj.checksum = checksum
        self._pending -= 1
        # The indexed strs, not the request's equal copies. A parent not stored yet (still
        # pending, or put later) is waited for, up to _MAX_WAITING children: linked when it
        # comes; meanwhile this block is a chain head to the policy (it can go first).
        parent = self._objects.get(obj.parent) if obj.parent else None
        if parent is not None and parent.state is COMPLETE:
            link: str | None = parent.key
        else:
            link = obj.parent if obj.parent and self._may_wait() else None
        # Put straight to disk (DRAM was full), the block waits there for its parent.
        self._track(obj.key, link, obj.segment_id in self._disk_segments)
        # The manifest records keep the parent named (linked again after a master restart);
        # the index does not: the records go to the nodes with the next heartbeat.
        named, obj.parent = obj.parent, None
        for e in obj.replicas:
            log = self._segments[e.segment_id].manifest_log
            if log is not None:
                log.append(ObjectRecord(obj.key, e.segment_id, e.offset, obj.size, checksum,
                                        obj.version, named))

    def _announce_one(self, node_id: str, r: ObjectRecord) -> None:
        validate_key(r.key)
        seg = self._segments.get(r.segment_id)
        if seg is None or seg.node_id != node_id:
            raise Conflict(f"{r.key!r}: segment {r.segment_id!r} is not mounted by {node_id!r}")
        obj = self._objects.get(r.key)
        extent = Extent(r.segment_id, r.offset, r.size)
        if obj is not None and (obj.state is not COMPLETE or obj.version != r.version
                                or obj.size != r.size or obj.checksum != r.checksum):
            raise Conflict(f"{r.key!r}: indexed as another object")
        if obj is None and self._tombstones.get(r.key) == r.version:
            raise Conflict(f"{r.key!r}: removed or evicted since this master started")
        if obj is None and r.segment_id in self._expired_segments:
            raise Conflict(f"{r.key!r}: not indexed since its node was declared dead (removed, "
                           "evicted, or it had no other replica)")
        if obj is not None and extent in obj.replicas:
            return   # announced again (a node retrying a batch whose answer it lost)
        if obj is not None and any(e.segment_id == r.segment_id for e in obj.replicas):
            raise Conflict(f"{r.key!r}: already has a replica in {r.segment_id!r}")
        if r.size < 1 or not seg.allocator.allocate_at(r.offset, r.size):
            raise Conflict(f"{r.key!r}: extent {r.offset}+{r.size} in {r.segment_id!r} overlaps "
                           "another object or lies outside the segment")
        seg.keys.add(r.key)
        if obj is not None:   # another node's replica of it was announced first
            obj.replicas = [*obj.replicas, extent]
            self._announce_pin(obj, r)
            return
        size = self._sizes.setdefault(r.size, r.size) if len(self._sizes) < _MAX_SHARED_SIZES \
            else r.size
        obj = _Object(r.key, size, r.version, r.segment_id, r.offset, state=COMPLETE,
                      checksum=r.checksum)
        self._objects[r.key] = obj
        # Linked to its parent as before the restart; a parent not announced yet (on another
        # node, later in the batch) links its children when it comes.
        parent = self._objects.get(r.parent) if r.parent else None
        self._track(obj.key, parent.key if parent is not None else r.parent,
                    r.segment_id in self._disk_segments)
        # Versions stay unique per key across the restart: new ones come after every announced.
        nxt = next(self._versions)
        self._versions = itertools.count(max(nxt, r.version + 1))
        self._announce_pin(obj, r)

    def _announce_pin(self, obj: _Object, r: ObjectRecord) -> None:
        """Hard-pin an announced object recorded as pinned. Not checked against the quota:
        it was granted within it, and after a master restart the quota counts only the
        segments mounted so far (the rest come with nodes still to announce)."""
        if r.pinned and not obj.pinned:
            self._pin_one(obj.key, None, self._clock(), quota=False)

    def _drop_corrupt_one(self, key: str, version: int, segment_id: str, now: float) -> None:
        validate_key(key)
        obj = self._objects.get(key)
        if obj is None or obj.state is not COMPLETE or obj.version != version:
            return
        bad = [e for e in obj.replicas if e.segment_id == segment_id]
        if not bad:
            return
        seg = self._segments[segment_id]
        obj.replicas = [e for e in obj.replicas if e.segment_id != segment_id]
        seg.keys.discard(key)
        if seg.manifest_log is not None:
            seg.manifest_log.append((key, version))
        # Other readers may be copying it under their lease: reuse only after that.
        self._free_later(bad, max(now, obj.lease_until))
        if not obj.replicas:
            self._tombstone(obj)
            self._unindex(obj)

    def _put_revoke_one(self, key: str) -> None:
        obj = self._pending_object(key)
        self._unindex(obj)
        self._free_now(obj.replicas)

    def _remove_one(self, key: str, now: float) -> None:
        obj = self._complete(key)
        self._tombstone(obj)
        self._unindex(obj)
        if obj.lease_until > now:
            # A reader may still be copying these bytes: reuse only after its lease.
            self._free_later(obj.replicas, obj.lease_until)
        else:
            self._free_now(obj.replicas)

    def _pin_one(self, key: str, ttl_s: float | None, now: float, quota: bool = True) -> None:
        obj = self._complete(key)
        if ttl_s is not None:
            if not obj.pinned:
                until = max(now + ttl_s, self._soft_pins.get(obj.key, 0.0))
                self._soft_pins[obj.key] = until
                heapq.heappush(self._soft_pin_expiry, (until, obj.key))
            return
        if obj.pinned:
            return
        size = self._pin_size(obj)
        limit = self._config.pin_quota_fraction * sum(
            s.allocator.capacity_bytes for s in self._segments.values())
        if quota and self._hard_pinned_bytes + size > limit:
            raise NoSpace(f"{key!r}: hard pins would hold {self._hard_pinned_bytes + size} "
                          f"bytes, over the quota of {int(limit)} (pin_quota_fraction "
                          f"{self._config.pin_quota_fraction} of the capacity); unpin some, "
                          "or pin with a ttl_s (a soft pin)")
        obj.pinned = True
        self._hard_pinned_bytes += size
        self._soft_pins.pop(obj.key, None)
        self._log_records(obj)

    def _unpin_one(self, key: str) -> None:
        obj = self._complete(key)
        if obj.pinned:
            obj.pinned = False
            self._hard_pinned_bytes -= self._pin_size(obj)
            self._log_records(obj)
        self._soft_pins.pop(obj.key, None)

    def _log_records(self, obj: _Object) -> None:
        """Tell the nodes holding ``obj`` its record again (a hard pin came or went): it
        supersedes the one their manifests hold, by key."""
        parent = self._parent_of(obj.key, obj.segment_id in self._disk_segments)
        for e in obj.replicas:
            log = self._segments[e.segment_id].manifest_log
            if log is not None:
                log.append(ObjectRecord(obj.key, e.segment_id, e.offset, obj.size,
                                        obj.checksum, obj.version, parent, obj.pinned))

    def _pin_size(self, obj: _Object) -> int:
        """What a hard pin of ``obj`` counts against the quota: its size (replicas come and
        go with nodes; the count must not drift)."""
        return obj.size

    def _victims(self, now: float, segment_ids):
        """Candidates with a replica in ``segment_ids`` possibly: those on disk (if any of
        them is a disk segment) by LRU, then the policy's; soft-pinned ones (still within their
        TTL) after all others: a soft pin is evicted last, not never."""
        disk = self._disk_segments
        walks = []
        if any(sid in disk for sid in segment_ids):
            walks.append(self._disk_policy.candidates())
        if any(sid not in disk for sid in segment_ids):
            walks.append(self._policy.candidates())
        candidates = itertools.chain.from_iterable(walks)
        if not self._soft_pins:
            yield from candidates
            return
        deferred = []
        for key in candidates:
            if self._soft_pins.get(key, 0.0) > now:
                deferred.append(key)
            else:
                yield key
        yield from deferred

    def _expire_soft_pins(self, now: float) -> None:
        heap = self._soft_pin_expiry
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            if self._soft_pins.get(key) == until:   # not extended since
                del self._soft_pins[key]

    # -- tick steps -------------------------------------------------------------------------

    def _expire_nodes(self, now: float) -> list[tuple[str, float, int]]:
        ttl = self._config.node_ttl_s
        silent = {k for k, n in self._nodes.items() if now - n.last_seen > ttl / 3}
        self._silent = silent if len(silent) < len(self._nodes) else set()
        expired = []
        for node_id in [k for k, n in self._nodes.items() if now - n.last_seen > ttl]:
            self._silent.discard(node_id)
            self._expired_segments.update(self._nodes[node_id].segment_ids)
            before = len(self._objects)
            for seg_id in list(self._nodes[node_id].segment_ids):
                self._drop_segment(self._segments[seg_id])
            expired.append((node_id, now - self._nodes[node_id].last_seen,
                            before - len(self._objects)))
            del self._nodes[node_id]
            self._outbox.pop(node_id, None)
        return expired

    def _reclaim_pending(self, now: float) -> None:
        while self._put_deadlines and self._put_deadlines[0][0] <= now:
            _, _, started = heapq.heappop(self._put_deadlines)
            for obj in started:
                if self._objects.get(obj.key) is not obj or obj.state is not PENDING:
                    continue   # committed, revoked or lost since: nothing to reclaim
                self._unindex(obj)
                # The writer may still be writing into these extents: keep them out of reuse.
                self._free_later(obj.replicas, now + self._config.quarantine_s)

    def _release_deferred(self, now: float) -> None:
        while self._deferred and self._deferred[0][0] <= now:
            _, _, entries = heapq.heappop(self._deferred)
            for seg, ext in entries:
                # A dropped segment took its space with it (a re-mount of its id is a new
                # segment with a new allocator); only its quarantine count would change.
                if self._segments.get(ext.segment_id) is seg:
                    seg.quarantined_bytes -= seg.allocator.aligned_size(ext.length)
                    seg.allocator.free(ext.offset, ext.length)

    def _evict_above_watermark(self, now: float) -> None:
        """Bring every segment above its high watermark down to its low one, in policy order:
        a segment with a lower tier on its node demotes (a move); a node's last tier drops.
        Objects being moved count as gone from their source already."""
        def fuller_than(seg: _Segment, mark: float) -> bool:
            used = seg.allocator.used_bytes - seg.moving_out_bytes
            return used > mark * seg.allocator.capacity_bytes

        # Hysteresis across ticks: a segment past its high watermark drains down to its low one
        # even when that takes several ticks (demotions complete asynchronously, and a chain
        # block becomes a victim only once its children went down).
        for s in self._segments.values():
            if fuller_than(s, self._config.high_watermark):
                s.draining = True
            elif s.draining and not fuller_than(s, self._config.low_watermark):
                s.draining = False
        hot = {sid for sid, s in self._segments.items() if s.draining}
        for _ in range(2):   # again if a demotion found its lower tier full: that one drops
            if not hot:
                return
            full: set[str] = set()
            for key in self._victims(now, hot):
                obj = self._objects.get(key)
                if obj is None or obj.state is not COMPLETE or obj.pinned:
                    continue
                touched = [e for e in obj.replicas if e.segment_id in hot]
                if not touched:
                    continue
                segs = [self._segments[e.segment_id] for e in touched]
                lower = [self._lower_tier(seg) for seg in segs]
                if None in lower:   # a last tier: the object goes (all of it, as before)
                    if self._evictable(obj, now):
                        self._evict(obj)
                # One move per object at a time: its first hot replica goes first.
                elif key not in self._moving and not self._start_move(
                        obj, touched[0], segs[0], lower[0], now):
                    full.add(lower[0].info.segment_id)
                for seg in segs:
                    if not fuller_than(seg, self._config.low_watermark):
                        hot.discard(seg.info.segment_id)
                        seg.draining = False
                if not hot:
                    break
            hot |= full

    # -- tiers ------------------------------------------------------------------------------
    #
    # A node with segments of several tiers (hbm, dram, disk) keeps its objects in the fastest
    # one with room; a tier above its high watermark demotes its policy-order victims one tier
    # down, and a disk object read twice within ``promote_window_s`` is promoted one tier up.
    # A move is an instruction (``take_moves``, sent with the node's heartbeat answer) to copy
    # the bytes into an extent allocated here; the index switches to the copy only when the
    # node reports it done (``moves_finished``), and the source is freed once no lease granted
    # on it can still be read under: a reader never sees a half-copied replica.

    def take_moves(self, node_id: str) -> list[Move]:
        """The moves ``node_id`` is to make (each is handed out once)."""
        return self._outbox.pop(node_id, [])

    def moves_finished(self, node_id: str, done: Sequence[int] = (),
                       failed: Sequence[int] = ()) -> None:
        """``node_id`` copied the moves ``done`` (the index switches to their destinations) and
        gave up on ``failed`` (their destinations are freed). Unknown ids (expired, another
        node's) are ignored."""
        now = self._clock()
        for ok, ids in ((True, done), (False, failed)):
            for move_id in ids:
                m = self._moves.get(move_id)
                if m is not None and m.src_seg.node_id == node_id:
                    self._finish_move(move_id, ok, now)

    def _note_disk_read(self, obj: _Object, now: float) -> None:
        """``obj`` was read and may have replicas on disk: the second read within the window
        promotes one of them (the first whose node has room above it)."""
        on_disk = [e for e in obj.replicas if e.segment_id in self._disk_segments]
        if not on_disk:
            return
        self._disk_policy.on_access(obj.key)
        seen = self._disk_reads.pop(obj.key, None)
        if seen is None or now - seen > self._config.promote_window_s:
            if len(self._disk_reads) > 65536:   # bounded: forget reads older than the window
                cutoff = now - self._config.promote_window_s
                self._disk_reads = {k: t for k, t in self._disk_reads.items() if t >= cutoff}
            self._disk_reads[obj.key] = now
            return
        if obj.key in self._moving:
            return
        for src in on_disk:
            src_seg = self._segments[src.segment_id]
            upper = self._upper_tier(src_seg)
            if upper is None:
                continue
            alloc = upper.allocator
            # Only into room below the high watermark: a promotion must not cause a demotion.
            if alloc.used_bytes + alloc.aligned_size(obj.size) <= \
                    self._config.high_watermark * alloc.capacity_bytes and \
                    self._start_move(obj, src, src_seg, upper, now):
                return

    def _start_move(self, obj: _Object, src: Extent, src_seg: _Segment, dst_seg: _Segment,
                    now: float) -> bool:
        """Allocate the destination and queue the instruction; False if it has no room."""
        offset = dst_seg.allocator.allocate(obj.size)
        if offset is None:
            return False
        dst = Extent(dst_seg.info.segment_id, offset, obj.size)
        move_id = next(self._seq)
        self._moves[move_id] = _MoveInFlight(obj, src, dst, src_seg, dst_seg,
                                             now + self._config.put_timeout_s)
        self._moving[obj.key] = move_id
        src_seg.moving_out_bytes += src_seg.allocator.aligned_size(obj.size)
        self._outbox.setdefault(src_seg.node_id, []).append(
            Move(move_id, obj.key, obj.version, src, dst))
        return True

    def _finish_move(self, move_id: int, ok: bool, now: float) -> None:
        m = self._moves.pop(move_id)
        obj = m.obj
        if self._moving.get(obj.key) == move_id:
            del self._moving[obj.key]
        m.src_seg.moving_out_bytes -= m.src_seg.allocator.aligned_size(m.src.length)
        dst_live = self._segments.get(m.dst.segment_id) is m.dst_seg
        if ok and dst_live and self._objects.get(obj.key) is obj and m.src in obj.replicas:
            was_on_disk = obj.segment_id in self._disk_segments
            obj.replicas = [m.dst if e == m.src else e for e in obj.replicas]
            if (obj.segment_id in self._disk_segments) != was_on_disk:
                # Down to disk: its parent may become demotable; there it links to its parent
                # once that comes down too (a chain is dropped from disk tail first). Back up:
                # linked again to its parent in DRAM.
                parent = self._parent_of(obj.key, was_on_disk)
                (self._disk_policy if was_on_disk else self._policy).on_remove(obj.key)
                self._waiting_for.pop(obj.key, None)
                self._track(obj.key, parent, not was_on_disk)
            # A new version: a reader whose read outlived its lease checks the version it read
            # against the index's, and the source may be reused by then.
            obj.version = next(self._versions)
            m.src_seg.keys.discard(obj.key)
            m.dst_seg.keys.add(obj.key)
            if m.dst_seg.manifest_log is not None:   # supersedes the source's record (by key)
                m.dst_seg.manifest_log.append(ObjectRecord(
                    obj.key, m.dst.segment_id, m.dst.offset, obj.size, obj.checksum,
                    obj.version, self._parent_of(obj.key, obj.segment_id in self._disk_segments),
                    obj.pinned))
            # Readers granted the source may still be copying from it: reuse after the lease.
            self._free_later([m.src], max(now, obj.lease_until))
            if TIER_RANK[m.dst_seg.info.tier] > TIER_RANK[m.src_seg.info.tier]:
                self._demotions += 1
            else:
                self._promotions += 1
                self._disk_reads.pop(obj.key, None)
        elif dst_live:   # the node is done with the destination either way
            self._free_now([m.dst])

    def _expire_moves(self, now: float) -> None:
        """Give up on moves not reported within ``put_timeout_s`` (a node that died or
        restarted): the destination is freed after the quarantine, as a write may linger."""
        expired = [i for i, m in self._moves.items() if m.deadline <= now]
        if not expired:
            return
        gone = set(expired)
        for node_id, moves in list(self._outbox.items()):   # never handed out now: too late
            self._outbox[node_id] = [m for m in moves if m.move_id not in gone]
        for move_id in expired:
            m = self._moves.pop(move_id)
            if self._moving.get(m.obj.key) == move_id:
                del self._moving[m.obj.key]
            m.src_seg.moving_out_bytes -= m.src_seg.allocator.aligned_size(m.src.length)
            if self._segments.get(m.dst.segment_id) is m.dst_seg:
                self._free_later([m.dst], now + self._config.quarantine_s)

    def _track(self, key: str, parent: str | None, disk: bool) -> None:
        """Hand a complete object to its tier's policy, linked to ``parent`` if that one is
        there, else waiting for it; children waiting for ``key`` there are linked now."""
        policy = self._disk_policy if disk else self._policy
        if parent is not None and parent in policy:
            policy.on_insert(key, parent)
        else:
            policy.on_insert(key)
            if parent is not None:
                kids = self._waiting.setdefault(parent, [])
                if key not in kids:
                    kids.append(key)
                self._waiting_for[key] = parent
        kids = self._waiting.pop(key, None) if self._waiting else None
        if kids:
            left = []
            for child in kids:
                if self._waiting_for.get(child) != key:
                    continue   # gone, or linked since
                if policy.link(child, key) or child in policy:
                    del self._waiting_for[child]
                else:   # on the other tier: waits for this block to come there
                    left.append(child)
            if left:
                self._waiting[key] = left

    def _may_wait(self) -> bool:
        """Room for one more child waiting for its parent (entries of children that left
        are pruned first when the table is full)."""
        if len(self._waiting_for) < _MAX_WAITING and len(self._waiting) < _MAX_WAITING:
            return True
        waiting_for = self._waiting_for
        self._waiting = {p: live for p, kids in self._waiting.items()
                         if (live := [c for c in kids if waiting_for.get(c) == p])}
        return len(waiting_for) < _MAX_WAITING and len(self._waiting) < _MAX_WAITING

    def _parent_of(self, key: str, disk: bool) -> str | None:
        """The parent ``key`` is linked to or waits for, in its tier's policy."""
        linked = (self._disk_policy if disk else self._policy).parent_of(key)
        if linked is not None:
            return linked
        return self._waiting_for.get(key) if self._waiting_for else None

    def _lower_tier(self, seg: _Segment) -> _Segment | None:
        """The roomiest segment of the next tier down on ``seg``'s node; None: a last tier."""
        return self._neighbour_tier(seg, +1)

    def _upper_tier(self, seg: _Segment) -> _Segment | None:
        return self._neighbour_tier(seg, -1)

    def _neighbour_tier(self, seg: _Segment, step: int) -> _Segment | None:
        rank = TIER_RANK[seg.info.tier]
        best: _Segment | None = None
        best_rank = 0
        for sid in self._nodes[seg.node_id].segment_ids:
            other = self._segments[sid]
            r = TIER_RANK[other.info.tier]
            if (r - rank) * step <= 0 or sid in self._recovering:
                continue
            if best is None or (r - best_rank) * step < 0 or (
                    r == best_rank and other.allocator.free_bytes > best.allocator.free_bytes):
                best, best_rank = other, r
        return best

    # -- helpers ----------------------------------------------------------------------------

    def _live_node(self, node_id: str) -> _Node:
        n = self._nodes.get(node_id)
        if n is None:
            raise UnknownNode(f"node {node_id!r} is not known; mount its segments again")
        n.last_seen = self._clock()
        self._silent.discard(node_id)
        return n

    def _complete(self, key: str) -> _Object:
        validate_key(key)
        obj = self._objects.get(key)
        if obj is None or obj.state is not COMPLETE:   # readers never see PENDING objects
            raise ObjectNotFound(f"{key!r} not found")
        return obj

    def _pending_object(self, key: str) -> _Object:
        validate_key(key)
        obj = self._objects.get(key)
        if obj is None or obj.state is not PENDING:
            raise NotPending(f"{key!r} is not being put (timed out, revoked or complete)")
        return obj

    def _evictable(self, obj: _Object, now: float) -> bool:
        return obj.state is COMPLETE and not obj.pinned and obj.lease_until <= now

    def _evict(self, obj: _Object) -> None:
        self._tombstone(obj)
        self._unindex(obj)
        self._free_now(obj.replicas)   # not leased, so no reader can be in flight
        self._evictions += 1
        if self._on_evict is not None:
            self._on_evict(obj.key, obj.version)

    def _replicas(self, obj: _Object) -> tuple[Replica, ...]:
        # Endpoints are looked up now, so a node that re-mounted with new ones is reached there.
        return tuple(self._replica(e) for e in obj.replicas)

    def _replica(self, e: Extent) -> Replica:
        seg = self._segments[e.segment_id]
        info = seg.info   # carries the segment's RDMA region (rkey 0 = none) into the descriptor
        return Replica(self._nodes[seg.node_id].endpoints, e, rdma_addr=info.rdma_addr,
                       rdma_rkey=info.rdma_rkey,
                       rdma_length=info.size_bytes if info.rdma_rkey else 0, tier=info.tier)

    def _tombstone(self, obj: _Object) -> None:
        """Remember ``obj`` gone while nodes may still announce it (see _tombstones)."""
        if self._recovering or (self._announcing_until is not None
                                and self._clock() < self._announcing_until):
            self._tombstones[obj.key] = obj.version

    def _end_tombstones(self, now: float) -> None:
        if self._tombstones and not self._recovering and self._announcing_until is not None \
                and now >= self._announcing_until:
            self._tombstones.clear()

    def _unindex(self, obj: _Object) -> None:
        """Forget ``obj``; its extents stay allocated until the caller frees them."""
        del self._objects[obj.key]
        if obj.state is PENDING:
            self._pending -= 1
        else:
            self._policy.on_remove(obj.key)
            self._disk_policy.on_remove(obj.key)
            if self._waiting_for:
                self._waiting_for.pop(obj.key, None)   # its entry in _waiting: dropped lazily
            if self._waiting:
                for child in self._waiting.pop(obj.key, ()):
                    if self._waiting_for.get(child) == obj.key:
                        del self._waiting_for[child]
            if obj.pinned:
                self._hard_pinned_bytes -= self._pin_size(obj)
            if self._soft_pins:
                self._soft_pins.pop(obj.key, None)
        for e in obj.replicas:
            seg = self._segments[e.segment_id]
            seg.keys.discard(obj.key)
            if seg.manifest_log is not None and obj.state is COMPLETE:
                seg.manifest_log.append((obj.key, obj.version))

    def _free_now(self, extents: list[Extent]) -> None:
        for e in extents:
            self._segments[e.segment_id].allocator.free(e.offset, e.length)

    def _free_later(self, extents: list[Extent], free_at: float) -> None:
        entries = [(self._segments[e.segment_id], e) for e in extents]
        for seg, e in entries:
            seg.quarantined_bytes += seg.allocator.aligned_size(e.length)
            if seg.manifest_log is not None:   # so that a restarted master waits as well
                seg.manifest_log.append(Reservation("", e.segment_id, e.offset, e.length,
                                                    free_at))
        heapq.heappush(self._deferred, (free_at, next(self._seq), entries))

    def _drop_segment(self, seg: _Segment) -> None:
        """Forget a segment: its replicas go, and objects left without replicas vanish."""
        sid = seg.info.segment_id
        del self._segments[sid]
        self._recovering.discard(sid)
        self._disk_segments.discard(sid)
        self._nodes[seg.node_id].segment_ids.discard(sid)
        for key in seg.keys:
            obj = self._objects[key]
            obj.replicas = [e for e in obj.replicas if e.segment_id != sid]
            if not obj.replicas:
                self._unindex(obj)


def _attempt(op: Callable[..., T], *args: object) -> T | KVPoolError:
    """``op(*args)``, or the KVPoolError it raised: one slot of a batch answer."""
    try:
        return op(*args)
    except KVPoolError as e:
        return e
