"""Online calibration of the router's cost model from observed times to first token; sans-IO.

The default policy ranks instances by an estimated time to first token built from two rates
per instance (:class:`~kvpool.master.routing.CostModel`): how fast it prefills and how fast it
loads store-held KV. Operators rarely know them, they differ between engines, and a wrong pair
routes badly without saying so. :class:`CostCalibrator` learns them per engine from what the
caller of ``Route`` (the gateway, the trace replay) sees of each request it forwarded: the
tokens it expected the engine to recompute and to load from the store (Route's answer) and
when the request was sent and its first token came back.

**Service time, not TTFT.** A TTFT includes the wait behind earlier requests, which says
nothing about this request's cost. For an engine that prefills in arrival order, a request's
service began when it was sent or when the previous request on that engine produced its first
token, whichever is later; ``first_token`` derives the service time that way. (An engine that
batches prefills shares a step between requests; the differences still sum to the work done,
and the fit below averages over a window.)

**The fit.** Per engine, the last ``window`` samples (younger than ``max_age_s``) of
``service_s ~ recomputed_tokens * prefill_s_per_token + store_tokens * store_s_per_token``,
least squares on relative error (a 30 k-token prompt does not outweigh a hundred short ones),
then samples whose relative residual is over ``outlier_mads`` median absolute deviations (a
stalled engine, a request that waited on something else) are dropped and the fit is redone.
The store rate is fitted only from enough samples that loaded from the store and when it is
not collinear with prefill; otherwise it holds (without a store it cannot be observed).

**The fleet first.** Every sample also feeds a fleet-wide fit (a window four times longer).
An engine with fewer than ``min_samples`` samples of its own is judged by the fleet's
estimate, and its own estimate starts from the fleet's: from a prior 4x off, engines judged
by the prior next to engines already measured would look 4x faster or slower than they are,
and the router would crowd onto the ones that look fast. (Scaling every rate alike changes few
decisions; scaling some engines' is what routes badly.) The fleet's estimate moves from its
first sample (``fleet_min_samples``), smoothed and clamped like every fit: the prior is a
guess, often far off (the master's default model is a GPU node's 8,000 tokens/s; a CPU engine
prefills a few hundred), and the router's affinity slack is in seconds, so the sooner the
rates are measured the sooner the slack means what it says. Before the first sample everything
is the prior (``measured`` says None: the router's own model decides).

**Refits are amortised.** A fit reads the whole window; refitting the fleet's 256 samples on
every request was the gateway's largest cost per request. An engine's window (``window``)
refits on every sample; the fleet's, four times longer, after every ``len // window`` new
samples, so each costs about the same per sample. (Refitting an engine's window less often
left its estimate a few percent off at 10% noise: each fit moves a fraction of the way, and
fewer fits average less.)

**Bounds and smoothing.** Each fit moves an estimate a fraction ``smoothing`` of the way (in
log space, so 4x too high and 4x too low converge alike), clamped to ``prefill_bounds`` /
``store_bounds`` (tokens/s): no run of bad samples can take the router somewhere absurd.

The model has no constant term: a fixed per-request overhead (HTTP, scheduling) is folded
into the rates, which overstates the cost of short prompts a little.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.common.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class Rates:
    """An engine's throughputs, tokens per second (what an operator would configure)."""

    prefill_tokens_per_s: float
    store_tokens_per_s: float

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.store_tokens_per_s > 0):
            raise InvalidArgument("rates must be > 0 tokens/s")

    def scaled(self, prefill: float, store: float) -> Rates:
        return Rates(self.prefill_tokens_per_s * prefill, self.store_tokens_per_s * store)


@dataclass(frozen=True, slots=True)
class Ticket:
    """A request in flight, from ``sent`` to ``first_token``."""

    engine: str
    sent_s: float


@dataclass(frozen=True, slots=True)
class _Sample:
    at_s: float
    recomputed: float
    store: float
    service_s: float


@dataclass(eq=False, slots=True)
class _Engine:
    rates: Rates
    samples: deque
    last_first_token_s: float = -math.inf
    accepted: int = 0         # samples taken (not skipped as uninformative)
    fits: int = 0             # estimates moved
    unfitted: int = 0         # samples taken since the last refit


@dataclass(frozen=True, slots=True)
class EngineEstimate:
    """What the calibrator believes of one engine, for logs and metrics."""

    rates: Rates
    samples: int              # in the window now
    accepted: int             # over the engine's life
    calibrated: bool          # False: still the prior


