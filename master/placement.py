"""Placement: which segments hold the replicas of a new object."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Protocol

from kvpool.common.types import TIER_RANK, Extent, SegmentInfo
from kvpool.master.allocator import RangeAllocator


class Placeable(Protocol):
    """What placement needs to know about a mounted segment."""

    node_id: str
    info: SegmentInfo
    allocator: RangeAllocator


def choose_segments(segments: Iterable[Placeable], size: int, replicas: int) -> list[Extent] | None:
    """Allocate ``size`` bytes in ``replicas`` segments on distinct nodes; None if impossible.

    Among the segments that can fit the object, the fastest tier wins (hbm, then dram, then
    disk: a lower tier takes new objects only when the ones above are full), then the one with
    the most free bytes, per node and then across nodes, which spreads load and keeps room for
    large objects. Nothing is
    allocated unless every replica fits. Extents have ``length == size``; the allocator rounds.
    """
    best: dict[str, Placeable] = {}   # node_id -> its roomiest segment that fits
    for seg in segments:
        alloc = seg.allocator
        if alloc.capacity_bytes == 0 or alloc.largest_free_bytes < alloc.aligned_size(size):
            continue
        cur = best.get(seg.node_id)
        if cur is None or _preference(seg) < _preference(cur):
            best[seg.node_id] = seg
    if len(best) < replicas:
        return None
    # Stable sort: among equally free segments the earlier-mounted wins, so tests are repeatable.
    chosen = sorted(best.values(), key=_preference)[:replicas]
    extents = []
    for seg in chosen:
        offset = seg.allocator.allocate(size)
        # largest_free_bytes >= the aligned size guarantees the best-fit allocation succeeds.
        assert offset is not None
        extents.append(Extent(seg.info.segment_id, offset, size))
    return extents


def _preference(seg: Placeable) -> tuple[int, int]:
    """Sort key, best first: the fastest tier, then the most free bytes."""
    return TIER_RANK.get(seg.info.tier, 1), -seg.allocator.free_bytes


class BatchPlacer:
    """``choose_segments(segments, size, 1)`` for each of up to ``count`` objects of one size
    in turn (a PutStart's blocks), each answer the same as that call's would be, at a fraction
    of its cost: the segments ordered once in a heap instead of looked over per object, and
    each segment's extents carved ahead in runs (RangeAllocator.allocate_many: the offsets
    ``allocate`` would give, in order), the order reckoning a segment's free bytes as if those
    carved ahead were still free. :meth:`release` frees what was carved and not taken: the free
    ranges are then as if only the taken extents were allocated (free ranges coalesce, so they
    depend only on which bytes are free). Nothing else may allocate in these segments until
    then. :meth:`take` answers None once no segment has room: the caller then places (and
    evicts) as without it."""

    def __init__(self, segments: Iterable[Placeable], size: int, count: int) -> None:
        self._size, self._left = size, count
        self._segments = [s for s in segments if s.allocator.capacity_bytes
                          and s.allocator.largest_free_bytes >= s.allocator.aligned_size(size)]
        self._length = [s.allocator.aligned_size(size) for s in self._segments]
        self._free = [s.allocator.free_bytes for s in self._segments]   # carved ones free
        self._carved: list[list[int]] = [[] for _ in self._segments]   # next one last
        self._live = [True] * len(self._segments)
        self._heap: list[tuple[int, int, int, int]] = []
        self._order()

    def _order(self) -> None:
        """The heap of live segments, best first as choose_segments ranks them: tier, most
        free bytes, then its node's first segment with room, then its own place."""
        nodes: dict[str, int] = {}
        for i, seg in enumerate(self._segments):
            if self._live[i]:
                nodes.setdefault(seg.node_id, len(nodes))
        self._heap = [(TIER_RANK.get(seg.info.tier, 1), -self._free[i], nodes[seg.node_id], i)
                      for i, seg in enumerate(self._segments) if self._live[i]]
        heapq.heapify(self._heap)

    def take(self) -> list[Extent] | None:
        """The next object's extent (as a list, like choose_segments), or None: no room."""
        while self._heap:
            rank, neg_free, node, i = self._heap[0]
            seg, carved = self._segments[i], self._carved[i]
            if not carved:   # it has room (a segment is dropped once it has none)
                carved.extend(reversed(seg.allocator.allocate_many(
                    self._size, max(1, -(-self._left // len(self._heap))))))
            taken = [Extent(seg.info.segment_id, carved.pop(), self._size)] if carved else None
            if taken is not None:
                self._left -= 1
                self._free[i] -= self._length[i]
                if carved or seg.allocator.largest_free_bytes >= self._length[i]:
                    heapq.heapreplace(self._heap, (rank, neg_free + self._length[i], node, i))
                    return taken
            # Full: choose_segments passes it by from now on (its node's turn may move).
            self._live[i] = False
            self._order()
            if taken is not None:
                return taken
        return None

    def release(self) -> None:
        """Free what was carved ahead and not taken."""
        for seg, carved in zip(self._segments, self._carved):
            for offset in carved:
                seg.allocator.free(offset, self._size)
            carved.clear()
