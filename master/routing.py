"""The routing index and policies, sans-IO: which instance holds which prefix, where to route.

``RoutingIndex`` keeps, per serving instance, the block hashes its own cache holds per tier
("gpu"; "cpu" for any offload medium), fed by KV events, and ages out instances that stop
publishing. The "store" tier is the cluster store itself, looked up through an injected
``store_lookup(hashes) -> [bool]`` (the master passes its object index; the trace replay a
simulated store), in the requesting tenant's namespace. Hashes are opaque hashables: kvpool-sha256-v1 digests on the wire, trace
hash ids in the replay.

A request's *expected hits* on an instance are its longest prefix of blocks each held by the
instance's gpu tier, else its cpu tier, else the store; the first block held nowhere ends the
prefix (a block is useful only if every earlier block is too).

Policies choose among candidates (instance id, queue depth, in-flight prefill tokens):

- ``random``: uniform, from a seeded generator.
- ``round_robin``: the candidates in turn.
- ``least_loaded``: fewest in-flight prefill tokens, then shortest queue.
- ``prefix_affinity``: the longest local (gpu + cpu) prefix; among those, least loaded.
- ``kvpool`` (the default): the smallest estimated time to first token::

      ttft_s = (inflight_prefill_tokens + recomputed_tokens) * prefill_s_per_token
               + cpu_hit_tokens * cpu_s_per_token + store_hit_tokens * store_s_per_token

  i.e. the prefill work queued ahead of the request plus the request's own prefill of what no
  tier holds, plus loading what the instance's offload tier and the store hold. Matched prefix
  counts through what it saves (a store hit costs ``store_s_per_token`` instead of
  ``prefill_s_per_token``; a gpu hit costs nothing); queueing counts through what it delays.
  The policy ranks candidates by::

      score_s = ttft_s + w * recomputed_tokens * prefill_s_per_token
      w = recompute_weight * (1 + backlog_weight_per_s * backlog_s)

  because recomputation costs more than this request's wait: it is work every request queued
  behind it on that instance waits for too, and KV the cluster already held. ``backlog_s`` is
  how long until even the least loaded candidate is free: while every instance has work
  queued, the cluster is saturated and work added now delays everything that arrives until
  the backlog drains, so recomputation is weighed up (doubled per 0.5 s of backlog at the
  default 2/s); with one candidate idle the weight is ``recompute_weight``. Then affinity:
  among the candidates within ``affinity_slack_tokens * prefill_s_per_token`` of the best
  score, at most ``affinity_slack_max_s``, the one with the longest local (gpu + cpu) prefix
  wins (then the one with fewer requests generating there, then the lower score, then the
  lighter load). Scores that close are within their estimates' error; the requests generating
  on an instance are counted, not estimated (the estimate leaves them out, though each shares
  every step with the new request's prefill), so they decide before the score does. Keeping
  the request where its KV already is keeps that instance warm for the conversation's next
  turn and leaves the store's bandwidth to requests that need it. The
  cap in seconds is for slow engines: on CPU engines prefilling ~500 tokens/s, 4,096 tokens are
  8 s, which held 18 of a live replay's first 24 requests on one engine while the other idled;
  a slack is what the router may add to a request's wait, so it is bounded in seconds.

  The parameters live in :class:`CostModel`; set them to the deployment's measured prefill
  throughput and transfer bandwidth, or let the caller measure them: a candidate may carry its
  own ``prefill_tokens_per_s`` and ``store_tokens_per_s`` (a gateway's
  :class:`~kvpool.master.calibration.CostCalibrator` learns them per engine from observed
  first-token times), which replace the configured ones for that candidate. Defaults: a
  LLaMA2-70B-class model on an 8-GPU node (Mooncake's testbed; derivation in
  ``kvpool.tools.replay_sim.InstanceModel``), 8,000 prefill tokens/s per instance, KV loads from
  the store at ~10x and from host memory at ~20x prefill speed, ``recompute_weight`` 1,
  ``backlog_weight_per_s`` 2 and a slack of 4,096 tokens, at most 0.5 s.

  Measured with ``kvpool replay --sweep 16000,8000,5000,4000`` on the Mooncake conversation
  trace (8 instances x 6,000 blocks, 60,000-block store or none, store loads at 10x prefill
  speed): the default's p90 TTFT is the best of the policies at all eight points. The backlog
  term is what holds it at 80% load without a store: with a constant weight of 1 the default
  left prefixes too readily there (p90 13.44 s against ``prefix_affinity``'s 13.08 s; now
  11.41 s), and a constant weight high enough for that load cost p90 at light load (weight 3:
  1.39 s instead of 1.35 s at 20% load). With a store the weight changes nothing measurable:
  every instance reuses the same prefixes, so recomputation is the same wherever a request
  goes. The slack trades local hits against nothing measurable up to 4,096 tokens, then
  against p90 (``prefix_affinity``, an unbounded slack: 3.39 s at 8,000 tokens/s against
  2.57 s). While the store holds a prefix, a local hit saves only its load (a tenth of its
  prefill), so chasing locality costs more queueing than it saves; without a store it is what
  saves the prefill.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

from kvpool.common.errors import InvalidArgument, LimitExceeded
from kvpool.common.kv_events import (  # noqa: F401  (re-exported: the index's vocabulary)
    CPU,
    GPU,
    LOCAL_TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    tier_of_medium,
)
from kvpool.common.logging import RateLimited, get_logger
from kvpool.common.tenants import tenant_of

STORE = "store"
TIERS = (GPU, CPU, STORE)
DEFAULT_POLICY = "kvpool"

BlockHash = Hashable
# Blocks dropped at a cap: said a few times a minute per instance, then counted.
_limited = RateLimited(get_logger(__name__))
# (hashes, tenant) -> whether the store holds each block, in that tenant's namespace.
StoreLookup = Callable[[Sequence[BlockHash], str], Sequence[bool]]


# -- queries and answers ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Candidate:
    """An instance a request may go to, with its load as the caller sees it."""

    instance_id: str
    queue_depth: int = 0                # requests waiting or running there
    inflight_prefill_tokens: int = 0    # tokens still to prefill there, after cache hits
    # The instance's own rates, as the caller measured them (master/calibration.py); 0: the
    # index's cost model's.
    prefill_tokens_per_s: float = 0.0
    store_tokens_per_s: float = 0.0
    # Of queue_depth, the requests past their first token: generating, they share every step
    # with a new request's prefill, and inflight_prefill_tokens does not count them.
    decoding_requests: int = 0

    def __post_init__(self) -> None:
        if not all(0 <= r < math.inf for r in (self.prefill_tokens_per_s,
                                               self.store_tokens_per_s)):
            raise InvalidArgument("a candidate's rates must be >= 0 tokens/s (0: the default)")


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """A request's block hashes and how many prompt tokens each block covers; ``tenant``:
    whose objects the store tier looks in (common/tenants.py)."""

    hashes: tuple[BlockHash, ...]
    prompt_tokens: int
    block_size: int
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise InvalidArgument("block size must be >= 1")
        if self.prompt_tokens < 0:
            raise InvalidArgument("prompt tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class Option:
    """One candidate with what routing the request there would reuse and cost."""

    candidate: Candidate
    order: int                       # position among the candidates, the last tie-break
    hit_blocks: dict[str, int]       # per tier, blocks of the prefix it would reuse
    hit_tokens: dict[str, int]       # per tier, prompt tokens of those blocks
    recomputed_tokens: int
    estimated_ttft_s: float
    cost: CostModel                  # the index's, with the candidate's own rates if it gave them

    @property
    def local_blocks(self) -> int:
        return self.hit_blocks[GPU] + self.hit_blocks[CPU]


@dataclass(frozen=True, slots=True)
class Decision:
    instance_id: str
    policy: str
    hit_blocks: dict[str, int]
    hit_tokens: dict[str, int]
    recomputed_tokens: int
    estimated_ttft_s: float


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per token of each way to obtain a prompt token's KV (see the module docstring)."""

    prefill_s_per_token: float = 1 / 8000
    store_s_per_token: float = 1 / 80000
    cpu_s_per_token: float = 1 / 160000
    recompute_weight: float = 1.0
    affinity_slack_tokens: int = 4096
    affinity_slack_max_s: float = 0.5
    backlog_weight_per_s: float = 2.0

    def __post_init__(self) -> None:
        if min(self.prefill_s_per_token, self.store_s_per_token, self.cpu_s_per_token) <= 0:
            raise InvalidArgument("cost model rates must be > 0 s/token")
        if min(self.recompute_weight, self.affinity_slack_tokens, self.affinity_slack_max_s,
               self.backlog_weight_per_s) < 0:
            raise InvalidArgument("cost model weights must be >= 0")

    @property
    def affinity_slack_s(self) -> float:
        """``affinity_slack_tokens`` of prefill, but never more than ``affinity_slack_max_s``:
        on a slow engine 4,096 tokens are seconds of queueing, not an estimate's error."""
        return min(self.affinity_slack_tokens * self.prefill_s_per_token,
                   self.affinity_slack_max_s)

    def for_candidate(self, c: Candidate) -> CostModel:
        """This model with the rates ``c`` reports (measured per instance) where it gives them."""
        if not (c.prefill_tokens_per_s or c.store_tokens_per_s):
            return self
        return replace(self, prefill_s_per_token=1 / c.prefill_tokens_per_s
                       if c.prefill_tokens_per_s else self.prefill_s_per_token,
                       store_s_per_token=1 / c.store_tokens_per_s
                       if c.store_tokens_per_s else self.store_s_per_token)

    def ttft_s(self, c: Candidate, recomputed: int, hit_tokens: dict[str, int]) -> float:
        return ((c.inflight_prefill_tokens + recomputed) * self.prefill_s_per_token
                + hit_tokens[CPU] * self.cpu_s_per_token
                + hit_tokens[STORE] * self.store_s_per_token)


