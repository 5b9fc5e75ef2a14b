"""Pins in MasterState: hard pins are never evicted and share a quota; soft pins are evicted
only after every unpinned candidate, until their TTL runs out."""

from __future__ import annotations

import pytest
from kvpool.common.errors import InvalidArgument, NoSpace, ObjectNotFound
from kvpool.common.types import SegmentInfo

from .test_state import LEASE_S, endpoints, make_state

B = 64


def full_segment(clock, n: int = 4, **cfg):
    """One DRAM-only node with an n-object segment, filled with k0..k{n-1} (oldest first)."""
    # Watermark 1.0: only puts evict, so each put shows what it pushed out.
    state = make_state(clock, high_watermark=1.0, low_watermark=0.9, **cfg)
    state.mount_segment(endpoints("n"), SegmentInfo("m", n * B))
    for i in range(n):
        [placed] = state.put_start([f"k{i}"], [B])
        assert isinstance(placed, tuple)
        state.put_end([f"k{i}"])
        clock.advance(1)
    clock.advance(LEASE_S + 1)
    return state


def evicted_by(state, key) -> list[str]:
    before = {k for k in state._objects}
    [placed] = state.put_start([key], [B])
    assert isinstance(placed, tuple), placed
    state.put_end([key])
    return sorted(before - set(state._objects))


def test_soft_pins_go_last_and_only_within_their_ttl(clock):
    state = full_segment(clock)
    assert state.pin(["k0", "k1"], ttl_s=60) == [None, None]
    assert evicted_by(state, "a") == ["k2"]          # the oldest unpinned, not k0
    assert evicted_by(state, "b") == ["k3"]
    assert state.pin(["a", "b"], ttl_s=60) == [None, None]
    assert evicted_by(state, "c") == ["k0"]          # only soft pins left: oldest first
    clock.advance(61)
    state.tick()                                      # every pin ran out
    state.pin(["c"], ttl_s=60)
    assert evicted_by(state, "d") == ["k1"]


def test_hard_pins_are_never_evicted_and_unpin_releases_them(clock):
    state = full_segment(clock, pin_quota_fraction=1.0)
    assert state.pin(["k0", "k1", "k2", "k3"]) == [None] * 4
    [err] = state.put_start(["a"], [B])
    assert isinstance(err, NoSpace)
    assert state.unpin(["k2"]) == [None]
    assert evicted_by(state, "a") == ["k2"]


def test_hard_pins_are_bounded_by_the_quota(clock):
    state = full_segment(clock, pin_quota_fraction=0.5)   # 2 of 4 objects
    assert state.pin(["k0", "k1"]) == [None, None]
    assert state.pin(["k1"]) == [None]                    # again: no double count
    [err] = state.pin(["k2"])
    assert isinstance(err, NoSpace) and "quota" in str(err)
    assert state.pin(["k2"], ttl_s=10) == [None]         # a soft pin is not bounded
    assert state.remove(["k0"]) == [None]                 # a removed pin frees its quota
    assert state.pin(["k2"]) == [None]


def test_pin_errors(clock):
    state = full_segment(clock)
    assert isinstance(state.pin(["nope"])[0], ObjectNotFound)
    assert isinstance(state.pin([""], ttl_s=5)[0], InvalidArgument)
    with pytest.raises(InvalidArgument):
        state.pin(["k0"], ttl_s=0)
