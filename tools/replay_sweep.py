"""``kvpool replay TRACE --sweep 16000,8000,5000,4000``: every policy at each prefill speed, with
the store and without, against the routing targets.

At each point the store loads at the same multiple of the prefill speed as the run's
``--store-tokens-per-s`` / ``--prefill-tokens-per-s`` (10x by default). The target: wherever
the best policy's p90 TTFT is under ``applies_below`` (10) x the floor p90 (beyond that every
policy drowns in queueing and the comparison says nothing about routing), the default policy's
p90 is within ``tolerance`` (2%) of the best policy's. The prefill work kvpool saves is the
default's recomputed fraction with the store against ``least_loaded``'s without one (a cluster
with no shared cache routed for load).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.master.routing import DEFAULT_POLICY
from kvpool.tools.replay_sim import InstanceModel, Request, percentile, simulate, ttft_floor_s


@dataclass(frozen=True, slots=True)
class Point:
    prefill_tokens_per_s: float
    store_blocks: int
    floor_p90_s: float
    store_speedup: float
    p90_s: dict[str, float]        # per policy
    recomputed: dict[str, float]   # per policy, fractions of prompt tokens
    store_hit: dict[str, float]

    @property
    def best(self) -> str:
        return min(self.p90_s, key=lambda p: (self.p90_s[p], p != DEFAULT_POLICY))

    @property
    def ratio(self) -> float:
        return self.p90_s[DEFAULT_POLICY] / self.p90_s[self.best]

    @property
    def best_other(self) -> str | None:
        """The best policy but the default: the margin the default has, or lacks."""
        others = [p for p in self.p90_s if p != DEFAULT_POLICY]
        return min(others, key=self.p90_s.__getitem__) if others else None

    def instance_time(self, policy: str) -> float:
        """Prefill-seconds spent per prompt token's worth, in prefill-token units: recomputed
        plus store loads at their speed."""
        return self.recomputed[policy] + self.store_hit[policy] / self.store_speedup


def sweep(requests: list[Request], rates: list[float], policies: list[str], *,
          store_speedup: float, store_blocks: int, block_tokens: int,
          progress=None, **sim) -> list[Point]:
    points = []
    for rate in rates:
        model = InstanceModel(1 / rate, 1 / (rate * store_speedup), block_tokens)
        floor = percentile(sorted(ttft_floor_s(requests, model)), 0.90)
        for blocks in (store_blocks, 0) if store_blocks else (0,):
            p90, recomputed, store_hit = {}, {}, {}
            for name in policies:
                result, _ = simulate(requests, name, model=model, store_blocks=blocks, **sim)
                p90[name], recomputed[name] = result.ttft_p90_s, result.recomputed
                store_hit[name] = result.store_hit
                if progress:
                    progress(f"{rate:,.0f} tokens/s, store {blocks}: {name}")
            points.append(Point(rate, blocks, floor, store_speedup, p90, recomputed,
                                store_hit))
    return points


def format_sweep(points: list[Point], header: str, applies_below: float = 10.0,
                 tolerance: float = 0.02) -> str:
    columns = (f"{'prefill/s':>9} {'store':>6} {'floor_p90':>9} {'best':<16} {'best_p90':>8} "
               f"{'default_p90':>11} {'ratio':>6}  {'best_other':<16} {'its_p90':>8} "
               f"{'default/it':>10}  target")
    lines = [header, columns]
    met = True
    for p in points:
        applies = p.p90_s[p.best] < applies_below * p.floor_p90_s
        ok = p.ratio <= 1 + tolerance
        met &= ok or not applies
        verdict = ("met" if ok else "MISSED") if applies else \
            f"n/a (best > {applies_below:g}x floor)"
        other = p.best_other
        vs = (f"{other:<16} {p.p90_s[other]:>8.3f} "
              f"{p.p90_s[DEFAULT_POLICY] / p.p90_s[other]:>10.3f}") if other else \
            f"{'-':<16} {'-':>8} {'-':>10}"
        lines.append(f"{p.prefill_tokens_per_s:>9,.0f} {p.store_blocks or 'none':>6} "
                     f"{p.floor_p90_s:>9.3f} {p.best:<16} {p.p90_s[p.best]:>8.3f} "
                     f"{p.p90_s[DEFAULT_POLICY]:>11.3f} {p.ratio:>6.3f}  {vs}  {verdict}")
    lines.append(f"target (default p90 within {tolerance:.0%} of the best wherever the best is "
                 f"under {applies_below:g}x the floor p90): {'met' if met else 'MISSED'}")
    saved = _prefill_saved(points)
    if saved:
        lines.append("prefill work: the default with the store against least_loaded without "
                     "one (recomputed fraction of prompt tokens; instance time adds the "
                     "store loads)")
        for rate, with_store, without, busy in saved:
            lines.append(f"{rate:>9,.0f}  recomputed {with_store:.2%} vs {without:.2%}: "
                         f"{1 - with_store / without:.1%} less prefill; instance time "
                         f"{busy:.2%} vs {without:.2%}: the same instances serve "
                         f"{without / busy:.2f}x the prompt tokens")
    return "\n".join(lines)


def _prefill_saved(points: list[Point]) -> list[tuple[float, float, float, float]]:
    by_rate: dict[float, dict[bool, Point]] = {}
    for p in points:
        by_rate.setdefault(p.prefill_tokens_per_s, {})[p.store_blocks > 0] = p
    out = []
    for rate, pair in by_rate.items():
        if True in pair and False in pair and DEFAULT_POLICY in pair[True].recomputed \
                and "least_loaded" in pair[False].recomputed:
            out.append((rate, pair[True].recomputed[DEFAULT_POLICY],
                        pair[False].recomputed["least_loaded"],
                        pair[True].instance_time(DEFAULT_POLICY)))
    return out


def as_report(points: list[Point]) -> list[dict]:
    return [{"prefill_tokens_per_s": p.prefill_tokens_per_s, "store_blocks": p.store_blocks,
             "floor_p90_s": p.floor_p90_s, "best": p.best, "ratio": p.ratio,
             "p90_s": p.p90_s, "recomputed": p.recomputed, "store_hit": p.store_hit}
            for p in points]
