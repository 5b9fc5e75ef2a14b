"""Trace replay with a simulated clock, through the master's own routing index and policies.

The trace is Mooncake's format: one JSON object per line, ``timestamp`` (ms since start),
``input_length`` (prompt tokens), ``hash_ids`` (prefix-block hashes, ``block_tokens`` per
block, the last block possibly partial).

The instance model (documented here because every figure depends on it):

- ``instances`` serving instances, each a FIFO queue in front of one prefill server; decode is
  not modelled (the figures are about time to first token).
- A request's service time is ``recomputed_tokens * prefill_s_per_token +
  store_hit_tokens * store_s_per_token``; local (GPU cache) hits cost nothing. Its TTFT is its
  wait in the queue plus its service time.
- Each instance's GPU prefix cache is an LRU of ``cache_blocks`` trace blocks in which a
  prompt's blocks are ordered tail first, so its last blocks go before its first (vLLM's block
  manager frees a finished request's blocks in reverse order for this reason). When a request
  is routed, its local hits are touched (they are in use); when its prefill finishes, all its
  blocks enter the instance's cache and the shared store.
- The store holds ``store_blocks`` blocks (0 = no store) under ``store_eviction``: ``"prefix"``
  (the default, the master's :class:`~kvpool.master.eviction.PrefixAwarePolicy`: least
  recently used chain tails first, a block only once no block extending it is left) or
  ``"lru"``. Reading a block touches it, putting a block it holds does not.
  ``store_writes="prefill"`` (kvpool's way, the default):
  an instance puts every block of a prompt when its prefill finishes, so any instance can reuse
  it at once. ``"eviction"``: an instance puts a block only when its own cache evicts it (the
  store as an offload tier behind each GPU cache, as offloading connectors do): the store and
  the GPU caches then hold different blocks, and a prefix still in one GPU is reusable only
  by routing there.
- Caches change when prefills *finish*: a request arriving while the same prefix is still being
  prefilled elsewhere cannot reuse it (as in a real cluster).
- The index learns of cache changes through KV events (BlockStored / BlockRemoved) applied at
  the same simulated instant, and the router sees each instance's exact remaining work as
  ``inflight_prefill_tokens`` (seconds of queued work / prefill_s_per_token) and queue depth.
- The router's cost model uses the instance model's rates unless ``router_rates`` says
  otherwise (a misconfigured router). With ``calibrate``, a
  :class:`~kvpool.master.calibration.CostCalibrator` starting from those rates learns each
  instance's rates from what a gateway would see (when each request was sent, when its first
  token came, the hits Route expected) as the simulated clock passes each first token, and the
  router gets them as each candidate's rates, as the gateway sends them.
- ``service_jitter`` (0 by default) multiplies each service time by a uniform factor in
  ``1 +- service_jitter`` (seeded): real step times vary, and a calibrator fed exact times
  would have it too easy.

A block counts as a hit only while every earlier block of its prompt also hits; fractions are of
prompt tokens. ``ideal_reuse`` is the fraction reusable with an infinite shared cache that knows
a block from the moment its request arrives.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvpool.common.errors import InvalidArgument
from kvpool.master.calibration import CostCalibrator, Rates
from kvpool.master.eviction import PrefixAwarePolicy
from kvpool.master.routing import (
    GPU,
    STORE,
    BlockRemoved,
    BlockStored,
    Candidate,
    CostModel,
    RouteQuery,
    RoutingIndex,
    make_policy,
)

ALL_POLICIES = ("random", "round_robin", "least_loaded", "prefix_affinity", "kvpool")
STORE_WRITES = ("prefill", "eviction")
STORE_EVICTIONS = ("prefix", "lru")


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    input_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class InstanceModel:
    """Per-instance rates. The defaults model the testbed of the Mooncake paper this trace comes
    from (FAST'25: a LLaMA2-70B-architecture model, nodes of 8 A800-80GB GPUs and 200 Gbps
    RDMA NICs), one instance per node:

    - prefill 8,000 tokens/s: 2 x 70e9 FLOP per token x 8,000/s = 1.1 PFLOP/s, ~45% of the
      node's 2.5 PFLOP/s dense BF16 peak (attention at the trace's 12k-token mean prompt adds
      ~10% more work; the figure is a realistic MFU, not a peak);
    - store loads 80,000 tokens/s: LLaMA2-70B's KV is 320 KiB per token (80 layers x K,V x 8
      GQA heads x 128 x 2 bytes), so 80k tokens/s is ~26 GB/s, one 200 Gbps NIC.

    Load on the conversation trace: 144.8 M prompt tokens in 3,537 s (40.9k tokens/s offered);
    even with ideal reuse 25.6k tokens/s must be prefilled, 40% of 8 x 8,000 — queues form in
    bursts, not steadily. ``kvpool replay --prefill-tokens-per-s 4000 / 16000`` gives 80% / 20%
    (the README's sensitivity table)."""

    prefill_s_per_token: float = 1 / 8000
    store_s_per_token: float = 1 / 80000
    block_tokens: int = 512


@dataclass(frozen=True, slots=True)
class PolicyResult:
    local_hit: float        # fractions of prompt tokens
    store_hit: float
    recomputed: float
    ttft_mean_s: float
    ttft_p90_s: float
    ttft_p99_s: float


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read a Mooncake-format trace; InvalidArgument (with the line number) on a bad line."""
    out: list[Request] = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidArgument(f"cannot read trace {path}: {e.strerror}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            req = Request(float(obj["timestamp"]) / 1000.0, int(obj["input_length"]),
                          tuple(int(h) for h in obj["hash_ids"]))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"{path}:{n}: not a Mooncake trace line "
                                  f"(timestamp, input_length, hash_ids): {e}") from None
        out.append(req)
    if not out:
        raise InvalidArgument(f"{path}: no requests")
    return out


def _block_tokens(req: Request, block_tokens: int) -> list[int]:
    left, out = req.input_tokens, []
    for _ in req.hash_ids:
        out.append(max(0, min(block_tokens, left)))
        left -= out[-1]
    return out


def ideal_reuse(requests: Iterable[Request], block_tokens: int = 512) -> float:
    """Fraction of prompt tokens reusable with an infinite shared cache."""
    seen: set[int] = set()
    reused = total = 0
    for r in requests:
        total += r.input_tokens
        sizes = _block_tokens(r, block_tokens)
        for h, size in zip(r.hash_ids, sizes):
            if h not in seen:
                break
            reused += size
        seen.update(r.hash_ids)
    return reused / total if total else 0.0


def ttft_floor_s(requests: Iterable[Request], model: InstanceModel) -> list[float]:
    """Per request, a TTFT no routing or caching can beat: the prefill of the tokens no earlier
    request computed (those :func:`ideal_reuse` cannot reuse), with no wait and free loads.
    Its p90 bounds every policy's p90 from below (a percentile of pointwise larger values is
    larger), so it shows how much of a p90 is the prompts' own work rather than routing."""
    seen: set[int] = set()
    out = []
    for r in requests:
        reused = 0
        for h, size in zip(r.hash_ids, _block_tokens(r, model.block_tokens)):
            if h not in seen:
                break
            reused += size
        seen.update(r.hash_ids)
        out.append((r.input_tokens - reused) * model.prefill_s_per_token)
    return out


