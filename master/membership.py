"""Membership and liveness: the store nodes, their segments, who is silent, how to reach them."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvpool.common.config import MasterConfig
from kvpool.common.errors import InvalidArgument, UnknownNode
from kvpool.common.types import TIER_RANK, Extent, NodeEndpoints, Replica, SegmentInfo
from kvpool.master.allocator import RangeAllocator
from kvpool.master.manifest_log import ManifestEvent

PENDING_HELD, PINNED_HELD, LEASED_HELD = 0, 1, 2   # Segment.held


@dataclass(eq=False, slots=True)
class Node:
    endpoints: NodeEndpoints
    last_seen: float
    segment_ids: set[str] = field(default_factory=set)


@dataclass(eq=False, slots=True)
class Segment:
    node_id: str
    info: SegmentInfo
    allocator: RangeAllocator
    # Indexed objects with a replica here: a count, not a set of their keys (~30 bytes per
    # object at 10M); dropping a segment finds them by a scan of the index (MasterState).
    objects: int = 0
    quarantined_bytes: int = 0
    manifest: list[ManifestEvent] | None = None   # its node's queue (manifest_log.py)
    moving_out_bytes: int = 0   # aligned bytes of in-flight moves out of here (leaving soon)
    draining: bool = False      # passed the high watermark, not yet down to the low one
    # Aligned bytes eviction cannot free (master/holds.py), indexed by PENDING_HELD,
    # PINNED_HELD, LEASED_HELD: a list, not three fields, so a hold's count is one index.
    held: list[int] = field(default_factory=lambda: [0, 0, 0])

    @property
    def pending_bytes(self) -> int:
        return self.held[PENDING_HELD]

    @property
    def pinned_bytes(self) -> int:
        return self.held[PINNED_HELD]

    @property
    def leased_bytes(self) -> int:
        return self.held[LEASED_HELD]

    def reclaimable_bytes(self) -> int:
        """At most how many bytes evicting every evictable object here could leave free: the
        capacity less what pending puts, hard pins, read leases and quarantine hold."""
        return self.allocator.capacity_bytes - self.quarantined_bytes - sum(self.held)


class Membership:
    """Nodes by id and segments by id. Dropping a segment's objects is the caller's: here a
    segment only comes and goes."""

    def __init__(self, config: MasterConfig) -> None:
        self._config = config
        self.nodes: dict[str, Node] = {}
        self.segments: dict[str, Segment] = {}
        self.disk_segments: set[str] = set()   # a set lookup on the read path
        # Nodes silent for a third of node_ttl_s (as of the last expiry): probably dead, so
        # new objects go elsewhere while the TTL runs out, instead of failing their writes
        # there. Their next heartbeat clears them; if every node is silent, none is avoided.
        self._silent: set[str] = set()
        # Bumped whenever what a replica's descriptor says can change (a segment comes or
        # goes, a node's endpoints change): whoever caches descriptors keys them by it.
        self.version = 0

    def check_mount(self, node: NodeEndpoints, segment: SegmentInfo) -> None:
        """InvalidArgument for a segment id mounted by another node or with another
        size/tier, an empty id, or a segment below the alignment."""
        if not node.node_id or not segment.segment_id:
            raise InvalidArgument("node_id and segment_id must not be empty")
        if segment.size_bytes < self._config.alignment_bytes:
            raise InvalidArgument(f"segment {segment.segment_id!r} has {segment.size_bytes} "
                                  f"bytes; at least {self._config.alignment_bytes} are needed")
        seg = self.segments.get(segment.segment_id)
        if seg is not None and seg.node_id != node.node_id:
            raise InvalidArgument(f"segment {segment.segment_id!r} is mounted by node "
                                  f"{seg.node_id!r}")
        if seg is not None and seg.info != segment:
            raise InvalidArgument(f"segment {segment.segment_id!r} is mounted as {seg.info}")

    def restarted(self, node: NodeEndpoints) -> list[Segment]:
        """The segments of ``node``'s previous process, if it restarted: endpoints are fixed
        for a node process's life, so new ones mean it restarted (within node_ttl_s, so it
        never looked dead), and its old segments are gone with it."""
        n = self.nodes.get(node.node_id)
        if n is None or n.endpoints == node:
            return []
        return [self.segments[sid] for sid in n.segment_ids]

    def mount(self, node: NodeEndpoints, segment: SegmentInfo, now: float,
              manifest: list[ManifestEvent] | None) -> bool:
        """Register or refresh ``node`` (a heartbeat too) with ``segment``; True if the
        segment is new."""
        n = self.nodes.get(node.node_id)
        if n is None:
            n = self.nodes[node.node_id] = Node(node, now)
        elif n.endpoints != node:
            self.version += 1
        n.endpoints, n.last_seen = node, now
        self._silent.discard(node.node_id)
        seg = self.segments.get(segment.segment_id)
        new = seg is None
        if new:
            # Untracked: the object index records every allocation (allocator.py).
            alloc = RangeAllocator(segment.size_bytes, self._config.alignment_bytes,
                                   track=False)
            seg = self.segments[segment.segment_id] = Segment(node.node_id, segment, alloc)
            self.version += 1
            n.segment_ids.add(segment.segment_id)
            if segment.tier == "disk":
                self.disk_segments.add(segment.segment_id)
        seg.manifest = manifest
        return new

    def remove_segment(self, seg: Segment) -> None:
        sid = seg.info.segment_id
        del self.segments[sid]
        self.version += 1
        self.disk_segments.discard(sid)
        self.nodes[seg.node_id].segment_ids.discard(sid)

    def touch(self, node_id: str, now: float) -> Node:
        """A sign of life from ``node_id``; UnknownNode tells it to mount its segments again."""
        n = self.nodes.get(node_id)
        if n is None:
            raise UnknownNode(f"node {node_id!r} is not known; mount its segments again")
        n.last_seen = now
        self._silent.discard(node_id)
        return n

    @property
    def silent_count(self) -> int:
        """Nodes marked silent at the last :meth:`expired` (probably dead, not expired yet)."""
        return len(self._silent)

    def heard_from(self, node_id: str, now: float) -> bool:
        n = self.nodes.get(node_id)
        return n is not None and now - n.last_seen <= self._config.node_ttl_s / 3

    def expired(self, now: float) -> list[str]:
        """Mark the nodes silent for a third of node_ttl_s; return those silent for all of it
        (the caller drops their segments, then forgets them)."""
        ttl = self._config.node_ttl_s
        silent = {k for k, n in self.nodes.items() if now - n.last_seen > ttl / 3}
        self._silent = silent if len(silent) < len(self.nodes) else set()
        gone = [k for k, n in self.nodes.items() if now - n.last_seen > ttl]
        self._silent.difference_update(gone)
        return gone

    def forget(self, node_id: str) -> None:
        del self.nodes[node_id]
        self.version += 1

    def open_segments(self, replicas: int = 1, closed: Collection[str] = ()
                      ) -> Iterable[Segment]:
        """The segments new objects may go to: all but ``closed`` ones, and those of nodes
        gone silent unless ``replicas`` distinct nodes need them."""
        if not closed and not self._silent:
            return self.segments.values()
        open_ = [s for sid, s in self.segments.items() if sid not in closed]
        if self._silent:
            fresh = [s for s in open_ if s.node_id not in self._silent]
            if len({s.node_id for s in fresh}) >= replicas:
                return fresh
        return open_

    def neighbour_tier(self, seg: Segment, step: int, closed: Collection[str] = ()
                       ) -> Segment | None:
        """The roomiest segment of the next tier down (``step`` +1) or up (-1) on ``seg``'s
        node, not one of ``closed``; None: there is none."""
        rank = TIER_RANK[seg.info.tier]
        best: Segment | None = None
        best_rank = 0
        for sid in self.nodes[seg.node_id].segment_ids:
            other = self.segments[sid]
            r = TIER_RANK[other.info.tier]
            if (r - rank) * step <= 0 or sid in closed:
                continue
            if best is None or (r - best_rank) * step < 0 or (
                    r == best_rank and other.allocator.free_bytes > best.allocator.free_bytes):
                best, best_rank = other, r
        return best

    def replica(self, e: Extent) -> Replica:
        """How to reach ``e``: its node's endpoints as of now (a node that re-mounted with new
        ones is reached there) and its segment's RDMA region (rkey 0 = none)."""
        seg = self.segments[e.segment_id]
        info = seg.info
        return Replica(self.nodes[seg.node_id].endpoints, e, rdma_addr=info.rdma_addr,
                       rdma_rkey=info.rdma_rkey,
                       rdma_length=info.size_bytes if info.rdma_rkey else 0, tier=info.tier)
