"""``kvpool replay TRACE --gateway URL``: the first requests of a trace as real streamed HTTP
requests through ``kvpool gateway`` to real engines, at the trace's own arrival times, with what
the simulator predicts for the same scaled trace beside what was measured.

Scaling: each trace block becomes ``--live-block-tokens`` token ids drawn from its hash id (set
it to the engines' block size, so a trace block is an engine block and shared hash ids are
shared engine blocks); a partial last block becomes a partial one; prompts are cut to
``--max-prompt-tokens`` (the engines' context: the prefix structure holds as far as it goes);
ids fall in ``[FIRST_TOKEN, --vocab-size)``. ``--salt`` seeds the draw too, so runs with
different salts share no prefix: several runs (one per gateway policy) against the same engines do not find each
other's blocks. Arrivals are the trace's timestamps times ``--time-scale``. Each request asks for
``--max-output-tokens`` tokens, greedy, streamed; TTFT is measured here, from sending the
request to the first streamed chunk.

Measured per run: TTFT p50/p90, the engine the gateway chose for each request (its
``X-Kvpool-Engine`` header), which policy the gateway routed with (its route metric), and, from
each engine's ``/metrics`` (``--engine-metrics``), the prompt tokens served from its own prefix
cache (``vllm:prefix_cache_hits``) and loaded through its KV connector from kvpool
(``vllm:external_prefix_cache_hits``). Predicted: :func:`simulate` on the same scaled requests,
as many instances as engines (those of ``--engine-metrics``, else those that answered), each
with ``--cache-blocks`` blocks, ``--prefill-tokens-per-s`` and ``--store-tokens-per-s`` (give
the engines' own: ``kvpool gateway`` learns them per engine).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from kvpool.common.errors import InvalidArgument
from kvpool.master.routing import DEFAULT_POLICY
from kvpool.tools.replay_live import live_blocks
from kvpool.tools.replay_sim import (
    InstanceModel,
    Request,
    as_dict,
    ideal_reuse,
    load_trace,
    percentile,
    simulate,
)
from prometheus_client.parser import text_string_to_metric_families

FIRST_TOKEN = 100          # below it: the special tokens of common vocabularies
ENGINE_COUNTERS = {"local_hit_tokens": "vllm:prefix_cache_hits_total",
                   "kvpool_hit_tokens": "vllm:external_prefix_cache_hits_total",
                   "prompt_tokens": "vllm:prompt_tokens_total"}
_ROUTED = "kvpool_gateway_route_seconds_count"


@dataclass(frozen=True, slots=True)
class Sent:
    """One request's outcome, as the client saw it."""

    index: int
    ttft_s: float | None     # None: failed
    total_s: float
    engine: str
    error: str = ""


