"""Placement: which segments hold the replicas of a new object."""

from __future__ import annotations

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
