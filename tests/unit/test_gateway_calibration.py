"""The gateway's engine pool feeding the cost-model calibrator: candidates carry each engine's
measured rates from the first sample, and none before (the master's model decides)."""

from __future__ import annotations

import pytest
from kvpool.client.router import Candidate
from kvpool.gateway.engines import EnginePool, EngineSpec
from kvpool.gateway.routing import Choice
from kvpool.master.calibration import CostCalibrator, Rates


def test_candidates_carry_measured_rates_from_the_first_sample(clock):
    cal = CostCalibrator(Rates(8000.0, 80000.0), clock=clock, min_samples=4)
    pool = EnginePool([EngineSpec("slow", "http://h:1"), EngineSpec("idle", "http://h:2")],
                      clock=clock, calibrator=cal)
    # "slow" prefills 1,000 tokens/s; two requests sent at once, answered in turn (the
    # second's service starts at the first's first token, not when it was sent).
    for n in range(12):
        tickets = [pool.sent("slow", 1000 * (k + 1)) for k in range(2)]
        if n == 0:   # no sample yet: no rates (the master's model decides)
            assert pool.candidates()[1] == Candidate("idle", 0, 0)
        for k, t in enumerate(tickets):
            clock.advance(k + 1.0)
            pool.first_token("slow", t)
            pool.done("slow", t)
    slow, idle = pool.candidates()
    assert slow.prefill_tokens_per_s == pytest.approx(1000, rel=0.01)
    # An engine not measured yet is judged by the fleet's estimate, not by the prior.
    assert idle.prefill_tokens_per_s == pytest.approx(1000, rel=0.01)
    # A request that failed before its first token teaches nothing.
    t = pool.sent("idle", 5000)
    clock.advance(100)
    pool.done("idle", t)
    assert cal.estimate("idle").accepted == 0


def test_without_a_calibrator_candidates_carry_no_rates(clock):
    pool = EnginePool([EngineSpec("e0", "http://h:1")], clock=clock)
    t = pool.sent("e0", 100, store_tokens=50)
    clock.advance(1)
    pool.first_token("e0", t)
    # still running there, generating
    assert pool.candidates() == [Candidate("e0", 1, 0, decoding_requests=1)]


def test_a_choice_names_the_tokens_it_expects_from_the_store():
    c = Choice("e0", "kvpool", {"gpu": 2, "cpu": 0, "store": 6}, 128, 0.0)
    assert c.store_tokens == 96
    assert Choice("e0", "kvpool", dict.fromkeys(("gpu", "cpu", "store"), 0), 0, 0.0) \
        .store_tokens == 0