# -- the index ----------------------------------------------------------------------------------

# What an instance serves as, when its bridge says (disaggregated prefill and decode).
INSTANCE_ROLES = ("both", "prefill", "decode")


@dataclass(eq=False, slots=True)
class _Instance:
    last_seen: float
    tiers: dict[str, set] = field(default_factory=lambda: {GPU: set(), CPU: set()})
    url: str = ""
    role: str = "both"

    def blocks(self) -> int:
        return len(self.tiers[GPU]) + len(self.tiers[CPU])


@dataclass(frozen=True, slots=True)
class InstanceView:
    """A live instance as ``ListInstances`` tells it (for ``kvpool gateway --discover``)."""

    instance_id: str
    url: str
    role: str
    gpu_blocks: int
    cpu_blocks: int
    seen_s_ago: float


@dataclass(frozen=True, slots=True)
class RoutingLimits:
    """What KV events may make the index hold: anyone who reaches the master can publish them,
    and each block is ~75 bytes of the master's memory. Blocks past a cap are dropped (the
    instance's routing knows less of its cache; nothing else is affected); an instance past
    ``max_instances`` is refused, and so is one past ``max_instances_per_tenant`` of its tenant
    (common/tenants.py: one tenant's publishers cannot take every other tenant's room).
    Defaults: a fleet of 1,024 engines, 256 of them one tenant's, an engine with a million
    blocks (a GPU and a CPU tier of 16-token blocks), ~4M blocks in all (~300 MiB)."""

    max_instances: int = 1024
    max_instances_per_tenant: int = 256
    max_blocks_per_instance: int = 1_000_000
    max_blocks: int = 4_000_000


