"""Pins: hard ones (never evicted nor demoted, within a quota of the capacity) and soft ones
(evicted or demoted after every unpinned candidate, until they end)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from kvpool.common.config import MasterConfig
from kvpool.common.errors import NoSpace
from kvpool.master.holds import FurtherReplicas, Holds
from kvpool.master.index import ObjectEntry
from kvpool.master.membership import PINNED_HELD, Segment
from kvpool.master.quotas import TenantUsage


class Pins:
    def __init__(self, config: MasterConfig, segments: dict[str, Segment],
                 more: FurtherReplicas, tenants: TenantUsage | None = None) -> None:
        """``more``: the index's further replicas (ObjectIndex.more); ``tenants``: the
        tenants' usage (master/quotas.py), whose pins it counts."""
        self._config = config
        self._segments = segments
        self._tenants = tenants if tenants is not None else TenantUsage()
        self._soft: dict[str, float] = {}            # key -> when its soft pin ends
        self._soft_ends: list[tuple[float, str]] = []   # a heap of those; may be stale
        # What hard pins hold against the quota: each object's size (replicas come and go
        # with nodes; the count must not drift).
        self.hard_bytes = 0
        # What hard pins hold per segment, every replica (admission counts it). Its objects
        # are the hard-pinned ones: an entry keeps no flag (8 bytes each, for a few pins).
        self.held = Holds(PINNED_HELD, segments, more)

    def pin(self, obj: ObjectEntry, ttl_s: float | None, now: float, quota: bool = True) -> bool:
        """Pin ``obj`` softly for ``ttl_s`` (again: extended), or hard if ``ttl_s`` is None
        (NoSpace past the quota, unless not ``quota``). True if a hard pin came now: the
        object's record changed."""
        if ttl_s is not None:
            if obj not in self.held:   # a hard-pinned object stays hard
                until = max(now + ttl_s, self._soft.get(obj.key, 0.0))
                self._soft[obj.key] = until
                heapq.heappush(self._soft_ends, (until, obj.key))
            return False
        if obj in self.held:
            return False
        limit = self._config.pin_quota_fraction * sum(
            s.allocator.capacity_bytes for s in self._segments.values())
        if quota and self.hard_bytes + obj.size > limit:
            raise NoSpace(f"{obj.key!r}: hard pins would hold {self.hard_bytes + obj.size} "
                          f"bytes, over the quota of {int(limit)} (pin_quota_fraction "
                          f"{self._config.pin_quota_fraction} of the capacity); unpin some, "
                          "or pin with a ttl_s (a soft pin)")
        if quota:
            self._tenants.check_pin(obj.key, obj.size, self._config.pin_quota_fraction)
        self._tenants.pins_changed(obj.key, obj.size)
        self.hard_bytes += obj.size
        self.held.credit(obj)
        self._soft.pop(obj.key, None)
        return True

    def is_hard(self, obj: ObjectEntry) -> bool:
        """Whether ``obj`` is hard-pinned."""
        return obj in self.held

    def unpin(self, obj: ObjectEntry) -> bool:
        """Drop both kinds of pin (they do not nest); True if a hard one went."""
        self._soft.pop(obj.key, None)
        if obj not in self.held:
            return False
        self._tenants.pins_changed(obj.key, -obj.size)
        self.hard_bytes -= obj.size
        self.held.debit(obj)
        return True

    def forget(self, obj: ObjectEntry) -> None:
        """``obj`` left the index, pins and all."""
        if obj in self.held:
            self.hard_bytes -= obj.size
            self.held.debit(obj)
            self._tenants.pins_changed(obj.key, -obj.size)
        if self._soft:
            self._soft.pop(obj.key, None)

    def replicas_changed(self, obj: ObjectEntry) -> None:
        """``obj`` gained, lost or moved a replica: a hard pin holds its replicas as they are."""
        if obj in self.held:
            self.held.credit(obj)

    def expire(self, now: float) -> None:
        heap = self._soft_ends
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            if self._soft.get(key) == until:   # not extended since
                del self._soft[key]

    def soft_last(self, candidates: Iterable[str], now: float) -> Iterator[str]:
        """``candidates`` in order, but those soft-pinned (still within their TTL) after all
        others: a soft pin is evicted last, not never."""
        if not self._soft:
            yield from candidates
            return
        deferred = []
        for key in candidates:
            if self._soft.get(key, 0.0) > now:
                deferred.append(key)
            else:
                yield key
        yield from deferred