@dataclass(eq=False)
class CostCalibrator:
    """Per-engine prefill and store-load rates learned online (see the module docstring).

    Not thread-safe: one event loop (or a lock held by the caller) owns it."""

    prior: Rates
    clock: Callable[[], float] = time.monotonic
    prefill_bounds: tuple[float, float] = (100.0, 1e6)
    store_bounds: tuple[float, float] = (1e3, 1e8)
    window: int = 64
    min_samples: int = 8
    fleet_min_samples: int = 1
    smoothing: float = 0.3
    outlier_mads: float = 4.0
    max_age_s: float = 600.0
    _engines: dict[str, _Engine] = field(default_factory=dict, init=False, repr=False)
    _fleet: _Engine = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("prefill", self.prefill_bounds), ("store", self.store_bounds)):
            if not 0 < lo <= hi:
                raise InvalidArgument(f"{name} bounds must satisfy 0 < low <= high")
        if not 0 < self.smoothing <= 1:
            raise InvalidArgument("smoothing must be in (0, 1]")
        if self.window < 2 or not 1 <= self.min_samples <= self.window \
                or not 1 <= self.fleet_min_samples <= 4 * self.window:
            raise InvalidArgument("need window >= 2, 1 <= min_samples <= window and "
                                  "1 <= fleet_min_samples <= 4 * window")
        self.prior = self._clamp(self.prior)
        # Every engine's samples together: what an engine is judged by until it has its own
        # (a longer window: it sees every engine's requests, and few of them load much).
        self._fleet = _Engine(self.prior, deque(maxlen=4 * self.window))

    # -- what the caller sees of a request --
    def sent(self, engine: str) -> Ticket:
        """A request was forwarded to ``engine`` now."""
        return Ticket(engine, self.clock())

    def first_token(self, ticket: Ticket, recomputed_tokens: int, store_tokens: int) -> None:
        """The request's first token arrived now; ``recomputed_tokens`` and ``store_tokens``
        are what Route expected of it. Derives its service time (FIFO) and learns from it."""
        now = self.clock()
        e = self._engine(ticket.engine)
        started = max(ticket.sent_s, min(e.last_first_token_s, now))
        e.last_first_token_s = max(e.last_first_token_s, now)
        self.observe(ticket.engine, recomputed_tokens, store_tokens, now - started)

    def observe(self, engine: str, recomputed_tokens: int, store_tokens: int,
                service_s: float) -> None:
        """Learn from one request's service time directly (when the caller measures it)."""
        if recomputed_tokens < 0 or store_tokens < 0:
            raise InvalidArgument("token counts must be >= 0")
        e = self._engine(engine)
        # Nothing to learn from a request that cost (almost) nothing or took no time: its
        # relative error is undefined, and an all-local hit says nothing about either rate.
        if service_s <= 0 or recomputed_tokens + store_tokens < 1:
            return
        sample = _Sample(self.clock(), recomputed_tokens, store_tokens, service_s)
        self._learn(self._fleet, sample, self.fleet_min_samples, fallback=None)
        self._learn(e, sample, self.min_samples, fallback=self._fleet.rates)

    # -- what the router uses --
    def rates(self, engine: str) -> Rates:
        """The engine's current estimate: the fleet's (every engine's samples together, the
        prior until there are ``fleet_min_samples``) until the engine has ``min_samples`` of
        its own."""
        e = self._engines.get(engine)
        return e.rates if e is not None and e.fits > 0 else self._fleet.rates

    def measured(self, engine: str) -> Rates | None:
        """``rates(engine)`` once measured (the engine's or the fleet's fit); None while it
        is still the prior, so a caller can leave the router's own configuration in force."""
        e = self._engines.get(engine)
        if e is not None and e.fits > 0:
            return e.rates
        return self._fleet.rates if self._fleet.fits > 0 else None

    def fleet_rates(self) -> Rates:
        return self._fleet.rates

    def estimate(self, engine: str) -> EngineEstimate:
        e = self._engines.get(engine)
        if e is None:
            return EngineEstimate(self.rates(engine), 0, 0, False)
        return EngineEstimate(self.rates(engine), len(e.samples), e.accepted, e.fits > 0)

    def engines(self) -> list[str]:
        return sorted(self._engines)

    def forget(self, engine: str) -> None:
        """Drop what was learned of ``engine`` (it was replaced, moved, reconfigured)."""
        self._engines.pop(engine, None)

    # -- internals --
    def _engine(self, engine: str) -> _Engine:
        if not engine:
            raise InvalidArgument("an engine id is required")
        e = self._engines.get(engine)
        if e is None:
            e = self._engines[engine] = _Engine(self.prior, deque(maxlen=self.window))
        return e

    def _learn(self, e: _Engine, sample: _Sample, min_samples: int,
               fallback: Rates | None) -> None:
        """Add ``sample`` to ``e``'s window and refit (see "Refits are amortised");
        ``fallback``: the store rate to use when ``e``'s own samples cannot tell it (None:
        hold its own)."""
        e.samples.append(sample)
        e.accepted += 1
        e.unfitted += 1
        while e.samples and e.samples[0].at_s < sample.at_s - self.max_age_s:
            e.samples.popleft()
        if len(e.samples) < min_samples or \
                (e.fits and e.unfitted < max(1, len(e.samples) // self.window)):
            return
        e.unfitted = 0
        if fallback is not None and e.fits == 0:
            # An engine's own estimate starts where the fleet's is now, not at the prior:
            # engines judged by different standards would look faster or slower than they are.
            e.rates = fallback
        fit = self._fit(list(e.samples), e.rates, fallback or e.rates)
        if fit is not None:
            e.rates = self._clamp(_smooth(e.rates, fit, self.smoothing))
            e.fits += 1

    def _clamp(self, r: Rates) -> Rates:
        return Rates(_clip(r.prefill_tokens_per_s, self.prefill_bounds),
                     _clip(r.store_tokens_per_s, self.store_bounds))

    def _fit(self, samples: list[_Sample], current: Rates, fallback: Rates) -> Rates | None:
        """Robust fit of (prefill, store) s/token; None when the samples say nothing usable."""
        store_s = 1 / fallback.store_tokens_per_s
        fit = (1 / current.prefill_tokens_per_s, 1 / current.store_tokens_per_s)
        kept = samples
        for _ in range(4):   # fit, drop outliers, refit: a bad first fit hides some
            # Relative error, scaled by the *predicted* time: scaling by the observed one would
            # give a request that returned implausibly fast the most weight.
            scale = [x.recomputed * fit[0] + x.store * fit[1] for x in kept]
            fit = _least_squares(kept, scale, store_s, self.min_samples)
            if fit is None:
                return None
            res = [(x.service_s - x.recomputed * fit[0] - x.store * fit[1]) / w
                   for x, w in zip(kept, scale)]
            center = _median(res)
            mad = _median([abs(r - center) for r in res])
            limit = max(self.outlier_mads * mad * 1.4826, 0.02)   # 1.4826: MAD -> sigma
            inliers = [x for x, r in zip(kept, res) if abs(r - center) <= limit]
            if len(inliers) == len(kept) or len(inliers) < self.min_samples:
                break
            kept = inliers
        prefill_s, fitted_store_s = fit
        return Rates(1 / prefill_s, 1 / fitted_store_s)


def _least_squares(samples: list[_Sample], scale: list[float], store_s: float,
                   min_store_samples: int) -> tuple[float, float] | None:
    """Minimise sum(((y - r*p - t*s) / scale)^2) over (p, s) > 0; s held at ``store_s`` when
    the store share cannot be told apart. None when p comes out non-positive."""
    srr = srt = stt = sry = sty = 0.0
    stores = 0
    for x, sc in zip(samples, scale):
        w = 1 / (sc * sc)
        srr += w * x.recomputed * x.recomputed
        srt += w * x.recomputed * x.store
        stt += w * x.store * x.store
        sry += w * x.recomputed * x.service_s
        sty += w * x.store * x.service_s
        stores += x.store > 0
    det = srr * stt - srt * srt
    # Both rates only from enough store loads, and not when store and recomputed tokens move
    # together (then any split between them fits as well).
    if stores >= min_store_samples and srr > 0 and stt > 0 and det > 1e-3 * srr * stt:
        p = (sry * stt - sty * srt) / det
        s = (srr * sty - srt * sry) / det
        if p > 0 and s > 0:
            return p, s
    if srr <= 0:
        return None
    p = (sry - store_s * srt) / srr
    return (p, store_s) if p > 0 else None


def _smooth(old: Rates, new: Rates, alpha: float) -> Rates:
    def step(a: float, b: float) -> float:
        return math.exp(math.log(a) + alpha * (math.log(b) - math.log(a)))
    return Rates(step(old.prefill_tokens_per_s, new.prefill_tokens_per_s),
                 step(old.store_tokens_per_s, new.store_tokens_per_s))


def _clip(x: float, bounds: tuple[float, float]) -> float:
    return min(max(x, bounds[0]), bounds[1])


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
