"""``kvpool replay TRACE --calibrate``: the default policy with a misconfigured cost model, fixed
and calibrated online (master/calibration.py), against the correctly configured one.

Each start multiplies the true prefill and store-load rates by a factor each (4 and 1/4 by
default: four starts). Scaling both rates alike changes no decision (every term of the
default's score scales with them), so the starts that matter are the mixed ones, where the
router misjudges a store load against a recomputation.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from kvpool.common.errors import InvalidArgument
from kvpool.master.calibration import Rates
from kvpool.master.routing import DEFAULT_POLICY
from kvpool.tools.replay_sim import (
    InstanceModel,
    Request,
    as_dict,
    model_rates,
    percentile,
    simulate,
)


@dataclass(frozen=True, slots=True)
class Run:
    label: str
    prefill_factor: float       # the router's rates over the true ones, at the start
    store_factor: float
    calibrated: bool
    result: dict
    ttfts: list[float]
    arrivals: list[float]
    # Per request: the calibrated rates over the true ones, geometric mean over instances.
    prefill_ratio: list[float]
    store_ratio: list[float]


def run_calibration(requests: list[Request], model: InstanceModel, *, factors=(4.0, 0.25),
                    service_jitter: float = 0.1, **sim) -> list[Run]:
    """The configured run, then every (prefill, store) start fixed and calibrated."""
    truth = model_rates(model)
    runs = [_run(requests, model, truth, 1.0, 1.0, False, service_jitter, sim)]
    for fp, fs in itertools.product(factors, factors):
        for calibrated in (False, True):
            runs.append(_run(requests, model, truth, fp, fs, calibrated, service_jitter, sim))
    return runs


def _run(requests, model, truth: Rates, fp: float, fs: float, calibrated: bool,
         jitter: float, sim: dict) -> Run:
    history: list = []
    result, ttfts = simulate(requests, DEFAULT_POLICY, model=model,
                             router_rates=truth.scaled(fp, fs), calibrate=calibrated,
                             service_jitter=jitter, history=history, **sim)
    pr, sr = [], []
    for _, rates in history:
        rs = list(rates.values())
        pr.append(_gmean([r.prefill_tokens_per_s / truth.prefill_tokens_per_s for r in rs])
                  if rs else fp)
        sr.append(_gmean([r.store_tokens_per_s / truth.store_tokens_per_s for r in rs])
                  if rs else fs)
    label = "configured" if (fp, fs) == (1, 1) and not calibrated else \
        f"prefill x{_f(fp)}, store x{_f(fs)}" + (", calibrated" if calibrated else ", fixed")
    return Run(label, fp, fs, calibrated, as_dict(result), ttfts,
               [t for t, _ in history], pr, sr)


def converged_after(ratios: list[float], tol: float = 0.05) -> int | None:
    """The first request from which a rate ratio stays within ``tol`` of 1 (None: never)."""
    last_bad = max((i for i, r in enumerate(ratios) if abs(r - 1) > tol), default=-1)
    return last_bad + 1 if last_bad + 1 < len(ratios) else None


def format_calibration(runs: list[Run], header: str) -> str:
    base = runs[0].result["ttft_p90_s"]
    half = len(runs[0].ttfts) // 2
    base_late = percentile(sorted(runs[0].ttfts[half:]), 0.9)
    columns = (f"{'router cost model':<38} {'p90_s':>7} {'vs conf':>7} {'p90_2nd_half':>12} "
               f"{'vs conf':>7} {'rates_at_end':>14} {'prefill_ok_from':>15} "
               f"{'store_ok_from':>13}")
    lines = [header, columns]
    for r in runs:
        late = percentile(sorted(r.ttfts[half:]), 0.9)
        conv = [converged_after(x) if r.calibrated else None
                for x in (r.prefill_ratio, r.store_ratio)]
        lines.append(
            f"{r.label:<38} {r.result['ttft_p90_s']:>7.3f} {r.result['ttft_p90_s'] / base:>7.3f} "
            f"{late:>12.3f} {late / base_late:>7.3f} "
            f"{f'x{r.prefill_ratio[-1]:.2f}/x{r.store_ratio[-1]:.2f}':>14} "
            f"{_req(conv[0]):>15} {_req(conv[1]):>13}")
    lines.append("(p90 over the whole trace and over its second half; rates_at_end: the router's "
                 "prefill/store rates over the true ones, geometric mean over instances; "
                 "*_ok_from: the request from which that mean stays within 5% of the truth)")
    return "\n".join(lines)


def plot_calibration(runs: list[Run], path: str, title: str, window: int = 500) -> None:
    try:
        import matplotlib
    except ImportError:
        raise InvalidArgument("--plot needs matplotlib: pip install 'kvpool[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = dict(zip([(r.prefill_factor, r.store_factor) for r in runs[1::2]],
                      plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for r in runs:
        xs, ys = _rolling_p90(r, window)
        color = "black" if r.label == "configured" else colors[(r.prefill_factor,
                                                                  r.store_factor)]
        ax1.plot(xs, ys, color=color, lw=1.6 if r.calibrated or r.label == "configured"
                 else 0.9, ls="-" if r.calibrated or r.label == "configured" else ":",
                 label=r.label)
    ax1.set_xlabel("simulated time (s)")
    ax1.set_ylabel(f"p90 TTFT over the last {window} requests (s)")
    ax1.set_title("TTFT: fixed (dotted) vs calibrated (solid) cost model")
    ax1.legend(fontsize=7)
    for r in runs:
        if not r.calibrated:
            continue
        color = colors[(r.prefill_factor, r.store_factor)]
        ax2.plot(r.arrivals, r.prefill_ratio, color=color, label=r.label + ": prefill")
        ax2.plot(r.arrivals, r.store_ratio, color=color, ls="--", label="store")
    ax2.set_yscale("log", base=2)
    ax2.axhspan(0.95, 1.05, color="grey", alpha=0.2)
    ax2.set_xlabel("simulated time (s)")
    ax2.set_ylabel("router's rate / true rate (mean over instances)")
    ax2.set_title("calibrated rates (prefill solid, store dashed)")
    ax2.legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _rolling_p90(run: Run, window: int) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    step = max(1, window // 5)
    for end in range(window, len(run.ttfts) + 1, step):
        xs.append(run.arrivals[end - 1])
        ys.append(percentile(sorted(run.ttfts[end - window:end]), 0.9))
    return xs, ys


def _req(i: int | None) -> str:
    return "-" if i is None else f"#{i}"


def _gmean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def _f(x: float) -> str:
    return f"{x:g}" if x >= 1 else f"1/{1 / x:g}"


def as_report(runs: list[Run]) -> dict:
    return {r.label: {**r.result, "rates_at_end": [r.prefill_ratio[-1], r.store_ratio[-1]],
                      "converged_after": [converged_after(x) for x in (r.prefill_ratio,
                                                                       r.store_ratio)]
                      if r.calibrated else None}
            for r in runs}

