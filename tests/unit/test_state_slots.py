"""MasterState: slots (client/slots.py), placeholders a writer fills later with keys of its
own (PutStart ``slots``, PutEnd ``as_keys``)."""

from __future__ import annotations

from kvpool.common.errors import AlreadyExists, InvalidArgument, NoSpace, NotPending
from kvpool.common.types import ObjectRecord, Reservation, SegmentInfo
from kvpool.master.allocator import PHASE_BYTES
from kvpool.master.state import MasterState

from .conftest import get_replicas
from .test_state import QUARANTINE_S, endpoints, make_state, segment


def slots(state: MasterState, n: int, size: int, prefix: str = "slot") -> list[str]:
    keys = [f"{prefix}{i}" for i in range(n)]
    placed = state.put_start_extents(keys, [size] * n, 1, slots=True)
    assert all(isinstance(p, list) for p in placed), placed
    return keys


def test_a_slot_is_committed_as_the_key_that_fills_it_and_its_tail_freed(clock):
    state = make_state(clock)
    state.mount_segment(endpoints("n1"), SegmentInfo("s1", 1 << 20), keeps_manifest=True)
    [a, b] = slots(state, 2, 64 << 10)
    assert state.take_manifest("n1").reserved == []   # the writer reserves slots itself
    assert state.pending_version(a) != state.pending_version(b)   # one version each
    version = state.pending_version(a)
    assert segment(state, "s1").used_bytes == 2 * (64 << 10)
    assert state.put_end([a], [0x1234], ["k"], [1000], ["p"]) == [None]
    [view] = get_replicas(state, ["k"])
    # A slot is a large extent: it starts half a page in (master/allocator.py).
    base = PHASE_BYTES
    assert (view.size, view.version, view.replicas[0].extent.offset) == (1000, version, base)
    assert state.exists([a, "k"]) == [False, True]
    assert segment(state, "s1").used_bytes == (64 << 10) + 1024   # the tail is free again
    stats = state.stats()
    assert (stats.objects, stats.pending_objects) == (1, 1)
    [record] = state.take_manifest("n1").committed
    assert record == ObjectRecord("k", "s1", base, 1000, 0x1234, version, "p")
    # The tail takes a new object at once.
    [placed] = state.put_start_extents(["next"], [4096])
    assert placed[0].offset == base + 1024


def test_a_slot_filled_with_a_stored_key_is_released_into_quarantine(clock):
    state = make_state(clock)
    state.mount_segment(endpoints("n1"), SegmentInfo("s1", 1 << 20), keeps_manifest=True)
    state.put_start(["k"], [100])
    assert state.put_end(["k"]) == [None]
    [s] = slots(state, 1, 4096)
    state.take_manifest("n1")
    [err] = state.put_end([s], [7], ["k"], [100])
    assert isinstance(err, AlreadyExists)
    # Its writer may have sealed "k" in the slot at the node: the quarantine's reservation
    # (keyed "") drops that seal there, and keeps the space out of reuse meanwhile.
    [res] = state.take_manifest("n1").reserved
    assert (res.key, res.size, res.until) == ("", 4096, clock() + QUARANTINE_S)
    assert state.stats().pending_objects == 0
    [again] = state.put_end([s], [7], ["k2"], [100])
    assert isinstance(again, NotPending)
    [view] = get_replicas(state, ["k"])
    assert view.size == 100


def test_a_slot_is_filled_only_within_its_size_and_its_tenant(clock):
    state = make_state(clock)
    state.mount_segment(endpoints("n1"), SegmentInfo("s1", 1 << 20))
    for key, size in (("big", 4097), ("\x1dother\x1dk", 10), ("", 10), ("zero", 0)):
        [s] = slots(state, 1, 4096, prefix=f"{key!r}{size}")
        [err] = state.put_end([s], [1], [key], [size])
        assert isinstance(err, InvalidArgument), (key, size, err)
    assert state.stats().pending_objects == 0


def test_slots_never_used_are_reclaimed_as_puts_are(clock):
    state = make_state(clock)
    state.mount_segment(endpoints("n1"), SegmentInfo("s1", 1 << 20))
    slots(state, 3, 4096)
    clock.advance(11.0)   # past put_timeout_s
    state.tick()
    assert state.stats().pending_objects == 0
    clock.advance(QUARANTINE_S + 1)
    state.tick()
    assert segment(state, "s1").used_bytes == 0


