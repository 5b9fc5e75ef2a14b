"""The scrubber: re-checks the checksums of the objects a node holds while they sit idle, so
damage (a bad DIMM, a stray write) is found before a reader trips on it, and the damaged
replica is dropped from the master's index (then readers use another replica, or miss).

It reads at a bounded rate (``bytes_per_s``) so that it never competes with serving.
Only objects in the manifest are checked: they are committed, so their bytes never change
while they are indexed. A pass walks a snapshot, though, and an object evicted or removed since
may already lie under a new one's bytes: a mismatch counts only if the record is still in the
manifest after the read (the master reuses space only once the node has applied the removal).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from kvpool.common.checksum import checksum
from kvpool.common.errors import KVPoolError
from kvpool.common.logging import get_logger
from kvpool.common.loops import RESTART, Supervisor
from kvpool.common.types import ObjectRecord
from kvpool.store_node.manifest import Manifest
from kvpool.store_node.memory import Segment

log = get_logger(__name__)


def _checksum_of(r: ObjectRecord, seg: Segment) -> int:
    """The CRC-32C of the bytes ``r`` names in ``seg`` now; ValueError once it is closed."""
    if seg.host_addressable:
        return checksum(seg.buffer[r.offset:r.offset + r.size])
    host = bytearray(r.size)   # device memory: through a host copy
    seg.read_into(r.offset, memoryview(host))
    return checksum(host)


def recheck(manifest: Manifest, segments: Mapping[str, Segment],
            suspects: Sequence[tuple[str, int, str]]) -> list[ObjectRecord]:
    """The records among ``suspects`` (key, version, segment id: what readers reported
    corrupt) whose bytes here fail their checksum now. A reader's report alone never drops a
    replica (a client could name any object): only this node's own check does. A suspect
    the manifest does not hold as named, or holds without a checksum, is not confirmed."""
    bad = []
    for key, version, segment_id in suspects:
        r, seg = manifest.get(key), segments.get(segment_id)
        if r is None or seg is None or r.checksum is None or r.version != version \
                or r.segment_id != segment_id:
            continue
        try:
            if _checksum_of(r, seg) != r.checksum and manifest.get(key) == r:
                bad.append(r)
        except ValueError:   # the segment was closed: the node is stopping
            break
    return bad


class Scrubber:
    """Walks the manifest, checksumming each object's extent; reports the ones that differ."""

    def __init__(self, manifest: Manifest, segments: Mapping[str, Segment],
                 report: Callable[[Sequence[ObjectRecord]], None], bytes_per_s: int,
                 pass_interval_s: float = 60.0, supervisor: Supervisor | None = None):
        """``report(records)``: tell the master these replicas are damaged. ``bytes_per_s``:
        how fast to read; ``pass_interval_s``: rest between two passes over the manifest;
        ``supervisor``: runs the background thread (common/loops.py)."""
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, not {bytes_per_s}")
        self._manifest, self._segments, self._report = manifest, segments, report
        self._rate, self._rest_s = bytes_per_s, pass_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._supervisor = supervisor or Supervisor()
        # Read by the node's metrics (plain ints: one writer, readers tolerate a stale value).
        self.objects_checked = 0
        self.bytes_checked = 0
        self.corrupt_found = 0

    def scrub_once(self) -> list[ObjectRecord]:
        """One pass over the manifest at the configured rate; returns the damaged records
        (already reported and forgotten)."""
        bad: list[ObjectRecord] = []
        started, read = time.monotonic(), 0
        for r in self._manifest.records():
            if self._stop.is_set():
                break
            seg = self._segments.get(r.segment_id)
            if r.checksum is None or seg is None:
                continue
            try:
                crc = _checksum_of(r, seg)
            except ValueError:   # the segment was closed: the node is stopping
                break
            self.objects_checked += 1
            self.bytes_checked += r.size
            if crc != r.checksum and self._manifest.get(r.key) == r:
                bad.append(r)
            read += r.size
            ahead_s = read / self._rate - (time.monotonic() - started)
            if ahead_s > 0 and self._stop.wait(ahead_s):
                break
        if bad:
            self.corrupt_found += len(bad)
            log.warning("scrub_found_corrupt", objects=len(bad), keys=[r.key for r in bad[:8]])
            self._report(bad)
            self._manifest.forget_records(bad)
        return bad

    def start(self) -> None:
        # Scrubbing only finds damage sooner (readers check checksums too): whatever it hit,
        # the node serves on, and the scrubber starts a new pass.
        self._thread = self._supervisor.start_thread("scrubber", self._run, RESTART, self._stop)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.scrub_once()
            except KVPoolError as e:   # the report did not reach the master: next pass
                log.warning("scrub_report_failed", error=str(e))
            self._stop.wait(self._rest_s)