def scale(requests: list[Request], *, trace_block_tokens: int, live_block_tokens: int,
          vocab_size: int, time_scale: float, salt: int = 0,
          max_prompt_tokens: int | None = None) -> tuple[list[Request], list[list[int]]]:
    """The requests as the engines will see them (arrivals scaled, one live block per trace
    block, prompts cut to ``max_prompt_tokens``: the prefix structure holds as far as it goes)
    and each one's prompt token ids."""
    if vocab_size <= FIRST_TOKEN:
        raise InvalidArgument(f"--vocab-size must be > {FIRST_TOKEN}")
    if time_scale <= 0:
        raise InvalidArgument("--time-scale must be > 0")
    scaled, prompts = [], []
    for r in requests:
        tokens = [t for h, n in live_blocks(r, trace_block_tokens, live_block_tokens)
                  for t in np.random.default_rng([salt, h]).integers(
                      FIRST_TOKEN, vocab_size, n).tolist()][:max_prompt_tokens]
        blocks = -(-len(tokens) // live_block_tokens)
        scaled.append(Request(r.arrival_s * time_scale, len(tokens), r.hash_ids[:blocks]))
        prompts.append(tokens)
    return scaled, prompts


def window(requests: list[Request], start: int, size: int) -> list[Request]:
    """``size`` requests from ``start``, their arrivals counted from the first of them."""
    part = requests[start:start + size]
    if not part:
        raise InvalidArgument(f"--start {start}: the trace has {len(requests)} requests")
    t0 = part[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in part]


def best_window(requests: list[Request], size: int, *, block_tokens: int,
                max_blocks: int | None = None) -> tuple[int, float]:
    """The start of the ``size`` consecutive requests with the most prefix reuse among
    themselves (:func:`ideal_reuse` of the window alone, each prompt cut to ``max_blocks``
    blocks as the live replay cuts it), and that reuse. A live replay starts with empty caches,
    so only reuse inside the window can show; the trace's first requests share almost none."""
    cut = [r if max_blocks is None or len(r.hash_ids) <= max_blocks else
           Request(r.arrival_s, max_blocks * block_tokens, r.hash_ids[:max_blocks])
           for r in requests]
    best = (0, -1.0)
    for start in range(max(1, len(cut) - size + 1)):
        reuse = ideal_reuse(cut[start:start + size], block_tokens)
        if reuse > best[1]:
            best = (start, reuse)
    return best


def multi_turn(requests: list[Request], start: int, horizon: int, size: int) -> list[Request]:
    """Whole conversations of two turns or more: among the ``horizon`` requests from
    ``start``, those whose first two blocks another of them starts with too (a conversation's
    turns share their history; the conversation trace's first block is common to every
    request), conversation by conversation in order of their first turn while they fit in
    ``size``, in arrival order, arrivals counted from the first. Consecutive requests of the
    conversation trace share little more than that first block (3% ideal reuse in its first
    24): its conversations' turns are minutes apart, so a short live run sees reuse only
    through a selection like this one (48% over the first 300 requests' conversations)."""
    part = requests[start:start + horizon]
    turns: dict[tuple, list[int]] = {}
    for i, r in enumerate(part):
        if len(r.hash_ids) >= 2:
            turns.setdefault(r.hash_ids[:2], []).append(i)
    chosen: list[int] = []
    for conversation in sorted((t for t in turns.values() if len(t) >= 2), key=lambda t: t[0]):
        if len(chosen) + len(conversation) <= size:
            chosen += conversation
    if not chosen:
        raise InvalidArgument(f"no conversation has two turns among requests #{start}-"
                              f"#{start + horizon - 1}: give a longer --multi-turn")
    chosen.sort()
    t0 = part[chosen[0]].arrival_s
    return [replace(part[i], arrival_s=part[i].arrival_s - t0) for i in chosen]


class Gateway:
    """The gateway's OpenAI endpoint, one connection per request (requests overlap)."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        parts = urlsplit(url if "//" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise InvalidArgument(f"--gateway {url!r}: expected http://HOST:PORT")
        self.host, self.port, self.timeout_s = parts.hostname, parts.port, timeout_s
        self.url = f"http://{self.host}:{self.port}"

    def get(self, path: str) -> bytes:
        return http_get(self.url, path, f"gateway {self.url}")

    def model(self) -> str:
        return json.loads(self.get("/v1/models"))["data"][0]["id"]

    def complete(self, index: int, model: str, prompt: list[int], max_tokens: int) -> Sent:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "stream": True, "ignore_eos": True})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            first = r.read1(65536)
            ttft = time.perf_counter() - t0
            rest = r.read()
            engine = r.getheader("X-Kvpool-Engine", "")
            if r.status != 200 or not first.startswith(b"data: {"):
                error = f"HTTP {r.status}: {(first + rest)[:200].decode(errors='replace')}"
                return Sent(index, None, time.perf_counter() - t0, engine, error)
            return Sent(index, ttft, time.perf_counter() - t0, engine)
        except OSError as e:
            return Sent(index, None, time.perf_counter() - t0, "", f"{type(e).__name__}: {e}")
        finally:
            conn.close()


def http_get(url: str, path: str, what: str) -> bytes:
    """``GET url + path``'s body; InvalidArgument naming ``what`` if it does not answer 200."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
    except OSError as e:
        raise InvalidArgument(f"{what} does not answer {path}: {e}") from None
    finally:
        conn.close()
    if r.status != 200:
        raise InvalidArgument(f"{what}: GET {path}: HTTP {r.status}")
    return body


def scrape(url: str) -> str:
    return http_get(url, "/metrics", f"--engine-metrics {url}").decode()


def by_label(page: str, name: str, label: str = "") -> dict[str, float]:
    """The samples of ``name`` in a /metrics page, summed by the value of ``label`` (all under
    ``""`` when no label is given)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == name:
                key = s.labels.get(label, "") if label else ""
                out[key] = out.get(key, 0.0) + s.value
    return out


def engine_counts(urls: list[str]) -> dict[str, float]:
    pages = [scrape(u) for u in urls]
    return {k: sum(by_label(p, name).get("", 0.0) for p in pages)
            for k, name in ENGINE_COUNTERS.items()}


def routed_by(before: str, after: str) -> dict[str, int]:
    """Requests the gateway routed during the run, per policy (its route metric)."""
    a, b = by_label(before, _ROUTED, "policy"), by_label(after, _ROUTED, "policy")
    return {policy: d for policy, n in b.items() if policy and (d := int(n - a.get(policy, 0.0)))}


def send_all(gateway: Gateway, model: str, scaled: list[Request], prompts: list[list[int]],
             max_tokens: int, progress=None) -> list[Sent]:
    """Each request at its arrival time (a thread each while in flight)."""
    results: list[Sent | None] = [None] * len(scaled)
    done = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        results[i] = gateway.complete(i, model, prompts[i], max_tokens)
        with lock:
            done[0] += 1
            if progress:
                progress(done[0])

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=64) as pool:
        for i, r in enumerate(scaled):
            time.sleep(max(0.0, start + r.arrival_s - time.monotonic()))
            pool.submit(one, i)
    return [r for r in results if r is not None]


def run_gateway(args, progress=None) -> int:
    gateway = Gateway(args.gateway)
    start = args.start
    if start == "auto":
        live_blocks_max = None if args.max_prompt_tokens is None else \
            max(1, args.max_prompt_tokens // args.live_block_tokens)
        start, _ = best_window(load_trace(args.trace), args.requests,
                               block_tokens=args.block_tokens, max_blocks=live_blocks_max)
    if args.multi_turn:
        if start == "auto":
            raise InvalidArgument("--multi-turn takes --start N, not auto")
        requests = multi_turn(load_trace(args.trace, start + args.multi_turn), start,
                              args.multi_turn, args.requests)
    else:
        requests = window(load_trace(args.trace, start + args.requests), start, args.requests)
    scaled, prompts = scale(requests, trace_block_tokens=args.block_tokens,
                            live_block_tokens=args.live_block_tokens,
                            vocab_size=args.vocab_size, time_scale=args.time_scale,
                            salt=args.salt, max_prompt_tokens=args.max_prompt_tokens)
    model = gateway.model()
    engines = args.engine_metrics or []
    before_gw, before = gateway.get("/metrics").decode(), engine_counts(engines)
    sent = send_all(gateway, model, scaled, prompts, args.max_output_tokens,
                    progress(len(scaled)) if progress else None)
    after_gw, after = gateway.get("/metrics").decode(), engine_counts(engines)
    routed = routed_by(before_gw, after_gw)
    policy = max(routed, key=routed.get) if routed else DEFAULT_POLICY
    sim_policy = "least_loaded" if policy.startswith("fallback") else policy
    ttfts = sorted(s.ttft_s for s in sent if s.ttft_s is not None)
    instances = len(engines) or max(1, len({s.engine for s in sent if s.engine}))
    result, predicted = simulate(
        scaled, sim_policy, instances=instances, cache_blocks=args.cache_blocks,
        store_blocks=args.store_blocks, seed=args.seed,
        model=InstanceModel(1 / args.prefill_tokens_per_s, 1 / args.store_tokens_per_s,
                            args.live_block_tokens))
    predicted.sort()
    prompt_tokens = sum(len(p) for p in prompts)
    report = {
        "trace": str(args.trace), "gateway": gateway.url, "start": start,
        "multi_turn": args.multi_turn,
        "requests": len(scaled),
        "ideal_reuse": ideal_reuse(scaled, args.live_block_tokens),
        "prompt_tokens": prompt_tokens, "policy": policy, "routed_by": routed,
        "failed": [{"request": s.index, "error": s.error} for s in sent if s.ttft_s is None],
        "per_engine": {e: sum(1 for s in sent if s.engine == e)
                       for e in sorted({s.engine for s in sent})},
        "measured": {"ttft_p50_s": percentile(ttfts, 0.5) if ttfts else None,
                     "ttft_p90_s": percentile(ttfts, 0.9) if ttfts else None,
                     **({k: after[k] - before[k] for k in ENGINE_COUNTERS} if engines else {})},
        "predicted": {"ttft_p50_s": percentile(predicted, 0.5),
                      "ttft_p90_s": percentile(predicted, 0.9),
                      "local_hit_tokens": round(result.local_hit * prompt_tokens),
                      "kvpool_hit_tokens": round(result.store_hit * prompt_tokens),
                      **as_dict(result)},
        "config": {"live_block_tokens": args.live_block_tokens, "time_scale": args.time_scale,
                   "max_prompt_tokens": args.max_prompt_tokens,
                   "max_output_tokens": args.max_output_tokens, "salt": args.salt,
                   "instances": instances, "cache_blocks": args.cache_blocks,
                   "store_blocks": args.store_blocks,
                   "prefill_tokens_per_s": args.prefill_tokens_per_s,
                   "store_tokens_per_s": args.store_tokens_per_s},
    }
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if report["failed"] else 0


def format_report(r: dict) -> str:
    m, p = r["measured"], r["predicted"]

    def ms(v):
        return "-" if v is None else f"{v * 1000:,.0f}"

    def tokens(v):
        return "-" if v is None else f"{v:,.0f}"

    picked = (f"of the multi-turn conversations in #{r['start']}-"
              f"#{r['start'] + r['multi_turn'] - 1}" if r.get("multi_turn")
              else f"from #{r['start']}")
    lines = [f"{r['requests']} requests {picked} ({r['prompt_tokens']:,} prompt "
             f"tokens, ideal reuse {r['ideal_reuse']:.1%}) through "
             f"{r['gateway']}, policy {r['policy']}; per engine: "
             + ", ".join(f"{e or '?'} {n}" for e, n in r["per_engine"].items()),
             f"{'':<22}{'measured':>12}{'predicted':>12}",
             f"{'TTFT p50 (ms)':<22}{ms(m['ttft_p50_s']):>12}{ms(p['ttft_p50_s']):>12}",
             f"{'TTFT p90 (ms)':<22}{ms(m['ttft_p90_s']):>12}{ms(p['ttft_p90_s']):>12}",
             (f"{'engine cache tokens':<22}{tokens(m.get('local_hit_tokens')):>12}"
              f"{tokens(p['local_hit_tokens']):>12}"),
             (f"{'kvpool-loaded tokens':<22}{tokens(m.get('kvpool_hit_tokens')):>12}"
              f"{tokens(p['kvpool_hit_tokens']):>12}")]
    if r["failed"]:
        lines.append(f"{len(r['failed'])} requests failed; the first: {r['failed'][0]['error']}")
    return "\n".join(lines)
