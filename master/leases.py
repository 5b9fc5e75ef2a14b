"""Read leases: each object's lease runs ``lease_ttl_s`` from its latest read, but a reader that
keeps re-reading cannot hold it forever: a lease ends at most ``max_lease_s`` after it began,
and for ``lease_ttl_s`` after that reads grant none (the object may be evicted meanwhile). A
read answer says how long its shortest lease runs, so a reader never trusts bytes past the
lease it really got (it re-checks them with the master, as for any slow read).

The bytes leased objects hold are counted per segment (``Segment.leased_bytes``) for
admission (master/pressure.py). Kept cheap on the read path: an object's lease is a slot of
its entry (``ObjectEntry.lease``, read with the entry a lookup already holds: a dict beside
the index cost two more cache misses a key, and the closing of leases as many again); a
lookup's new leases are one (cap, end) pair their objects share and one credit for them all
(a batch, its objects in runs of a segment) in the bucket of ``BUCKET_S`` in which they end
(a heap of buckets, not of credits); extending a running lease touches nothing but that
object's pair. When the bucket is due, the objects whose slot still holds the batch's pair
close together (an identity test each); an extended one gets a credit of its own, in the
bucket of its new end (one dict step). Bytes stay counted as
leased up to ``BUCKET_S`` past a lease's end. (Credits were kept in lists, one per lookup,
each put back at the earliest end among the extended ones it held: under steady re-reads
every list was walked again at each of its credits' ends, 40% of a lookup's time on the
master.) A pinned object's lease is not counted (its pin holds it), except one pinned while
leased, counted twice until that lease ends; so is an object removed under its lease (its
space is quarantined until the lease ends too): both bounded, and both on the side of
refusing a put, never of evicting for one that then fails.

A closed lease leaves a mark in its slot, ``(CLOSED, t)``: the second its lease ended in (one
mark object shared by the leases that ended in it, as they close). The eviction order learns
a key's last read from its slot (:func:`read_at`) when a walk comes to it, instead of at
every read (master/eviction.py ``PrefixAwarePolicy``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container, Sequence

from kvpool.master.holds import FurtherReplicas
from kvpool.master.index import ObjectEntry
from kvpool.master.membership import LEASED_HELD as LEASED
from kvpool.master.membership import Segment

# One credit: the object, the segment it holds bytes of, and how many (aligned). A pause
# (after a lease reached its cap) is an entry with no segment.
_Credit = tuple[ObjectEntry, Segment | None, int]
BUCKET_S = 0.1


class _Batch:
    """The credits of one :meth:`Leases.begin`: ``objs``, in ``runs`` of (segment, bytes
    each, how many), all given the lease ``lease`` (one tuple) then. Closing them is an
    identity test each where a credit apiece cost a tuple and a dozen steps."""

    __slots__ = ("lease", "objs", "runs")

    def __init__(self, lease: tuple[float, float], objs: list[ObjectEntry],
                 runs: list[tuple[Segment, int, int]]) -> None:
        self.lease, self.objs, self.runs = lease, objs, runs

#: A closed lease's cap: (CLOSED, t) in a slot is no lease, only when the last one ended.
CLOSED = -math.inf


def read_at(lease: tuple[float, float] | None, ttl_s: float) -> float | None:
    """When the object whose lease slot holds ``lease`` was last read (a lease runs ``ttl_s``
    from its latest read; a closed one's mark says up to a second early); None: never."""
    return None if lease is None else lease[1] - ttl_s


class Leases:
    def __init__(self, ttl_s: float, max_s: float, segments: dict[str, Segment],
                 hard_pinned: Container[ObjectEntry], more: FurtherReplicas) -> None:
        """``hard_pinned``: the objects a hard pin holds (their leases are not counted);
        ``more``: the index's further replicas (ObjectIndex.more)."""
        self._ttl_s, self._max_s = ttl_s, max_s
        self._segments = segments
        self._hard_pinned, self._more = hard_pinned, more
        # An entry's lease (ObjectEntry.lease) is (cap, end): when it must end (began +
        # max_s), and when it ends (the read path extends it up to the cap); kept through the
        # pause after a lease that reached its cap; None: never read, (CLOSED, t): a mark.
        # How many entries hold one:
        self.count = 0
        self._mark: tuple[float, float] = (CLOSED, 0.0)   # the latest, shared
        # Credits by the bucket of BUCKET_S they are due in, and a heap of those buckets.
        self._buckets: dict[int, list[_Credit | _Batch]] = {}
        self._due: list[int] = []

    def until(self, obj: ObjectEntry) -> float:
        """When ``obj``'s lease ends (in the past, or 0.0: none runs)."""
        lease = obj.lease
        return 0.0 if lease is None else lease[1]

    def begin(self, objs: Sequence[ObjectEntry], now: float, until: float) -> float:
        """Lease ``objs`` (read at ``now``, none of them leased now) until ``until`` or their
        cap; returns when the shortest of those leases ends (``now``: one is paused)."""
        self.expire(now)   # leases ended by now are closed before new ones open
        segments, pause_s = self._segments, self._ttl_s
        pinned, more = self._hard_pinned, self._more
        cap_at = now + self._max_s
        end = min(until, cap_at)
        shortest = end
        lease = (cap_at, end)   # shared by the objects leased here
        leased: list[ObjectEntry] = []   # those that hold bytes of a segment, in runs:
        runs: list[tuple[Segment, int, int]] = []   # (segment, bytes each, how many)
        extra: list[_Credit] = []   # further replicas' (rare)
        add = leased.append
        seg: Segment | None = None
        place, n = None, 0
        began = run = 0   # leases begun; objects leased in ``seg`` since ``place`` changed
        for obj in objs:
            last = obj.lease
            if last is None or last[0] == CLOSED:
                began += 1
            elif last[1] >= last[0] and last[0] <= now < last[0] + pause_s:
                shortest = now   # its last lease reached the cap: paused
                continue
            obj.lease = lease
            if pinned and obj in pinned:
                continue   # its pin holds it
            # Most keys of a lookup share one place (segment, size): once per run of them.
            if obj.place is not place:
                if run:
                    seg.held[LEASED] += run * n
                    runs.append((seg, n, run))
                place, run = obj.place, 0
                seg = segments.get(place[0])
                n = seg.allocator.aligned_size(place[1]) if seg is not None else 0
            if seg is not None:
                run += 1
                add(obj)
            if more and obj in more:   # further replicas (rare)
                for e in more[obj]:
                    if (other := segments.get(e.segment_id)) is not None:
                        m = other.allocator.aligned_size(obj.place[1])
                        other.held[LEASED] += m
                        extra.append((obj, other, m))
        if run:
            seg.held[LEASED] += run * n
            runs.append((seg, n, run))
        self.count += began
        if leased or extra:
            bucket = self._bucket(until)
            if leased:
                bucket.append(_Batch(lease, leased, runs))
            bucket.extend(extra)
        return shortest

    def _bucket(self, at: float) -> list[_Credit | _Batch]:
        """The credits due in ``at``'s bucket (looked at once it has passed)."""
        b = math.ceil(at / BUCKET_S)
        if b * BUCKET_S < at:   # a quotient rounded down: never a bucket due before ``at``
            b += 1              # (expire() puts an extended credit back while it runs)
        credits = self._buckets.get(b)
        if credits is None:
            credits = self._buckets[b] = []
            heapq.heappush(self._due, b)
        return credits

    def expire(self, now: float) -> None:
        """Close the leases (and pauses) due by ``now``; credits of leases extended since
        are looked at again when those end."""
        due, buckets = self._due, self._buckets
        while due and due[0] * BUCKET_S <= now:
            for credit in buckets.pop(heapq.heappop(due)):
                if type(credit) is _Batch:
                    self._close_batch(credit, now)
                else:
                    self._settle(credit, now)

    def _settle(self, credit: _Credit, now: float) -> None:
        """One credit come due: its lease closes, pauses, or (extended) is looked at again
        when it ends."""
        obj, seg, n = credit
        lease = obj.lease
        if lease is not None and lease[1] > now:   # extended (or leased again)
            self._bucket(lease[1] if seg is not None else lease[0] + self._ttl_s
                         ).append(credit)
            return
        if seg is not None:
            seg.held[LEASED] -= n
        if lease is None or lease[0] == CLOSED:
            return
        cap, end = lease
        if end >= cap and now < cap + self._ttl_s:   # reached its cap: pause
            self._bucket(cap + self._ttl_s).append((obj, None, 0))
        elif seg is not None or now >= cap + self._ttl_s:
            obj.lease = self._closed(end)
            self.count -= 1

    def _close_batch(self, batch: _Batch, now: float) -> None:
        """A begin()'s leases come due: those still holding the lease it gave (one tuple,
        so an identity test) close in one step per run of a segment; the others (extended,
        closed or leased again since) are settled one by one."""
        lease, objs = batch.lease, batch.objs
        capped = lease[1] >= lease[0]   # they reached their cap at once: each pauses (settled)
        mark = None if capped else self._closed(lease[1])
        start = closed_all = 0
        for seg, n, count in batch.runs:
            closed = 0
            for obj in objs[start:start + count]:
                if obj.lease is lease and mark is not None:
                    obj.lease = mark
                    closed += 1
                else:
                    self._settle((obj, seg, n), now)
            seg.held[LEASED] -= closed * n
            closed_all += closed
            start += count
        self.count -= closed_all

    def _closed(self, end: float) -> tuple[float, float]:
        """The mark of a lease that ended at ``end``: its second (never later), shared."""
        second = float(math.floor(end))
        if self._mark[1] != second:
            self._mark = (CLOSED, second)
        return self._mark

    def __len__(self) -> int:
        return self.count
