"""PrefixAwarePolicy: chain tails go before their parents; shared parents outlive their chains."""

from __future__ import annotations

import pytest
from kvpool.master.eviction import LRUPolicy, PrefixAwarePolicy


def chain(policy: PrefixAwarePolicy, keys: list[str], parent: str | None = None) -> None:
    for key in keys:
        policy.on_insert(key, parent)
        parent = key


def evict(policy, n: int) -> list[str]:
    out = []
    for _ in range(n):
        victim = next(policy.candidates())
        policy.on_remove(victim)
        out.append(victim)
    return out


def test_tails_go_before_heads_where_lru_takes_heads_first():
    prefix = PrefixAwarePolicy()
    chain(prefix, ["a", "b", "c"])
    chain(prefix, ["x", "y"])
    assert evict(prefix, 5) == ["c", "b", "a", "y", "x"]
    lru = LRUPolicy()
    for key in ["a", "b", "c", "x", "y"]:
        lru.on_insert(key)
    assert list(lru.candidates())[:3] == ["a", "b", "c"]   # the head first: strands b and c


def test_a_shared_parent_stays_while_any_chain_below_it_does():
    p = PrefixAwarePolicy()
    chain(p, ["sys", "t1"])
    chain(p, ["u1"], parent="sys")
    p.on_access("t1")                 # the older chain's tail is used again
    assert evict(p, 1) == ["u1"]      # sys is older than everything but still has t1 below it
    assert evict(p, 2) == ["t1", "sys"]
    assert len(p) == 0


def test_keys_offered_but_kept_stay_candidates():
    p = PrefixAwarePolicy()
    chain(p, ["a", "b"])
    p.on_insert("z")
    walk = p.candidates()
    assert next(walk) == "b"          # the caller skips b (leased, pinned) ...
    assert next(walk) == "z"
    p.on_remove("z")                  # ... and evicts z
    walk.close()
    assert list(p.candidates()) == ["b"] and "a" in p and "z" not in p


def test_removing_a_parent_first_and_reinserting_it_is_safe():
    p = PrefixAwarePolicy()
    chain(p, ["a", "b"])
    p.on_remove("a")                  # node loss took the parent; b is a chain head now
    p.on_insert("a")
    p.on_remove("b")
    p.on_remove("missing")            # unknown keys are ignored
    assert evict(p, 1) == ["a"] and len(p) == 0


def test_many_touches_do_not_grow_without_bound():
    p = PrefixAwarePolicy()
    chain(p, ["a", "b"])
    for _ in range(10_000):
        p.on_access("b")
    assert evict(p, 2) == ["b", "a"]
    chain(p, ["a", "b"])
    for i in range(10_000):   # a's only child comes and goes; a is touched in between
        p.on_insert(f"c{i}", "b")
        p.on_remove(f"c{i}")
        p.on_access("b")
    assert len(p._revived_heap) <= 2 * len(p) + 1025
    assert evict(p, 2) == ["b", "a"]


def test_a_block_whose_children_went_is_offered_in_its_own_lru_turn():
    p = PrefixAwarePolicy()
    p.on_insert("parent")
    p.on_insert("x")                  # used after parent
    p.on_insert("child", "parent")
    p.on_remove("child")              # parent is a leaf again, older than x
    assert list(p.candidates()) == ["parent", "x"]
    p.on_access("parent")             # now the newest
    assert list(p.candidates()) == ["x", "parent"]
    p.on_insert("y")
    p.on_insert("child", "x")
    walk = p.candidates()
    assert [next(walk) for _ in range(3)] == ["parent", "y", "child"]   # x has a child
    p.on_remove("child")              # the caller evicts it: x is a leaf again, the oldest
    assert list(walk) == ["x"]
    assert list(p.candidates()) == ["x", "parent", "y"]
    assert len(p) == 3 and "child" not in p


def test_a_revived_block_keeps_its_turn_across_epochs_of_touches():
    p = PrefixAwarePolicy()
    old = [f"old{i}" for i in range(600)]    # more touches than an epoch holds
    for key in old:
        p.on_insert(key)
    p.on_insert("parent")
    p.on_insert("new")
    p.on_insert("child", "parent")
    p.on_remove("child")
    order = list(p.candidates())
    # After every block used an epoch or more before it; only its own epoch is approximate.
    assert order.index("parent") >= 600 - PrefixAwarePolicy._EPOCH_TOUCHES
    assert order.index("parent") < order.index("new")
    assert sorted(order) == sorted([*old, "parent", "new"])


def test_a_parent_linked_after_its_children_goes_after_them():
    policy = PrefixAwarePolicy()
    chain(policy, ["c1", "c2"])              # c1 <- c2, inserted before their parent
    policy.on_insert("p")
    assert policy.link("c1", "p") and policy.parent_of("c1") == "p"
    assert evict(policy, 3) == ["c2", "c1", "p"]


