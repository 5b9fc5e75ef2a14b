"""Space on its own: deferred frees (quarantine counts, reservations in the manifest, a dropped
segment's space left alone) and put deadlines."""

from __future__ import annotations

from kvpool.common.types import Extent, Reservation, SegmentInfo
from kvpool.master.allocator import RangeAllocator
from kvpool.master.index import ObjectIndex
from kvpool.master.manifest_log import ManifestLog
from kvpool.master.membership import Segment
from kvpool.master.space import Space


def segment(sid: str, manifest=None) -> Segment:
    return Segment("n1", SegmentInfo(sid, 4096), RangeAllocator(4096, 64), manifest=manifest)


def test_a_deferred_free_is_quarantined_and_reserved_in_the_manifest_until_due():
    log = ManifestLog()
    segments = {"s": segment("s", log.keep("n1"))}
    space, alloc = Space(segments, {}), segments["s"].allocator
    offset = alloc.allocate(100)
    space.free_later([Extent("s", offset, 100)], 5.0)
    assert (alloc.used_bytes, segments["s"].quarantined_bytes) == (128, 128)
    assert log.take("n1").reserved == [Reservation("", "s", offset, 100, 5.0)]
    space.release_due(4.9)
    assert alloc.used_bytes == 128
    space.release_due(5.0)
    assert (alloc.used_bytes, segments["s"].quarantined_bytes) == (0, 0)


def test_a_deferred_free_of_a_dropped_segment_leaves_its_remounted_namesake_alone():
    segments = {"s": segment("s")}
    space = Space(segments, {})
    space.free_later([Extent("s", segments["s"].allocator.allocate(100), 100)], 1.0)
    segments["s"] = again = segment("s")   # dropped, mounted again: a new allocator
    taken = again.allocator.allocate(100)
    space.release_due(2.0)
    assert again.allocator.used_bytes == 128 and again.quarantined_bytes == 0
    assert taken == 0


def test_puts_come_due_by_deadline_batch_by_batch():
    index = ObjectIndex()
    space = Space({}, index.more)
    a, b, c = (index.add(k, 10, [Extent("s", 0, 10)]) for k in "abc")
    space.put_deadline(3.0, [c])
    space.put_deadline(1.0, [a, b])
    assert list(space.puts_due(0.5)) == []
    assert list(space.puts_due(2.0)) == [a, b]
    assert list(space.puts_due(9.0)) == [c]
    assert list(space.puts_due(9.0)) == []
