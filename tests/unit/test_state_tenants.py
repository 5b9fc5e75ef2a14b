"""Tenants in the master's state (master/quotas.py): byte quotas refused before placement,
pins within a share of the quota, and fair eviction."""

from __future__ import annotations

from kvpool.common.errors import QuotaExceeded
from kvpool.common.tenants import scoped

from .test_state import make_state, mount, put


def test_a_tenants_put_past_its_quota_is_refused_and_the_others_are_not_bound(clock):
    state = make_state(clock, tenant_quotas="a=256")
    mount(state, "n1", "s1", size=4096)
    put(state, scoped("a", "x"), 192)
    [refused] = state.put_start([scoped("a", "y")], [128])
    assert isinstance(refused, QuotaExceeded) and "'a' holds 192 B in 1 objects" in str(refused)
    put(state, scoped("b", "y"), 1024)
    put(state, "default-key", 1024)
    assert state.remove([scoped("a", "x")]) == [None]
    put(state, scoped("a", "y"), 128)
    assert {t: (n, b, q) for t, n, b, q in state.stats().tenants} == {
        "a": (1, 128, 256), "b": (1, 1024, None), "default": (1, 1024, None)}


def test_a_tenants_hard_pins_hold_at_most_its_share_of_its_quota(clock):
    state = make_state(clock, tenant_quotas="a=1000", pin_quota_fraction=0.5)
    mount(state, "n1", "s1", size=4096)
    for k in ("p", "q"):
        put(state, scoped("a", k), 300)
    assert state.pin([scoped("a", "p")]) == [None]
    [refused] = state.pin([scoped("a", "q")])
    assert isinstance(refused, QuotaExceeded) and "hard-pinned" in str(refused)
    assert state.pin([scoped("a", "q")], ttl_s=10) == [None]    # a soft pin is no hold
    assert state.unpin([scoped("a", "p")]) == [None]
    assert state.pin([scoped("a", "q")]) == [None]


def test_a_put_that_must_evict_takes_from_tenants_over_their_share_first(clock):
    """One segment of 4 KiB, two tenants without quotas (an equal share: 2 KiB each). b holds
    3 KiB, a 1 KiB written before b's (first in LRU order): a's put evicts b's oldest, not a's."""
    state = make_state(clock, eviction="lru")
    mount(state, "n1", "s1", size=4096)
    put(state, scoped("a", "old"), 1024)
    clock.advance(1)
    for i in range(3):
        put(state, scoped("b", f"b{i}"), 1024)
        clock.advance(1)
    put(state, scoped("a", "new"), 1024)
    assert state.exists([scoped("a", "old"), scoped("b", "b0"), scoped("b", "b1"),
                         scoped("a", "new")]) == [True, False, True, True]
    # Once b is within its share, the policy's order holds again.
    put(state, scoped("a", "newer"), 1024)
    assert state.exists([scoped("a", "old")]) == [False]


def test_one_tenants_puts_not_ended_hold_at_most_its_share_of_the_pending_room(clock):
    """4 KiB, max_pending_fraction 0.5, two tenants holding objects (a share of 2 KiB each):
    a's pending puts stop at 1 KiB, leaving b room to start its own; an ended put frees a's."""
    state = make_state(clock, max_pending_fraction=0.5)
    mount(state, "n1", "s1", size=4096)
    put(state, scoped("b", "held"), 64)
    assert isinstance(state.put_start([scoped("a", "p0")], [512])[0], tuple)
    assert isinstance(state.put_start([scoped("a", "p1")], [512])[0], tuple)
    [refused] = state.put_start([scoped("a", "p2")], [512])
    assert isinstance(refused, QuotaExceeded), refused
    assert "tenant 'a' has 1024 bytes in puts started and not ended" in str(refused)
    assert isinstance(state.put_start([scoped("b", "p0")], [512])[0], tuple)
    assert state.put_end([scoped("a", "p0")]) == [None]
    assert isinstance(state.put_start([scoped("a", "p2")], [512])[0], tuple)
    assert state.put_revoke([scoped("a", "p1")]) == [None]
    assert state.put_end([scoped("a", "p2"), scoped("b", "p0")]) == [None, None]
    # The default tenant is one of three now (a share of 1365 bytes): 682 of them pending.
    assert isinstance(state.put_start(["d0"], [512])[0], tuple)
    [refused] = state.put_start(["d1"], [512])
    assert isinstance(refused, QuotaExceeded) and "tenant 'default' has 512" in str(refused)
