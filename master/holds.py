"""What objects hold of their segments' bytes, per segment and in all: pending puts, hard pins
and read leases, which eviction cannot free. Admission (master/pressure.py) reads the counts
to refuse a put that cannot fit before evicting anything.

Each object is counted as of when it was credited (its replicas then): a debit takes back
exactly what was credited, so a replica that moves or goes meanwhile cannot make the counts
drift; callers credit again when an object's replicas change (a pin outlives such changes).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpool.common.tenants import DEFAULT, MARK, tenant_of
from kvpool.common.types import Extent
from kvpool.master.index import ObjectEntry
from kvpool.master.membership import Segment

# The index's further replicas (ObjectIndex.more): entry -> its replicas past the first.
FurtherReplicas = Mapping[ObjectEntry, tuple[Extent, ...]]


class Holds:
    """One kind of hold: ``kind`` indexes ``Segment.held`` (membership.PENDING_HELD, ...)."""

    def __init__(self, kind: int, segments: dict[str, Segment], more: FurtherReplicas,
                 per_tenant: bool = False) -> None:
        """``per_tenant``: count ``by_tenant`` too (common/tenants.py)."""
        self._kind = kind
        self._segments = segments
        self._more = more
        self._credits: dict[ObjectEntry, tuple[tuple[Segment, int], ...]] = {}
        self.total_bytes = 0   # aligned bytes, every replica counted
        # Of ``total_bytes``, each namespaced tenant's (None: not counted; a tenant holding
        # none is absent); the default tenant's is the rest (:meth:`tenant_bytes`).
        self.by_tenant: dict[str, int] | None = {} if per_tenant else None
        self._namespaced_bytes = 0

    def credit(self, obj: ObjectEntry) -> None:
        """Count ``obj``'s replicas as they are now (again, if it was counted already)."""
        credits = self._credits
        if obj in credits:
            self.debit(obj)
        kind, segments = self._kind, self._segments
        sid, size = obj.place
        seg = segments.get(sid) if sid else None
        more = self._more.get(obj) if self._more else None
        if seg is not None and not more:   # the common case: one replica
            n = seg.allocator.aligned_size(size)
            seg.held[kind] += n
            self.total_bytes += n
            credits[obj] = ((seg, n),)
            if self.by_tenant is not None and obj.key.startswith(MARK):
                self._tenant_holds(obj, n)
            return
        out = []
        sids = [obj.segment_id, *(e.segment_id for e in more or ())] if obj.segment_id else []
        for sid in sids:
            if (seg := segments.get(sid)) is not None:
                n = seg.allocator.aligned_size(obj.size)
                seg.held[kind] += n
                self.total_bytes += n
                out.append((seg, n))
        credits[obj] = tuple(out)
        if self.by_tenant is not None and obj.key.startswith(MARK):
            self._tenant_holds(obj, sum(n for _, n in out))

    def debit(self, obj: ObjectEntry) -> None:
        """Stop counting ``obj`` (a no-op if it is not counted)."""
        credits = self._credits.pop(obj, None)
        if credits is None:
            return
        kind = self._kind
        for seg, n in credits:   # a dropped segment's count goes with it: harmless
            seg.held[kind] -= n
            self.total_bytes -= n
        if self.by_tenant is not None and obj.key.startswith(MARK):
            self._tenant_holds(obj, -sum(n for _, n in credits))

    def _tenant_holds(self, obj: ObjectEntry, n: int) -> None:
        tenant = tenant_of(obj.key)[0]
        self._namespaced_bytes += n
        if held := self.by_tenant.get(tenant, 0) + n:
            self.by_tenant[tenant] = held
        else:
            self.by_tenant.pop(tenant, None)

    def tenant_bytes(self, tenant: str) -> int:
        """What ``tenant``'s objects hold (counted ``per_tenant`` only)."""
        if tenant == DEFAULT:
            return self.total_bytes - self._namespaced_bytes
        return self.by_tenant.get(tenant, 0)

    @property
    def objects(self) -> Mapping[ObjectEntry, object]:
        """The objects counted (a mapping's ``in`` is C, not a method call, on hot paths)."""
        return self._credits

    def __contains__(self, obj: ObjectEntry) -> bool:
        return obj in self._credits

    def __len__(self) -> int:
        return len(self._credits)
