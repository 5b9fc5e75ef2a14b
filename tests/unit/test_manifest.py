"""The store node's manifest: deltas applied in order, stale records replaced, batches."""

from __future__ import annotations

from kvpool.common.types import ObjectRecord, Reservation
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


def test_forgetting_a_record_keeps_a_newer_one_of_its_key():
    manifest = Manifest()
    old = ObjectRecord("k", "s", 0, 64, 1, 1)
    new = ObjectRecord("k", "s", 128, 64, 2, 2)
    manifest.apply([old], [])
    manifest.apply([new], [("k", 1)])
    manifest.forget_records([old])
    assert manifest.get("k") == new
    manifest.forget_records([new])
    assert manifest.get("k") is None


def test_reservations_end_with_their_commit_or_their_time(clock):
    m = Manifest(clock)
    m.apply([], [], [Reservation("p", "s", 0, 64, clock.now + 10),
                     Reservation("", "s", 128, 64, clock.now + 2),
                     Reservation("q", "t", 0, 64, clock.now + 10)])
    # A commit of another key at "p"'s place (stale order) leaves "p"'s reservation alone.
    m.apply([ObjectRecord("x", "s", 0, 64, 1, 1)], [("x", 1)])
    assert sorted(r.key for r in m.reservations()) == ["", "p", "q"]
    m.apply([ObjectRecord("p", "s", 0, 64, 1, 2)], [])
    assert sorted(r.key for r in m.reservations()) == ["", "q"]
    clock.advance(2)
    assert [r.key for r in m.reservations()] == ["q"]
    m.forget_segments(["t"])            # its memory is gone
    assert m.reservations() == []