class RoutingIndex:
    """Instance -> blocks per tier, fed by KV events; instances silent for ``instance_ttl_s``
    are dropped by ``tick``. One event loop owns it: no locks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 instance_ttl_s: float = 30.0, store_lookup: StoreLookup | None = None,
                 cost: CostModel | None = None, limits: RoutingLimits | None = None) -> None:
        self._clock = clock
        self.instance_ttl_s = instance_ttl_s
        self._store_lookup = store_lookup
        self.cost = cost or CostModel()
        self.limits = limits or RoutingLimits()
        self._instances: dict[str, _Instance] = {}
        self._per_tenant: dict[str, int] = {}   # instances, by tenant
        self._blocks = 0           # held by every instance, every tier
        self.dropped_blocks = 0    # BlockStored hashes the caps refused

    # -- events --
    def apply(self, instance_id: str, events: Sequence[KVEvent]) -> int:
        """Apply one instance's events in order (an empty list is a heartbeat); return how
        many were applied."""
        if not instance_id:
            raise InvalidArgument("an instance id is required")
        inst = self._instances.get(instance_id)
        if inst is None:
            inst = self._add(instance_id)
        inst.last_seen = self._clock()
        for ev in events:
            held = inst.blocks()
            if isinstance(ev, BlockStored):
                self._store(instance_id, inst, ev)
            elif isinstance(ev, BlockRemoved):
                inst.tiers[_local_tier(ev.tier)].difference_update(ev.hashes)
            elif isinstance(ev, AllBlocksCleared):
                for blocks in inst.tiers.values():
                    blocks.clear()
            else:
                raise InvalidArgument(f"unknown KV event {ev!r}")
            self._blocks += inst.blocks() - held
        return len(events)

    def _store(self, instance_id: str, inst: _Instance, ev: BlockStored) -> None:
        blocks = inst.tiers[_local_tier(ev.tier)]
        room = min(self.limits.max_blocks_per_instance - inst.blocks(),
                   self.limits.max_blocks - self._blocks)
        if len(ev.hashes) <= room:
            blocks.update(ev.hashes)
            return
        new = [h for h in dict.fromkeys(ev.hashes) if h not in blocks]
        blocks.update(new[:max(0, room)])
        if (dropped := len(new) - max(0, room)) > 0:
            self.dropped_blocks += dropped
            _limited.warning("routing_blocks_dropped", kind=instance_id, instance=instance_id,
                             dropped=dropped, instance_blocks=inst.blocks(),
                             max_blocks_per_instance=self.limits.max_blocks_per_instance,
                             max_blocks=self.limits.max_blocks)

    def announce(self, instance_id: str, url: str, role: str = "") -> None:
        """The instance's serving URL and role, as its bridge announces them (each batch
        carries them: a restarted master learns them with the next heartbeat)."""
        role = role or "both"
        if role not in INSTANCE_ROLES:
            raise InvalidArgument(f"unknown instance role {role!r}: expected "
                                  f"{', '.join(INSTANCE_ROLES)}")
        inst = self._instances.get(instance_id)
        if inst is not None and url:
            inst.url, inst.role = url, role

    def _add(self, instance_id: str) -> _Instance:
        """A new instance, unless it would pass the limits (LimitExceeded)."""
        tenant = tenant_of(instance_id)[0]
        limits = self.limits
        if len(self._instances) >= limits.max_instances \
                or self._per_tenant.get(tenant, 0) >= limits.max_instances_per_tenant:
            self.tick()   # room held by instances that went silent
        if len(self._instances) >= limits.max_instances:
            raise LimitExceeded(f"the routing index holds {len(self._instances)} instances, "
                                "its limit (kvpool master --max-routing-instances)")
        if (held := self._per_tenant.get(tenant, 0)) >= limits.max_instances_per_tenant:
            raise LimitExceeded(
                f"tenant {tenant!r} has {held} serving instances in the routing index, its "
                "limit (kvpool master --max-routing-instances-per-tenant); an instance is "
                f"dropped {self.instance_ttl_s:g} s after its last KV event")
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        inst = self._instances[instance_id] = _Instance(self._clock())
        return inst

    def forget(self, instance_id: str) -> None:
        if (inst := self._instances.pop(instance_id, None)) is not None:
            self._blocks -= inst.blocks()
            tenant = tenant_of(instance_id)[0]
            if (left := self._per_tenant[tenant] - 1) > 0:
                self._per_tenant[tenant] = left
            else:
                del self._per_tenant[tenant]

    def tick(self) -> list[str]:
        """Drop instances silent for longer than the TTL; return their ids."""
        cutoff = self._clock() - self.instance_ttl_s
        gone = [i for i, inst in self._instances.items() if inst.last_seen < cutoff]
        for i in gone:
            self.forget(i)
        return gone

    def instances(self) -> list[str]:
        return sorted(self._instances)

    @property
    def total_blocks(self) -> int:
        """Blocks held for every instance, every tier (what ``RoutingLimits.max_blocks`` caps)."""
        return self._blocks

    def describe(self) -> list[InstanceView]:
        now = self._clock()
        return [InstanceView(i, inst.url, inst.role, len(inst.tiers[GPU]), len(inst.tiers[CPU]),
                             max(0.0, now - inst.last_seen))
                for i, inst in sorted(self._instances.items())]

    def blocks(self, instance_id: str, tier: str = GPU) -> int:
        inst = self._instances.get(instance_id)
        return len(inst.tiers[tier]) if inst else 0

    # -- matching and routing --
    def options(self, query: RouteQuery, candidates: Sequence[Candidate]) -> list[Option]:
        """Every candidate with its expected prefix hits per tier and estimated TTFT."""
        in_store = list(self._store_lookup(query.hashes, query.tenant)) \
            if self._store_lookup and query.hashes else [False] * len(query.hashes)
        out = []
        for order, c in enumerate(candidates):
            inst = self._instances.get(c.instance_id)
            gpu, cpu = (inst.tiers[GPU], inst.tiers[CPU]) if inst else (frozenset(), frozenset())
            hits = {GPU: 0, CPU: 0, STORE: 0}
            tokens = {GPU: 0, CPU: 0, STORE: 0}
            left = query.prompt_tokens
            for h, stored in zip(query.hashes, in_store):
                tier = GPU if h in gpu else CPU if h in cpu else STORE if stored else None
                if tier is None:
                    break
                hits[tier] += 1
                # Only the prompt's last block may be partial (trace blocks include it).
                tokens[tier] += min(query.block_size, left)
                left -= min(query.block_size, left)
            cost = self.cost.for_candidate(c)
            out.append(Option(c, order, hits, tokens, left, cost.ttft_s(c, left, tokens), cost))
        return out

    def route(self, query: RouteQuery, candidates: Sequence[Candidate] | None,
              policy: RoutingPolicy) -> Decision:
        """Choose an instance for ``query``. ``candidates=None``: every live instance, idle."""
        if candidates is None:
            candidates = [Candidate(i) for i in self.instances()]
        if not candidates:
            raise InvalidArgument("no candidate instances (none given, none publishing events)")
        ids = [c.instance_id for c in candidates]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a candidate instance is listed twice")
        best = policy.choose(self.options(query, candidates), self.cost)
        return Decision(best.candidate.instance_id, policy.name, best.hit_blocks,
                        best.hit_tokens, best.recomputed_tokens, best.estimated_ttft_s)


def _local_tier(tier: str) -> str:
    if tier not in LOCAL_TIERS:
        raise InvalidArgument(f"unknown instance tier {tier!r}: expected one of {LOCAL_TIERS}")
    return tier


# -- policies -----------------------------------------------------------------------------------

def _load_key(o: Option) -> tuple:
    return (o.candidate.inflight_prefill_tokens, o.candidate.queue_depth, o.order)


class RoutingPolicy:
    """Chooses one option; ``name`` is what the Route RPC and the replay call it."""

    name = ""

    def choose(self, options: Sequence[Option], cost: CostModel) -> Option:
        """The chosen option; ``cost`` is the index's cost model (for policies that weigh)."""
        raise NotImplementedError


