"""What each store node's manifest must learn, as typed events queued per node until taken.

A node that keeps a manifest (it says so when it mounts) hears, in order, of every object
committed in its segments (or whose record changed: moved there, pinned, unpinned), every one
dropped from them, and every extent a restarted master must keep out of reuse for a while. Its
stream (master/manifest_watch.py) or its heartbeat takes the queue; a stream that broke before
the node acknowledged puts what it took back in front, so the node sees each node's changes in
the order they happened.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvpool.common.types import ObjectRecord, Reservation


@dataclass(frozen=True, slots=True)
class Removal:
    """An object dropped from a node's segment: the node forgets its record of this version
    (a newer version's record, committed since, stays)."""

    key: str
    version: int


# An ObjectRecord is a commit (or supersedes the record of the same key); a Reservation keeps
# an extent out of reuse until its end (on the master's clock while queued).
ManifestEvent = ObjectRecord | Removal | Reservation


@dataclass(frozen=True, slots=True)
class ManifestDelta:
    """What changed in one node's segments since its last heartbeat: objects committed there,
    ``(key, version)`` of objects dropped from there (applied after the commits), and space a
    restarted master must not reuse for a while (``Reservation``, on this master's clock)."""

    committed: list[ObjectRecord]
    removed: list[tuple[str, int]]
    reserved: list[Reservation] = ()

    def events(self) -> list[ManifestEvent]:
        """The delta as events again, in the order a node applies them."""
        return [*self.reserved, *self.committed, *(Removal(k, v) for k, v in self.removed)]


class ManifestLog:
    """The queues of the nodes that keep a manifest, by node id: each one a list of events
    in order, which the node's segments append to directly (a put appends one per replica)."""

    def __init__(self) -> None:
        self._queues: dict[str, list[ManifestEvent]] = {}
        self._gone = 0   # events that left the queues (taken, not put back; or dropped)
        # has_removals' progress per node: (events looked at, whether one was a Removal).
        # Queues only grow at their end between takes, so each event is looked at once.
        self._scanned: dict[str, tuple[int, bool]] = {}

    @property
    def recorded(self) -> int:
        """How many events were ever appended: a call that moved it changed what some
        manifest must hold (taking, putting back and dropping leave it as it is)."""
        return self._gone + sum(map(len, self._queues.values()))

    def keep(self, node_id: str) -> list[ManifestEvent]:
        """The node's queue, opened now if it kept none."""
        return self._queues.setdefault(node_id, [])

    def queue(self, node_id: str) -> list[ManifestEvent] | None:
        """The node's queue; None if it keeps no manifest."""
        return self._queues.get(node_id)

    def forget(self, node_id: str) -> None:
        """The node is gone (expired): what it did not take goes with it."""
        self._gone += len(self._queues.pop(node_id, ()))
        self._scanned.pop(node_id, None)

    def take(self, node_id: str) -> ManifestDelta | None:
        """The node's events since the last take, as a delta; None for a node that keeps no
        manifest."""
        q = self._queues.get(node_id)
        if q is None:
            return None
        events = list(q)
        q.clear()   # in place: the node's segments hold it
        self._scanned.pop(node_id, None)
        self._gone += len(events)
        delta = ManifestDelta([], [], [])
        for e in events:
            match e:
                case ObjectRecord():
                    delta.committed.append(e)
                case Removal(key=key, version=version):
                    delta.removed.append((key, version))
                case Reservation():
                    delta.reserved.append(e)
        return delta

    def requeue(self, node_id: str, delta: ManifestDelta) -> None:
        """Put a taken delta back in front of the node's queue (not applied by the node): the
        next take has it again, before anything newer."""
        q = self._queues.get(node_id)
        if q is not None:
            events = delta.events()
            q[:0] = events
            self._scanned.pop(node_id, None)
            self._gone -= len(events)

    def has_removals(self) -> bool:
        """Whether a removal is queued for some node (not taken yet); each event is looked at
        once (a put asks on every call, while its confirmations may queue for a while)."""
        for node_id, q in self._queues.items():
            seen, found = self._scanned.get(node_id, (0, False))
            if not found and len(q) > seen:
                found = any(type(e) is Removal for e in itertools.islice(q, seen, None))
            self._scanned[node_id] = (len(q), found)
            if found:
                return True
        return False

    def nodes_with_changes(self) -> list[str]:
        """The nodes whose events have not been taken yet."""
        return [nid for nid, q in self._queues.items() if q]