class LRUBlocks:
    """A capacity-bounded LRU set of block hashes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._blocks: OrderedDict = OrderedDict()

    def __contains__(self, h) -> bool:
        return h in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, hashes: Iterable) -> None:
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def add(self, hashes: Iterable, refresh: bool = True) -> tuple[list, list]:
        """Insert ``hashes`` (and, with ``refresh``, mark those present as just used);
        return (newly stored, evicted)."""
        stored, evicted = [], []
        if self.capacity <= 0:
            return stored, evicted
        for h in hashes:
            if h in self._blocks:
                if refresh:
                    self._blocks.move_to_end(h)
                continue
            self._blocks[h] = None
            stored.append(h)
            if len(self._blocks) > self.capacity:
                evicted.append(self._blocks.popitem(last=False)[0])
        gone = set(evicted) & set(stored)   # inserted and pushed out by the same request
        return [h for h in stored if h not in gone], [h for h in evicted if h not in gone]


class PrefixBlocks:
    """The shared store's blocks under prefix-aware eviction (the master's
    :class:`~kvpool.master.eviction.PrefixAwarePolicy`): least recently used *chain tails*
    first, so a block goes only after every block extending it. ``parent_of`` maps a block to
    the block before it in its prompt (the trace's hash chains). Same interface as
    :class:`LRUBlocks`."""

    def __init__(self, capacity: int, parent_of: dict):
        self.capacity = capacity
        self._parent_of = parent_of
        self._policy = PrefixAwarePolicy()

    def __contains__(self, h) -> bool:
        return h in self._policy

    def __len__(self) -> int:
        return len(self._policy)

    def touch(self, hashes: Iterable) -> None:
        for h in hashes:
            self._policy.on_access(h)

    def add(self, hashes: Iterable, refresh: bool = True) -> tuple[list, list]:
        stored, evicted = [], []
        if self.capacity <= 0:
            return stored, evicted
        for h in hashes:
            if h in self:
                if refresh:
                    self._policy.on_access(h)
                continue
            self._policy.on_insert(h, self._parent_of.get(h))
            stored.append(h)
            while len(self._policy) > self.capacity:
                victim = next(self._policy.candidates())
                self._policy.on_remove(victim)
                evicted.append(victim)
        gone = set(evicted) & set(stored)
        return [h for h in stored if h not in gone], [h for h in evicted if h not in gone]


@dataclass(eq=False, slots=True)
class _Instance:
    name: str
    cache: LRUBlocks
    free_at_s: float = 0.0
    finishes: list = None   # heap of finish times of requests routed here, for queue depth


def simulate(requests: Sequence[Request], policy: str, *, instances: int = 8,
             cache_blocks: int = 6000, store_blocks: int = 60000,
             model: InstanceModel = InstanceModel(), seed: int = 0,
             store_writes: str = "prefill", store_eviction: str = "prefix",
             affinity_slack_tokens: int | None = None,
             router_rates: Rates | None = None, calibrate: bool = False,
             service_jitter: float = 0.0,
             history: list[tuple[float, dict[str, Rates]]] | None = None,
             progress: Callable[[int], None] | None = None) -> tuple[PolicyResult, list[float]]:
    """Replay ``requests`` through ``policy``; return the result and every request's TTFT.
    ``history``: a list to which each request's arrival time and the calibrated rates per
    instance (with ``calibrate``) are appended."""
    if instances < 1:
        raise InvalidArgument("--instances must be >= 1")
    if store_writes not in STORE_WRITES:
        raise InvalidArgument(f"store writes {store_writes!r}: expected one of {STORE_WRITES}")
    if store_eviction not in STORE_EVICTIONS:
        raise InvalidArgument(f"store eviction {store_eviction!r}: expected one of "
                              f"{STORE_EVICTIONS}")
    if not 0 <= service_jitter < 1:
        raise InvalidArgument("service jitter must be in [0, 1)")
    parent_of: dict = {}
    store = PrefixBlocks(store_blocks, parent_of) if store_eviction == "prefix" \
        else LRUBlocks(store_blocks)
    index = RoutingIndex(lambda: 0.0, instance_ttl_s=math.inf,
                         store_lookup=lambda hs, _tenant: [h in store for h in hs],
                         cost=_cost(model, affinity_slack_tokens, router_rates))
    router = make_policy(policy, seed)
    clock = [0.0]   # the simulated now, for the calibrator
    calibrator = CostCalibrator(router_rates or model_rates(model), clock=lambda: clock[0]) \
        if calibrate else None
    jitter = random.Random(seed)
    fleet = {f"i{k}": _Instance(f"i{k}", LRUBlocks(cache_blocks), finishes=[])
             for k in range(instances)}
    for name in fleet:
        index.apply(name, [])
    # (finish_s, seq, instance, hashes, (calibrator ticket, recomputed, store-hit tokens))
    done: list[tuple[float, int, str, tuple, tuple]] = []
    ttfts: list[float] = []
    local = via_store = total = 0
    for n, req in enumerate(requests):
        now = req.arrival_s
        while done and done[0][0] <= now:
            finish_s, _, name, hashes, seen = heapq.heappop(done)
            if calibrator is not None:
                clock[0] = finish_s
                calibrator.first_token(*seen)
            # Tail first, as vLLM frees a finished request's blocks: its cache evicts a
            # prompt's last blocks before its first.
            stored, evicted = fleet[name].cache.add(hashes[::-1])
            events = ([BlockStored(tuple(stored))] if stored else []) \
                + ([BlockRemoved(tuple(evicted))] if evicted else [])
            index.apply(name, events)
            # As in the master: a put of a stored key is a no-op that does not refresh it.
            # Evictions come tail first; put them parents first, as chains are.
            store.add(hashes if store_writes == "prefill" else evicted[::-1], refresh=False)
        candidates = []
        for inst in fleet.values():
            while inst.finishes and inst.finishes[0] <= now:
                heapq.heappop(inst.finishes)
            queued_s = max(0.0, inst.free_at_s - now)
            rates = calibrator.rates(inst.name) if calibrator is not None else None
            candidates.append(Candidate(
                inst.name, len(inst.finishes), round(queued_s / model.prefill_s_per_token),
                *((rates.prefill_tokens_per_s, rates.store_tokens_per_s) if rates else ())))
        if history is not None:
            history.append((now, {c.instance_id: Rates(c.prefill_tokens_per_s,
                                                       c.store_tokens_per_s)
                                  for c in candidates} if calibrator is not None else {}))
        for parent, h in zip((None, *req.hash_ids), req.hash_ids):
            parent_of.setdefault(h, parent)
        query = RouteQuery(req.hash_ids, req.input_tokens, model.block_tokens)
        d = index.route(query, candidates, router)
        inst = fleet[d.instance_id]
        hit_gpu, hit_store = d.hit_blocks[GPU], d.hit_blocks[STORE]
        inst.cache.touch(req.hash_ids[:hit_gpu][::-1])
        store.touch(req.hash_ids[hit_gpu:hit_gpu + hit_store])   # only reads touch the store
        service_s = (d.recomputed_tokens * model.prefill_s_per_token
                     + d.hit_tokens[STORE] * model.store_s_per_token)
        if service_jitter:
            service_s *= 1 + jitter.uniform(-service_jitter, service_jitter)
        finish = max(now, inst.free_at_s) + service_s
        inst.free_at_s = finish
        heapq.heappush(inst.finishes, finish)
        if calibrator is not None:
            clock[0] = now
            seen = (calibrator.sent(inst.name), d.recomputed_tokens, d.hit_tokens[STORE])
        else:
            seen = ()
        heapq.heappush(done, (finish, n, inst.name, req.hash_ids, seen))
        ttfts.append(finish - now)
        local += d.hit_tokens[GPU]
        via_store += d.hit_tokens[STORE]
        total += req.input_tokens
        if progress:
            progress(n + 1)
    ordered = sorted(ttfts)
    result = PolicyResult(
        local_hit=local / total, store_hit=via_store / total,
        recomputed=(total - local - via_store) / total,
        ttft_mean_s=sum(ttfts) / len(ttfts), ttft_p90_s=percentile(ordered, 0.90),
        ttft_p99_s=percentile(ordered, 0.99))
    return result, ttfts


def model_rates(model: InstanceModel) -> Rates:
    return Rates(1 / model.prefill_s_per_token, 1 / model.store_s_per_token)


def _cost(model: InstanceModel, affinity_slack_tokens: int | None,
          router_rates: Rates | None = None) -> CostModel:
    """The router's cost model: the instance model's own rates (an operator would measure
    them) unless ``router_rates`` (a misconfigured router), the default policy's other
    parameters at their defaults unless given."""
    r = router_rates or model_rates(model)
    cost = CostModel(1 / r.prefill_tokens_per_s, 1 / r.store_tokens_per_s)
    return cost if affinity_slack_tokens is None else \
        replace(cost, affinity_slack_tokens=affinity_slack_tokens)


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def as_dict(result: PolicyResult) -> dict:
    return asdict(result)
