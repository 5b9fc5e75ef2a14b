"""MasterState.locate_columns (GetReplicas' form): the columns' layout, and the leases, counts
and eviction touches of a batch lookup."""

from __future__ import annotations

from kvpool.common import checksum
from kvpool.common.errors import InvalidArgument, ObjectNotFound

from .conftest import get_replicas
from .test_state import LEASE_S, make_state, mount, put


def test_columns_hold_zeros_for_misses_and_every_replica_in_key_order(clock):
    state = make_state(clock)
    mount(state, "n1", "s1", 1 << 20)
    mount(state, "n2", "s2", 1 << 20)
    [a] = state.put_start(["a"], [100], 1)
    [two] = state.put_start(["two"], [64], 2)
    state.put_end(["a", "two"], [7, None])
    state.put_start(["pending"], [64])

    c = state.locate_columns(["two", "missing", "a", "pending", 7, "a"])
    assert sorted(c.errors) == [1, 3, 4]
    assert isinstance(c.errors[1], ObjectNotFound) and isinstance(c.errors[3], ObjectNotFound)
    assert isinstance(c.errors[4], InvalidArgument)
    assert c.sizes == [64, 0, 100, 0, 0, 100]
    assert c.checksums == [0, 0, checksum.encode(7), 0, 0, checksum.encode(7)]
    assert c.counts == [2, 0, 1, 0, 0, 1]
    places = [(r.extent.segment_id, r.extent.offset) for r in (*two, *a, *a)]
    assert list(zip(c.segment_ids, c.offsets)) == places
    versions = {v.key: v.version for v in get_replicas(state, ["a", "two"])}
    assert c.versions == [versions["two"], 0, versions["a"], 0, 0, versions["a"]]
    stats = state.stats()
    # 2 more hits: the get_replicas above; a bad key is no miss
    assert (stats.hits, stats.misses) == (3 + 2, 2)


def test_a_batch_lookup_leases_and_touches_every_object_found(clock):
    state = make_state(clock, eviction="lru")
    mount(state, "n1", "s1", 1 << 20)
    for i in range(300):
        put(state, f"k{i}")
    clock.advance(LEASE_S / 2)
    read = [f"k{i}" for i in range(0, 300, 3)][::-1]     # newest first
    assert not state.locate_columns(read).errors
    assert list(state._chains.policy.candidates())[-len(read):] == read   # now the newest, in order
    for key in read:
        assert state._leasing.until(state._objects[key]) == clock.now + LEASE_S
    assert state._leasing.until(state._objects["k1"]) < clock.now + LEASE_S