class RandomPolicy(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, options, cost):
        return options[self._rng.randrange(len(options))]


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, options, cost):
        chosen = options[self._next % len(options)]
        self._next += 1
        return chosen


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def choose(self, options, cost):
        return min(options, key=_load_key)


class PrefixAffinityPolicy(RoutingPolicy):
    name = "prefix_affinity"

    def choose(self, options, cost):
        return min(options, key=lambda o: (-o.local_blocks, *_load_key(o)))


class KVPoolPolicy(RoutingPolicy):
    """Smallest estimated TTFT, then affinity within the slack (see the module docstring)."""

    name = "kvpool"

    def choose(self, options, cost):
        # The cluster's backlog: how long until even the least loaded candidate is free.
        backlog_s = min(o.candidate.inflight_prefill_tokens * o.cost.prefill_s_per_token
                        for o in options)

        # Each option weighs with its own cost model: candidates may report measured rates.
        def score_s(o: Option) -> float:
            weight = o.cost.recompute_weight * (1 + o.cost.backlog_weight_per_s * backlog_s)
            return o.estimated_ttft_s + \
                weight * o.recomputed_tokens * o.cost.prefill_s_per_token

        best = min(options, key=score_s)
        best_s = score_s(best)
        close = [o for o in options if score_s(o) <= best_s + best.cost.affinity_slack_s]
        # Within the slack, scores are within their estimates' error; the requests generating
        # there are counted, not estimated, and the estimate leaves them out: fewer decides.
        return min(close, key=lambda o: (-o.local_blocks, o.candidate.decoding_requests,
                                         score_s(o), *_load_key(o)))


POLICIES: dict[str, Callable[[int], RoutingPolicy]] = {
    "random": lambda seed: RandomPolicy(seed),
    "round_robin": lambda seed: RoundRobinPolicy(),
    "least_loaded": lambda seed: LeastLoadedPolicy(),
    "prefix_affinity": lambda seed: PrefixAffinityPolicy(),
    "kvpool": lambda seed: KVPoolPolicy(),
}


def make_policy(name: str, seed: int = 0) -> RoutingPolicy:
    """A fresh policy by name; InvalidArgument naming the choices for an unknown one."""
    try:
        return POLICIES[name or DEFAULT_POLICY](seed)
    except KeyError:
        raise InvalidArgument(f"unknown routing policy {name!r}: expected one of "
                              f"{', '.join(POLICIES)}") from None