def test_a_restarted_master_indexes_a_filled_slot_and_ignores_its_reservation(clock):
    state = make_state(clock)
    state.mount_segment(endpoints("n1"), SegmentInfo("s1", 1 << 20))
    [s] = slots(state, 1, 8192)
    version = state.pending_version(s)
    assert state.put_end([s], [5], ["k"], [100]) == [None]
    new = make_state(clock)
    new.mount_segment(endpoints("n1"), SegmentInfo("s1", 1 << 20), recovering=True)
    # The node announces the record and the writer's reservation of the whole slot.
    assert new.announce_objects("n1", [ObjectRecord("k", "s1", 0, 100, 5, version)], done=True,
                                reserved=[Reservation(s, "s1", 0, 8192, clock() + 60)]) == [None]
    assert segment(new, "s1").used_bytes == 128   # the slot's tail is free: nobody writes there


def test_slots_hold_at_most_a_quarter_of_what_puts_started_may(clock):
    state = make_state(clock, max_pending_fraction=0.5)
    state.mount_segment(endpoints("n1"), SegmentInfo("s1", 1 << 20))
    placed = state.put_start_extents([f"slot{i}" for i in range(3)], [64 << 10] * 3, 1,
                                     slots=True)
    assert [isinstance(p, list) for p in placed] == [True, True, False]
    assert isinstance(placed[2], NoSpace) and "slots" in str(placed[2])
    # The puts themselves still have the rest of max_pending_fraction.
    placed = state.put_start_extents([f"k{i}" for i in range(6)], [64 << 10] * 6)
    assert all(isinstance(p, list) for p in placed)


def test_a_forked_child_takes_no_slot_of_its_parent(monkeypatch):
    """A child forked with a client shares its parent's slots and has no helper thread: it
    takes none (two processes filling one slot would write over each other)."""
    import os

    from kvpool.client import slots as client_slots
    pool = client_slots.SlotPool(None, lambda replica: None, 1)
    child = os.getpid() + 1
    monkeypatch.setattr(client_slots.os, "getpid", lambda: child)
    assert pool.take(4096) is None
    assert pool._thread is None   # and asks for none


def test_a_batch_takes_a_slot_for_each_value_or_none():
    """SlotPool.take_many: one free slot per value, of each value's size class, or nothing
    taken at all (the batch then goes the usual way); slots past their deadline are passed
    by."""
    import math
    import time

    from kvpool.client import slots as client_slots
    from kvpool.common.types import Extent, NodeEndpoints, Replica
    from kvpool.net.data_port import PutRecord

    pool = client_slots.SlotPool(None, lambda replica: None, 1)
    now = time.monotonic()

    def slot(n: int, size: int, deadline: float):
        return client_slots.Slot(f"s{n}", Replica(NodeEndpoints("n", "b", "n:1"),
                                                  Extent("seg", n * size, size)),
                                 PutRecord(f"s{n}", n + 1, 1, 30.0), "", deadline)

    small, large = client_slots.size_class(4096), client_slots.size_class(1 << 20)
    for size in (small, large):
        pool._backoff[size] = math.inf   # no helper asks the (absent) master for more
    pool._free[small] = [slot(0, small, now + 60), slot(1, small, now + 30),
                         slot(2, small, now - 1)]   # soonest deadline last: one expired
    pool._free[large] = [slot(3, large, now + 60)]
    assert pool.take_many([4096, 1 << 20, 4096, 4096]) is None   # 3 small asked, 2 live
    assert [s.key for s in pool._free[small]] == ["s0", "s1"] and len(pool._free[large]) == 1
    got = pool.take_many([100, 1 << 20, 4000])
    assert [s.key for s in got] == ["s1", "s3", "s0"] and pool.used == 3
    assert pool._free[small] == [] and pool._free[large] == []
    assert pool.take_many([4096]) is None and pool.take(4096) is None
    assert [s.key for s in pool._stale] == ["s2"]   # to be revoked
    assert pool._thread is None
