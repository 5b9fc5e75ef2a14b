"""MasterState: two-phase put, immutability, leases, eviction, reclaim, membership, stats."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpool.common.config import MasterConfig
from kvpool.common.errors import (
    AlreadyExists,
    InvalidArgument,
    NoSpace,
    NotPending,
    ObjectNotFound,
    UnknownNode,
    ValueTooLarge,
)
from kvpool.common.types import Extent, NodeEndpoints, ObjectView, Replica, SegmentInfo
from kvpool.master.state import MasterState

from .conftest import get_replicas

# Nodes live long by default so that tests about time do not also have to heartbeat.
LEASE_S, PUT_TIMEOUT_S, NODE_TTL_S, QUARANTINE_S = 5.0, 10.0, 100.0, 30.0


def make_state(clock, **overrides) -> MasterState:
    # These tests fill segments of a few objects with one put: no cap on what PENDING puts
    # hold (test_state_admission.py tests it), unless a test asks for one.
    cfg = {"lease_ttl_s": LEASE_S, "put_timeout_s": PUT_TIMEOUT_S, "node_ttl_s": NODE_TTL_S,
           "quarantine_s": QUARANTINE_S, "high_watermark": 0.95, "low_watermark": 0.85,
           "max_pending_fraction": 1.0}
    cfg.update(overrides)
    return MasterState(MasterConfig(**cfg), clock)


def endpoints(node_id: str, port: int = 7000) -> NodeEndpoints:
    return NodeEndpoints(node_id, f"boot-{node_id}", f"{node_id}:{port}")


def mount(state: MasterState, node_id: str, segment_id: str, size: int = 4096) -> None:
    state.mount_segment(endpoints(node_id), SegmentInfo(segment_id, size))


def put(state: MasterState, key: str, size: int = 64, replicas: int | None = None):
    [result] = state.put_start([key], [size], replicas)
    assert isinstance(result, tuple), result
    assert state.put_end([key]) == [None]
    return result


def segment(state: MasterState, segment_id: str):
    [s] = [s for s in state.stats().segments if s.info.segment_id == segment_id]
    return s


def nodes_of(replicas) -> list[str]:
    return [r.node.node_id for r in replicas]


# -- two-phase put ----------------------------------------------------------------------------

def test_put_is_invisible_until_put_end(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    [replicas] = state.put_start(["k"], [100])
    assert replicas == (Replica(endpoints("n1"), Extent("s1", 0, 100)),)
    assert state.exists(["k"]) == [False]
    [miss] = get_replicas(state, ["k"])
    assert isinstance(miss, ObjectNotFound)
    stats = state.stats()
    assert (stats.objects, stats.pending_objects, stats.misses) == (0, 1, 1)
    assert segment(state, "s1").used_bytes == 128          # 100 rounded to the 64-byte alignment

    assert state.put_end(["k"]) == [None]
    assert state.exists(["k"]) == [True]
    [view] = get_replicas(state, ["k"])
    assert view == ObjectView("k", 100, view.version, replicas)
    stats = state.stats()
    assert (stats.objects, stats.pending_objects, stats.hits) == (1, 0, 1)


def test_put_end_and_revoke_need_a_pending_object(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    put(state, "done")
    [err] = state.put_end(["never"])
    assert isinstance(err, NotPending)
    errors = state.put_end(["done"]) + state.put_revoke(["done"])
    assert all(isinstance(e, NotPending) for e in errors)
    assert state.exists(["done"]) == [True]             # a stray revoke does not remove it
    state.put_start(["p"], [64])
    assert state.put_revoke(["p"]) == [None]
    assert isinstance(state.put_revoke(["p"])[0], NotPending)
    assert isinstance(state.put_end(["p"])[0], NotPending)


def test_put_revoke_frees_space_at_once(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=64)
    [first] = state.put_start(["a"], [64])
    assert state.put_revoke(["a"]) == [None]
    s = segment(state, "s1")
    assert (s.used_bytes, s.quarantined_bytes, s.objects) == (0, 0, 0)
    [again] = state.put_start(["b"], [64])
    assert again[0].extent == first[0].extent
    assert state.stats().pending_objects == 1


# -- immutability and batches ------------------------------------------------------------------

def test_second_put_of_a_key_is_already_exists_and_changes_nothing(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    replicas = put(state, "k", 64)
    [before] = get_replicas(state, ["k"])
    used = segment(state, "s1").used_bytes
    [err] = state.put_start(["k"], [999])
    assert isinstance(err, AlreadyExists)
    [after] = get_replicas(state, ["k"])
    assert after == before and after.replicas == replicas and after.size == 64
    assert segment(state, "s1").used_bytes == used
    # A PENDING key is taken too.
    state.put_start(["p"], [64])
    assert isinstance(state.put_start(["p"], [64])[0], AlreadyExists)
    assert state.stats().pending_objects == 1


def test_same_key_twice_in_one_batch(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    first, second = state.put_start(["k", "k"], [64, 64])
    assert isinstance(first, tuple) and isinstance(second, AlreadyExists)
    assert segment(state, "s1").used_bytes == 64
    # Refused even when the first slot failed: a repeated key is the caller's bug.
    first, second = state.put_start(["j", "j"], [0, 64])
    assert isinstance(first, InvalidArgument) and isinstance(second, AlreadyExists)
    assert segment(state, "s1").used_bytes == 64 and state.stats().pending_objects == 1


def test_batch_with_mixed_good_and_bad_slots(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=4096)
    keys = ["good1", "", "x" * 1025, "zero", "neg", "huge", "good2"]
    sizes = [64, 64, 64, 0, -5, 10_000, 128]
    results = state.put_start(keys, sizes)
    kinds = [type(r) for r in results]
    assert kinds == [tuple, InvalidArgument, InvalidArgument, InvalidArgument, InvalidArgument,
                     ValueTooLarge, tuple]
    assert results[0][0].extent == Extent("s1", 0, 64)
    assert results[6][0].extent == Extent("s1", 64, 128)
    assert state.put_end(["good1", "", "zero", "good2"])[0] is None
    assert state.exists(["good1", "", "zero", "good2"]) == [True, False, False, True]
    with pytest.raises(InvalidArgument):
        state.put_start(["a", "b"], [64])


def test_replicas_below_one_is_invalid(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    assert all(isinstance(r, InvalidArgument) for r in state.put_start(["a", "b"], [64, 64], 0))
    assert state.stats().pending_objects == 0


def test_versions_are_unique_and_change_when_a_key_is_put_again(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    put(state, "a")
    put(state, "b")
    va, vb = (v.version for v in get_replicas(state, ["a", "b"]))
    assert va != vb
    clock.advance(LEASE_S)
    assert state.remove(["a"]) == [None]
    put(state, "a")
    [again] = get_replicas(state, ["a"])
    assert again.version not in (va, vb)


# -- leases and remove -------------------------------------------------------------------------

def test_remove_of_unleased_object_frees_at_once(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=64)
    put(state, "a")
    assert state.remove(["a"]) == [None]
    assert state.exists(["a"]) == [False]
    assert (segment(state, "s1").used_bytes, segment(state, "s1").quarantined_bytes) == (0, 0)
    put(state, "b")   # the only 64 bytes are reusable immediately
    state.put_start(["p"], [64])
    assert all(isinstance(e, ObjectNotFound) for e in state.remove(["p", "missing"]))


def test_remove_of_leased_object_defers_the_free_until_the_lease_ends(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=128)
    put(state, "a")
    [view] = get_replicas(state, ["a"])                   # lease until now + 5
    clock.advance(2)
    assert state.remove(["a"]) == [None]
    assert state.exists(["a"]) == [False]
    assert isinstance(get_replicas(state, ["a"])[0], ObjectNotFound)
    s = segment(state, "s1")
    assert (s.used_bytes, s.quarantined_bytes, s.objects) == (0, 64, 0)
    # The key may be put again at once, but not into the leased bytes.
    [new] = state.put_start(["a"], [64])
    assert new[0].extent.offset != view.replicas[0].extent.offset
    assert state.put_end(["a"]) == [None]
    get_replicas(state, ["a"])                            # so the new "a" is not evicted
    assert isinstance(state.put_start(["c"], [64])[0], NoSpace)   # leased bytes not reusable
    clock.advance(2.5)
    state.tick()
    assert segment(state, "s1").quarantined_bytes == 64
    clock.advance(0.5)                                   # the first lease has now run out
    state.tick()
    assert segment(state, "s1").quarantined_bytes == 0
    [c] = state.put_start(["c"], [64])
    assert c[0].extent == view.replicas[0].extent


def test_each_read_extends_the_lease(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=64)
    put(state, "a")
    get_replicas(state, ["a"])
    clock.advance(4)
    get_replicas(state, ["a"])                            # lease now runs to t+9
    clock.advance(4.5)
    state.remove(["a"])
    assert segment(state, "s1").quarantined_bytes == 64
    clock.advance(0.5)
    state.tick()
    assert segment(state, "s1").quarantined_bytes == 0


# -- eviction ----------------------------------------------------------------------------------

def test_put_evicts_least_recently_used_first(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=1024)
    for key in "abcd":
        put(state, key, 256)
    get_replicas(state, ["a"])                            # a is now the most recently used
    clock.advance(LEASE_S)
    [e] = state.put_start(["e"], [256])
    assert isinstance(e, tuple)
    assert state.exists(list("abcd")) == [True, False, True, True]
    assert e[0].extent.offset == 256                     # b's space
    [f] = state.put_start(["f"], [512])                  # needs c and d (contiguous)
    assert isinstance(f, tuple)
    assert state.exists(list("acd")) == [True, False, False]
    assert state.stats().evictions == 3


def test_a_read_counts_for_eviction_long_after_its_lease_closed(clock):
    """A lookup does not touch the eviction order: the walk reads each key's last read off its
    lease slot, which keeps a mark of the second a closed lease ended in."""
    state = make_state(clock)
    mount(state, "n1", "s1", size=1024)
    for key in "abcd":
        put(state, key, 256)
        clock.advance(1.0)
    get_replicas(state, ["b", "a"])
    assert list(state._chains.policy._leaves) == list("abcd")   # noqa: SLF001 (not touched)
    clock.advance(LEASE_S + 1.0)
    state.tick()                                         # the leases close
    assert len(state._leasing) == 0                      # noqa: SLF001
    [obj] = [state._objects["a"]]                        # noqa: SLF001
    assert obj.lease[0] == float("-inf") and obj.lease[1] <= clock.now - 1.0
    clock.advance(100.0)
    [e, f] = state.put_start(["e", "f"], [256, 256])
    assert isinstance(e, tuple) and isinstance(f, tuple)
    assert state.exists(list("abcd")) == [True, True, False, False]
    get_replicas(state, ["a"])                           # leased again: counted again
    assert len(state._leasing) == 1                      # noqa: SLF001


def test_eviction_skips_pinned_leased_and_pending_objects(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=256)
    put(state, "pinned")
    put(state, "leased")
    state.put_start(["pending"], [64])
    put(state, "plain")
    assert state.pin(["pinned"]) == [None]
    get_replicas(state, ["leased"])
    [x] = state.put_start(["x"], [64])
    assert isinstance(x, tuple)
    assert state.exists(["pinned", "leased", "plain"]) == [True, True, False]
    assert state.stats().pending_objects == 2
    before = state.stats()
    [err] = state.put_start(["y"], [64])
    assert isinstance(err, NoSpace)
    after = state.stats()
    assert after.evictions == before.evictions and after.segments == before.segments
    assert state.unpin(["pinned"]) == [None]
    assert isinstance(state.put_start(["y"], [64])[0], tuple)
    assert state.exists(["pinned", "leased"]) == [False, True]


def test_put_only_evicts_from_segments_that_could_hold_it(clock):
    state = make_state(clock)
    mount(state, "n1", "small", 256)
    for key in ("s0", "s1", "s2", "s3"):                 # the oldest objects, but useless here
        put(state, key, 64)
    mount(state, "n2", "big", 1024)
    put(state, "b0", 512)
    put(state, "b1", 512)
    [x] = state.put_start(["x"], [512])
    assert nodes_of(x) == ["n2"]
    assert state.exists(["s0", "s1", "s2", "s3", "b0", "b1"]) == [True] * 4 + [False, True]
    assert state.stats().evictions == 1


def test_pin_needs_a_complete_object(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    state.put_start(["p"], [64])
    assert all(isinstance(e, ObjectNotFound) for e in state.pin(["p", "nope"]) + state.unpin(["p"]))
    assert isinstance(state.pin([""])[0], InvalidArgument)


def test_tick_evicts_above_high_watermark_down_to_low(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=6400)                  # 100 blocks of 64 bytes
    keys = [f"k{i:02d}" for i in range(96)]
    for key in keys:
        put(state, key)
    get_replicas(state, ["k00"])                          # recently used, and leased
    state.pin(["k01"])
    clock.advance(1)
    state.tick()                                         # 96% > 95%: down to 85 blocks
    alive = [k for k, ok in zip(keys, state.exists(keys)) if ok]
    assert alive == ["k00", "k01"] + keys[13:]
    assert segment(state, "s1").used_bytes == 85 * 64
    assert state.stats().evictions == 11
    state.tick()                                         # at the low watermark: nothing to do
    assert state.stats().evictions == 11


def test_watermark_eviction_stops_when_nothing_is_evictable(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=640)
    for i in range(10):
        put(state, f"k{i}")
    get_replicas(state, [f"k{i}" for i in range(10)])
    state.tick()
    assert state.stats().evictions == 0 and state.stats().objects == 10
    clock.advance(LEASE_S)
    state.tick()                                         # 100% -> 80%: two of them go
    assert state.exists([f"k{i}" for i in range(10)]) == [False] * 2 + [True] * 8


# -- PENDING reclaim and quarantine -------------------------------------------------------------

def test_timed_out_put_is_reclaimed_and_its_space_quarantined(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", size=64)
    [first] = state.put_start(["slow"], [64])
    clock.advance(PUT_TIMEOUT_S - 0.5)
    state.tick()
    assert state.stats().pending_objects == 1
    clock.advance(0.5)
    state.tick()
    assert state.stats().pending_objects == 0
    assert isinstance(state.put_end(["slow"])[0], NotPending)
    s = segment(state, "s1")
    assert (s.used_bytes, s.quarantined_bytes, s.objects) == (0, 64, 0)
    # The key is free again, the bytes are not (the slow writer may still be writing).
    assert isinstance(state.put_start(["slow"], [64])[0], NoSpace)
    clock.advance(QUARANTINE_S - 0.5)
    state.tick()
    assert segment(state, "s1").quarantined_bytes == 64
    clock.advance(0.5)
    state.tick()
    assert segment(state, "s1").quarantined_bytes == 0
    [again] = state.put_start(["slow"], [64])
    assert again == first


def test_reclaim_does_not_hit_a_newer_put_of_the_same_key(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    state.put_start(["k"], [64])
    state.put_revoke(["k"])
    clock.advance(PUT_TIMEOUT_S / 2)
    state.put_start(["k"], [64])                         # its own deadline is later
    clock.advance(PUT_TIMEOUT_S / 2)
    state.tick()                                         # the first put's deadline passes
    assert state.stats().pending_objects == 1
    assert state.put_end(["k"]) == [None]


def test_committed_put_is_not_reclaimed(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    put(state, "a")
    clock.advance(PUT_TIMEOUT_S * 3)
    state.heartbeat("n1")
    state.tick()
    assert state.exists(["a"]) == [True]
    assert segment(state, "s1").quarantined_bytes == 0


# -- placement and capacity errors -------------------------------------------------------------

def test_replicas_go_to_distinct_nodes(clock):
    state = make_state(clock)
    for n in ("n1", "n2", "n3"):
        mount(state, n, f"{n}-a", 4096)
        mount(state, n, f"{n}-b", 4096)
    for i in range(20):
        replicas = put(state, f"k{i}", 64 * (1 + i % 3), replicas=3)
        assert sorted(nodes_of(replicas)) == ["n1", "n2", "n3"]
        assert all(r.extent.segment_id.startswith(r.node.node_id) for r in replicas)
    # Within a node, the segment with the most free bytes takes the next replica.
    used = {s.info.segment_id: s.used_bytes for s in state.stats().segments}
    assert all(abs(used[f"{n}-a"] - used[f"{n}-b"]) <= 192 for n in ("n1", "n2", "n3"))


def test_placement_prefers_the_emptiest_segment(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", 4096)
    mount(state, "n2", "s2", 8192)
    assert nodes_of(put(state, "a", 4096)) == ["n2"]
    assert nodes_of(put(state, "b", 64)) == ["n1"]      # n1 has 4096 free, n2 4096: mount order
    assert nodes_of(put(state, "c", 64)) == ["n2"]


def test_too_large_and_no_space(clock):
    state = make_state(clock)
    [err] = state.put_start(["a"], [64])
    assert isinstance(err, NoSpace) and "0 live nodes" in str(err)
    mount(state, "n1", "s1", 4096)
    mount(state, "n2", "s2", 8192)
    [err] = state.put_start(["a"], [8193])
    assert isinstance(err, ValueTooLarge)
    [err] = state.put_start(["a"], [64], replicas=3)
    assert isinstance(err, NoSpace) and not isinstance(err, ValueTooLarge)
    assert "2 live nodes" in str(err)
    put(state, "small", 64)
    [err] = state.put_start(["b"], [8192], replicas=2)   # only n2 could ever hold it
    assert isinstance(err, NoSpace)
    assert state.exists(["small"]) == [True]             # nothing was evicted for it
    assert isinstance(state.put_start(["c"], [8192])[0], tuple)


# -- membership --------------------------------------------------------------------------------

def test_mount_rules(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", 4096)
    put(state, "a")
    mount(state, "n1", "s1", 4096)                      # idempotent: the object is still there
    assert state.exists(["a"]) == [True] and len(state.stats().segments) == 1
    with pytest.raises(InvalidArgument):
        mount(state, "n2", "s1", 4096)                  # another node's segment
    with pytest.raises(InvalidArgument):
        mount(state, "n1", "s1", 8192)                  # same id, other size
    with pytest.raises(InvalidArgument):
        mount(state, "n1", "tiny", 32)
    assert state.stats().nodes == 1                     # failed mounts registered nothing


def test_node_restarted_within_ttl_loses_its_old_segments(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", 4096)
    put(state, "a")
    # Same node id, new endpoints: a new process, whose memory holds none of the old objects.
    state.mount_segment(endpoints("n1", port=7001), SegmentInfo("s2", 4096))
    assert state.exists(["a"]) == [False]
    assert [g.info.segment_id for g in state.stats().segments] == ["s2"]
    put(state, "b")
    [view] = get_replicas(state, ["b"])
    assert view.replicas[0].node.tcp_endpoint == "n1:7001"


def test_unmount_and_heartbeat_of_unknown_node(clock):
    state = make_state(clock)
    with pytest.raises(UnknownNode):
        state.heartbeat("ghost")
    with pytest.raises(UnknownNode):
        state.unmount_segment("ghost", "s1")
    mount(state, "n1", "s1")
    mount(state, "n2", "s2")
    a = put(state, "a", replicas=2)
    with pytest.raises(InvalidArgument):
        state.unmount_segment("n2", "s1")
    state.unmount_segment("n1", "s1")
    state.unmount_segment("n1", "s1")                   # a retry is harmless
    [view] = get_replicas(state, ["a"])
    assert nodes_of(view.replicas) == ["n2"] and view.replicas[0] in a
    state.unmount_segment("n2", "s2")
    assert state.exists(["a"]) == [False] and state.stats().objects == 0
    assert state.stats().nodes == 2                     # the nodes themselves are still alive


def test_heartbeats_keep_a_node_alive(clock):
    state = make_state(clock)
    mount(state, "n1", "s1")
    put(state, "a")
    for _ in range(5):
        clock.advance(NODE_TTL_S - 1)
        state.heartbeat("n1")
        state.tick()
    assert state.exists(["a"]) == [True] and state.stats().nodes == 1


def test_dead_node_loses_its_segments_and_replicas(clock):
    ttl = 5.0                                            # shorter than the put timeout
    state = make_state(clock, node_ttl_s=ttl)
    mount(state, "n1", "s1", 8192)
    mount(state, "n2", "s2", 8192)
    assert nodes_of(put(state, "on1")) == ["n1"]
    assert nodes_of(put(state, "on2")) == ["n2"]
    put(state, "both", replicas=2)
    [pending] = state.put_start(["pending1"], [64])
    assert nodes_of(pending) == ["n1"]
    clock.advance(ttl)
    state.heartbeat("n2")
    assert state.tick() == []
    assert state.stats().nodes == 2                      # exactly the TTL is not yet dead
    clock.advance(0.5)
    # Expired: silent this long, and "on1" and "pending1" had no other replica.
    assert state.tick() == [("n1", ttl + 0.5, 2)]
    stats = state.stats()
    assert stats.nodes == 1 and [s.info.segment_id for s in stats.segments] == ["s2"]
    assert state.exists(["on1", "on2", "both"]) == [False, True, True]
    [both] = get_replicas(state, ["both"])
    assert nodes_of(both.replicas) == ["n2"]
    assert stats.pending_objects == 0
    assert isinstance(state.put_end(["pending1"])[0], NotPending)
    with pytest.raises(UnknownNode):
        state.heartbeat("n1")


def test_dead_node_remounting_gets_a_fresh_segment(clock):
    # The node dies before the lease of "a" ends, so that deferred free is still queued when
    # the segment id is mounted again.
    state = make_state(clock, node_ttl_s=2.0)
    mount(state, "n1", "s1", 256)
    put(state, "a")
    get_replicas(state, ["a"])
    state.remove(["a"])                                  # deferred free until the lease ends
    state.put_start(["p"], [64])
    clock.advance(3)
    state.tick()
    assert state.stats().nodes == 0 and state.stats().pending_objects == 0
    mount(state, "n1", "s1", 256)                        # same segment id, as new
    s = segment(state, "s1")
    assert (s.used_bytes, s.quarantined_bytes, s.objects) == (0, 0, 0)
    put(state, "b", 128)                                 # over the stale extents
    clock.advance(QUARANTINE_S + LEASE_S)
    state.heartbeat("n1")
    state.tick()                                         # the stale deferred frees are dropped
    assert segment(state, "s1").used_bytes == 128 and state.exists(["b"]) == [True]


# -- accounting --------------------------------------------------------------------------------

def test_stats_return_to_zero_after_everything_is_gone(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", 4096)
    mount(state, "n2", "s2", 4096)
    for i in range(10):
        put(state, f"k{i}", 100, replicas=2)
    state.put_start(["p1", "p2"], [64, 64])
    state.put_revoke(["p2"])
    get_replicas(state, ["k0", "k1", "nope"])
    stats = state.stats()
    assert (stats.objects, stats.pending_objects, stats.hits, stats.misses) == (10, 1, 2, 1)
    assert sum(s.used_bytes for s in stats.segments) == 10 * 2 * 128 + 64
    assert sum(s.objects for s in stats.segments) == 21
    assert state.remove([f"k{i}" for i in range(10)]) == [None] * 10
    clock.advance(PUT_TIMEOUT_S)
    state.heartbeat("n1")
    state.heartbeat("n2")
    state.tick()                                         # leases over, p1 quarantined
    assert sum(s.quarantined_bytes for s in state.stats().segments) == 64
    clock.advance(QUARANTINE_S)
    state.heartbeat("n1")
    state.heartbeat("n2")
    state.tick()
    stats = state.stats()
    assert (stats.objects, stats.pending_objects, stats.nodes) == (0, 0, 2)
    books = [(s.used_bytes, s.quarantined_bytes, s.objects) for s in stats.segments]
    assert books == [(0, 0, 0)] * 2
    assert state.put_start(["big"], [4096], replicas=2)[0][0].extent.offset == 0


# -- random operations keep the books exact ----------------------------------------------------

def _check_books(state: MasterState) -> None:
    """White-box: every segment's allocator agrees with the index and the deferred frees."""
    replicas, hard, lease = state._index.replicas, state._pins.is_hard, state._leasing.until
    for sid, seg in state._segments.items():
        live = [(e.offset, seg.allocator.aligned_size(e.length)) for o in state._objects.values()
                for e in replicas(o) if e.segment_id == sid]
        deferred = [(e.offset, seg.allocator.aligned_size(e.length))
                    for _, _, entries, _ in state._space.deferred for s, e in entries
                    if s is seg and state._segments.get(sid) is s]
        spans = sorted(live + deferred)
        for (o1, l1), (o2, _) in pairwise(spans):
            assert o1 + l1 <= o2, f"overlapping extents in {sid}"
        assert seg.allocator.used_bytes == sum(length for _, length in spans)
        assert seg.quarantined_bytes == sum(length for _, length in deferred)
        assert seg.objects == len({o.key for o in state._objects.values()
                                   for e in replicas(o) if e.segment_id == sid})
        # What eviction cannot free (admission's counts) agrees with the index: every replica
        # of a PENDING or hard-pinned object, and of a leased one (not pinned) once the
        # leases due are ended.
        state._leasing.expire(state.now())
        now = state.now()

        def held(keep, seg=seg, sid=sid) -> int:
            return sum(seg.allocator.aligned_size(o.size) for o in state._objects.values()
                       if keep(o) for e in replicas(o) if e.segment_id == sid)
        assert seg.pending_bytes == held(lambda o: o.state.name == "PENDING")
        t = now
        assert seg.pinned_bytes == held(hard)
        # Leases: every leased object not pinned; at most also those pinned under their
        # lease and those removed under it (quarantined till it ends): master/leases.py.
        leased = held(lambda o, t=t: lease(o) > t and not hard(o))
        assert leased <= seg.leased_bytes <= leased + seg.quarantined_bytes + held(
            lambda o, t=t: lease(o) > t and hard(o))
        assert seg.reclaimable_bytes() >= seg.allocator.free_bytes


