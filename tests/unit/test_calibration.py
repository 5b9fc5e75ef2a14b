"""The cost-model calibrator: converges from a wrong prior, resists outliers, stays in bounds,
holds the prior until it has evidence, and derives service time from what a gateway sees."""

from __future__ import annotations

import random

import pytest
from kvpool.common.errors import InvalidArgument
from kvpool.master.calibration import CostCalibrator, Rates

TRUE = Rates(8000.0, 80000.0)


def samples(n: int, rng: random.Random, rates: Rates = TRUE, noise: float = 0.0,
            store_share: float = 0.5):
    """(recomputed, store tokens, service_s) of requests on an engine with ``rates``; ``noise``
    is relative (uniform +-), as a real engine's step times jitter."""
    for _ in range(n):
        recomputed = rng.randrange(64, 16000)
        store = rng.randrange(512, 40000) if rng.random() < store_share else 0
        service = recomputed / rates.prefill_tokens_per_s + store / rates.store_tokens_per_s
        yield recomputed, store, service * (1 + rng.uniform(-noise, noise))


def feed(cal: CostCalibrator, engine: str, clock, data) -> None:
    for recomputed, store, service in data:
        clock.advance(service)
        cal.observe(engine, recomputed, store, service)


def within(r: Rates, want: Rates, tol: float) -> bool:
    return (abs(r.prefill_tokens_per_s / want.prefill_tokens_per_s - 1) <= tol
            and abs(r.store_tokens_per_s / want.store_tokens_per_s - 1) <= tol)


@pytest.mark.parametrize("factor", [4.0, 0.25])
@pytest.mark.parametrize("store_factor", [4.0, 0.25])
def test_converges_from_four_times_off(clock, factor, store_factor):
    cal = CostCalibrator(TRUE.scaled(factor, store_factor), clock=clock)
    rng = random.Random(1)
    feed(cal, "e0", clock, samples(40, rng, noise=0.1))
    assert within(cal.rates("e0"), TRUE, 0.05), cal.rates("e0")
    feed(cal, "e0", clock, samples(100, rng, noise=0.1))
    assert within(cal.rates("e0"), TRUE, 0.03), cal.rates("e0")
    assert cal.estimate("e0").calibrated


def test_engines_are_calibrated_apart(clock):
    slow = Rates(2000.0, 40000.0)
    cal = CostCalibrator(TRUE, clock=clock)
    rng = random.Random(2)
    feed(cal, "fast", clock, samples(60, rng))
    feed(cal, "slow", clock, samples(60, rng, rates=slow))
    assert within(cal.rates("fast"), TRUE, 0.01)
    assert within(cal.rates("slow"), slow, 0.01)
    # An engine not heard from yet is judged by the fleet's recent samples, not the prior.
    assert cal.rates("never-seen") == cal.fleet_rates() != TRUE


def test_a_new_engine_starts_from_the_fleet_not_the_prior(clock):
    """From a prior 4x off, engines calibrated while others still hold the prior would look 4x
    faster or slower than those: a newcomer is judged by the fleet's estimate instead."""
    cal = CostCalibrator(TRUE.scaled(0.25, 0.25), clock=clock)
    rng = random.Random(8)
    for i, sample in enumerate(samples(80, rng)):
        clock.advance(sample[2])
        cal.observe(f"e{i % 4}", *sample)
    assert within(cal.fleet_rates(), TRUE, 0.05)
    feed(cal, "late", clock, samples(3, rng))
    assert within(cal.rates("late"), TRUE, 0.05) and not cal.estimate("late").calibrated


def test_an_engine_is_judged_by_the_fleet_until_it_has_enough_samples(clock):
    prior = TRUE.scaled(4, 4)
    cal = CostCalibrator(prior, clock=clock, min_samples=8)
    assert cal.measured("e0") is None        # no sample yet: the router's own model
    rng = random.Random(3)
    feed(cal, "e0", clock, samples(1, rng))
    # The fleet moves from its first sample (a fraction of the way: one sample is weak
    # evidence), so the router stops using a prior that may be 10x off at once.
    first = cal.rates("e0")
    assert first == cal.fleet_rates() == cal.measured("e0")
    assert TRUE.prefill_tokens_per_s < first.prefill_tokens_per_s < prior.prefill_tokens_per_s
    feed(cal, "e0", clock, samples(6, rng))
    assert not cal.estimate("e0").calibrated
    # Requests that cost nothing (all local hits) or took no time are not evidence.
    cal.observe("e0", 0, 0, 0.5)
    cal.observe("e0", 4000, 0, 0.0)
    assert cal.estimate("e0").accepted == 7 and not cal.estimate("e0").calibrated
    feed(cal, "e0", clock, samples(1, rng))
    assert cal.estimate("e0").calibrated