def test_link_refuses_cycles_unknown_keys_and_second_parents():
    policy = PrefixAwarePolicy()
    chain(policy, ["a", "b", "c"])
    assert not policy.link("a", "c")         # c descends from a: a cycle would never go
    assert not policy.link("b", "a")         # b has a parent already
    assert not policy.link("a", "zz") and not policy.link("zz", "a")
    assert not policy.link("a", "a")
    assert evict(policy, 3) == ["c", "b", "a"]
    lru = LRUPolicy()
    lru.on_insert("x")
    lru.on_insert("y")
    assert not lru.link("y", "x") and lru.parent_of("y") is None and "x" in lru


def test_on_access_many_is_on_access_key_by_key():
    def build(policy):
        chain(policy, [f"a{i}" for i in range(300)])
        chain(policy, ["s", "t"])
        chain(policy, ["u"], parent="s")
        policy.on_remove("u")             # s stays inner (t below it)
        policy.on_remove("a299")          # a298 is revived: a leaf again in its own turn
        return policy

    touches = ["unknown", "a298", "s", "t", "a0"] + [f"a{i}" for i in range(0, 600, 2)] * 2
    for make in (PrefixAwarePolicy, LRUPolicy):
        one, many = build(make()), build(make())
        for key in touches:
            one.on_access(key)
        many.on_access_many(touches)
        assert vars(one) == vars(many)
        assert list(one.candidates()) == list(many.candidates())


class _Reads:
    """A clock and the reads a master's leases would record (``read_at``)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.last: dict[str, float] = {}

    def __call__(self) -> float:
        return self.now

    def read(self, *keys: str) -> None:
        self.last.update(dict.fromkeys(keys, self.now))

    def policy(self) -> PrefixAwarePolicy:
        return PrefixAwarePolicy(self, self.last.get)


def test_reads_told_later_give_a_second_chance_in_the_walk():
    """A key read since it took its place goes after every key that was not, as a touch
    would put it; keys moved so go in the order the walk reaches them (second chance: not
    the order of their reads, as touches would)."""
    r = _Reads()
    p = r.policy()
    for key in "abcde":
        p.on_insert(key)
        r.now += 1
    r.read("d")
    r.now += 1
    r.read("b")
    assert p.reads_later
    assert list(p.candidates()) == ["a", "c", "e", "b", "d"]
    assert list(p._leaves) == ["a", "c", "e", "b", "d"]   # moved once, by that walk
    assert list(p.candidates()) == ["a", "c", "e", "b", "d"]
    r.now += 1
    r.read("c")
    assert evict(p, 3) == ["a", "e", "b"]
    p.on_access("d")                      # a touch still works: d to the end, now
    assert list(p.candidates()) == ["c", "d"]


def test_a_read_in_the_epoch_a_key_was_placed_in_counts_as_later():
    r = _Reads()
    p = r.policy()
    p.on_insert("a")
    p.on_insert("b")
    r.read("a")                           # the same instant: still after a took its place
    assert list(p.candidates()) == ["b", "a"]
    assert list(p.candidates()) == ["b", "a"]   # and moved once, not at every walk


def test_a_block_whose_children_went_takes_its_turn_from_its_last_read():
    r = _Reads()
    p = r.policy()
    p.on_insert("parent")
    r.now += 1
    p.on_insert("x")
    r.now += 1
    p.on_insert("child", "parent")
    r.now += 1
    r.read("parent")                      # a prefix read: the inner block too
    r.now += 1
    p.on_remove("child")
    assert list(p.candidates()) == ["x", "parent"]
    q = r.policy()                        # read while waiting as a revived leaf
    q.on_insert("parent")
    r.now += 1
    q.on_insert("child", "parent")
    r.now += 1
    q.on_remove("child")
    q.on_insert("y")
    r.now += 1
    r.read("parent")
    assert list(q.candidates()) == ["y", "parent"]
    assert list(q.candidates()) == ["y", "parent"]


def test_a_walk_moves_a_bounded_number_of_keys_and_the_next_goes_on():
    r = _Reads()
    p = r.policy()
    p._MAX_MOVES = 2
    for key in "abcde":
        p.on_insert(key)
    r.now += 1
    r.read(*"abcd")
    assert list(p.candidates()) == ["c", "d", "e", "a", "b"]   # a and b moved, then no more
    assert list(p.candidates()) == ["e", "a", "b", "c", "d"]


def test_reads_told_later_need_both_a_clock_and_read_at():
    with pytest.raises(ValueError, match="both"):
        PrefixAwarePolicy(clock=lambda: 0.0)
    with pytest.raises(ValueError, match="both"):
        PrefixAwarePolicy(read_at=lambda key: None)
