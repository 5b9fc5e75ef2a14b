"""Read leases: each object's lease runs ``lease_ttl_s`` from its latest read, but a reader that
keeps re-reading cannot hold it forever: a lease ends at most ``max_lease_s`` after it began,
and for ``lease_ttl_s`` after that reads grant none (the object may be evicted meanwhile). A
read answer says how long its shortest lease runs, so a reader never trusts bytes past the
lease it really got (it re-checks them with the master, as for any slow read).

The bytes leased objects hold are counted per segment (``Segment.leased_bytes``) for
admission (master/pressure.py). Kept cheap on the read path: a lookup's new leases are one
record (a heap entry per lookup, not per key) and one (cap, end) pair their objects share;
extending a running lease touches nothing but that object's pair. A pinned object's lease is not counted (its pin holds it), except one pinned
while leased, counted twice until that lease ends; so is an object removed under its lease
(its space is quarantined until the lease ends too): both bounded, and both on the side of
refusing a put, never of evicting for one that then fails.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Container, Sequence

from kvpool.master.holds import FurtherReplicas
from kvpool.master.index import ObjectEntry
from kvpool.master.membership import LEASED_HELD as LEASED
from kvpool.master.membership import Segment

# One credit: the object, the segment it holds bytes of, and how many (aligned). A pause
# (after a lease reached its cap) is an entry with no segment.
_Credit = tuple[ObjectEntry, Segment | None, int]


class Leases:
    def __init__(self, ttl_s: float, max_s: float, segments: dict[str, Segment],
                 hard_pinned: Container[ObjectEntry], more: FurtherReplicas) -> None:
        """``hard_pinned``: the objects a hard pin holds (their leases are not counted);
        ``more``: the index's further replicas (ObjectIndex.more)."""
        self._ttl_s, self._max_s = ttl_s, max_s
        self._segments = segments
        self._hard_pinned, self._more = hard_pinned, more
        # obj -> (cap, end): when its lease must end (began + max_s), and when it ends (the
        # read path extends it up to the cap); kept through the pause after a lease that
        # reached its cap. An object not here holds no lease: an entry keeps no slot for it
        # (8 bytes for every object, leased or not).
        self.running: dict[ObjectEntry, tuple[float, float]] = {}
        self._due: list[tuple[float, int, list[_Credit]]] = []   # when to look at credits
        self._seq = itertools.count()

    def until(self, obj: ObjectEntry) -> float:
        """When ``obj``'s lease ends (in the past, or 0.0: none runs)."""
        lease = self.running.get(obj)
        return 0.0 if lease is None else lease[1]

    def begin(self, objs: Sequence[ObjectEntry], now: float, until: float) -> float:
        """Lease ``objs`` (read at ``now``, none of them leased now) until ``until`` or their
        cap; returns when the shortest of those leases ends (``now``: one is paused)."""
        self.expire(now)   # leases ended by now are closed before new ones open
        running, segments, pause_s = self.running, self._segments, self._ttl_s
        pinned, more = self._hard_pinned, self._more
        cap_at = now + self._max_s
        end = min(until, cap_at)
        shortest = end
        lease = (cap_at, end)   # shared by the objects leased here
        credits: list[_Credit] = []
        add = credits.append
        seg: Segment | None = None
        for obj in objs:
            last = running.get(obj)
            if last is not None and last[0] <= now < last[0] + pause_s:
                shortest = now   # its last lease reached the cap: paused
                continue
            running[obj] = lease
            if pinned and obj in pinned:
                continue   # its pin holds it
            # Most keys of a lookup live in one segment: look it up once per run of them.
            if seg is None or seg.info.segment_id != obj.segment_id:
                seg = segments.get(obj.segment_id)
            if seg is not None:
                n = seg.allocator.aligned_size(obj.size)
                seg.held[LEASED] += n
                add((obj, seg, n))
            for e in more.get(obj, ()) if more else ():   # further replicas (rare)
                if (other := segments.get(e.segment_id)) is not None:
                    n = other.allocator.aligned_size(obj.size)
                    other.held[LEASED] += n
                    add((obj, other, n))
        if credits:
            heapq.heappush(self._due, (until, next(self._seq), credits))
        return shortest

    def expire(self, now: float) -> None:
        """Close the leases (and pauses) due by ``now``; credits of leases extended since
        are looked at again when those end."""
        due = self._due
        running, pause_s = self.running, self._ttl_s
        while due and due[0][0] <= now:
            _, _, credits = heapq.heappop(due)
            later: list[_Credit] = []
            for credit in credits:
                obj, seg, n = credit
                lease = running.get(obj)
                if lease is not None and lease[1] > now:   # extended (or leased again)
                    later.append(credit)
                    continue
                if seg is not None:
                    seg.held[LEASED] -= n
                if lease is None:
                    continue
                cap, end = lease
                if end >= cap and now < cap + pause_s:   # reached its cap: pause
                    later.append((obj, None, 0))
                elif seg is not None or now >= cap + pause_s:
                    del running[obj]
            if later:   # each again when it ends: a lease extended, or a pause
                next_at = min(running[obj][1] if seg is not None else running[obj][0] + pause_s
                              for obj, seg, _ in later)
                heapq.heappush(due, (next_at, next(self._seq), later))

    def __len__(self) -> int:
        return len(self.running)
