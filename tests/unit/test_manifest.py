"""The store node's manifest: deltas applied in order, stale records replaced, batches."""

from __future__ import annotations

import pytest
from kvpool.common.types import ObjectRecord, Reservation
from kvpool.net import seal_board
from kvpool.store_node.manifest import Board, Manifest, SealConflict, StaleEpoch


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



# -- a writer's reservations and seals (store_node/manifest.py; DESIGN.md, Put) --

def test_a_writer_of_another_master_epoch_is_refused(clock):
    m = Manifest(clock)
    res = Reservation("k", "s", 0, 64, clock.now + 10)
    with pytest.raises(StaleEpoch):
        m.reserve(1, res)   # no master known yet
    m.set_epoch(2)
    with pytest.raises(StaleEpoch):
        m.reserve(1, res)
    with pytest.raises(StaleEpoch):
        m.seal(1, rec("k"))
    assert m.reservations() == [] and m.records() == []
    m.reserve(2, res)
    assert m.reservations() == [res]


def test_a_seal_is_announced_until_the_master_commits_it_however_long_that_takes(clock):
    """A sealed record counts as committed (a restarted master indexes it), and time alone
    never ends it: the master may be down longer than any hold, and its PutEnd was answered."""
    m = Manifest(clock)
    m.set_epoch(5)
    m.seal(5, rec("confirmed", 0))
    m.seal(5, rec("waiting", 64))
    m.seal(5, rec("announced", 128))
    m.apply([rec("confirmed", 0)], [])            # the master's commit, on the stream
    m.confirm([rec("announced", 128)])            # indexed by a restarted master
    clock.advance(3600)
    assert [r.key for r in m.records()] == ["confirmed", "waiting", "announced"]
    assert m.sealed() == [rec("waiting", 64)]


def test_a_seal_that_arrives_after_the_masters_commit_leaves_nothing_pending(clock):
    """A single put sends PutEnd while its seal is on the way (client/kv_client.py): the
    master's commit may reach the node first. The seal then finds the record committed and
    waits for no word that already came."""
    m = Manifest(clock)
    m.set_epoch(5)
    m.reserve(5, Reservation("k", "s", 0, 64, clock.now + 10))
    m.apply([rec("k", 0)], [])
    m.seal(5, rec("k", 0))
    assert m.records() == [rec("k", 0)] and m.sealed() == []
    m.apply([], [("k", rec("k", 0).version)])     # and its removal ends it for good
    assert m.records() == [] and m.sealed() == []


def test_a_reservation_of_another_key_drops_a_seal_it_overlaps(clock):
    """Reserved or committed space is the master's to give: a seal still there overlapping it
    is stale (its put was revoked or timed out, never committed)."""
    m = Manifest(clock)
    m.set_epoch(5)
    m.seal(5, ObjectRecord("old", "s", 64, 128, 1, 1))
    m.reserve(5, Reservation("new", "s", 128, 64, clock.now + 10))
    assert m.records() == []
    m.seal(5, ObjectRecord("old2", "s", 64, 128, 1, 2))
    m.apply([], [], [Reservation("new2", "s", 0, 128, clock.now + 10)])
    assert m.records() == []
    m.seal(5, ObjectRecord("old3", "s", 64, 128, 1, 3))
    m.apply([ObjectRecord("moved", "s", 0, 128, 1, 4)], [])   # a commit over it, elsewhere
    assert [r.key for r in m.records()] == ["moved"]


def test_only_the_seals_a_reservation_overlaps_go(clock):
    m = Manifest(clock)
    m.set_epoch(5)
    for i in range(8):   # [128 i, 128 i + 128)
        m.seal(5, ObjectRecord(f"k{i}", "s", 128 * i, 128, 1, i + 1))
    m.seal(5, ObjectRecord("other-segment", "t", 128, 128, 1, 99))
    m.reserve(5, Reservation("new", "s", 100, 200, clock.now + 10))   # [100, 300)
    assert sorted(r.key for r in m.sealed()) == ["k3", "k4", "k5", "k6", "k7", "other-segment"]
    m.reserve(5, Reservation("k5", "s", 640, 128, clock.now + 10))   # its own seal stays
    m.apply([ObjectRecord("moved", "s", 900, 10, 1, 100)], [])       # inside k7's
    assert sorted(r.key for r in m.sealed()) == ["k3", "k4", "k5", "k6", "other-segment"]


def test_a_seal_in_space_the_master_released_is_refused(clock):
    """A put that timed out (or a slot the master could not commit) is released into
    quarantine, keyed "": its writer's seal, however late, is not taken there."""
    m = Manifest(clock)
    m.set_epoch(5)
    m.reserve(5, Reservation("k", "s", 0, 64, clock.now + 10))
    m.apply([], [], [Reservation("", "s", 0, 64, clock.now + 10)])
    with pytest.raises(SealConflict):
        m.seal(5, rec("k", 0))
    assert m.records() == []


