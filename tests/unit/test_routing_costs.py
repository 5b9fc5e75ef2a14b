"""The default policy's cost model: candidates' own measured rates, and recomputation weighed
up while the whole cluster has a backlog."""

from __future__ import annotations

import pytest
from kvpool.common.errors import InvalidArgument
from kvpool.master.routing import (
    BlockStored,
    Candidate,
    CostModel,
    RouteQuery,
    RoutingIndex,
    make_policy,
)

BS = 10


def q(*hashes) -> RouteQuery:
    return RouteQuery(tuple(hashes), len(hashes) * BS, BS)


def route(idx, candidates) -> str:
    return idx.route(q(1, 2, 3), candidates, make_policy("kvpool")).instance_id


@pytest.fixture
def idx(clock):
    index = RoutingIndex(clock, cost=CostModel(1.0, 0.1, 0.01, recompute_weight=1,
                                               affinity_slack_tokens=0,
                                               backlog_weight_per_s=0))
    index.apply("a", [BlockStored((1, 2))])
    index.apply("b", [])
    return index


def test_a_candidates_measured_rates_replace_the_configured_ones(idx):
    # a: 20 queued + 10 recomputed = 30 s; b: 30 recomputed = 30 s (+ 30 s of recomputation
    # in its score): a.
    assert route(idx, [Candidate("a", 1, 20), Candidate("b")]) == "a"
    # a measured at a quarter of the configured speed: 120 s; b: 60 (score): b.
    slow_a = [Candidate("a", 1, 20, prefill_tokens_per_s=0.25), Candidate("b")]
    assert route(idx, slow_a) == "b"
    (oa, ob) = idx.options(q(1, 2, 3), slow_a)
    assert oa.estimated_ttft_s == pytest.approx(30 / 0.25) and ob.estimated_ttft_s == 30
    # The store rate likewise: b holds nothing but the store holds all 3 blocks.
    store = RoutingIndex(idx._clock, store_lookup=lambda hs, _t: [True] * len(hs), cost=idx.cost)
    (o,) = store.options(q(1, 2, 3), [Candidate("b", store_tokens_per_s=100.0)])
    assert o.estimated_ttft_s == pytest.approx(30 / 100)


def test_rates_must_be_positive_and_finite():
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument, match="rates"):
            Candidate("a", prefill_tokens_per_s=bad)
    with pytest.raises(InvalidArgument):
        CostModel(prefill_s_per_token=0)
    with pytest.raises(InvalidArgument):
        CostModel(backlog_weight_per_s=-1)


@pytest.mark.parametrize("backlog_weight_per_s, expected", [(0.0, "b"), (1.0, "a")])
def test_recomputation_weighs_more_while_every_candidate_is_busy(clock, backlog_weight_per_s,
                                                                  expected):
    idx = RoutingIndex(clock, cost=CostModel(1.0, 0.1, 0.01, recompute_weight=1,
                                             affinity_slack_tokens=0,
                                             backlog_weight_per_s=backlog_weight_per_s))
    idx.apply("a", [BlockStored((1, 2))])
    # Recomputing b's 20 extra tokens delays what queues behind it; while even the least
    # loaded candidate has work queued (here 3 s), everything arriving meanwhile queues too.
    close = [Candidate("a", 2, 48), Candidate("b", 1, 3)]
    # a: 48 + 10 = 58 s, b: 3 + 30 = 33 s; scores add w x recomputed with w = 1 + rate x 3 s:
    # b at 0/s (68 vs 63), a at 1/s (w = 4: 98 vs 153).
    assert idx.route(q(1, 2, 3), close, make_policy("kvpool")).instance_id == expected
    # One idle candidate means no cluster backlog: the weight is 1 whatever the rate.
    idle_b = [Candidate("a", 2, 44), Candidate("b")]
    # a: 54 s, score 64; b: 30 s, score 60 -> b.
    assert idx.route(q(1, 2, 3), idle_b, make_policy("kvpool")).instance_id == "b"
