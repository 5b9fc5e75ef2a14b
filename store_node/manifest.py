"""A store node's manifest: the committed objects its segments hold, as the master told it.

The master pushes what it committed in and dropped from the node's segments on the node's
manifest stream (``ManifestDelta``; master/manifest_watch.py), and a put is answered once the
node has applied its commit. When a master restarts with an empty index, the node re-announces
the manifest and the master indexes the objects again at exactly these extents.

The manifest lives in the node's memory, next to the segments it describes: it has to survive
a master restart, not a node restart (the segments are anonymous shared memory and go with the
node). What it can miss: a commit the master answered without the node's acknowledgement (the
node took longer than MAX_WAIT_S) and then died; such an object is lost as a cache entry,
never served wrong.

It also keeps the master's reservations (``Reservation``): space handed to a put still being
written, or freed while a reader may still copy from it. A restarted master learns them with
the announcement and keeps that space out of reuse until each ends, so a writer or reader of
the master that died never meets an object of the new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

from kvpool.common.types import ObjectRecord, Reservation

PRUNE_EVERY_S = 1.0


class Manifest:
    """Thread-safe ``key -> ObjectRecord`` of one node, one record per (segment, offset)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, ObjectRecord] = {}
        self._by_place: dict[tuple[str, int], str] = {}
        self._bytes: dict[str, int] = {}   # segment id -> bytes of its committed objects
        # Space a restarted master must not reuse yet, by place (``until`` on ``clock``).
        self._reserved: dict[tuple[str, int], Reservation] = {}
        self._clock = clock
        self._pruned = clock()

    def __len__(self) -> int:
        return len(self._by_key)

    def apply(self, committed: Iterable[ObjectRecord], removed: Iterable[tuple[str, int]],
              reserved: Iterable[Reservation] = ()) -> None:
        """Apply one heartbeat's delta: reservations (a newer one at a place replaces the
        older), commits (each ends its put's reservation), then removals of the version named
        (so a key committed, removed and committed again in one interval keeps the last)."""
        with self._lock:
            for res in reserved:
                self._reserved[(res.segment_id, res.offset)] = res
            self._prune_reserved()
            for r in committed:
                res = self._reserved.get((r.segment_id, r.offset))
                if res is not None and res.key == r.key:
                    del self._reserved[(r.segment_id, r.offset)]
                self._drop(r.key)
                # A record at the same place is stale: the master reused the space, so that
                # object's removal was lost (e.g. with a master that died).
                stale = self._by_place.get((r.segment_id, r.offset))
                if stale is not None:
                    self._drop(stale)
                self._by_key[r.key] = r
                self._by_place[(r.segment_id, r.offset)] = r.key
                self._bytes[r.segment_id] = self._bytes.get(r.segment_id, 0) + r.size
            for key, version in removed:
                r = self._by_key.get(key)
                if r is not None and r.version == version:
                    self._drop(key)

    def forget(self, keys: Iterable[str]) -> None:
        """Drop these keys (the master refused them when they were announced)."""
        with self._lock:
            for key in keys:
                self._drop(key)

    def forget_records(self, records: Iterable[ObjectRecord]) -> None:
        """Drop these records, each only while it is the key's current one (a key committed
        again since keeps its new record)."""
        with self._lock:
            for r in records:
                if self._by_key.get(r.key) == r:
                    self._drop(r.key)

    def forget_segments(self, segment_ids: Iterable[str]) -> None:
        """Drop every record in these segments (their memory is gone)."""
        ids = set(segment_ids)
        with self._lock:
            for key in [k for k, r in self._by_key.items() if r.segment_id in ids]:
                self._drop(key)
            for place in [p for p in self._reserved if p[0] in ids]:
                del self._reserved[place]

    def reservations(self) -> list[Reservation]:
        """The reservations still running (``until`` on this manifest's clock)."""
        with self._lock:
            self._prune_reserved(force=True)
            return list(self._reserved.values())

    def _prune_reserved(self, force: bool = False) -> None:
        now = self._clock()
        if force or now - self._pruned >= PRUNE_EVERY_S:
            self._pruned = now
            for place in [p for p, r in self._reserved.items() if r.until <= now]:
                del self._reserved[place]

    def bytes_by_segment(self) -> dict[str, int]:
        """Bytes of the committed objects in each segment (object sizes, not aligned)."""
        with self._lock:
            return {sid: n for sid, n in self._bytes.items() if n}

    def get(self, key: str) -> ObjectRecord | None:
        """The record of ``key``, or None."""
        return self._by_key.get(key)

    def records(self) -> list[ObjectRecord]:
        """A snapshot, ordered by segment and offset."""
        with self._lock:
            return sorted(self._by_key.values(), key=lambda r: (r.segment_id, r.offset))

    def batches(self, size: int) -> list[Sequence[ObjectRecord]]:
        """The snapshot in batches of at most ``size`` records (one AnnounceObjects each)."""
        records = self.records()
        return [records[i:i + size] for i in range(0, len(records), size)]

    def _drop(self, key: str) -> None:
        r = self._by_key.pop(key, None)
        if r is not None:
            self._by_place.pop((r.segment_id, r.offset), None)
            self._bytes[r.segment_id] -= r.size
