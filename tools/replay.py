"""``kvpool replay TRACE``: replay a Mooncake-format trace through the router and measure reuse
and time to first token per routing policy (simulated clock; ``--live``: against a cluster)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from kvpool.common.errors import InvalidArgument
from kvpool.master.routing import DEFAULT_POLICY, POLICIES
from kvpool.tools.argtypes import count_type
from kvpool.tools.replay_sim import (
    ALL_POLICIES,
    STORE_EVICTIONS,
    STORE_WRITES,
    InstanceModel,
    as_dict,
    ideal_reuse,
    load_trace,
    percentile,
    simulate,
    ttft_floor_s,
)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"invalid rate {text!r}: expected a number > 0")
    return value


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(bad) or text!r}: choose from "
                                         f"{','.join(POLICIES)}")
    return names


def _rates(text: str) -> list[float]:
    try:
        return [_positive(t) for t in text.split(",") if t.strip()] or [_positive(text)]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: expected numbers > 0 "
                                         "separated by commas") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = ("Replay a Mooncake-format request trace (one JSON object per line: "
                     "timestamp ms, input_length, hash_ids of 512-token prefix blocks) through "
                     "kvpool's routing index and policies with a simulated clock, and report per "
                     "policy the fractions of prompt tokens served from the instance's own cache "
                     "(local_hit), from the shared store (store_hit) and recomputed, and the time "
                     "to first token (mean, p90).")
    p.epilog = ("Instance model: each instance is a FIFO queue in front of one prefill server "
                "that computes --prefill-tokens-per-s and loads store-held KV at "
                "--store-tokens-per-s; its own cache is an LRU of --cache-blocks trace blocks "
                "(a prompt's tail evicted before its head, as vLLM does); the store holds "
                "--store-blocks with prefix-aware eviction; caches fill when a prefill finishes. "
                "A block is a hit only while every earlier block of its prompt is. ideal_reuse is "
                "what an infinite shared cache would reuse; floor p90 is the p90 TTFT no policy "
                "can beat (each prompt's prefill of what no earlier request computed).\n\n"
                "Example: kvpool replay trace.jsonl --json out.json --plot out.png\n"
                "         kvpool replay trace.jsonl --sweep 16000,8000,5000,4000\n"
                "         kvpool replay trace.jsonl --calibrate --plot calibration.png\n"
                "         kvpool replay trace.jsonl --live --master 127.0.0.1:50051 --requests 50\n"
                "         kvpool replay trace.jsonl --gateway http://127.0.0.1:8080 --requests 40 "
                "--engine-metrics http://127.0.0.1:8000,http://127.0.0.1:8001 "
                "--live-block-tokens 16 --max-prompt-tokens 2000")
    p.add_argument("trace", metavar="TRACE", help="Mooncake-format trace (.jsonl)")
    p.add_argument("--instances", type=count_type, default=8, help="serving instances (default: 8)")
    p.add_argument("--cache-blocks", type=lambda t: count_type(t, 0), default=6000,
                   help="each instance's own prefix cache, in trace blocks, LRU (default: 6000)")
    p.add_argument("--store-blocks", type=lambda t: count_type(t, 0), default=60000,
                   help="the shared store, in trace blocks, LRU; 0 = no store (default: 60000)")
    p.add_argument("--store-writes", choices=STORE_WRITES, default="prefill",
                   help="when instances put blocks into the store: `prefill` (kvpool's way: "
                        "every block once its prefill finishes, reusable at once by any "
                        "instance) or `eviction` (only blocks their own cache evicts, the store "
                        "as an offload tier) (default: prefill)")
    p.add_argument("--store-eviction", choices=STORE_EVICTIONS, default="prefix",
                   help="the store's eviction order: `prefix` (kvpool's: least recently used "
                        "chain tails first, a block only after every block extending it) or "
                        "`lru` (plain) (default: prefix)")
    p.add_argument("--policies", type=_policies, default=list(ALL_POLICIES), metavar="A,B,...",
                   help=f"routing policies to compare (default: all: {','.join(ALL_POLICIES)})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy (default: 0)")
    p.add_argument("--limit", type=count_type, metavar="N", help="replay only the first N requests")
    p.add_argument("--prefill-tokens-per-s", type=_positive, default=8000.0, metavar="RATE",
                   help="prefill throughput of one instance (default: 8000)")
    p.add_argument("--store-tokens-per-s", type=_positive, default=80000.0, metavar="RATE",
                   help="rate one instance loads store-held KV at, in tokens/s (default: 80000)")
    p.add_argument("--block-tokens", type=count_type, default=512,
                   help="tokens per trace block (default: 512, the Mooncake traces')")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG: reuse per tier and TTFT CDF")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--service-jitter", type=float, default=0.0, metavar="F",
                   help="each service time times a uniform factor in 1 +- F, seeded "
                        "(default: 0; --calibrate: 0.1)")
    study = p.add_argument_group("studies")
    study.add_argument("--sweep", type=_rates, metavar="RATE,...",
                       help="run the policies at each of these prefill speeds (the store "
                            "speed kept at the same multiple), with the store and without, "
                            "and check the routing targets: the default's p90 within 2%% of "
                            "the best policy's wherever that is under 10x the floor p90")
    study.add_argument("--calibrate", action="store_true",
                       help="the default policy with its cost model's prefill and store rates "
                            "each started at every --calibrate-factors multiple of the true "
                            "ones, fixed and calibrated online from the simulated first-token "
                            "times (master/calibration.py), against the correctly configured "
                            "model; --plot: rolling p90 and the rates over time")
    study.add_argument("--calibrate-factors", type=_rates, default=[4.0, 0.25],
                       metavar="F,...", help="misconfiguration factors (default: 4,0.25)")
    live = p.add_argument_group("live replay (against a running cluster)")
    live.add_argument("--live", action="store_true",
                      help="replay the first --requests requests against --master with real "
                           "block bytes, route them with the master's Router (the one policy "
                           "given with --policies, else the default), verify every read")
    live.add_argument("--master", default=os.environ.get("KVPOOL_MASTER"), metavar="HOST:PORT",
                      help="the cluster's master (--live; default: $KVPOOL_MASTER)")
    live.add_argument("--requests", type=count_type, default=50,
                      help="requests replayed live (default: 50)")
    live.add_argument("--live-block-tokens", type=count_type, default=16,
                      help="tokens per block live: trace blocks are scaled down to this "
                           "(default: 16)")
    live.add_argument("--block-bytes", type=count_type, default=16384,
                      help="KV bytes per block live (default: 16384)")
    gw = p.add_argument_group("live replay through kvpool gateway (real engines)")
    gw.add_argument("--gateway", metavar="URL",
                    help="send the first --requests requests as streamed completions through "
                         "this gateway at the trace's arrival times; prints measured TTFT and "
                         "cache hits beside what the simulator predicts for the same requests")
    gw.add_argument("--engine-metrics", type=_urls, metavar="URL,...",
                    help="the engines' own URLs, whose /metrics give the prompt tokens each "
                         "served from its prefix cache and loaded from kvpool")
    gw.add_argument("--vocab-size", type=count_type, default=32000,
                    help="token ids stay below it: the model's vocabulary (default: 32000)")
    gw.add_argument("--start", type=_start, default=0, metavar="N|auto",
                    help="replay --requests requests from the N-th (arrivals counted from it); "
                         "auto: the window with the most prefix reuse among its own requests "
                         "(default: 0)")
    gw.add_argument("--multi-turn", type=count_type, metavar="H",
                    help="replay whole conversations of two turns or more found among the H "
                         "requests from --start, up to --requests (real prefix reuse in a "
                         "short run)")
    gw.add_argument("--time-scale", type=_positive, default=1.0, metavar="F",
                    help="arrival times are the trace's times F (default: 1.0)")
    gw.add_argument("--max-prompt-tokens", type=count_type, metavar="N",
                    help="cut prompts to N tokens: leave room for the output in the engines' "
                         "context (default: no cut)")
    gw.add_argument("--max-output-tokens", type=count_type, default=4,
                    help="tokens generated per request (default: 4)")
    gw.add_argument("--salt", type=lambda t: count_type(t, 0), default=0,
                    help="runs with different salts share no prefix (default: 0)")


def _start(text: str) -> int | str:
    return "auto" if text == "auto" else count_type(text, 0)


class Progress:
    """A one-line progress bar on a terminal; silent when stderr is not one."""

    def __init__(self, label: str, total: int, out: TextIO = sys.stderr, enabled: bool = True):
        self.label, self.total, self.out = label, total, out
        self.enabled = enabled and out.isatty()
        self._shown = -1
        self._start = time.monotonic()

    def __call__(self, done: int) -> None:
        pct = done * 100 // self.total
        if not self.enabled or pct == self._shown:
            return
        self._shown = pct
        bar = "#" * (pct // 4) + "." * (25 - pct // 4)
        self.out.write(f"\r{self.label:<16} [{bar}] {pct:3d}% {done}/{self.total} "
                       f"{time.monotonic() - self._start:.0f}s")
        if done >= self.total:
            self.out.write("\n")
        self.out.flush()


def _urls(text: str) -> list[str]:
    urls = [u.strip() for u in text.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: expected URL,URL,...")
    return urls


def run(args) -> int:
    if args.gateway:
        from kvpool.tools.replay_gateway import run_gateway
        return run_gateway(args, progress=lambda n: Progress(
            "gateway", n, enabled=not args.no_progress))
    if args.live:
        from kvpool.tools.replay_live import run_live
        return run_live(args)
    if not 0 <= args.service_jitter < 1:
        raise InvalidArgument("--service-jitter must be in [0, 1)")
    requests = load_trace(args.trace, args.limit)
    model = InstanceModel(1 / args.prefill_tokens_per_s, 1 / args.store_tokens_per_s,
                          args.block_tokens)
    if args.sweep:
        return run_sweep(args, requests)
    if args.calibrate:
        return run_calibrate(args, requests, model)
    ideal = ideal_reuse(requests, args.block_tokens)
    results, ttfts = {}, {}
    for name in args.policies:
        result, ttfts[name] = simulate(
            requests, name, instances=args.instances, cache_blocks=args.cache_blocks,
            store_blocks=args.store_blocks, model=model, seed=args.seed,
            store_writes=args.store_writes, store_eviction=args.store_eviction,
            service_jitter=args.service_jitter,
            progress=Progress(name, len(requests), enabled=not args.no_progress))
        results[name] = as_dict(result)
    report = {
        "trace": str(args.trace), "requests": len(requests),
        "prompt_tokens": sum(r.input_tokens for r in requests),
        "ideal_reuse": ideal, "default_policy": DEFAULT_POLICY,
        "ttft_floor_p90_s": percentile(sorted(ttft_floor_s(requests, model)), 0.90),
        "config": {"instances": args.instances, "cache_blocks": args.cache_blocks,
                   "store_blocks": args.store_blocks, "store_writes": args.store_writes,
                   "store_eviction": args.store_eviction,
                   "seed": args.seed,
                   "prefill_tokens_per_s": args.prefill_tokens_per_s,
                   "store_tokens_per_s": args.store_tokens_per_s,
                   "block_tokens": args.block_tokens},
        "policies": results,
    }
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, ttfts, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _sim_args(args) -> dict:
    return {"instances": args.instances, "cache_blocks": args.cache_blocks, "seed": args.seed,
            "store_writes": args.store_writes, "store_eviction": args.store_eviction}


def _describe(args, requests) -> str:
    return (f"{Path(args.trace).name}: {len(requests)} requests; {args.instances} instances x "
            f"{args.cache_blocks} blocks, store {args.store_blocks} blocks")


def run_sweep(args, requests) -> int:
    from kvpool.tools.replay_sweep import as_report, format_sweep, sweep
    speedup = args.store_tokens_per_s / args.prefill_tokens_per_s
    points = sweep(requests, args.sweep, args.policies, store_speedup=speedup,
                   store_blocks=args.store_blocks, block_tokens=args.block_tokens,
                   service_jitter=args.service_jitter, **_sim_args(args))
    print(format_sweep(points, f"{_describe(args, requests)}; store loads at {speedup:g}x "
                               f"the prefill speed; p90 TTFT in simulated seconds"))
    if args.json:
        Path(args.json).write_text(json.dumps(as_report(points), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def run_calibrate(args, requests, model) -> int:
    from kvpool.tools.replay_calibration import (
        as_report,
        format_calibration,
        plot_calibration,
        run_calibration,
    )
    jitter = args.service_jitter or 0.1
    runs = run_calibration(requests, model, factors=args.calibrate_factors,
                           service_jitter=jitter, store_blocks=args.store_blocks,
                           **_sim_args(args))
    title = (f"{_describe(args, requests)}; {args.prefill_tokens_per_s:,.0f} prefill, "
             f"{args.store_tokens_per_s:,.0f} store tokens/s, service jitter +-{jitter:.0%}")
    print(format_calibration(runs, title))
    if args.json:
        Path(args.json).write_text(json.dumps(as_report(runs), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot_calibration(runs, args.plot, title)
        print(f"wrote {args.plot}")
    return 0


def format_table(report: dict) -> str:
    c = report["config"]
    head = (f"{report['requests']} requests, {report['prompt_tokens']:,} prompt tokens; "
            f"{c['instances']} instances x {c['cache_blocks']} blocks, store "
            f"{c['store_blocks']} blocks (written at {c['store_writes']}, "
            f"{c['store_eviction']} eviction); {c['prefill_tokens_per_s']:,.0f} prefill tokens/s "
            f"per instance; ideal reuse {report['ideal_reuse']:.2%}, floor p90 "
            f"{report['ttft_floor_p90_s']:.3f} s")
    columns = (f"{'policy':<16} {'local_hit':>9} {'store_hit':>9} {'recomputed':>10} "
               f"{'ttft_mean_s':>11} {'ttft_p90_s':>10}")
    lines = [head, columns]
    for name, r in report["policies"].items():
        mark = " *" if name == report["default_policy"] else ""
        lines.append(f"{name:<16} {r['local_hit']:>9.2%} {r['store_hit']:>9.2%} "
                     f"{r['recomputed']:>10.2%} {r['ttft_mean_s']:>11.3f} "
                     f"{r['ttft_p90_s']:>10.3f}{mark}")
    lines.append("(* the default policy; fractions are of prompt tokens)")
    return "\n".join(lines)


def plot(report: dict, ttfts: dict[str, list[float]], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise InvalidArgument("--plot needs matplotlib: pip install 'kvpool[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["policies"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(names)
    for field, color in (("local_hit", "#2b8a3e"), ("store_hit", "#74c0fc"),
                         ("recomputed", "#dee2e6")):
        vals = [report["policies"][n][field] for n in names]
        ax1.bar(names, vals, bottom=bottom, label=field, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.axhline(report["ideal_reuse"], color="black", ls="--", lw=1, label="ideal reuse")
    ax1.set_ylabel("fraction of prompt tokens")
    ax1.set_title("where prompt KV came from")
    ax1.legend(fontsize=8)
    ax1.tick_params(axis="x", labelrotation=20)
    for name in names:
        xs = sorted(ttfts[name])
        ax2.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax2.set_xscale("log")
    ax2.set_xlabel("time to first token (s, simulated)")
    ax2.set_ylabel("fraction of requests")
    ax2.axhline(0.9, color="grey", lw=0.5)
    ax2.set_title("TTFT CDF")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{Path(report['trace']).name}: {report['requests']} requests, "
                 f"{report['config']['instances']} instances")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
