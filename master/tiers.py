"""Tiers: moves of objects between a node's segments of different tiers.

A node with segments of several tiers (hbm, dram, disk) keeps its objects in the fastest one
with room; a tier above its high watermark demotes its policy-order victims one tier down, and
a disk object read twice within ``promote_window_s`` is promoted one tier up. A move is an
instruction (``take``, sent with the node's heartbeat answer) to copy the bytes into an extent
allocated here; the index switches to the copy only when the node reports it done
(``finished``), and the source is freed once no lease granted on it can still be read under:
a reader never sees a half-copied replica.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Container
from dataclasses import dataclass

from kvpool.common.config import MasterConfig
from kvpool.common.types import TIER_RANK, Extent, Move
from kvpool.master.chains import Chains
from kvpool.master.index import ObjectEntry, ObjectIndex
from kvpool.master.leases import Leases
from kvpool.master.membership import Membership, Segment
from kvpool.master.space import Space


@dataclass(eq=False, slots=True)
class _MoveInFlight:
    """A copy a node was told to make; the index switches to ``dst`` when it reports done."""

    obj: ObjectEntry
    src: Extent
    dst: Extent
    src_seg: Segment
    dst_seg: Segment
    deadline: float


class Tiers:
    def __init__(self, config: MasterConfig, members: Membership, closed: Collection[str],
                 index: ObjectIndex, chains: Chains, space: Space,
                 hard_pinned: Container[ObjectEntry], leases: Leases) -> None:
        """``closed``: segments no move may go to (still being announced); ``hard_pinned``:
        the objects a hard pin holds (their manifest records say so)."""
        self._config = config
        self._hard_pinned, self._leases = hard_pinned, leases
        self._members, self._closed = members, closed
        self._index, self._chains, self._space = index, chains, space
        self._moves: dict[int, _MoveInFlight] = {}   # handed to nodes, not reported yet
        self.moving: dict[str, int] = {}     # the key of each object with one in flight
        self._outbox: dict[str, list[Move]] = {}   # instructions not taken yet, per node
        self._disk_reads: dict[str, float] = {}    # disk objects read once, and when
        self._ids = itertools.count()
        self.demotions = self.promotions = 0

    def lower(self, seg: Segment) -> Segment | None:
        """The roomiest segment of the next tier down on ``seg``'s node; None: a last tier."""
        return self._members.neighbour_tier(seg, +1, self._closed)

    def take(self, node_id: str) -> list[Move]:
        """The moves ``node_id`` is to make (each is handed out once)."""
        return self._outbox.pop(node_id, [])

    def forget(self, node_id: str) -> None:
        """The node is gone: its moves not taken yet go (the rest expire)."""
        self._outbox.pop(node_id, None)

    def finished(self, node_id: str, move_id: int, ok: bool, now: float
                 ) -> ObjectEntry | None:
        """``node_id`` made (``ok``) or gave up on a move; unknown ids (expired, another
        node's) are ignored. Returns the object if its replica moved."""
        m = self._moves.get(move_id)
        if m is None or m.src_seg.node_id != node_id:
            return None
        del self._moves[move_id]
        obj = m.obj
        self._end(move_id, m)
        dst_live = self._members.segments.get(m.dst.segment_id) is m.dst_seg
        if not (ok and dst_live and self._index.objects.get(obj.key) is obj
                and m.src in self._index.replicas(obj)):
            if dst_live:   # the node is done with the destination either way
                self._space.free_now([m.dst])
            return None
        disk = self._members.disk_segments
        was_on_disk = obj.segment_id in disk
        self._index.set_replicas(obj, [m.dst if e == m.src else e
                                       for e in self._index.replicas(obj)])
        if (obj.segment_id in disk) != was_on_disk:
            # Down to disk: its parent may become demotable; there it links to its parent
            # once that comes down too (a chain is dropped from disk tail first). Back up:
            # linked again to its parent in DRAM.
            self._chains.moved(obj.key, was_on_disk)
        # A new version: a reader whose read outlived its lease checks the version it read
        # against the index's, and the source may be reused by then.
        obj.version = self._index.new_version()
        m.src_seg.objects -= 1
        m.dst_seg.objects += 1
        if m.dst_seg.manifest is not None:   # supersedes the source's record (by key)
            parent = self._chains.parent_of(obj.key, obj.segment_id in disk)
            m.dst_seg.manifest.append(obj.record(m.dst, parent, obj in self._hard_pinned))
        # Readers granted the source may still be copying from it: reuse after the lease.
        self._space.free_later([m.src], max(now, self._leases.until(obj)))
        if TIER_RANK[m.dst_seg.info.tier] > TIER_RANK[m.src_seg.info.tier]:
            self.demotions += 1
        else:
            self.promotions += 1
            self._disk_reads.pop(obj.key, None)
        return obj

    def note_disk_read(self, obj: ObjectEntry, now: float) -> None:
        """``obj`` was read and may have replicas on disk: the second read within the window
        promotes one of them (the first whose node has room above it)."""
        on_disk = [e for e in self._index.replicas(obj)
                   if e.segment_id in self._members.disk_segments]
        if not on_disk:
            return
        self._chains.disk_policy.on_access(obj.key)
        seen = self._disk_reads.pop(obj.key, None)
        if seen is None or now - seen > self._config.promote_window_s:
            if len(self._disk_reads) > 65536:   # bounded: forget reads older than the window
                cutoff = now - self._config.promote_window_s
                self._disk_reads = {k: t for k, t in self._disk_reads.items() if t >= cutoff}
            self._disk_reads[obj.key] = now
            return
        if obj.key in self.moving:
            return
        for src in on_disk:
            src_seg = self._members.segments[src.segment_id]
            upper = self._members.neighbour_tier(src_seg, -1, self._closed)
            if upper is None:
                continue
            alloc = upper.allocator
            # Only into room below the high watermark: a promotion must not cause a demotion.
            if alloc.used_bytes + alloc.aligned_size(obj.size) <= \
                    self._config.high_watermark * alloc.capacity_bytes and \
                    self.start(obj, src, src_seg, upper, now):
                return

    def start(self, obj: ObjectEntry, src: Extent, src_seg: Segment, dst_seg: Segment,
              now: float) -> bool:
        """Allocate the destination and queue the instruction; False if it has no room."""
        offset = dst_seg.allocator.allocate(obj.size)
        if offset is None:
            return False
        dst = Extent(dst_seg.info.segment_id, offset, obj.size)
        move_id = next(self._ids)
        self._moves[move_id] = _MoveInFlight(obj, src, dst, src_seg, dst_seg,
                                             now + self._config.put_timeout_s)
        self.moving[obj.key] = move_id
        src_seg.moving_out_bytes += src_seg.allocator.aligned_size(obj.size)
        self._outbox.setdefault(src_seg.node_id, []).append(
            Move(move_id, obj.key, obj.version, src, dst))
        return True

    def expire(self, now: float) -> None:
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
            self._end(move_id, m)
            if self._members.segments.get(m.dst.segment_id) is m.dst_seg:
                self._space.free_later([m.dst], now + self._config.quarantine_s)

    def _end(self, move_id: int, m: _MoveInFlight) -> None:
        if self.moving.get(m.obj.key) == move_id:
            del self.moving[m.obj.key]
        m.src_seg.moving_out_bytes -= m.src_seg.allocator.aligned_size(m.src.length)
