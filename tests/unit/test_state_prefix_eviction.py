"""MasterState with its default PrefixAwarePolicy: the parents named at PutStart decide what a
full segment gives up (chain tails first, shared parents last), within the lease/pin rules."""

from __future__ import annotations

import pytest
from kvpool.common.config import ConfigError, MasterConfig
from kvpool.common.errors import InvalidArgument
from kvpool.common.types import ObjectRecord, SegmentInfo

from .conftest import get_replicas
from .test_state import LEASE_S, endpoints, make_state

BLOCK = 64   # one alignment unit: a segment of n * BLOCK bytes holds exactly n blocks
# A shared two-block prefix (a system prompt) and two conversations that extend it.
CHAINS = [("s0", None), ("s1", "s0"), ("a0", "s1"), ("a1", "a0"), ("b0", "s1"), ("b1", "b0")]


def fill(state, clock) -> None:
    state.mount_segment(endpoints("n1"), SegmentInfo("s", len(CHAINS) * BLOCK))
    for key, parent in CHAINS:   # one put each, so every block has its own last-use time
        [placed] = state.put_start([key], [BLOCK], parents=[parent])
        assert isinstance(placed, tuple), placed
        assert state.put_end([key]) == [None]
        clock.advance(1)


def evicted_by_new_puts(state, clock, n: int) -> list[str]:
    """Put ``n`` parentless blocks into the full segment; the keys each one pushed out."""
    order, stored = [], {key for key, _ in CHAINS}
    for i in range(n):
        clock.advance(LEASE_S + 1)   # nothing is leased
        [placed] = state.put_start([f"new{i}"], [BLOCK])
        assert isinstance(placed, tuple), placed
        state.put_end([f"new{i}"])
        gone = [k for k, there in zip(sorted(stored), state.exists(sorted(stored))) if not there]
        order += gone
        stored -= set(gone)
    return order


def test_full_segment_evicts_chain_tails_first_and_the_shared_prefix_last(clock):
    state = make_state(clock)
    fill(state, clock)
    # Plain LRU would take s0 first (the oldest), stranding every block after it.
    assert evicted_by_new_puts(state, clock, 6) == ["a1", "a0", "b1", "b0", "s1", "s0"]


def test_eviction_lru_config_ignores_parents(clock):
    state = make_state(clock, eviction="lru")
    fill(state, clock)
    assert evicted_by_new_puts(state, clock, 6) == ["s0", "s1", "a0", "a1", "b0", "b1"]
    with pytest.raises(ConfigError, match="expected one of prefix, lru"):
        MasterConfig(eviction="fifo")


def test_reading_a_prefix_keeps_that_chain_and_its_parents(clock):
    state = make_state(clock)
    fill(state, clock)
    get_replicas(state, ["s0", "s1", "a0", "a1"])   # a prompt matched s0..a1: all touched
    assert evicted_by_new_puts(state, clock, 3) == ["b1", "b0", "a1"]


def test_a_pinned_tail_holds_its_whole_chain_and_newer_blocks_go_instead(clock):
    state = make_state(clock)
    fill(state, clock)
    assert state.pin(["a1"]) == [None]
    # a1 cannot go, so neither can a0, s1, s0 (a parent never goes before its children): once
    # b's chain is gone, the new blocks make room for each other although they are younger.
    assert evicted_by_new_puts(state, clock, 4) == ["b1", "b0"]
    assert state.unpin(["a1"]) == [None]
    clock.advance(LEASE_S + 1)
    state.put_start(["last"], [BLOCK])
    assert state.exists(["a1", "a0"]) == [False, True]


def test_parent_committed_in_the_same_batch_is_linked(clock):
    state = make_state(clock)
    state.mount_segment(endpoints("n1"), SegmentInfo("s", 3 * BLOCK))
    keys = ["h", "m", "t"]
    state.put_start(keys, [BLOCK] * 3, parents=[None, "h", "m"])
    assert state.put_end(keys) == [None] * 3
    clock.advance(LEASE_S + 1)
    state.put_start(["x"], [BLOCK])
    state.put_end(["x"])
    assert state.exists(keys) == [True, True, False]   # the tail, not the oldest block


def test_bad_parents_are_refused_per_key_or_for_the_batch(clock):
    state = make_state(clock)
    state.mount_segment(endpoints("n1"), SegmentInfo("s", 4 * BLOCK))
    self_parent, ok = state.put_start(["k", "j"], [BLOCK, BLOCK], parents=["k", ""])
    assert isinstance(self_parent, InvalidArgument) and isinstance(ok, tuple)
    with pytest.raises(InvalidArgument, match="2 keys but 1 parents"):
        state.put_start(["a", "b"], [BLOCK, BLOCK], parents=["a"])


def restarted_with_chain(clock, order):
    """A master that indexed the chain p0 <- p1 <- p2 restarts; the node announces the records
    in ``order`` (indexes into the manifest), then p3 is put onto p2 and ages with the rest."""
    old = make_state(clock)
    old.mount_segment(endpoints("n1"), SegmentInfo("s", 4 * BLOCK), keeps_manifest=True)
    for key, parent in [("p0", None), ("p1", "p0"), ("p2", "p1")]:
        old.put_start([key], [BLOCK], parents=[parent])
        old.put_end([key])
    manifest = old.heartbeat("n1").committed
    assert [r.parent for r in manifest] == [None, "p0", "p1"]   # the records name the parent

    new = make_state(clock)
    new.mount_segment(endpoints("n1"), SegmentInfo("s", 4 * BLOCK), keeps_manifest=True,
                      recovering=True)
    records = [manifest[i] for i in order]
    assert new.announce_objects("n1", records[:2]) == [None] * 2
    assert new.announce_objects("n1", records[2:], done=True) == [None]
    new.put_start(["p3"], [BLOCK], parents=["p2"])   # extends an announced block
    new.put_end(["p3"])
    return new


