"""Routing index and policies on small hand-made cases (no sockets, fake clock)."""

from __future__ import annotations

import pytest
from kvpool.common.errors import InvalidArgument, LimitExceeded
from kvpool.common.tenants import scoped
from kvpool.master.routing import (
    CPU,
    GPU,
    STORE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Candidate,
    CostModel,
    RouteQuery,
    RoutingIndex,
    RoutingLimits,
    make_policy,
)

BS = 10  # tokens per block in these cases


def q(*hashes, tokens=None):
    return RouteQuery(tuple(hashes), len(hashes) * BS if tokens is None else tokens, BS)


@pytest.fixture
def index(clock):
    """Instance a holds blocks 1-2 on GPU, b holds 1-2-3 on GPU, c holds 1 on GPU and 2 on CPU;
    the store holds 1-4."""
    store = {1, 2, 3, 4}
    idx = RoutingIndex(clock, instance_ttl_s=10, store_lookup=lambda hs, _t: [h in store for h in hs],
                       cost=CostModel(prefill_s_per_token=1.0, store_s_per_token=0.1,
                                      cpu_s_per_token=0.01, affinity_slack_tokens=0))
    idx.apply("a", [BlockStored((1, 2))])
    idx.apply("b", [BlockStored((1, 2, 3))])
    idx.apply("c", [BlockStored((1,)), BlockStored((2,), CPU)])
    return idx


def hits(index, query, instance):
    (o,) = index.options(query, [Candidate(instance)])
    return o.hit_blocks


def test_prefix_hits_per_tier_stop_at_the_first_block_held_nowhere(index):
    assert hits(index, q(1, 2, 3, 4, 5), "a") == {GPU: 2, CPU: 0, STORE: 2}
    assert hits(index, q(1, 2, 3, 4, 5), "b") == {GPU: 3, CPU: 0, STORE: 1}
    assert hits(index, q(1, 2, 3, 4, 5), "c") == {GPU: 1, CPU: 1, STORE: 2}
    # Block 9 is held nowhere: blocks after it do not count even where they are held.
    assert hits(index, q(1, 9, 2), "b") == {GPU: 1, CPU: 0, STORE: 0}
    assert hits(index, q(1, 2), "unknown") == {GPU: 0, CPU: 0, STORE: 2}


def test_partial_last_block_counts_its_tokens_only(index):
    (o,) = index.options(q(1, 2, 3, tokens=25), [Candidate("b")])
    assert o.hit_tokens == {GPU: 25, CPU: 0, STORE: 0} and o.recomputed_tokens == 0


def test_events_remove_and_clear(index):
    index.apply("b", [BlockRemoved((2,))])
    assert hits(index, q(1, 2, 3), "b") == {GPU: 2, CPU: 0, STORE: 1}   # 2 now from the store
    index.apply("b", [AllBlocksCleared()])
    assert index.blocks("b") == 0
    with pytest.raises(InvalidArgument, match="tier"):
        index.apply("b", [BlockStored((1,), "disk")])


def test_silent_instances_age_out(index, clock):
    clock.advance(6)
    index.apply("a", [])                      # a heartbeat keeps a
    clock.advance(6)
    assert sorted(index.tick()) == ["b", "c"]
    assert index.instances() == ["a"]


def route(index, policy, query, candidates, seed=0):
    return index.route(query, candidates, make_policy(policy, seed)).instance_id


LOADS = [Candidate("a", 1, 30), Candidate("b", 3, 50), Candidate("c", 0, 10)]


def test_random_is_seeded_and_covers_the_candidates(index):
    first = route(index, "random", q(1), LOADS, seed=7)
    policy = make_policy("random", 7)
    seq = [index.route(q(1), LOADS, policy).instance_id for _ in range(30)]
    policy2 = make_policy("random", 7)
    assert seq == [index.route(q(1), LOADS, policy2).instance_id for _ in range(30)]
    assert set(seq) == {"a", "b", "c"} and first == seq[0]


