"""Recovery on its own: the announcing window, tombstones, what an announcement may not bring
back."""

from __future__ import annotations

import pytest
from kvpool.common.errors import Conflict
from kvpool.common.types import Extent, ObjectRecord
from kvpool.master.index import COMPLETE, ObjectIndex
from kvpool.master.recovery import Recovery


def entry(key: str, version: int):
    return ObjectIndex().add(key, 10, [Extent("s", 0, 10)], version, state=COMPLETE)


def record(key: str, version: int, segment_id: str = "s") -> ObjectRecord:
    return ObjectRecord(key, segment_id, 0, 10, None, version)


def test_tombstones_last_for_twice_the_node_ttl_after_the_first_mount_and_while_recovering():
    r = Recovery(node_ttl_s=5.0)
    r.tombstone(entry("before", 1), 0.0)   # no mount yet: nobody can announce it
    r.check_unindexed(record("before", 1))
    r.mounted(1.0)
    r.mounted(8.0)                          # only the first mount starts the window
    r.tombstone(entry("gone", 3), 2.0)
    with pytest.raises(Conflict, match="removed or evicted"):
        r.check_unindexed(record("gone", 3))
    r.check_unindexed(record("gone", 4))   # another version of the key is welcome
    r.recover("s", 10.5)
    r.end_tombstones(11.0)                  # the window is over, but a segment still recovers
    with pytest.raises(Conflict):
        r.check_unindexed(record("gone", 3))
    assert r.announced(["s"], 11.0)
    r.end_tombstones(11.0)
    r.check_unindexed(record("gone", 3))
    r.tombstone(entry("late", 1), 12.0)    # after the window, with none recovering: none kept
    r.check_unindexed(record("late", 1))


def test_announced_says_whether_any_segment_still_recovers_and_times_the_recovery():
    r = Recovery(node_ttl_s=5.0)
    r.recover("a", 1.0)
    r.recover("b", 2.0)
    assert not r.announced(["a"], 3.0) and r.last_duration_s is None
    assert r.announced(["b", "c"], 4.5)
    assert r.last_duration_s == 3.5        # from the first segment to recover to the last done
    r.recover("d", 10.0)
    assert r.announced(["d"], 10.25) and r.last_duration_s == 0.25


def test_an_expired_segment_brings_back_nothing_the_index_does_not_hold():
    r = Recovery(node_ttl_s=5.0)
    r.expired_segments.add("dead")
    with pytest.raises(Conflict, match="declared dead"):
        r.check_unindexed(record("k", 1, "dead"))
    r.check_unindexed(record("k", 1, "alive"))