def test_a_slot_seal_never_drops_another_record_of_its_key(clock):
    """A slot (client/slots.py) is reserved under its placeholder, and the master checks the
    key that fills it only beside the seal: a seal of a key this node holds another record of
    is refused, so a duplicate put never makes the node forget the stored object."""
    m = Manifest(clock)
    m.set_epoch(5)
    m.apply([rec("k", 0, version=1)], [])                   # stored, committed
    m.reserve(5, Reservation("slot1", "s", 128, 64, clock.now + 10))
    with pytest.raises(SealConflict):
        m.seal(5, rec("k", 128, version=2))
    m.seal(5, rec("sealed", 256, version=3))                # another writer's, sealed
    m.reserve(5, Reservation("slot2", "s", 384, 64, clock.now + 10))
    with pytest.raises(SealConflict):
        m.seal(5, rec("sealed", 384, version=4))
    assert m.records() == [rec("k", 0, version=1), rec("sealed", 256, version=3)]
    m.seal(5, rec("fresh", 128, version=2))                 # a new key fills its slot
    assert m.get("fresh") == rec("fresh", 128, version=2)


# -- seals on a writer's seal board (net/seal_board.py) --

def board_of(m: Manifest, clock, epoch: int, cells: dict[int, tuple[str, int, int]]):
    """A board whose cell i is bound to a slot (placeholder, offset, version) reserved at
    ``epoch``; and a writer's fill of a cell."""
    board = Board(-1, bytearray(seal_board.BOARD_BYTES))
    for i, (placeholder, offset, version) in cells.items():
        m.reserve(epoch, Reservation(placeholder, "s", offset, 64, clock.now + 10), version,
                  (board, i))
    seq = iter(range(1, 1000))

    def fill(i: int, key: str, length: int = 64) -> None:
        assert seal_board.fill(board.buf, i, next(seq), key, length, 123, None)
    return board, fill


def test_a_filled_cell_is_a_seal_before_the_epoch_changes(clock):
    """The writer's PutEnd may be acknowledged by a master that dies before its commit is
    streamed: the seal in the cell is taken before the node mounts on the next master, and
    announced like any seal."""
    m = Manifest(clock)
    m.set_epoch(5)
    board, fill = board_of(m, clock, 5, {0: ("slot0", 0, 1), 1: ("slot1", 64, 2)})
    fill(0, "k")
    assert m.records() == []                       # not read on the put's path
    m.set_epoch(6)
    assert m.sealed() == [rec("k", 0, version=1)]   # the slot's place and version
    assert board.cells == {}                       # slot1's cell, never filled, is void too
    fill(1, "late")                                # filled after: its master is gone
    m.set_epoch(7)
    assert [r.key for r in m.records()] == ["k"]


def test_the_masters_word_at_a_cells_place_voids_it(clock):
    """A commit at the slot's place (the master's word on the put), or a reservation there
    (its space given again: a slot released), ends the cell: what it says is never taken
    later, after a removal of the object say."""
    m = Manifest(clock)
    m.set_epoch(5)
    board, fill = board_of(m, clock, 5, {0: ("slot0", 0, 1), 1: ("slot1", 64, 2)})
    fill(0, "k")
    fill(1, "dup")
    m.apply([rec("k", 0, version=1)], [], [Reservation("", "s", 64, 64, clock.now + 10)])
    m.apply([], [("k", 1)])                        # evicted
    m.set_epoch(6)
    assert m.records() == [] and board.cells == {}


def test_a_boards_cells_are_taken_in_the_order_they_were_filled(clock):
    """A duplicate put of a key through another slot is refused at the node only if the first
    one's seal is taken first: binding any cell again takes every filled one, by ``seq``."""
    m = Manifest(clock)
    m.set_epoch(5)
    # The duplicate's slot was bound first (slots are taken in any order).
    board, fill = board_of(m, clock, 5, {0: ("slot0", 0, 2), 1: ("slot1", 64, 1)})
    fill(1, "k")
    fill(0, "k")                                   # the duplicate, refused by the master
    m.reserve(5, Reservation("slot2", "s", 128, 64, clock.now + 10), 3, (board, 1))
    assert m.records() == [rec("k", 64, version=1)]
    assert list(board.cells) == [1]


def test_a_closed_writers_cells_are_seals_and_torn_or_oversized_ones_are_not(clock):
    m = Manifest(clock)
    m.set_epoch(5)
    board, fill = board_of(m, clock, 5, {i: (f"slot{i}", 64 * i, i + 1) for i in range(4)})
    fill(0, "whole")
    fill(1, "torn")
    board.buf[seal_board.CELL_BYTES + 33] ^= 1     # a fill caught half way (its key)
    fill(2, "too-long", length=65)                 # longer than its slot
    m.release_board(board)
    assert m.records() == [rec("whole", 0, version=1)] and board.cells == {}
