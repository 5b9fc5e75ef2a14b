"""Read leases: each object's lease runs ``lease_ttl_s`` from its latest read, but a reader that
keeps re-reading cannot hold it forever: a lease ends at most ``max_lease_s`` after it began,
and for ``lease_ttl_s`` after that reads grant none (the object may be evicted meanwhile). A
read answer says how long its shortest lease runs, so a reader never trusts bytes past the
lease it really got (it re-checks them with the master, as for any slow read).

The bytes leased objects hold are counted per segment (master/holds.py) for admission; a hard
pin holds an object already, so a pinned object's lease is not counted twice.
"""

from __future__ import annotations

import heapq
import itertools

from kvpool.master.holds import Holds
from kvpool.master.index import ObjectEntry
from kvpool.master.membership import Segment


class Leases:
    def __init__(self, ttl_s: float, max_s: float, segments: dict[str, Segment]) -> None:
        self._ttl_s, self._max_s = ttl_s, max_s
        self.held = Holds("leased_bytes", segments)
        # obj -> when its lease must end (began + max_s); kept through the pause after a
        # lease that reached it, until the pause ends.
        self._caps: dict[ObjectEntry, float] = {}
        self._checks: list[tuple[float, int, ObjectEntry]] = []   # when to look at a lease again
        self._seq = itertools.count()

    def grant(self, obj: ObjectEntry, now: float, until: float) -> float:
        """Lease ``obj``, read at ``now``, until ``until`` (now + lease_ttl_s) or as far as its
        cap allows; returns when its lease ends (``<= now``: no lease, it is paused)."""
        lease = obj.lease_until
        if lease > now:   # a running lease, extended up to its cap
            cap = self._caps.get(obj, until)
            obj.lease_until = new = until if until <= cap else cap
            return new if new > lease else lease
        cap = self._caps.get(obj)
        if cap is not None and cap <= now < cap + self._ttl_s:
            return lease   # paused: its last lease reached the cap
        # A new lease (any previous one ended without reaching its cap, or its pause did).
        self._caps[obj] = cap = now + self._max_s
        obj.lease_until = new = until if until <= cap else cap
        if not obj.pinned:
            self.held.credit(obj)
        heapq.heappush(self._checks, (new, next(self._seq), obj))
        return new

    def expire(self, now: float) -> None:
        """End the leases (and pauses) due by ``now``."""
        checks = self._checks
        while checks and checks[0][0] <= now:
            _, _, obj = heapq.heappop(checks)
            cap = self._caps.get(obj)
            if cap is None:
                continue   # forgotten
            if obj.lease_until > now:   # extended since: look again when it ends
                heapq.heappush(checks, (obj.lease_until, next(self._seq), obj))
                continue
            self.held.debit(obj)
            if obj.lease_until >= cap and now < cap + self._ttl_s:   # reached its cap: pause
                heapq.heappush(checks, (cap + self._ttl_s, next(self._seq), obj))
            else:
                del self._caps[obj]

    def pinned(self, obj: ObjectEntry) -> None:
        """``obj`` was hard-pinned: its pin holds it from now on, not its lease."""
        self.held.debit(obj)

    def unpinned(self, obj: ObjectEntry, now: float) -> None:
        """``obj`` lost its hard pin: a lease still running holds it again."""
        if obj.lease_until > now and obj in self._caps:
            self.held.credit(obj)

    def forget(self, obj: ObjectEntry) -> None:
        """``obj`` left the index."""
        if self._caps.pop(obj, None) is not None:
            self.held.debit(obj)

    def __len__(self) -> int:
        return len(self._caps)
