"""MasterState: checksums, corrupt replicas, manifest deltas, rebuild from announcements, and
NoSpace that says how much room there is; all on the fake clock."""

from __future__ import annotations

import pytest
from kvpool.common.errors import Conflict, NoSpace, ObjectNotFound
from kvpool.common.types import ObjectRecord, Reservation, SegmentInfo
from kvpool.master.allocator import RangeAllocator
from kvpool.master.state import MasterState
from kvpool.store_node.manifest import Manifest

from .conftest import get_replicas
from .test_state import NODE_TTL_S, PUT_TIMEOUT_S, QUARANTINE_S, endpoints, make_state


def mount(state, node_id, segment_id, size=4096, **kw):
    state.mount_segment(endpoints(node_id), SegmentInfo(segment_id, size), **kw)


def put(state, key, size=64, replicas=None, crc=None):
    [placed] = state.put_start([key], [size], replicas)
    assert isinstance(placed, tuple), placed
    assert state.put_end([key], [crc]) == [None]
    return placed


# -- allocator ------------------------------------------------------------------------------

def test_allocate_at_takes_exactly_the_extent_and_refuses_overlaps():
    a = RangeAllocator(1024, 64)
    assert a.allocate_at(128, 100)         # rounds to 128 bytes: [128, 256)
    assert not a.allocate_at(192, 64)      # overlaps
    assert not a.allocate_at(100, 64)      # unaligned
    assert not a.allocate_at(1000, 64)     # past the end
    assert a.free_ranges() == [(0, 128), (256, 768)]
    assert a.used_bytes == 128
    a.free(128, 100)
    assert a.free_ranges() == [(0, 1024)]


# -- integrity ------------------------------------------------------------------------------

