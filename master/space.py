"""Space: frees at once or deferred (a lease still running, a writer that may linger), each
deferred one mirrored to its node's manifest as a reservation, the deadlines of puts, and what
PENDING puts hold (with the quarantine their reclaim leaves: ``max_pending_fraction``)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from kvpool.common.types import Extent, Reservation
from kvpool.master.holds import FurtherReplicas, Holds
from kvpool.master.index import ObjectEntry
from kvpool.master.membership import PENDING_HELD, Segment


class Space:
    def __init__(self, segments: dict[str, Segment], more: FurtherReplicas) -> None:
        """``more``: the index's further replicas (ObjectIndex.more)."""
        self._segments = segments
        # (free_at, seq, [(segment, extent)], abandoned): lease-deferred removals and put
        # quarantine alike; ``abandoned``: the quarantine of reclaimed puts.
        self.deferred: list[tuple[float, int, list[tuple[Segment, Extent]], bool]] = []
        # What PENDING puts hold, and the quarantine of those reclaimed (aligned, every replica).
        self.pending = Holds(PENDING_HELD, segments, more, per_tenant=True)
        self.abandoned_bytes = 0
        # (deadline, seq, objects): one entry per PutStart batch, not per object.
        self._put_deadlines: list[tuple[float, int, list[ObjectEntry]]] = []
        self._seq = itertools.count()

    def free_now(self, extents: Iterable[Extent]) -> None:
        for e in extents:
            self._segments[e.segment_id].allocator.free(e.offset, e.length)

    def free_later(self, extents: Iterable[Extent], free_at: float,
                   abandoned: bool = False) -> None:
        """Free ``extents`` at ``free_at``; until then they count as quarantined, and their
        nodes' manifests reserve them, so that a restarted master waits as well.
        ``abandoned``: a reclaimed put's, counted against ``max_pending_fraction`` too."""
        entries = [(self._segments[e.segment_id], e) for e in extents]
        for seg, e in entries:
            seg.quarantined_bytes += seg.allocator.aligned_size(e.length)
            if abandoned:
                self.abandoned_bytes += seg.allocator.aligned_size(e.length)
            if seg.manifest is not None:
                seg.manifest.append(Reservation("", e.segment_id, e.offset, e.length, free_at))
        heapq.heappush(self.deferred, (free_at, next(self._seq), entries, abandoned))

    def release_due(self, now: float) -> None:
        """Run the deferred frees that are due."""
        while self.deferred and self.deferred[0][0] <= now:
            _, _, entries, abandoned = heapq.heappop(self.deferred)
            for seg, ext in entries:
                if abandoned:
                    self.abandoned_bytes -= seg.allocator.aligned_size(ext.length)
                # A dropped segment took its space with it (a re-mount of its id is a new
                # segment with a new allocator); only its quarantine count would change.
                if self._segments.get(ext.segment_id) is seg:
                    seg.quarantined_bytes -= seg.allocator.aligned_size(ext.length)
                    seg.allocator.free(ext.offset, ext.length)

    def put_deadline(self, deadline: float, started: list[ObjectEntry]) -> None:
        """The objects of one PutStart, to be reclaimed at ``deadline`` if still PENDING."""
        heapq.heappush(self._put_deadlines, (deadline, next(self._seq), started))

    def puts_due(self, now: float) -> Iterator[ObjectEntry]:
        """The objects whose put deadline has passed (committed or gone ones included)."""
        while self._put_deadlines and self._put_deadlines[0][0] <= now:
            yield from heapq.heappop(self._put_deadlines)[2]

    @staticmethod
    def summary(segments: Iterable[Segment]) -> str:
        """Where the room of ``segments`` went, for a NoSpace message: free bytes, then what
        eviction cannot free (pending puts, hard pins, leases, quarantine)."""
        segments = list(segments)
        total = sum(s.allocator.capacity_bytes for s in segments)
        free = sum(s.allocator.free_bytes for s in segments)
        largest = max((s.allocator.largest_free_bytes for s in segments), default=0)
        held = {what: sum(getattr(s, f"{what}_bytes") for s in segments)
                for what in ("pending", "pinned", "leased", "quarantined")}
        evictable = max(0, total - free - sum(held.values()))
        return (f"the cluster has {free} of {total} bytes free in {len(segments)} segments "
                f"(largest free range {largest} bytes); eviction cannot free "
                + ", ".join(f"{n} {what}" for what, n in held.items())
                + f" (quarantined: freed space a late writer or reader may still use), "
                f"and at most {evictable} bytes are evictable")
