"""A store node's manifest: the committed objects its segments hold, as the master told it.

The master sends what it committed in and dropped from the node's segments with each heartbeat
answer (``ManifestDelta``), so the put path pays nothing for it: no extra round trip, no write
to the node. When a master restarts with an empty index, the node re-announces the manifest
and the master indexes the objects again at exactly these extents.

The manifest lives in the node's memory, next to the segments it describes: it has to survive
a master restart, not a node restart (the segments are anonymous shared memory and go with the
node). What it can miss: objects committed in the last heartbeat interval before a master dies
(their delta never reached the node); those are lost as cache entries, never served wrong.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvpool.common.types import ObjectRecord


class Manifest:
    """Thread-safe ``key -> ObjectRecord`` of one node, one record per (segment, offset)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, ObjectRecord] = {}
        self._by_place: dict[tuple[str, int], str] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def apply(self, committed: Iterable[ObjectRecord], removed: Iterable[tuple[str, int]]) -> None:
        """Apply one heartbeat's delta: commits first, then removals of the version named (so
        a key committed, removed and committed again in one interval keeps the last)."""
        with self._lock:
            for r in committed:
                self._drop(r.key)
                # A record at the same place is stale: the master reused the space, so that
                # object's removal was lost (e.g. with a master that died).
                stale = self._by_place.get((r.segment_id, r.offset))
                if stale is not None:
                    self._drop(stale)
                self._by_key[r.key] = r
                self._by_place[(r.segment_id, r.offset)] = r.key
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
