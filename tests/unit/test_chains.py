"""Chains on their own: links waiting for a parent, per tier, and what leaving forgets."""

from __future__ import annotations

from kvpool.master import chains as chains_module
from kvpool.master.chains import Chains
from kvpool.master.eviction import PrefixAwarePolicy


def make() -> Chains:
    return Chains(PrefixAwarePolicy(), PrefixAwarePolicy())


def test_a_child_before_its_parent_waits_and_is_linked_when_the_parent_comes():
    c = make()
    c.track("child", "parent", disk=False)
    assert c.waiting == {"parent": ["child"]} and c.parent_of("child", disk=False) == "parent"
    assert list(c.candidates(disk=False, above=True)) == ["child"]
    c.track("parent", None, disk=False)
    assert not c.waiting and not c.waiting_for
    assert c.policy.parent_of("child") == "parent"
    # The parent is no victim while its child stays.
    assert list(c.candidates(disk=False, above=True)) == ["child"]


def test_a_child_on_disk_waits_for_its_parent_to_come_down_too():
    c = make()
    c.track("child", "parent", disk=True)
    c.track("parent", None, disk=False)
    assert c.waiting_for == {"child": "parent"}   # not linked across tiers
    assert list(c.candidates(disk=True, above=False)) == ["child"]
    c.moved("parent", was_on_disk=False)
    assert not c.waiting_for and c.disk_policy.parent_of("child") == "parent"
    assert "parent" not in c.policy and list(c.candidates(disk=False, above=True)) == []


def test_a_parent_moved_down_before_its_child_is_still_the_childs_parent_there():
    # Moves run concurrently, so a block may reach disk before its child: the child, moved
    # next, links to it on disk (and names it in its record) instead of becoming a head.
    c = make()
    c.track("c10", None, disk=False)
    c.track("c11", "c10", disk=False)
    c.track("c12", "c11", disk=False)
    c.moved("c11", was_on_disk=False)
    assert c.parent_of("c12", disk=False) == "c11"
    c.moved("c12", was_on_disk=False)
    assert c.disk_policy.parent_of("c12") == "c11" and c.parent_of("c12", disk=True) == "c11"
    assert list(c.candidates(disk=True, above=False)) == ["c12"]   # the chain's tail first


def test_a_parent_that_leaves_or_never_comes_is_no_longer_waited_for():
    c = make()
    for i in range(3):
        c.track(f"c{i}", f"p{i}", disk=False)
    c.forget("p0")
    c.forget("c1")
    assert c.waiting_for == {"c2": "p2"}
    c.stop_waiting_for_absent(indexed={"p1"})
    assert not c.waiting_for and list(c.waiting) == ["p1"]   # c1's entry: pruned lazily


def test_the_waiting_table_is_bounded_after_pruning_children_that_left(monkeypatch):
    monkeypatch.setattr(chains_module, "_MAX_WAITING", 2)
    c = make()
    c.track("a", "pa", disk=False)
    c.track("b", "pb", disk=False)
    assert not c.may_wait()
    c.forget("a")
    assert c.may_wait() and list(c.waiting) == ["pb"]