def test_the_fleet_can_wait_for_evidence(clock):
    prior = TRUE.scaled(4, 4)
    cal = CostCalibrator(prior, clock=clock, fleet_min_samples=8)
    feed(cal, "e0", clock, samples(7, random.Random(3)))
    assert cal.rates("e0") == prior and cal.measured("e0") is None


def test_ignores_outliers(clock):
    cal = CostCalibrator(TRUE, clock=clock)
    rng = random.Random(4)
    data = list(samples(200, rng, noise=0.05))
    # One request in ten stalls: 20x its service time (a preempted engine), or returns at once.
    for i in range(0, len(data), 10):
        r, s, y = data[i]
        data[i] = (r, s, y * (20 if i % 20 else 0.05))
    feed(cal, "e0", clock, data)
    assert within(cal.rates("e0"), TRUE, 0.05), cal.rates("e0")


def test_never_leaves_its_bounds(clock):
    bounds = (1000.0, 50000.0), (10000.0, 500000.0)
    cal = CostCalibrator(Rates(100.0, 1e9), clock=clock, prefill_bounds=bounds[0],
                         store_bounds=bounds[1])
    assert cal.rates("e0") == Rates(1000.0, 500000.0)   # the prior itself is clamped
    rng = random.Random(5)
    for absurd in (Rates(1e7, 1e9), Rates(1.0, 10.0), Rates(1e7, 10.0)):
        for r, s, y in samples(100, rng, rates=absurd):
            clock.advance(1)
            cal.observe("e0", r, s, y)
            got = cal.rates("e0")
            assert bounds[0][0] <= got.prefill_tokens_per_s <= bounds[0][1]
            assert bounds[1][0] <= got.store_tokens_per_s <= bounds[1][1]
    # Pinned at a bound it still comes back when the engine does.
    feed(cal, "e0", clock, samples(150, rng))
    assert within(cal.rates("e0"), TRUE, 0.02)


def test_store_rate_holds_without_store_loads(clock):
    prior = TRUE.scaled(1, 4)
    cal = CostCalibrator(prior, clock=clock)
    feed(cal, "e0", clock, samples(50, random.Random(6), store_share=0.0))
    got = cal.rates("e0")
    # Nothing to learn it from: it holds (up to rounding).
    assert got.store_tokens_per_s == pytest.approx(prior.store_tokens_per_s, rel=1e-9)
    assert got.prefill_tokens_per_s == pytest.approx(TRUE.prefill_tokens_per_s, rel=0.01)


def test_old_samples_age_out(clock):
    cal = CostCalibrator(TRUE, clock=clock, max_age_s=300.0, window=32)
    rng = random.Random(7)
    feed(cal, "e0", clock, samples(32, rng))
    clock.advance(600)
    slower = Rates(4000.0, 40000.0)
    feed(cal, "e0", clock, samples(30, rng, rates=slower))
    # Only the new samples are in the window: the estimate follows the engine, not the mix.
    assert cal.estimate("e0").samples == 30
    assert within(cal.rates("e0"), slower, 0.02)


def test_first_token_derives_service_time_in_fifo_order(clock):
    """Three requests sent together to one engine: the second's service starts at the first's
    first token, not when it was sent, so its wait is not taken for slowness."""
    cal = CostCalibrator(TRUE, clock=clock, min_samples=3)
    tickets = [cal.sent("e0") for _ in range(3)]
    clock.advance(1.0)      # 8,000 tokens at 8,000/s
    cal.first_token(tickets[0], 8000, 0)
    clock.advance(0.5)      # 4,000 recomputed
    cal.first_token(tickets[1], 4000, 0)
    clock.advance(0.25)     # 20,000 from the store at 80,000/s
    cal.first_token(tickets[2], 0, 20000)
    got = cal.rates("e0")
    assert got.prefill_tokens_per_s == pytest.approx(8000, rel=1e-6)
    # A request sent after the engine went idle: its service starts when it was sent.
    clock.advance(10)
    t = cal.sent("e0")
    clock.advance(0.5)
    cal.first_token(t, 4000, 0)
    assert cal.rates("e0").prefill_tokens_per_s == pytest.approx(8000, rel=1e-6)


def test_bad_configuration_and_samples_are_refused(clock):
    with pytest.raises(InvalidArgument):
        Rates(0, 1)
    with pytest.raises(InvalidArgument):
        CostCalibrator(TRUE, clock=clock, prefill_bounds=(10.0, 1.0))
    with pytest.raises(InvalidArgument):
        CostCalibrator(TRUE, clock=clock, smoothing=0)
    with pytest.raises(InvalidArgument):
        CostCalibrator(TRUE, clock=clock, window=4, min_samples=5)
    cal = CostCalibrator(TRUE, clock=clock)
    with pytest.raises(InvalidArgument):
        cal.observe("e0", -1, 0, 1.0)
    with pytest.raises(InvalidArgument):
        cal.observe("", 1, 0, 1.0)
