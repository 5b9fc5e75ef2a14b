"""The store node's manifest: deltas applied in order, stale records replaced, batches."""

from __future__ import annotations

from kvpool.common.types import ObjectRecord
from kvpool.store_node.manifest import Manifest


def rec(key: str, offset: int = 0, version: int = 1, segment: str = "s") -> ObjectRecord:
    return ObjectRecord(key, segment, offset, 64, 123, version)


def test_commit_remove_commit_in_one_delta_keeps_the_last():
    m = Manifest()
    m.apply([rec("a", 0, 1), rec("a", 64, 2)], [("a", 1)])
    assert m.records() == [rec("a", 64, 2)]


def test_commit_then_remove_in_one_delta_drops_it():
    m = Manifest()
    m.apply([rec("a", 0, 1), rec("b", 64, 2)], [("a", 1)])
    assert [r.key for r in m.records()] == ["b"]


def test_a_record_at_a_reused_place_replaces_the_stale_one():
    m = Manifest()
    m.apply([rec("a", 0, 1)], [])
    m.apply([rec("b", 0, 2)], [])   # a's removal never arrived; b took its space
    assert [r.key for r in m.records()] == ["b"]


def test_forget_and_batches():
    m = Manifest()
    m.apply([rec(f"k{i}", 64 * i, i) for i in range(5)], [])
    m.forget(["k1"])
    assert [len(b) for b in m.batches(2)] == [2, 2]
    m.forget_segments(["s"])
    assert len(m) == 0 and m.batches(2) == []