_ops = st.lists(st.tuples(
    st.sampled_from(["put", "end", "revoke", "get", "remove", "pin", "unpin", "tick", "beat"]),
    st.integers(0, 11),       # key index
    st.integers(1, 700),      # size
    st.integers(1, 3),        # replicas
    st.floats(0, 12),         # seconds to advance on tick
), max_size=80)


# The clock fixture is shared by the examples; it only moves forward, which is all they need.
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_random_operations_keep_allocators_and_index_consistent(clock, ops):
    state = make_state(clock, high_watermark=0.9, low_watermark=0.6, node_ttl_s=20.0)
    for n, size in (("n1", 2048), ("n2", 2048), ("n3", 1024)):
        mount(state, n, f"{n}-s", size)
    for op, i, size, replicas, dt in ops:
        key = f"k{i}"
        if op == "put":
            state.put_start([key], [size], replicas)
        elif op == "end":
            state.put_end([key])
        elif op == "revoke":
            state.put_revoke([key])
        elif op == "get":
            get_replicas(state, [key])
        elif op == "remove":
            state.remove([key])
        elif op in ("pin", "unpin"):
            getattr(state, op)([key])
        elif op == "beat":
            for n in ("n1", "n2", "n3"):
                try:
                    state.heartbeat(n)
                except UnknownNode:
                    mount(state, n, f"{n}-s", 1024 if n == "n3" else 2048)
        else:
            clock.advance(dt)
            state.tick()
        _check_books(state)
    stats = state.stats()
    assert stats.objects + stats.pending_objects == len(state._objects)


# -- the LRU policy on its own -----------------------------------------------------------------

def test_lru_candidates_survive_removal_and_inserts_while_walking():
    from kvpool.master.eviction import LRUPolicy

    lru = LRUPolicy()
    keys = [f"k{i}" for i in range(500)]                 # several of the doubling chunks
    for k in keys:
        lru.on_insert(k)
    lru.on_access("k0")                                  # k0 is now the newest
    expected = keys[1:] + ["k0"]
    seen = []
    for i, key in enumerate(lru.candidates()):
        seen.append(key)
        if i % 3 == 0:
            lru.on_remove(key)                           # evict some, skip the others
        if i == 10:
            lru.on_insert("late")                        # a put completing mid-walk goes last
    assert seen == expected + ["late"]
    assert len(lru) == 501 - len(expected[::3])
    assert list(lru.candidates()) == [k for k in expected + ["late"] if k not in expected[::3]]
