"""What objects hold of their segments' bytes, per segment and in all: pending puts, hard pins
and read leases, which eviction cannot free. Admission (master/pressure.py) reads the counts
to refuse a put that cannot fit before evicting anything.

Each object is counted as of when it was credited (its replicas then): a debit takes back
exactly what was credited, so a replica that moves or goes meanwhile cannot make the counts
drift; callers credit again when an object's replicas change (a pin outlives such changes).
"""

from __future__ import annotations

from kvpool.master.index import ObjectEntry
from kvpool.master.membership import Segment


class Holds:
    """One kind of hold: ``attr`` names the Segment field it counts (``pending_bytes``, ...)."""

    def __init__(self, attr: str, segments: dict[str, Segment]) -> None:
        self._attr = attr
        self._segments = segments
        self._credits: dict[ObjectEntry, tuple[tuple[Segment, int], ...]] = {}
        self.total_bytes = 0   # aligned bytes, every replica counted

    def credit(self, obj: ObjectEntry) -> None:
        """Count ``obj``'s replicas as they are now (again, if it was counted already)."""
        if obj in self._credits:
            self.debit(obj)
        attr, credits = self._attr, []
        for e in obj.replicas:
            seg = self._segments.get(e.segment_id)
            if seg is None:
                continue
            n = seg.allocator.aligned_size(obj.size)
            setattr(seg, attr, getattr(seg, attr) + n)
            credits.append((seg, n))
            self.total_bytes += n
        self._credits[obj] = tuple(credits)

    def debit(self, obj: ObjectEntry) -> None:
        """Stop counting ``obj`` (a no-op if it is not counted)."""
        credits = self._credits.pop(obj, None)
        if credits is None:
            return
        attr = self._attr
        for seg, n in credits:   # a dropped segment's count goes with it: harmless
            setattr(seg, attr, getattr(seg, attr) - n)
            self.total_bytes -= n

    def __contains__(self, obj: ObjectEntry) -> bool:
        return obj in self._credits

    def __len__(self) -> int:
        return len(self._credits)
