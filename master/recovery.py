"""Recovery: while store nodes announce what they hold (after a master restart, or a node
back from a partition), what this index takes from them and what it refuses."""

from __future__ import annotations

from collections.abc import Iterable

from kvpool.common.errors import Conflict
from kvpool.common.types import ObjectRecord
from kvpool.master.index import ObjectEntry


class Recovery:
    def __init__(self, node_ttl_s: float) -> None:
        self._node_ttl_s = node_ttl_s
        # Segments whose node is still announcing what they hold: no new object goes there.
        self.recovering: set[str] = set()
        # Segments this master dropped because their node went silent (partition, crash). If
        # the node comes back and announces what they hold, this index stays authoritative for
        # them: only replicas of objects still indexed are taken back, so an object removed
        # or evicted meanwhile does not return (a restarted master, knowing none, takes all).
        self.expired_segments: set[str] = set()
        # Objects removed, evicted or dropped as corrupt while nodes may still be announcing
        # (key -> version): until twice node_ttl_s after the first mount (every live node has
        # re-mounted and announced by then) and while a segment recovers. Another node's
        # replica announced later must not bring such an object back.
        self._tombstones: dict[str, int] = {}
        self._announcing_until: float | None = None
        self._recovering_since: float | None = None
        self.last_duration_s: float | None = None   # from a first recovering segment to none

    def mounted(self, now: float) -> None:
        """A segment was mounted: the first one starts the window nodes announce in."""
        if self._announcing_until is None:
            self._announcing_until = now + 2 * self._node_ttl_s

    def recover(self, segment_id: str, now: float) -> None:
        """A segment was mounted whose node will announce what it holds."""
        if not self.recovering:
            self._recovering_since = now
        self.recovering.add(segment_id)

    def announced(self, segment_ids: Iterable[str], now: float) -> bool:
        """These segments' node announced all it holds; True if no segment recovers now."""
        was = bool(self.recovering)
        self.recovering.difference_update(segment_ids)
        if was and not self.recovering and self._recovering_since is not None:
            self.last_duration_s = now - self._recovering_since
        return not self.recovering

    def tombstone(self, obj: ObjectEntry, now: float) -> None:
        """Remember ``obj`` gone while nodes may still announce it."""
        if self.recovering or (self._announcing_until is not None
                               and now < self._announcing_until):
            self._tombstones[obj.key] = obj.version

    def end_tombstones(self, now: float) -> None:
        if self._tombstones and not self.recovering and self._announcing_until is not None \
                and now >= self._announcing_until:
            self._tombstones.clear()

    def check_unindexed(self, r: ObjectRecord) -> None:
        """Conflict if an announced object this index does not hold must stay out of it."""
        if self._tombstones.get(r.key) == r.version:
            raise Conflict(f"{r.key!r}: removed or evicted since this master started")
        if r.segment_id in self.expired_segments:
            raise Conflict(f"{r.key!r}: not indexed since its node was declared dead (removed, "
                           "evicted, or it had no other replica)")
