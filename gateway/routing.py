"""Choosing an engine: the master's Route, or the gateway's own least-loaded choice without it.

Route hashes the prompt's token ids with the cluster's block size and ``extra_keys``
(``{"model": NAME}``: the name the engines' KV-event bridges hash under, ``kvpool kv-events
--model NAME``) and answers the candidate with the smallest expected time to first token and
the prefix each tier would give it. When the master cannot answer (unreachable, or no client
registered a hash spec yet), the gateway routes by load alone rather than fail the request,
and leaves the master alone for ``master_backoff_s`` so requests do not each wait out a
timeout. Route goes on the master's lookup port from the gateway's event loop (a thread hop
cost as much as the call itself), over gRPC on a worker thread until the port is known.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.client.router import Candidate, RouterClient
from kvpool.common.errors import KVPoolError
from kvpool.common.logging import get_logger

log = get_logger(__name__)
TIERS = ("gpu", "cpu", "store")


@dataclass(frozen=True, slots=True)
class Choice:
    instance_id: str
    policy: str                 # the master's policy, or "fallback_least_loaded"
    hit_blocks: dict[str, int]  # expected prefix hits per tier, in blocks
    hit_tokens: int             # prompt tokens those blocks cover (estimated)
    route_s: float              # how long choosing took

    @property
    def store_tokens(self) -> int:
        """The prompt tokens Route expects the engine to load from the store."""
        blocks = sum(self.hit_blocks.values())
        return self.hit_tokens * self.hit_blocks.get("store", 0) // blocks if blocks else 0


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=lambda c: (c.inflight_prefill_tokens, c.queue_depth))


class EngineRouter:
    def __init__(self, master: str | None, *, model: str, policy: str = "",
                 timeout_s: float = 1.0, master_backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self._client = RouterClient(master, timeout_s=timeout_s) if master else None
        self.extra_keys = {"model": model}
        self.policy = policy
        self.master_backoff_s = master_backoff_s
        self._clock = clock
        self._skip_until = 0.0
        self._lock = threading.Lock()
        self.last_error: str | None = None

    async def choose(self, token_ids: Sequence[int], candidates: Sequence[Candidate]
                     ) -> Choice:
        t0 = time.perf_counter()
        if self._client is not None and self._clock() >= self._skip_until:
            try:
                r = await self._client.route_async(
                    token_ids=token_ids, candidates=candidates, policy=self.policy,
                    extra_keys=self.extra_keys)
            except KVPoolError as e:
                self._master_failed(e)
            else:
                hits = {t: r.hits.get(t, 0) for t in TIERS}
                # Route counts full blocks; their size is the prompt's tokens per block.
                per_block = len(token_ids) // r.blocks if r.blocks else 0
                return Choice(r.instance_id, r.policy, hits,
                              min(len(token_ids), sum(hits.values()) * per_block),
                              time.perf_counter() - t0)
        c = least_loaded(candidates)
        return Choice(c.instance_id, "fallback_least_loaded", dict.fromkeys(TIERS, 0), 0,
                      time.perf_counter() - t0)

    def list_instances(self) -> list:
        """The master's live instances (``kvpool gateway --discover``); blocking."""
        if self._client is None:
            raise KVPoolError("no master to discover engines from")
        return self._client.list_instances()

    def _master_failed(self, e: KVPoolError) -> None:
        with self._lock:
            self._skip_until = self._clock() + self.master_backoff_s
            if self.last_error != str(e):
                log.warning("route_unavailable", error=str(e),
                            retry_in_s=self.master_backoff_s,
                            routing="least loaded until the master answers")
            self.last_error = str(e)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