def test_checksum_is_kept_and_returned(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    put(state, "k", crc=0xDEADBEEF)
    [view] = get_replicas(state, ["k"])
    assert view.checksum == 0xDEADBEEF


def test_report_corrupt_drops_one_replica_then_the_object(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    mount(state, "n2", "s2")
    put(state, "k", replicas=2, crc=7)
    [view] = get_replicas(state, ["k"])   # leased now
    # A reader's report drops nothing: the replica's node is asked to re-check it.
    assert state.report_corrupt(["k"], [view.version], ["s1"]) == [None]
    assert len(get_replicas(state, ["k"])[0].replicas) == 2
    assert state.take_rechecks("n1") == [("k", view.version, "s1")]
    assert state.take_rechecks("n1") == []
    # The node's own report drops it; another node cannot report for a segment not its own.
    assert state.report_corrupt(["k"], [view.version], ["s1"], "n2") != [None]
    assert state.report_corrupt(["k"], [view.version], ["s1"], "n1") == [None]
    [after] = get_replicas(state, ["k"])
    assert [r.extent.segment_id for r in after.replicas] == ["s2"]
    # A stale report (another version) changes nothing; the last replica removes the object.
    state.report_corrupt(["k"], [view.version + 99], ["s2"], "n2")
    assert state.exists(["k"]) == [True]
    state.report_corrupt(["k"], [view.version], ["s2"], "n2")
    assert state.exists(["k"]) == [False]
    assert state.stats().corrupt_replicas == 2   # counted for alerts; not the stale report
    # The damaged space waits for the lease, then is free.
    clock.advance(10)
    state.tick()
    assert all(s.used_bytes == 0 and s.quarantined_bytes == 0 for s in state.stats().segments)


# -- manifest deltas and rebuild ------------------------------------------------------------

def test_heartbeat_carries_commits_and_removals_to_manifest_nodes(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", keeps_manifest=True)
    put(state, "a", crc=1)
    put(state, "b", crc=2)
    state.remove(["a"])
    delta = state.heartbeat("n1")
    assert [r.key for r in delta.committed] == ["a", "b"]
    assert [k for k, _ in delta.removed] == ["a"]
    assert state.heartbeat("n1").committed == []   # taken once
    mount(state, "n2", "s2")
    assert state.heartbeat("n2") is None           # keeps no manifest: nothing queued


def test_restarted_master_rebuilds_index_and_allocators_from_announcements(clock):
    old = make_state(clock)
    mount(old, "n1", "s1", keeps_manifest=True)
    mount(old, "n2", "s2", keeps_manifest=True)
    put(old, "a", 100, replicas=2, crc=11)
    put(old, "b", 200, crc=22)
    manifests = {n: old.heartbeat(n).committed for n in ("n1", "n2")}
    used = sorted((s.info.segment_id, s.used_bytes) for s in old.stats().segments)

    new = make_state(clock)
    for n, sid in (("n1", "s1"), ("n2", "s2")):
        mount(new, n, sid, keeps_manifest=True, recovering=True)
    # Nothing is placed in a recovering segment, so no announced extent is handed out twice.
    with pytest.raises(NoSpace):
        raise new.put_start(["c"], [64])[0]
    for n in ("n1", "n2"):
        assert new.announce_objects(n, manifests[n], done=True) == [None] * len(manifests[n])
        # Announcing again (a lost answer, retried) is harmless.
        assert new.announce_objects(n, manifests[n]) == [None] * len(manifests[n])
    assert sorted((s.info.segment_id, s.used_bytes) for s in new.stats().segments) == used
    a, b = get_replicas(new, ["a", "b"])
    assert (a.size, a.checksum, len(a.replicas)) == (100, 11, 2)
    assert (b.size, b.checksum) == (200, 22)
    # New objects get new versions, and land outside the announced extents.
    [placed] = new.put_start(["c"], [64])
    assert new.put_end(["c"]) == [None]
    [c] = get_replicas(new, ["c"])
    assert c.version not in (a.version, b.version)
    taken = {(r.extent.segment_id, r.extent.offset) for v in (a, b) for r in v.replicas}
    assert (placed[0].extent.segment_id, placed[0].extent.offset) not in taken


def test_conflicting_announcements_are_refused(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", keeps_manifest=True, recovering=True)
    ok = ObjectRecord("a", "s1", 0, 100, 5, 3)
    overlap = ObjectRecord("b", "s1", 64, 100, 6, 4)
    other_version = ObjectRecord("a", "s1", 1024, 100, 5, 9)
    foreign = ObjectRecord("c", "s9", 0, 100, 5, 1)
    results = state.announce_objects("n1", [ok, overlap, other_version, foreign], done=True)
    assert results[0] is None
    assert all(isinstance(r, Conflict) for r in results[1:])
    with pytest.raises(ObjectNotFound):
        raise get_replicas(state, ["b"])[0]


# -- back-pressure --------------------------------------------------------------------------

def test_no_space_says_what_was_asked_and_what_the_cluster_has(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=4096)
    put(state, "a", 2048)
    state.pin(["a"])
    results = state.put_start(["b", "c"], [1024, 3000])
    assert isinstance(results[0], tuple)          # b fits
    err = results[1]
    assert isinstance(err, NoSpace)
    msg = str(err)
    assert "3000 bytes" in msg and "1024 of 4096 bytes free" in msg, msg


# -- a node declared dead that comes back (partition healed) ---------------------------------

def test_node_back_from_the_dead_gets_only_still_indexed_replicas_back(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", keeps_manifest=True)
    put(state, "only_n1", 100, replicas=1, crc=3)   # n1 is the only node yet
    mount(state, "n2", "s2", keeps_manifest=True)
    put(state, "kept", 100, replicas=2, crc=1)
    put(state, "removed", 100, replicas=2, crc=2)
    manifest = state.heartbeat("n1").committed
    assert {r.key for r in manifest} == {"only_n1", "kept", "removed"}
    # n1 is cut off: only n2 heartbeats, so n1 is declared dead; meanwhile a removal.
    clock.advance(NODE_TTL_S / 2 + 0.1)
    state.heartbeat("n2")
    clock.advance(NODE_TTL_S / 2 + 0.1)
    state.heartbeat("n2")
    state.tick()
    assert state.stats().nodes == 1
    assert state.remove(["removed"]) == [None]
    # The partition heals: n1 re-mounts and re-announces what it holds.
    mount(state, "n1", "s1", keeps_manifest=True, recovering=True)
    results = dict(zip([r.key for r in manifest],
                       state.announce_objects("n1", manifest, done=True)))
    assert results["kept"] is None
    assert isinstance(results["removed"], Conflict)    # a removal never comes back
    assert isinstance(results["only_n1"], Conflict)   # dropped with n1: the index moved on
    [kept] = get_replicas(state, ["kept"])
    assert sorted(r.extent.segment_id for r in kept.replicas) == ["s1", "s2"]
    assert state.exists(["removed", "only_n1"]) == [False, False]
    for s in state.stats(audit=True).segments:   # refused objects hold no space
        assert s.used_bytes == s.indexed_bytes


def test_audit_stats_and_eviction_hook(clock):
    evicted = []
    state = MasterState(make_state(clock).config, clock,
                        on_evict=lambda key, version: evicted.append(key))
    mount(state, "n1", "s1", size=4096)
    put(state, "a", 2048)
    put(state, "b", 1024)
    [s] = state.stats().segments
    assert s.indexed_bytes is None
    [s] = state.stats(audit=True).segments
    assert s.indexed_bytes == s.used_bytes == 3072
    clock.advance(10)
    put(state, "c", 2048)   # room only by evicting "a", the least recently used
    assert evicted == ["a"]
    [s] = state.stats(audit=True).segments
    assert s.indexed_bytes == s.used_bytes == 3072


def test_new_objects_avoid_a_node_gone_silent_until_it_heartbeats(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    mount(state, "n2", "s2")
    clock.advance(NODE_TTL_S / 3 + 0.1)
    state.heartbeat("n2")
    state.tick()
    # n1 has said nothing for a third of the TTL: probably dead, so puts go to n2 (though s1
    # has as much room) rather than fail their writes there...
    for i in range(3):
        assert [r.extent.segment_id for r in put(state, f"k{i}")] == ["s2"]
    # ...unless they need it: two replicas need both nodes (not a NoSpace for a slow node).
    assert sorted(r.extent.segment_id for r in put(state, "two", replicas=2)) == ["s1", "s2"]
    state.heartbeat("n1")   # alive after all: used again at once
    assert [r.extent.segment_id for r in put(state, "b")] == ["s1"]
    # Every node silent (a master that stalled, not nodes that died): none is avoided.
    clock.advance(NODE_TTL_S / 3 + 0.1)
    state.tick()
    assert len(put(state, "c", replicas=2)) == 2


def test_hard_pins_travel_in_the_manifest_and_come_back_after_a_restart(clock):
    old = make_state(clock)
    mount(old, "n1", "s", size=4 * 64, keeps_manifest=True)
    for k in ("a", "b"):
        put(old, k)
    old.heartbeat("n1")
    assert old.pin(["a"]) == [None]
    assert old.pin(["b"], ttl_s=60) == [None]          # soft: not recorded
    [rec] = old.heartbeat("n1").committed               # the pin supersedes a's record
    assert (rec.key, rec.pinned) == ("a", True)
    assert old.unpin(["a"]) == [None]
    assert [r.pinned for r in old.heartbeat("n1").committed] == [False]
    assert old.pin(["a"]) == [None]
    [rec] = old.heartbeat("n1").committed

    new = make_state(clock)
    mount(new, "n1", "s", size=4 * 64, keeps_manifest=True, recovering=True)
    b = ObjectRecord("b", "s", 64, 64, None, 2)
    assert new.announce_objects("n1", [rec, b], done=True) == [None, None]
    for k in ("c", "d"):
        put(new, k)
    clock.advance(60)
    put(new, "e")                  # the segment is full: b goes, never the pinned a
    assert new.exists(["a", "b"]) == [True, False]
    assert [r.pinned for r in new.heartbeat("n1").committed if r.key == "a"] == [True]


def test_pins_restored_after_a_restart_are_not_held_to_a_partly_mounted_quota(clock):
    """Hard pins granted across two nodes come back whole although the first node to announce
    holds more than the quota of the segments mounted so far; new pins past the quota are
    still refused."""
    old = make_state(clock)
    mount(old, "n1", "s-n1", size=4 * 64, keeps_manifest=True)
    for k in ("a", "b", "c"):
        put(old, k)
    mount(old, "n2", "s-n2", size=4 * 64, keeps_manifest=True)
    assert old.pin(["a", "b", "c"]) == [None] * 3   # 192 bytes, quota 0.5 x 512 = 256
    manifest = {r.key: r for r in old.heartbeat("n1").committed}   # the last record wins
    assert sorted(manifest) == ["a", "b", "c"] and all(r.pinned for r in manifest.values())

    new = make_state(clock)
    mount(new, "n1", "s-n1", size=4 * 64, keeps_manifest=True, recovering=True)
    # n2 has not mounted yet: the quota so far is 0.5 x 256 = 128 < 192.
    assert new.announce_objects("n1", list(manifest.values()), done=True) == [None] * 3
    assert [new._pins.is_hard(new._objects[k]) for k in "abc"] == [True] * 3
    mount(new, "n2", "s-n2", size=4 * 64, keeps_manifest=True, recovering=True)
    assert new.announce_objects("n2", [], done=True) == []
    put(new, "d")
    assert new.pin(["d"]) == [None]                          # 256: at the quota
    put(new, "e")
    assert isinstance(new.pin(["e"])[0], NoSpace)             # 320: over it


def test_a_restarted_master_keeps_space_a_writer_or_reader_may_still_use_out_of_reuse(clock):
    """The old master handed "p" to a writer that has not committed, and freed "r" under a
    reader's lease, then died. Its nodes kept reservations of both; the new master keeps that
    space out of reuse until each one ends, instead of handing it to a new put whose bytes
    the late writer would overwrite (or whose bytes the late reader would take for "r")."""
    old = make_state(clock)
    mount(old, "n1", "s1", size=4 * 64, keeps_manifest=True)
    [p] = old.put_start(["p"], [64])
    put(old, "r", crc=1)
    [r] = get_replicas(old, ["r"])           # leased
    assert old.remove(["r"]) == [None]
    delta = old.take_manifest("n1")
    assert [(x.key, x.offset) for x in delta.reserved] == \
        [("p", p[0].extent.offset), ("r", r.replicas[0].extent.offset),
         ("", r.replicas[0].extent.offset)]
    put_ends = clock.now + PUT_TIMEOUT_S + QUARANTINE_S
    assert delta.reserved[0].until == put_ends
    lease_ends = delta.reserved[2].until
    node = Manifest(clock)                  # the node's, on the same clock here
    node.apply(delta.committed, delta.removed, delta.reserved)
    assert node.records() == []
    # "r"'s put reservation ended with its commit; its lease's replaced it at that place.
    assert sorted((x.key, x.until) for x in node.reservations()) == \
        [("", lease_ends), ("p", put_ends)]

    new = make_state(clock)
    mount(new, "n1", "s1", size=4 * 64, keeps_manifest=True, recovering=True)
    assert new.announce_objects("n1", node.records(), done=True,
                                reserved=node.reservations()) == []
    s = new.stats().segments[0]
    assert (s.used_bytes, s.quarantined_bytes, s.objects) == (0, 2 * 64, 0)
    taken = {p[0].extent.offset, r.replicas[0].extent.offset}
    placed = [put(new, f"n{i}") for i in range(3)]   # the third evicts: no space is free
    assert {x[0].extent.offset for x in placed}.isdisjoint(taken)
    clock.advance(lease_ends - clock.now)
    new.tick()                              # the reader's lease is over: its space is free
    assert new.stats().segments[0].quarantined_bytes == 64
    clock.advance(put_ends - clock.now)
    new.tick()                              # and the writer's put would have been reclaimed
    assert new.stats().segments[0].quarantined_bytes == 0


def test_a_reservation_overlapping_an_announced_object_is_stale_and_ignored(clock):
    new = make_state(clock)
    mount(new, "n1", "s1", size=4 * 64, keeps_manifest=True, recovering=True)
    rec = ObjectRecord("a", "s1", 0, 64, 1, 3)
    stale = Reservation("", "s1", 0, 64, clock.now + 60)
    assert new.announce_objects("n1", [rec], done=True, reserved=[stale]) == [None]
    s = new.stats().segments[0]
    assert (s.used_bytes, s.quarantined_bytes, s.objects) == (64, 0, 1)


def test_an_object_removed_while_its_other_replica_is_not_announced_yet_stays_removed(clock):
    """After a restart, node n1 announces "k" and a client removes it before n2 (its other
    replica) has announced: n2's copy must not bring it back."""
    old = make_state(clock)
    mount(old, "n1", "s1", keeps_manifest=True)
    mount(old, "n2", "s2", keeps_manifest=True)
    put(old, "k", replicas=2, crc=1)
    manifests = {n: old.take_manifest(n).committed for n in ("n1", "n2")}

    new = make_state(clock)
    mount(new, "n1", "s1", keeps_manifest=True, recovering=True)
    assert new.announce_objects("n1", manifests["n1"], done=True) == [None]
    assert new.remove(["k"]) == [None]
    mount(new, "n2", "s2", keeps_manifest=True, recovering=True)
    [refused] = new.announce_objects("n2", manifests["n2"], done=True)
    assert isinstance(refused, Conflict) and "removed or evicted" in str(refused)
    assert new.exists(["k"]) == [False]
    # Once every node had the time to announce (twice the node TTL), that is over: a node
    # announcing "k" now (it was never told otherwise) is believed.
    clock.advance(2 * NODE_TTL_S)
    new.heartbeat("n1")
    new.heartbeat("n2")
    new.tick()
    assert new.announce_objects("n2", manifests["n2"]) == [None]
