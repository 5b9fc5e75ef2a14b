"""Eviction under pressure: room made for a put that found none, and segments past their high
watermark drained to their low one (a demotion where the node has a lower tier, a drop from
its last tier).

Admission comes before eviction: a put is given room by evicting only if evicting could make
it, counting what eviction cannot free (pending puts, hard pins, read leases, quarantine:
``Segment.reclaimable_bytes``). Otherwise nothing is evicted: a put that cannot fit must not
empty the cache on its way to NoSpace. The count is of bytes, not ranges: a put refused for
fragmentation alone still evicts first (rare: objects of a cache are mostly of a few sizes)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

from kvpool.common.config import MasterConfig
from kvpool.common.tenants import tenant_of
from kvpool.common.types import Extent
from kvpool.master.chains import Chains
from kvpool.master.index import COMPLETE, PENDING, ObjectEntry, ObjectIndex
from kvpool.master.leases import Leases
from kvpool.master.membership import Membership, Segment
from kvpool.master.pins import Pins
from kvpool.master.placement import choose_segments
from kvpool.master.tiers import Tiers

# How many eviction candidates a put looks through for those of tenants over their share.
FAIR_SCAN = 4096


class Pressure:
    def __init__(self, config: MasterConfig, members: Membership, closed: Collection[str],
                 index: ObjectIndex, chains: Chains, pins: Pins, leases: Leases, tiers: Tiers,
                 evict: Callable[[ObjectEntry], None]) -> None:
        """``closed``: segments no new object may go to; ``evict``: drops an object (its
        replicas freed at once: it is not leased)."""
        self._config = config
        self._members, self._closed = members, closed
        self._index, self._chains, self._pins, self._tiers = index, chains, pins, tiers
        # Read per eviction candidate: the tables, not a method call each.
        self._hard_pinned = pins.held.objects
        self._evict = evict

    def place(self, size: int, n: int, fits: list[Segment], now: float) -> list[Extent] | None:
        """``n`` extents of ``size`` bytes on distinct nodes, evicting from ``fits`` (segments
        big enough) if need be; None if there is no room even then."""
        extents = choose_segments(self._members.open_segments(n, self._closed), size, n)
        if extents is not None:
            return extents
        # Only objects with a replica in a segment that could hold this one make room for it,
        # and only a node's last tier drops data (a tier above it demotes instead: drain).
        fit_ids = {s.info.segment_id for s in fits if self._tiers.lower(s) is None}
        if not fit_ids or not self.admits(size, n, fits):
            return None
        # Tenants over their share give first (master/quotas.py), from the first FAIR_SCAN
        # candidates in the policy's order (a bounded look: this runs in a PutStart), then
        # anyone, in order.
        tenants = self._index.tenants
        over = tenants.over_share(sum(s.allocator.capacity_bytes
                                      for s in self._members.segments.values()))
        for only in ((over, None) if over else (None,)):
            for seen, key in enumerate(self._victims(now, fit_ids)):
                if only is not None:
                    if seen >= FAIR_SCAN:
                        break
                    if tenant_of(key)[0] not in only:
                        continue
                obj = self._index.objects.get(key)
                if obj is None or not self._evictable(obj, now):
                    continue
                if not any(e.segment_id in fit_ids for e in self._index.replicas(obj)):
                    continue
                self._evict(obj)
                extents = choose_segments(self._members.open_segments(n, self._closed),
                                          size, n)
                if extents is not None:
                    return extents
        return None

    def admits(self, size: int, n: int, fits: list[Segment]) -> bool:
        """Whether ``n`` distinct nodes could hold ``size`` bytes, now or by evicting: each
        has an open segment with room for it, or a last-tier segment among ``fits`` in which
        what eviction cannot free leaves room for it."""
        nodes = {s.node_id for s in self._members.open_segments(n, self._closed)
                 if s.allocator.largest_free_bytes >= s.allocator.aligned_size(size)}
        for s in fits:
            if s.node_id not in nodes and self._tiers.lower(s) is None \
                    and s.reclaimable_bytes() >= s.allocator.aligned_size(size):
                nodes.add(s.node_id)
        return len(nodes) >= n

    def drain(self, now: float) -> None:
        """Bring every segment above its high watermark down to its low one, in policy order:
        a segment with a lower tier on its node demotes (a move); a node's last tier drops.
        Objects being moved count as gone from their source already."""
        segments, high, low = self._members.segments, self._config.high_watermark, \
            self._config.low_watermark

        def fuller_than(seg: Segment, mark: float) -> bool:
            used = seg.allocator.used_bytes - seg.moving_out_bytes
            return used > mark * seg.allocator.capacity_bytes

        # Hysteresis across ticks: a segment past its high watermark drains down to its low one
        # even when that takes several ticks (demotions complete asynchronously, and a chain
        # block becomes a victim only once its children went down).
        for s in segments.values():
            if fuller_than(s, high):
                s.draining = True
            elif s.draining and not fuller_than(s, low):
                s.draining = False
        hot = {sid for sid, s in segments.items() if s.draining}
        for _ in range(2):   # again if a demotion found its lower tier full: that one drops
            if not hot:
                return
            full: set[str] = set()
            for key in self._victims(now, hot):
                obj = self._index.objects.get(key)
                if obj is None or obj.state is not COMPLETE or obj in self._hard_pinned:
                    continue
                touched = [e for e in self._index.replicas(obj) if e.segment_id in hot]
                if not touched:
                    continue
                segs = [segments[e.segment_id] for e in touched]
                lower = [self._tiers.lower(seg) for seg in segs]
                if None in lower:   # a last tier: the object goes (all of it, as before)
                    if self._evictable(obj, now):
                        self._evict(obj)
                # One move per object at a time: its first hot replica goes first.
                elif key not in self._tiers.moving and not self._tiers.start(
                        obj, touched[0], segs[0], lower[0], now):
                    full.add(lower[0].info.segment_id)
                for seg in segs:
                    if not fuller_than(seg, low):
                        hot.discard(seg.info.segment_id)
                        seg.draining = False
                if not hot:
                    break
            hot |= full

    def _evictable(self, obj: ObjectEntry, now: float) -> bool:
        lease = obj.lease   # (cap, end)
        return obj.seal is not PENDING and (lease is None or lease[1] <= now) \
            and obj not in self._hard_pinned

    def _victims(self, now: float, segment_ids: Collection[str]) -> Iterator[str]:
        """Candidates with a replica in ``segment_ids`` possibly: those on disk (if any of
        them is a disk segment), then those above; soft-pinned ones (still within their TTL)
        after all others: a soft pin is evicted last, not never."""
        disk = self._members.disk_segments
        candidates = self._chains.candidates(any(sid in disk for sid in segment_ids),
                                             any(sid not in disk for sid in segment_ids))
        return self._pins.soft_last(candidates, now)