def eviction_order(state, clock, keys) -> list[str]:
    clock.advance(LEASE_S + 1)
    order = []
    for i in range(len(keys)):
        state.put_start([f"x{i}"], [BLOCK])
        state.put_end([f"x{i}"])
        order += [k for k in keys if k not in order and not state.exists([k])[0]]
    return order


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)],
                         ids=["parents-first", "children-first", "mixed"])
def test_after_a_master_restart_announced_chains_are_linked_again(clock, order):
    """Manifest records carry the parent: a restarted master links announced blocks into their
    chains again, whatever order they are announced in, and evicts from the tail."""
    new = restarted_with_chain(clock, order)
    assert eviction_order(new, clock, ["p0", "p1", "p2", "p3"]) == ["p3", "p2", "p1", "p0"]


def test_announced_parent_on_another_node_links_its_children(clock):
    """A chain split over two nodes: the child's node announces (and finishes) first, its
    parent comes with the other node; the link waits for it."""
    new = make_state(clock)
    for n in ("n1", "n2"):
        new.mount_segment(endpoints(n), SegmentInfo(f"s-{n}", 2 * BLOCK), keeps_manifest=True,
                          recovering=True)
    assert new.announce_objects("n1", [ObjectRecord("p1", "s-n1", 0, BLOCK, None, 2, "p0"),
                                       ObjectRecord("q", "s-n1", BLOCK, BLOCK, None, 3)],
                                done=True) == [None, None]
    assert new.announce_objects("n2", [ObjectRecord("p0", "s-n2", 0, BLOCK, None, 1),
                                       ObjectRecord("r", "s-n2", BLOCK, BLOCK, None, 4)],
                                done=True) == [None, None]
    get_replicas(new, ["p1"])   # the child is the newest block: unlinked it would go last
    assert eviction_order(new, clock, ["p0", "p1", "q", "r"]) == ["q", "r", "p1", "p0"]


def test_a_parent_never_announced_leaves_its_child_a_plain_head(clock):
    """A record naming a parent that no node announces: once all are done, the child is a
    chain head (plain LRU) and nothing waits for the parent any more."""
    new = make_state(clock)
    new.mount_segment(endpoints("n1"), SegmentInfo("s", 2 * BLOCK), keeps_manifest=True,
                      recovering=True)
    recs = [ObjectRecord("c", "s", 0, BLOCK, None, 5, "lost"), ObjectRecord("d", "s", BLOCK,
                                                                            BLOCK, None, 6)]
    assert new.announce_objects("n1", recs, done=True) == [None, None]
    assert not new._chains.waiting and not new._chains.waiting_for
    assert eviction_order(new, clock, ["c", "d"]) == ["c", "d"]


@pytest.mark.parametrize("pending", [False, True], ids=["put-later", "pending"])
def test_a_parent_stored_after_its_child_is_linked_when_it_comes(clock, pending):
    """A child committed before its parent (the parent put later, or still pending in another
    client's put) waits for it: once the parent is stored, the chain goes tail first."""
    state = make_state(clock)
    state.mount_segment(endpoints("n1"), SegmentInfo("s", 3 * BLOCK))
    if pending:
        state.put_start(["p"], [BLOCK])
    state.put_start(["c"], [BLOCK], parents=["p"])
    assert state.put_end(["c"]) == [None]
    clock.advance(1)
    if not pending:
        state.put_start(["p"], [BLOCK])
    assert state.put_end(["p"]) == [None]   # the newest block: as a head it would go last
    clock.advance(1)
    state.put_start(["q"], [BLOCK])
    state.put_end(["q"])
    get_replicas(state, ["c"])   # the child is the most recently used
    assert eviction_order(state, clock, ["p", "c", "q"]) == ["q", "c", "p"]
    assert not state._chains.waiting and not state._chains.waiting_for


def test_children_waiting_for_parents_that_never_come_are_bounded(clock, monkeypatch):
    from kvpool.master import chains
    monkeypatch.setattr(chains, "_MAX_WAITING", 4)
    state = make_state(clock)
    state.mount_segment(endpoints("n1"), SegmentInfo("s", 16 * BLOCK))
    for i in range(10):
        state.put_start([f"c{i}"], [BLOCK], parents=[f"lost{i}"])
        state.put_end([f"c{i}"])
        if i % 2:
            state.remove([f"c{i}"])   # a child that leaves stops waiting
    # The removed children's entries were pruned to make room; past 4, c8 waits for nothing.
    assert sorted(state._chains.waiting_for) == ["c0", "c2", "c4", "c6"]
    assert len(state._chains.waiting) == 4
    state.put_start(["lost0"], [BLOCK])
    state.put_end(["lost0"])
    assert "c0" not in state._chains.waiting_for and "lost0" not in state._chains.waiting