def test_round_robin_takes_turns(index):
    policy = make_policy("round_robin")
    assert [index.route(q(1), LOADS, policy).instance_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_takes_fewest_inflight_tokens_then_shortest_queue(index):
    assert route(index, "least_loaded", q(1, 2, 3), LOADS) == "c"
    tied = [Candidate("a", 2, 10), Candidate("b", 1, 10)]
    assert route(index, "least_loaded", q(1), tied) == "b"


def test_prefix_affinity_takes_longest_local_prefix_then_least_loaded(index):
    assert route(index, "prefix_affinity", q(1, 2, 3, 4), LOADS) == "b"
    # a and c both hold 2 local blocks (c: 1 gpu + 1 cpu); c is less loaded.
    assert route(index, "prefix_affinity", q(1, 2, 4), LOADS) == "c"


def test_kvpool_weighs_matched_prefix_against_queueing(index):
    # Idle: a = 10 recomputed + 20 store tokens = 12 s, b = 10 + 10 store = 11 s,
    # c = 10 + 10 cpu + 20 store = 12.1 s: the longest gpu prefix wins.
    idle = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert route(index, "kvpool", q(1, 2, 3, 4, 5), idle) == "b"
    # A queued request with nothing left to prefill costs b nothing ...
    busy_b = [Candidate("a"), Candidate("b", 1, 0), Candidate("c")]
    assert route(index, "kvpool", q(1, 2, 3, 4, 5), busy_b) == "b"
    # ... but 50 queued prefill tokens (50 s) outweigh one block of reuse (1 s).
    loaded_b = [Candidate("a"), Candidate("b", 4, 50), Candidate("c")]
    assert route(index, "kvpool", q(1, 2, 3, 4, 5), loaded_b) == "a"


def test_kvpool_keeps_affinity_within_the_slack(clock):
    idx = RoutingIndex(clock, cost=CostModel(1.0, 0.1, 0.01, recompute_weight=0,
                                             affinity_slack_tokens=5, affinity_slack_max_s=60))
    idx.apply("a", [BlockStored((1, 2))])
    query = q(1, 2, 3)
    # a: 10 recomputed + 4 queued = 14 s; b: 30 recomputed = 30 s -> a (no contest).
    assert route(idx, "kvpool", query, [Candidate("a", 1, 4), Candidate("b")]) == "a"
    # a with 22 queued tokens: 32 s vs b's 30 s; within 5 s of the best, a keeps its prefix.
    assert route(idx, "kvpool", query, [Candidate("a", 1, 22), Candidate("b")]) == "a"
    # 26 queued: 36 s, more than the slack behind b: b wins.
    assert route(idx, "kvpool", query, [Candidate("a", 1, 26), Candidate("b")]) == "b"


def test_the_affinity_slack_is_bounded_in_seconds(clock):
    """On a slow instance (1 token/s here) the slack in tokens is long in seconds: the cap
    keeps the router from making a request wait that long for affinity."""
    idx = RoutingIndex(clock, cost=CostModel(1.0, 0.1, 0.01, recompute_weight=0,
                                             affinity_slack_tokens=5, affinity_slack_max_s=1))
    idx.apply("a", [BlockStored((1, 2))])
    # a: 32 s against b's 30 s: within 5 tokens (5 s) but not within 1 s of the best.
    assert route(idx, "kvpool", q(1, 2, 3), [Candidate("a", 1, 22), Candidate("b")]) == "b"
    assert route(idx, "kvpool", q(1, 2, 3), [Candidate("a", 1, 21), Candidate("b")]) == "a"
    assert CostModel(1 / 8000).affinity_slack_s == 0.5
    assert CostModel(1 / 16000).affinity_slack_s == pytest.approx(4096 / 16000)


@pytest.mark.parametrize("weight, expected", [(0.0, "b"), (1.0, "a")])
def test_kvpool_weighs_recomputation_beyond_its_own_wait(clock, weight, expected):
    idx = RoutingIndex(clock, cost=CostModel(1.0, 0.1, 0.01, recompute_weight=weight,
                                             affinity_slack_tokens=0))
    idx.apply("a", [BlockStored((1, 2))])
    # a: 30 queued + 10 recomputed = 40 s (score 40 + w * 10); b: 30 s (score 30 + w * 30).
    # Waiting on a is slower for this request, but b would compute 20 tokens the cluster holds.
    assert route(idx, "kvpool", q(1, 2, 3), [Candidate("a", 1, 30), Candidate("b")]) == expected


def test_kvpool_estimate_is_the_documented_formula(index):
    (o,) = index.options(q(1, 2, 3, 4, 5), [Candidate("c", 2, 7)])
    # c: 1 gpu, 1 cpu, 2 store blocks, 1 recomputed; 7 tokens queued ahead.
    assert o.estimated_ttft_s == pytest.approx((7 + 10) * 1.0 + 10 * 0.01 + 20 * 0.1)


def test_default_policy_and_errors(index):
    assert make_policy("").name == "kvpool"
    with pytest.raises(InvalidArgument, match="unknown routing policy 'best'"):
        make_policy("best")
    with pytest.raises(InvalidArgument, match="no candidate"):
        RoutingIndex().route(q(1), None, make_policy("kvpool"))
    with pytest.raises(InvalidArgument, match="twice"):
        index.route(q(1), [Candidate("a"), Candidate("a")], make_policy("kvpool"))


def test_no_candidates_means_every_live_instance(index):
    assert route(index, "prefix_affinity", q(1, 2, 3), None) == "b"


def test_kv_events_are_held_within_the_routing_limits(clock):
    index = RoutingIndex(clock, instance_ttl_s=30.0,
                         limits=RoutingLimits(max_instances=2, max_blocks_per_instance=5,
                                              max_blocks=8))
    assert index.apply("a", [BlockStored(tuple(range(7)))]) == 1
    assert index.blocks("a") == 5 and index.dropped_blocks == 2
    index.apply("a", [BlockStored((0, 1, 2))])          # already held: nothing dropped
    assert index.dropped_blocks == 2
    index.apply("b", [BlockStored(tuple(range(10, 15)), CPU)])
    assert index.blocks("b", CPU) == 3 and index.total_blocks == 8   # the total cap
    with pytest.raises(LimitExceeded, match="--max-routing-instances"):
        index.apply("c", [])
    index.apply("a", [BlockRemoved((0, 1))])
    index.apply("b", [BlockStored((20, 21, 22))])
    assert index.total_blocks == 8 and index.blocks("b", GPU) == 2
    index.apply("a", [AllBlocksCleared()])
    assert index.total_blocks == 5
    clock.advance(31.0)
    index.apply("b", [])                                   # b heard from; a went silent
    index.apply("c", [BlockStored((1,))])                  # a's place, taken back by tick
    assert sorted(index.instances()) == ["b", "c"] and index.total_blocks == 6


def test_one_tenant_cannot_take_every_other_tenants_instance_room(clock):
    index = RoutingIndex(clock, instance_ttl_s=30.0,
                         limits=RoutingLimits(max_instances=4, max_instances_per_tenant=2))
    a = [scoped("a", f"engine{i}") for i in range(3)]
    index.apply(a[0], [])
    index.apply(a[1], [BlockStored((1, 2))])
    with pytest.raises(LimitExceeded, match="tenant 'a' has 2 .*per-tenant"):
        index.apply(a[2], [])
    index.apply(a[1], [BlockStored((3,))])          # a known instance is not a new one
    index.apply(scoped("b", "engine0"), [])         # another tenant still has room
    index.apply("engine0", [])                      # and so has the default tenant
    clock.advance(31.0)
    index.apply(a[0], [])                           # heard from; a[1] went silent
    index.apply(a[2], [])                           # a[1]'s place, taken back by tick
    assert sorted(index.instances()) == sorted([a[0], a[2]])
