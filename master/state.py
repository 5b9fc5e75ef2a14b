"""The master's authoritative index, sans-IO: one method per RPC plus ``tick``.

No grpc, no asyncio, no threads: the servicer calls these methods from one event loop, and time
comes from an injected clock, so every rule below is tested with a hand-advanced fake clock.

Batch methods return one result per key, in order; per-key errors are exception *instances*
in the result list, never raised, so one bad key fails only its own slot.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvpool.common.config import MasterConfig, parse_quotas
from kvpool.common.errors import (
    AlreadyExists,
    Conflict,
    InvalidArgument,
    KVPoolError,
    NoSpace,
    ObjectNotFound,
    QuotaExceeded,
    ValueTooLarge,
)
from kvpool.common.tenants import DEFAULT, MARK, tenant_of
from kvpool.common.tenants import validate_stored_key as validate_key  # keys as stored
from kvpool.common.types import (
    Extent,
    Move,
    NodeEndpoints,
    ObjectRecord,
    Replica,
    Reservation,
    SegmentInfo,
)
from kvpool.master.chains import Chains
from kvpool.master.eviction import EvictionPolicy, make_eviction_policy
from kvpool.master.index import COMPLETE, PENDING, LocatedColumns, ObjectEntry, ObjectIndex
from kvpool.master.leases import Leases, read_at
from kvpool.master.manifest_log import ManifestDelta, ManifestLog, Removal
from kvpool.master.membership import Membership, Segment
from kvpool.master.pins import Pins
from kvpool.master.placement import BatchPlacer
from kvpool.master.pressure import Pressure
from kvpool.master.quotas import TenantUsage
from kvpool.master.reads import LeaseCount, NamespaceLookups
from kvpool.master.rechecks import Rechecks
from kvpool.master.recovery import Recovery
from kvpool.master.space import Space
from kvpool.master.tiers import Tiers

T = TypeVar("T")
# Slots (PutStart ``slots``: space writers hold ahead of single puts, client/slots.py) are
# made only while puts started hold less than this share of max_pending_fraction's limit
# (the tenant's too): the rest stays for the puts themselves.
SLOT_SHARE = 0.25


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
    recovering_segments: int = 0   # segments whose node is still announcing (after a restart)
    corrupt_replicas: int = 0      # replicas dropped because their bytes failed the checksum
    silent_nodes: int = 0          # alive, not heard from within a third of node_ttl_s
    nodes_expired: int = 0         # nodes declared dead (silent for node_ttl_s) so far
    pinned_bytes: int = 0          # held by hard pins
    recovery_s: float | None = None   # how long the last re-announcement took (None: none yet)
    namespaces: tuple[tuple[str, int, int], ...] = ()   # (namespace, hits, misses)
    hit_bytes: int = 0             # sizes of the objects lookups found (handed to readers)
    committed: int = 0             # puts completed
    committed_bytes: int = 0
    leases: int = 0                # read leases granted and not expired (per key and read)
    # (tenant, objects, bytes, quota or None) of each tenant holding objects (master/quotas.py)
    tenants: tuple[tuple[str, int, int, int | None], ...] = ()


class MasterState:
    """The facade over the master's units, each owning its data: membership (nodes,
    segments), the object index, space (frees, put deadlines), chains (eviction orders),
    pins, recovery, tiers (moves), pressure (eviction) and the manifest log. An operation
    that spans several units is composed here."""

    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic,
                 policy: EvictionPolicy | None = None,
                 on_evict: Callable[[str, int], None] | None = None) -> None:
        """``policy``: the eviction order; by default the one ``config.eviction`` names
        ("prefix": a chain's tail before its parents, shared parents last, plain LRU for
        objects without a parent). ``on_evict(key, version)``: told of each object evicted
        (the server logs it, so an auditor can tell evictions from losses)."""
        self._config = config
        self._clock = clock
        self._on_evict = on_evict
        self._evictions = 0
        self._corrupt_replicas = 0
        self._nodes_expired = 0
        self._leases = LeaseCount()
        self._namespaces = NamespaceLookups(config.namespace_depth)
        self._manifests = ManifestLog()
        self._members = Membership(config)
        self._index = ObjectIndex(TenantUsage(parse_quotas(config.tenant_quotas)))
        # The two tables nearly every operation reads (membership and the index own them).
        self._segments, self._objects = self._members.segments, self._index.objects
        more = self._index.more   # the further replicas of the objects that have several
        self._space = Space(self._segments, more)
        self._pins = Pins(config, self._segments, more, self._index.tenants)
        self._leasing = Leases(config.lease_ttl_s, config.max_lease_s, self._segments,
                               self._pins.held.objects, more)
        self._pending_limit = 0.0   # bytes PENDING puts may hold, as of the current PutStart
        # Why the current PutStart's NoSpace came before any eviction, if it did (told in
        # space_summary: the put's answer carries one summary, not a message per key).
        self._refused_why: str | None = None
        # Reads are not touched in the order: the walk learns them from the read leases (see
        # PrefixAwarePolicy: a touch per key was a fifth of a batched lookup).
        ttl_s, objects = config.lease_ttl_s, self._objects

        def last_read(key: str) -> float | None:
            obj = objects.get(key)
            return None if obj is None else read_at(obj.lease, ttl_s)

        self._chains = Chains(policy if policy is not None else
                              make_eviction_policy(config.eviction, clock, last_read),
                              make_eviction_policy(config.eviction))
        self._rechecks = Rechecks()
        self._recovery = Recovery(config.node_ttl_s)
        closed = self._recovery.recovering   # no new object, nor move, goes there
        self._tiers = Tiers(config, self._members, closed, self._index, self._chains,
                            self._space, self._pins.held.objects, self._leasing)
        self._pressure = Pressure(config, self._members, closed, self._index, self._chains,
                                  self._pins, self._leasing, self._tiers, self._evict)

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
        self._members.check_mount(node, segment)
        now = self._clock()
        self._recovery.mounted(now)
        for old in self._members.restarted(node):
            self._drop_segment(old)
        if keeps_manifest:
            self._manifests.keep(node.node_id)
        if self._members.mount(node, segment, now, self._manifests.queue(node.node_id)) \
                and recovering:
            self._recovery.recover(segment.segment_id, now)

    def unmount_segment(self, node_id: str, segment_id: str) -> None:
        """Drop a segment and every replica in it; a no-op if it is not mounted (retries)."""
        self._members.touch(node_id, self._clock())
        seg = self._segments.get(segment_id)
        if seg is not None and seg.node_id != node_id:
            raise InvalidArgument(f"segment {segment_id!r} is mounted by node {seg.node_id!r}")
        if seg is not None:
            self._drop_segment(seg)

    def heartbeat(self, node_id: str, take_manifest: bool = True) -> ManifestDelta | None:
        """Keep ``node_id`` alive; UnknownNode tells the node to mount its segments again.
        For a node that keeps a manifest, what changed in its segments since it was last taken
        (unless ``take_manifest`` is False: the changes go another way, ``take_manifest``)."""
        self._members.touch(node_id, self._clock())
        return self.take_manifest(node_id) if take_manifest else None

    def take_manifest(self, node_id: str) -> ManifestDelta | None:
        """What was committed in and dropped from the node's segments since the last take;
        None for an unknown node or one that keeps no manifest."""
        return self._manifests.take(node_id)

    def requeue_manifest(self, node_id: str, delta: ManifestDelta) -> None:
        """Put a taken delta back in front of the node's queue (its stream broke before the
        node acknowledged it): the next take sends it again, before anything newer."""
        self._manifests.requeue(node_id, delta)

    def nodes_with_changes(self) -> list[str]:
        """The nodes whose manifest changes have not been taken yet."""
        return self._manifests.nodes_with_changes()

    def removals_queued(self) -> bool:
        """Whether a removal is queued for some node's manifest (not taken by it yet)."""
        return self._manifests.has_removals()

    def pending_version(self, key: str) -> int:
        """The version of ``key``'s PENDING put (its writer hands it to the nodes)."""
        return self._index.pending_entry(key).version

    def manifest_mark(self) -> int:
        """How many manifest changes were recorded so far: a call that moved it changed what
        some node's manifest must hold (the servicer then waits for the nodes to apply it)."""
        return self._manifests.recorded

    def heard_from(self, node_id: str) -> bool:
        """Whether ``node_id`` is known and was heard from within a third of node_ttl_s (not
        probably dead)."""
        return self._members.heard_from(node_id, self._clock())

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
        n = self._members.touch(node_id, self._clock())
        out = [_attempt(self._announce_one, node_id, r) for r in records]
        for r in reserved:
            seg = self._segments.get(r.segment_id)
            if seg is not None and seg.node_id == node_id and r.size > 0 \
                    and seg.allocator.allocate_at(r.offset, r.size):
                self._space.free_later([Extent(r.segment_id, r.offset, r.size)], r.until)
        if done and self._recovery.announced(n.segment_ids, self._clock()):
            # Every node announced: parents not indexed by now never come.
            self._chains.stop_waiting_for_absent(self._objects)
        return out

    def report_corrupt(self, keys: Sequence[str], versions: Sequence[int],
                       segment_ids: Sequence[str], node_id: str | None = None
                       ) -> list[KVPoolError | None]:
        """Replicas whose bytes failed the checksum. From a reader (``node_id`` None): each
        replica's node is asked to re-check it (:meth:`take_rechecks`; master/rechecks.py),
        nothing is dropped. From the node holding them (``node_id``, its own segments only,
        else InvalidArgument): the replicas are dropped; an object left without replicas is
        removed. A report about another version of the key, or a replica already gone, is
        a no-op (reports race with removals and with other readers' reports)."""
        now = self._clock()
        if node_id is None:
            return [_attempt(self._ask_recheck_one, k, v, sid)
                    for k, v, sid in zip(keys, versions, segment_ids)]
        return [_attempt(self._drop_confirmed_one, k, v, sid, node_id, now)
                for k, v, sid in zip(keys, versions, segment_ids)]

    def take_rechecks(self, node_id: str) -> list[tuple[str, int, str]]:
        """The replicas (key, version, segment id) readers reported corrupt on ``node_id``,
        for it to re-check (each handed out once)."""
        return self._rechecks.take(node_id)

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
        replica = self._members.replica
        return [r if isinstance(r, KVPoolError) else tuple(map(replica, r))
                for r in self.put_start_extents(keys, sizes, replicas, parents)]

    def put_start_extents(self, keys: Sequence[str], sizes: Sequence[int],
                          replicas: int | None = None,
                          parents: Sequence[str | None] | None = None, *, slots: bool = False
                          ) -> list[list[Extent] | KVPoolError]:
        """:meth:`put_start` with each placement as its extents (PutStart's columns are
        built from them, and segment descriptors once per segment: :meth:`replica_in`).
        ``slots``: the keys are placeholders their writer fills later with keys of its own
        (:meth:`put_end` ``as_keys``); each gets a version of its own, and no node is told
        (the writer reserves each slot at its node before writing into it)."""
        if len(keys) != len(sizes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        if parents is not None and len(parents) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(parents)} parents")
        n = self._config.default_replicas if replicas is None else replicas
        now = self._clock()
        self._leasing.expire(now)   # admission counts only the leases still running
        self._refused_why = None
        self._capacity = sum(s.allocator.capacity_bytes for s in self._segments.values())
        self._pending_limit = self._config.max_pending_fraction * self._capacity
        seen: set[str] = set()
        started: list[ObjectEntry] = []
        # One version for every object of this PutStart: a version tells one object of a key
        # from the next (a key appears once per call, and a later call gets a later version),
        # and one shared int object saves 32 bytes per indexed object over one each.
        version = self._index.new_version()
        where: dict[int, tuple] = {}   # size -> open segments and those it fits (below)
        # One size and one replica (a prompt's blocks): placed by a BatchPlacer (see _put_one).
        placing = len(keys) if n == 1 and sizes and sizes.count(sizes[0]) == len(sizes) else 0
        new_version = self._index.new_version if slots else None
        try:
            out = [_attempt(self._put_one, key, size, n, now, seen, started,
                            new_version() if new_version else version, where,
                            parents[i] if parents is not None else None, slots, placing)
                   for i, (key, size) in enumerate(zip(keys, sizes))]
        finally:
            for *_, placer in where.values():
                if placer is not None:
                    placer.release()
        if started:
            self._space.put_deadline(now + self._config.put_timeout_s, started)
        return out

    def put_end(self, keys: Sequence[str], checksums: Sequence[int | None] | None = None,
                as_keys: Sequence[str] | None = None, sizes: Sequence[int] | None = None,
                parents: Sequence[str | None] | None = None) -> list[KVPoolError | None]:
        """Commit PENDING objects: readable and evictable from now on. ``checksums``: the
        CRC-32C of each object's bytes as the writer computed it (None: not computed).
        ``as_keys`` (with ``sizes``, and ``parents`` or None): each of ``keys`` is a slot
        (:meth:`put_start_extents` ``slots``) its writer filled with the value of
        ``as_keys[i]``, of ``sizes[i]`` bytes; the slot is committed as that key, and the
        rest of its space is freed. A slot that cannot be (the key is stored, or invalid) is
        released into quarantine: its writer may have sealed the key in it at its node."""
        if as_keys is not None:
            n = len(keys)
            if checksums is None or sizes is None or len(checksums) != n \
                    or len(as_keys) != n or len(sizes) != n \
                    or (parents is not None and len(parents) != n):
                raise InvalidArgument(f"{n} slots need as many keys, sizes and checksums")
            now = self._clock()
            return [_attempt(self._fill_slot_one, slot, c, key, size,
                             parents[i] if parents is not None else None, now)
                    for i, (slot, c, key, size) in enumerate(zip(keys, checksums, as_keys,
                                                                 sizes))]
        if checksums is None:
            return [_attempt(self._put_end_one, key, None) for key in keys]
        if len(checksums) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(checksums)} checksums")
        return [_attempt(self._put_end_one, key, c) for key, c in zip(keys, checksums)]

    def put_revoke(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        """Abandon PENDING objects; their space is free at once (the writer says it stopped)."""
        return [_attempt(self._put_revoke_one, key) for key in keys]

    def locate_columns(self, keys: Sequence[str]) -> LocatedColumns:
        """Where each complete object lives, in columns (GetReplicas' form): each one found is
        leased for ``lease_ttl_s``, touched in the eviction order and counted as a hit; a miss
        is counted and explained in ``errors``."""
        now = self._clock()
        lease_until = now + self._config.lease_ttl_s
        get, touch = self._objects.get, self._chains.policy.on_access
        disk = self._members.disk_segments
        # None: a miss, explained in ``errors``. Keys are strs, the index's keys too: any
        # other hashable key finds nothing (and an unhashable one is looked at alone).
        try:
            objs: list[ObjectEntry | None] = self._index.get_many(keys)
        except TypeError:
            objs = [get(k) if isinstance(k, str) else None for k in keys]
        errors: dict[int, KVPoolError] = {}
        misses_before = self._index.misses
        # Leases (master/leases.py): a running one is extended up to its cap here; new ones
        # are opened together after the loop.
        fresh, shortest = [], lease_until
        for i, obj in enumerate(objs):
            if obj is None or obj.seal is PENDING:   # only the misses learn why
                errors[i] = self._why_missing(keys[i])
                objs[i] = None
                continue
            lease = obj.lease   # (cap, end)
            if lease is None or lease[1] <= now:
                fresh.append(obj)
            elif lease[1] < lease_until:   # not leased by this instant's reads already
                if (cap := lease[0]) < lease_until:
                    obj.lease = (cap, cap)
                    if cap < shortest:   # noqa: PLR1730 (the answer says so: readers re-check past it)
                        shortest = cap
                else:
                    obj.lease = (cap, lease_until)
            if disk:   # a read may promote: touch in order, as locate does
                touch(obj.key)
                if obj.segment_id in disk or obj in self._index.more:
                    self._tiers.note_disk_read(obj, now)
        if fresh:
            shortest = min(shortest, self._leasing.begin(fresh, now, lease_until))
        found = [o for o in objs if o is not None] if errors else objs
        if not disk and not self._chains.policy.reads_later:   # the indexed strs
            self._chains.policy.on_access_many([o.key for o in found])
        self._index.hits += len(found)
        self._leases.granted(lease_until, len(found), now)
        if keys:
            self._namespaces.count(keys[0], len(found), self._index.misses - misses_before)
        columns = self._index.columns(objs, found, errors, max(0.0, shortest - now))
        self._index.hit_bytes += sum(columns.sizes)
        return columns

    def replica_in(self, segment_id: str, offset: int = 0, length: int = 0) -> Replica:
        """The descriptor of ``[offset, offset + length)`` in a mounted segment."""
        return self._members.replica(Extent(segment_id, offset, length))

    @property
    def descriptors_version(self) -> int:
        """Changes whenever :meth:`replica_in` may describe some segment otherwise (one comes
        or goes, a node's endpoints change): a cache of descriptors is keyed by it."""
        return self._members.version

    def node_of(self, segment_id: str) -> str:
        """The id of the node that holds a mounted segment."""
        return self._segments[segment_id].node_id

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is a complete object (no lease, no LRU touch, no hit counted)."""
        return self._index.exists(keys)

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
        if ttl_s is not None and not 0 < ttl_s < math.inf:   # NaN fails both
            raise InvalidArgument(f"a soft pin needs a finite ttl_s > 0, not {ttl_s!r}")
        now = self._clock()
        return [_attempt(self._pin_one, key, ttl_s, now) for key in keys]

    def unpin(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        """Drop hard and soft pins (pins do not nest)."""
        return [_attempt(self._unpin_one, key) for key in keys]

    def stats(self, audit: bool = False) -> MasterStats:
        """Exact accounting of segments, objects and counters. ``audit``: also sum each
        segment's indexed objects one by one (``indexed_bytes``; O(objects), for checkers)."""
        def indexed(s: Segment) -> int | None:
            if not audit:
                return None
            sid = s.info.segment_id
            return sum(s.allocator.aligned_size(o.size) for o in self._objects.values()
                       if any(e.segment_id == sid for e in self._index.replicas(o)))

        segs = tuple(
            SegmentStats(s.node_id, s.info, s.allocator.used_bytes - s.quarantined_bytes,
                         s.quarantined_bytes, s.objects,
                         self._members.nodes[s.node_id].endpoints,
                         indexed_bytes=indexed(s))
            for s in self._segments.values())
        idx = self._index
        return MasterStats(segs, len(self._objects) - idx.pending, idx.pending,
                           idx.hits, idx.misses, self._evictions, len(self._members.nodes),
                           self._tiers.demotions, self._tiers.promotions,
                           len(self._recovery.recovering), self._corrupt_replicas,
                           self._members.silent_count, self._nodes_expired,
                           self._pins.hard_bytes, self._recovery.last_duration_s,
                           tuple((ns, h, m) for ns, (h, m) in self._namespaces.counts.items()),
                           idx.hit_bytes, idx.committed, idx.committed_bytes,
                           self._leases.live(self._clock()), idx.tenants.table())

    def tick(self) -> list[tuple[str, float, int]]:
        """Expire silent nodes, reclaim timed-out puts, run due frees, evict above watermarks.
        Returns the nodes expired now: (node id, seconds silent, objects left without any
        replica and so dropped with it)."""
        now = self._clock()
        expired = self._expire_nodes(now)
        self._recovery.end_tombstones(now)
        self._reclaim_pending(now)
        self._tiers.expire(now)
        self._pins.expire(now)
        self._leasing.expire(now)
        self._space.release_due(now)
        self._pressure.drain(now)
        return expired

    # -- per-key operations -----------------------------------------------------------------

    def _put_one(self, key: str, size: int, n: int, now: float, seen: set[str],
                 started: list[ObjectEntry], version: int, where: dict[int, tuple],
                 parent: str | None = None, slot: bool = False, placing: int = 0
                 ) -> list[Extent]:
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
        # The open segments and those big enough for ``size``: once per size and PutStart
        # (nothing in one changes which segments are open, nor their capacities).
        if (seen_size := where.get(size)) is None:
            segments = list(self._open_segments(n))
            fits = [s for s in segments
                    if s.allocator.capacity_bytes >= s.allocator.aligned_size(size)]
            # ``placing`` objects of this size and one replica each: placed as one
            # choose_segments call each would, at a fraction of the cost (master/placement.py)
            seen_size = where[size] = (segments, len({s.node_id for s in segments}), fits,
                                       len({s.node_id for s in fits}),
                                       BatchPlacer(segments, size, placing) if placing else None)
        segments, nodes, fits, fit_nodes, placer = seen_size
        if nodes < n:
            raise NoSpace(f"{key!r}: {n} replicas asked but only {nodes} live nodes "
                          "have segments")
        if not fits:
            raise ValueTooLarge(f"{key!r}: {size} bytes is larger than every segment")
        if fit_nodes < n:
            # Checked up front: otherwise eviction would flush the cache for a put that can
            # never succeed.
            raise NoSpace(f"{key!r}: fewer than {n} nodes have a segment of {size} bytes")
        self._index.tenants.check(key, size)
        self._check_pending_limit(key, size, n, SLOT_SHARE if slot else 1.0)
        extents = placer.take() if placer is not None else None
        if extents is None:   # no room without evicting (or not placed in a batch)
            extents = self._pressure.place(size, n, fits, now)
        if extents is None and not self._pressure.admits(size, n, fits):
            self._refused_why = (f"refused before evicting anything: evicting every evictable "
                                 f"object would not make room for {size} bytes x{n}")
            raise NoSpace(f"{key!r}: no room for {size} bytes x{n}, and evicting every "
                          "evictable object would not make it, so nothing was evicted: "
                          + Space.summary(segments))
        if extents is None:
            raise NoSpace(f"{key!r}: no room for {size} bytes x{n}, even after eviction: "
                          + Space.summary(segments))
        obj = self._index.add(key, size, extents, fresh_version=version, parent=parent or None)
        self._space.pending.credit(obj)
        # Until its writer is surely done (its put reclaimed, then quarantined), a restarted
        # master must not hand this space out: the nodes keep a reservation of it. Not of a
        # slot: its writer reserves it, and this one, arriving after the writer sealed
        # another key in it, would drop that seal.
        until = now + self._config.put_timeout_s + self._config.quarantine_s
        for e in extents:
            seg = self._segments[e.segment_id]
            seg.objects += 1
            if seg.manifest is not None and not slot:
                seg.manifest.append(Reservation(key, e.segment_id, e.offset, e.length, until))
        started.append(obj)
        return extents

    def _check_pending_limit(self, key: str, size: int, n: int, share: float = 1.0) -> None:
        """NoSpace if this put would take PENDING puts (and the quarantine of reclaimed ones)
        past ``max_pending_fraction`` of the capacity (``share`` of that: a slot's limit)."""
        space = self._space
        held = space.pending.total_bytes + space.abandoned_bytes
        need = n * (-(-size // self._config.alignment_bytes) * self._config.alignment_bytes)
        if held + need > share * self._pending_limit:
            if share < 1.0:
                raise NoSpace(f"{key!r}: slots are made only while puts started hold less "
                              f"than {share} of max_pending_fraction's limit")
            self._refused_why = (
                f"refused before evicting anything: puts started and not ended (and the "
                f"quarantine of those timed out) would pass max_pending_fraction "
                f"{self._config.max_pending_fraction} of the capacity "
                f"({held} of {int(self._pending_limit)} bytes held)")
            raise NoSpace(f"{key!r}: puts started and not ended hold {space.pending.total_bytes} "
                          f"bytes ({len(space.pending)} objects), and {space.abandoned_bytes} "
                          f"more wait out their quarantine after a put timeout; {need} more would "
                          f"pass the limit of {int(self._pending_limit)} (max_pending_fraction "
                          f"{self._config.max_pending_fraction} of the capacity). End or revoke "
                          "puts before starting more")
        # Each tenant's own puts may hold that fraction of its share only, so one tenant's
        # puts started and not ended cannot take the room of every other's.
        tenants = self._index.tenants
        if not tenants.quotas and not key.startswith(MARK) and len(tenants.usage) < 2 \
                and (not tenants.usage or DEFAULT in tenants.usage):
            return   # the default tenant alone: its share is the capacity, checked above
        tenant = tenant_of(key)[0]
        mine = space.pending.tenant_bytes(tenant)
        tenant_share = tenants.share(tenant, self._capacity)
        if mine + need > share * self._config.max_pending_fraction * tenant_share:
            raise QuotaExceeded(
                f"{key!r}: tenant {tenant!r} has {mine} bytes in puts started and not ended; "
                f"{need} more would pass max_pending_fraction "
                f"{self._config.max_pending_fraction} of its share of {tenant_share} bytes (its "
                "quota, or an equal part of the capacity among the tenants holding objects). "
                "End or revoke puts before starting more")

    def space_summary(self) -> str:
        """How much room the cluster has for new objects, for a NoSpace message; first why
        the last PutStart was refused before evicting, if it was."""
        summary = Space.summary(self._open_segments())
        return f"{self._refused_why}; {summary}" if self._refused_why else summary

    def _open_segments(self, replicas: int = 1):
        """Where new objects may go: not to segments still being announced."""
        return self._members.open_segments(replicas, self._recovery.recovering)

    def _why_missing(self, key) -> KVPoolError:
        """Why a read finds no complete object at ``key`` (a miss is counted). Built, not
        raised and caught: a lookup of 65,536 absent keys held the loop ~1 s that way."""
        try:
            validate_key(key)
        except InvalidArgument as e:
            return e
        obj = self._objects.get(key)
        assert obj is None or obj.state is not COMPLETE, f"{key!r} is complete: not a miss"
        self._index.misses += 1
        # The message names a long key by its start: a repr of 1 KiB per miss costs more
        # than the lookup (the answer carries the status only).
        return ObjectNotFound(f"{key!r} not found" if len(key) <= 128
                              else f"{key[:96]!r}... ({len(key)} characters) not found")

    def _fill_slot_one(self, slot: str, checksum: int | None, key: str, size: int,
                       parent: str | None, now: float) -> None:
        obj = self._index.pending_entry(slot)
        try:
            validate_key(key)
            if parent:
                validate_key(parent)
                if parent == key:
                    raise InvalidArgument(f"{key!r} names itself as its parent")
            if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= obj.size:
                raise InvalidArgument(f"{key!r}: {size!r} bytes do not fit its slot of "
                                      f"{obj.size}")
            if self._index.more.get(obj) or tenant_of(key)[0] != tenant_of(slot)[0]:
                raise InvalidArgument(f"{key!r}: {slot!r} is not a slot of its tenant")
            if key in self._objects:
                raise AlreadyExists(f"{key!r} already exists")
        except KVPoolError:
            # Its writer may have sealed ``key`` in the slot at its node: the quarantine's
            # reservation drops that seal there, and keeps the space out of reuse meanwhile.
            self._space.free_later(self._unindex(obj), now + self._config.quarantine_s,
                                   abandoned=True)
            raise
        self._space.pending.debit(obj)
        seg = self._segments[obj.segment_id]
        slot_bytes, used = seg.allocator.aligned_size(obj.size), seg.allocator.aligned_size(size)
        self._index.rename(obj, key, size)
        if used < slot_bytes:
            seg.allocator.free(obj.offset + used, slot_bytes - used)
        if parent:
            self._index.parents[obj] = parent
        self._put_end_one(key, checksum)

    def _put_end_one(self, key: str, checksum: int | None) -> None:
        obj = self._index.pending_entry(key)
        self._index.commit(obj, checksum)
        self._space.pending.debit(obj)
        # The indexed strs, not the request's equal copies. A parent not stored yet (still
        # pending, or put later) is waited for, up to a bound (chains.py): linked when it
        # comes; meanwhile this block is a chain head to the policy (it can go first).
        named = self._index.take_parent(obj)
        parent = self._objects.get(named) if named else None
        if parent is not None and parent.state is COMPLETE:
            link: str | None = parent.key
        else:
            link = named if named and self._chains.may_wait() else None
        # Put straight to disk (DRAM was full), the block waits there for its parent.
        self._chains.track(obj.key, link, obj.place[0] in self._members.disk_segments)
        # The manifest records keep the parent named (linked again after a master restart);
        # the index does not.
        self._log_records(obj, named)

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
        if obj is None:
            self._recovery.check_unindexed(r)
        replicas = self._index.replicas(obj) if obj is not None else []
        if extent in replicas:
            return   # announced again (a node retrying a batch whose answer it lost)
        if any(e.segment_id == r.segment_id for e in replicas):
            raise Conflict(f"{r.key!r}: already has a replica in {r.segment_id!r}")
        if r.size < 1 or not seg.allocator.allocate_at(r.offset, r.size):
            raise Conflict(f"{r.key!r}: extent {r.offset}+{r.size} in {r.segment_id!r} overlaps "
                           "another object or lies outside the segment")
        seg.objects += 1
        if obj is not None:   # another node's replica of it was announced first
            self._index.set_replicas(obj, [*replicas, extent])
            self._pins.replicas_changed(obj)
            self._announce_pin(obj, r)
            return
        obj = self._index.add(r.key, r.size, [extent], r.version, state=COMPLETE,
                              checksum=r.checksum)
        # Linked to its parent as before the restart; a parent not announced yet (on another
        # node, later in the batch) links its children when it comes.
        parent = self._objects.get(r.parent) if r.parent else None
        self._chains.track(obj.key, parent.key if parent is not None else r.parent,
                           r.segment_id in self._members.disk_segments)
        self._announce_pin(obj, r)

    def _announce_pin(self, obj: ObjectEntry, r: ObjectRecord) -> None:
        """Hard-pin an announced object recorded as pinned. Not checked against the quota:
        it was granted within it, and after a master restart the quota counts only the
        segments mounted so far (the rest come with nodes still to announce)."""
        if r.pinned and not self._pins.is_hard(obj):
            self._pin_one(obj.key, None, self._clock(), quota=False)

    def _ask_recheck_one(self, key: str, version: int, segment_id: str) -> None:
        validate_key(key)
        obj = self._objects.get(key)
        if obj is None or obj.state is not COMPLETE or obj.version != version \
                or not any(e.segment_id == segment_id for e in self._index.replicas(obj)):
            return
        self._rechecks.ask(self._segments[segment_id].node_id, (key, version, segment_id))

    def _drop_confirmed_one(self, key: str, version: int, segment_id: str, node_id: str,
                            now: float) -> None:
        seg = self._segments.get(segment_id)
        if seg is not None and seg.node_id != node_id:
            raise InvalidArgument(f"segment {segment_id!r} is mounted by node {seg.node_id!r}, "
                                  f"not {node_id!r}")
        self._drop_corrupt_one(key, version, segment_id, now)

    def _drop_corrupt_one(self, key: str, version: int, segment_id: str, now: float) -> None:
        validate_key(key)
        obj = self._objects.get(key)
        if obj is None or obj.state is not COMPLETE or obj.version != version:
            return
        replicas = self._index.replicas(obj)
        bad = [e for e in replicas if e.segment_id == segment_id]
        if not bad:
            return
        seg = self._segments[segment_id]
        self._corrupt_replicas += 1
        left = [e for e in replicas if e.segment_id != segment_id]
        self._index.set_replicas(obj, left)
        seg.objects -= 1
        if seg.manifest is not None:
            seg.manifest.append(Removal(key, version))
        # Other readers may be copying it under their lease: reuse only after that.
        self._space.free_later(bad, max(now, self._leasing.until(obj)))
        self._pins.replicas_changed(obj)
        if not left:
            self._recovery.tombstone(obj, self._clock())
            self._unindex(obj)

    def _put_revoke_one(self, key: str) -> None:
        obj = self._index.pending_entry(key)
        self._space.free_now(self._unindex(obj))

    def _remove_one(self, key: str, now: float) -> None:
        obj = self._index.complete(key)
        self._recovery.tombstone(obj, self._clock())
        replicas = self._unindex(obj)
        if (lease := self._leasing.until(obj)) > now:
            # A reader may still be copying these bytes: reuse only after its lease.
            self._space.free_later(replicas, lease)
        else:
            self._space.free_now(replicas)

    def _pin_one(self, key: str, ttl_s: float | None, now: float, quota: bool = True) -> None:
        obj = self._index.complete(key)
        if self._pins.pin(obj, ttl_s, now, quota):
            self._log_records(obj, self._parent_of(obj))

    def _unpin_one(self, key: str) -> None:
        if self._pins.unpin(obj := self._index.complete(key)):
            self._log_records(obj, self._parent_of(obj))

    def _log_records(self, obj: ObjectEntry, parent: str | None) -> None:
        """Tell the nodes holding ``obj`` its record (committed, or a hard pin came or went:
        it supersedes the one their manifests hold, by key)."""
        pinned = self._pins.is_hard(obj)
        for e in self._index.replicas(obj):
            log = self._segments[e.segment_id].manifest
            if log is not None:
                log.append(obj.record(e, parent, pinned))

    def _parent_of(self, obj: ObjectEntry) -> str | None:
        return self._chains.parent_of(obj.key, obj.segment_id in self._members.disk_segments)

    # -- tick steps -------------------------------------------------------------------------

    def _expire_nodes(self, now: float) -> list[tuple[str, float, int]]:
        expired = []
        for node_id in self._members.expired(now):
            n = self._members.nodes[node_id]
            self._recovery.expired_segments.update(n.segment_ids)
            before = len(self._objects)
            for seg_id in list(n.segment_ids):
                self._drop_segment(self._segments[seg_id])
            expired.append((node_id, now - n.last_seen, before - len(self._objects)))
            self._nodes_expired += 1
            self._members.forget(node_id)
            self._manifests.forget(node_id)
            self._tiers.forget(node_id)
        return expired

    def _reclaim_pending(self, now: float) -> None:
        for obj in self._space.puts_due(now):
            # Committed since (most puts; asked first: no probe of the index for them), or
            # revoked or lost: nothing to reclaim.
            if obj.seal is not PENDING or self._objects.get(obj.key) is not obj:
                continue
            # The writer may still be writing into these extents: keep them out of reuse.
            self._space.free_later(self._unindex(obj), now + self._config.quarantine_s,
                                   abandoned=True)

    # -- tiers (see master/tiers.py) --------------------------------------------------------

    def take_moves(self, node_id: str) -> list[Move]:
        """The moves ``node_id`` is to make (each is handed out once)."""
        return self._tiers.take(node_id)

    def moves_finished(self, node_id: str, done: Sequence[int] = (),
                       failed: Sequence[int] = ()) -> None:
        """``node_id`` copied the moves ``done`` (the index switches to their destinations) and
        gave up on ``failed`` (their destinations are freed). Unknown ids (expired, another
        node's) are ignored."""
        now = self._clock()
        for ok, ids in ((True, done), (False, failed)):
            for move_id in ids:
                moved = self._tiers.finished(node_id, move_id, ok, now)
                if moved is not None:
                    self._pins.replicas_changed(moved)

    # -- helpers ----------------------------------------------------------------------------

    def _evict(self, obj: ObjectEntry) -> None:
        self._recovery.tombstone(obj, self._clock())
        self._space.free_now(self._unindex(obj))   # not leased: no reader can be in flight
        self._evictions += 1
        if self._on_evict is not None:
            self._on_evict(obj.key, obj.version)

    def _unindex(self, obj: ObjectEntry) -> list[Extent]:
        """Forget ``obj``; returns its extents, allocated until the caller frees them."""
        replicas = self._index.replicas(obj)
        self._index.discard(obj)
        if obj.state is COMPLETE:
            self._chains.forget(obj.key)
            self._pins.forget(obj)
        else:
            self._space.pending.debit(obj)
        for e in replicas:
            seg = self._segments[e.segment_id]
            seg.objects -= 1
            if seg.manifest is not None and obj.state is COMPLETE:
                seg.manifest.append(Removal(obj.key, obj.version))
        return replicas

    def _drop_segment(self, seg: Segment) -> None:
        """Forget a segment: its replicas go, and objects left without replicas vanish."""
        sid = seg.info.segment_id
        self._members.remove_segment(seg)
        self._recovery.recovering.discard(sid)
        if not seg.objects:
            return
        # A scan of the index (the segment keeps a count, not its keys: a set of them cost
        # ~30 bytes per object); a node's loss is rare, a put or lookup is not. Objects with
        # a replica here have it first or among the index's further replicas.
        index = self._index
        for obj in [o for o in self._objects.values() if o.segment_id == sid] + [
                o for o, more in index.more.items() if any(e.segment_id == sid for e in more)]:
            left = [e for e in index.replicas(obj) if e.segment_id != sid]
            index.set_replicas(obj, left)
            if not left:
                self._unindex(obj)


def _attempt(op: Callable[..., T], *args: object) -> T | KVPoolError:
    """``op(*args)``, or the KVPoolError it raised: one slot of a batch answer. Without its
    traceback: that holds this frame, which holds the error (a cycle that outlives the call
    and, frozen, is never collected: tools/master_cmd.py ``gc_for_a_large_index``)."""
    try:
        return op(*args)
    except KVPoolError as e:
        return e.with_traceback(None)
