"""The gateway's Prometheus series (``/metrics``), in a registry of its own.

Per engine (label ``engine``: its instance id): requests by outcome, TTFT observed (streamed
requests: the first body chunk after the request arrived at the gateway), whole-request
latency, the prefix Route expected per tier, failures and whether the engine is up; the load
the gateway routes with (its own in-flight requests and prompt tokens waiting for a first token)
is read from the engine pool at each scrape, not counted twice.
"""

from __future__ import annotations

from kvpool.common.metrics import new_registry
from kvpool.gateway.engines import EnginePool
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

# TTFT on CPU engines spans ~10 ms to tens of seconds.
_TTFT_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self, pool: EnginePool, registry: CollectorRegistry | None = None):
        self.registry = registry or new_registry()
        r = self.registry
        self.requests = Counter("kvpool_gateway_requests", "Requests answered, by the engine "
                                "that served them ('' if none) and outcome",
                                ["endpoint", "engine", "status"], registry=r)
        self.ttft = Histogram("kvpool_gateway_ttft_seconds", "Time from a streamed request's "
                              "arrival to its first body chunk from the engine", ["engine"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.latency = Histogram("kvpool_gateway_request_seconds", "Time from a request's "
                                 "arrival to its last byte", ["engine"],
                                 buckets=_TTFT_BUCKETS, registry=r)
        self.route = Histogram("kvpool_gateway_route_seconds", "Time to tokenize a prompt and "
                               "choose its engine", ["policy"],
                               buckets=(.0002, .0005, .001, .002, .005, .01, .05, .25, 1),
                               registry=r)
        self.hit_blocks = Counter("kvpool_gateway_expected_hit_blocks", "Prefix blocks Route "
                                  "expected the chosen engine to reuse, per tier",
                                  ["engine", "tier"], registry=r)
        self.prompt_tokens = Counter("kvpool_gateway_prompt_tokens", "Prompt tokens sent to "
                                     "each engine", ["engine"], registry=r)
        self.failures = Counter("kvpool_gateway_engine_failures", "Requests or probes an engine "
                                "failed (each marks it down)", ["engine", "reason"], registry=r)
        self.retries = Counter("kvpool_gateway_retries", "Requests sent again to another engine "
                               "after theirs failed before answering", registry=r)
        r.register(_LoadCollector(pool))


class _LoadCollector:
    def __init__(self, pool: EnginePool):
        self._pool = pool

    def collect(self):
        up = GaugeMetricFamily("kvpool_gateway_engine_up", "1 while the engine takes requests, "
                               "0 while marked down", labels=["engine"])
        inflight = GaugeMetricFamily("kvpool_gateway_inflight_requests", "The gateway's "
                                     "requests at each engine", labels=["engine"])
        queued = GaugeMetricFamily("kvpool_gateway_queued_prefill_tokens", "Prompt tokens "
                                   "sent to each engine still waiting for their first token "
                                   "(less the prefix Route expected reused)", labels=["engine"])
        reported = GaugeMetricFamily("kvpool_gateway_engine_reported_requests", "Requests "
                                     "running or waiting at the engine's last scrape",
                                     labels=["engine"])
        for i, e in list(self._pool.engines.items()):
            up.add_metric([i], 1 if e.up else 0)
            inflight.add_metric([i], e.inflight)
            queued.add_metric([i], sum(e.waiting_first_token.values()))
            reported.add_metric([i], e.reported_queue)
        return [up, inflight, queued, reported]
