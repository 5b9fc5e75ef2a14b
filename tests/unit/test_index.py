"""ObjectIndex on its own: versions, the PENDING count, lookups and the columnar answer."""

from __future__ import annotations

import pytest
from kvpool.common import checksum
from kvpool.common.errors import NotPending, ObjectNotFound
from kvpool.common.types import Extent
from kvpool.master.index import COMPLETE, ObjectIndex


def test_new_versions_come_after_every_announced_one():
    index = ObjectIndex()
    assert index.add("a", 10, [Extent("s", 0, 10)]).version == 1
    assert index.add("b", 10, [Extent("s", 64, 10)], version=41, state=COMPLETE).version == 41
    assert index.add("c", 10, [Extent("s", 128, 10)]).version == 42
    assert index.add("d", 10, [Extent("s", 192, 10)], version=7, state=COMPLETE).version == 7
    assert index.new_version() == 43   # an older announced version does not lower the next


def test_pending_entries_are_counted_until_committed_or_discarded_and_never_read():
    index = ObjectIndex()
    a = index.add("a", 10, [Extent("s", 0, 10)])
    b = index.add("b", 10, [Extent("s", 64, 10)])
    assert index.pending == 2
    with pytest.raises(ObjectNotFound):
        index.complete("a")
    index.commit(a, 123)
    index.discard(b)
    assert index.pending == 0 and index.complete("a").checksum == 123
    with pytest.raises(NotPending):
        index.pending_entry("a")
    assert index.exists(["a", "b", 5]) == [True, False, False]


def test_entries_of_one_size_share_one_int():
    index = ObjectIndex()
    sizes = [index.add(f"k{i}", int(f"{1 << 20}"), [Extent("s", i << 20, 1 << 20)]).size
             for i in range(3)]
    assert sizes[0] is sizes[1] is sizes[2]


def test_columns_hold_zeros_for_misses_and_every_replica_in_key_order():
    index = ObjectIndex()
    a = index.add("a", 10, [Extent("s1", 0, 10), Extent("s2", 64, 10)], state=COMPLETE,
                  checksum=5)
    b = index.add("b", 20, [Extent("s1", 64, 20)], state=COMPLETE)
    miss = ObjectNotFound("'x' not found")
    c = index.columns([a, None, b], [a, b], {1: miss})
    assert c.errors == {1: miss}
    assert (c.sizes, c.versions, c.counts) == ([10, 0, 20], [1, 0, 2], [2, 0, 1])
    assert [checksum.decode(x) for x in c.checksums] == [5, None, None]
    assert (c.segment_ids, c.offsets) == (["s1", "s2", "s1"], [0, 64, 64])
