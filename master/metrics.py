"""The master's Prometheus metrics.

The index's figures are read from ``MasterState.stats()`` at each scrape: the index keeps
those counters already, and a scrape takes one snapshot of them on the master's event loop
(where the state lives; the scrape comes on the metrics server's thread). Each gRPC call is
timed and counted by ``RpcMetrics`` (an interceptor: a few microseconds a call, on calls that
each carry a batch). The names: README "Metrics, probes and logs".
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from kvpool.master.state import MasterState, MasterStats
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

SNAPSHOT_TIMEOUT_S = 5.0
# From 0.25 ms (a lookup on an idle loop) to 5 s (a put held by a node slow to acknowledge).
RPC_BUCKETS_S = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0)
# From a young collection (~1-10 ms) to a full one over ten million entries (3.5 s).
GC_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Per segment, as the master accounts it: (name, help, the figure from a SegmentStats).
_SEGMENT_FIGURES = (
    ("capacity_bytes", "Segment size", lambda g: g.info.size_bytes),
    ("used_bytes", "Bytes held by indexed objects (aligned; pending and complete)",
     lambda g: g.used_bytes),
    ("quarantined_bytes", ("Bytes freed but kept out of reuse until a lease or put quarantine "
                           "ends"), lambda g: g.quarantined_bytes),
    ("objects", "Objects with a replica in the segment", lambda g: g.objects),
)


@dataclass(frozen=True)
class ServerFigures:
    """What the server around the state counts (master/server.py)."""
    lookup_port_calls: dict[str, int] = field(default_factory=dict)   # by method
    manifest_unacked: dict[str, int] = field(default_factory=dict)    # by node
    manifest_wait_timeouts: int = 0
    routing_instances: int = 0        # the routing index's (KV events)
    routing_blocks: int = 0
    routing_dropped_blocks: int = 0


class MasterCollector:
    """Collects ``state``'s figures, and the server's (``figures()``), on ``loop``;
    ``leading()`` says whether this master serves (False on an HA standby)."""

    def __init__(self, state: MasterState, loop: asyncio.AbstractEventLoop,
                 leading: Callable[[], bool],
                 figures: Callable[[], ServerFigures] = ServerFigures) -> None:
        self._state, self._loop, self._leading, self._figures = state, loop, leading, figures

    def snapshot(self) -> tuple[MasterStats, ServerFigures]:
        """The state's stats and the server's figures, taken on the event loop (from any
        other thread)."""
        async def take() -> tuple[MasterStats, ServerFigures]:
            return self._state.stats(), self._figures()
        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(SNAPSHOT_TIMEOUT_S)

    def collect(self):
        s, f = self.snapshot()
        objects = GaugeMetricFamily("kvpool_master_objects", "Objects indexed, by state",
                                    labels=["state"])
        objects.add_metric(["complete"], s.objects)
        objects.add_metric(["pending"], s.pending_objects)
        yield objects
        yield GaugeMetricFamily("kvpool_master_nodes", "Store nodes alive (mounted, heard from "
                                "within node_ttl_s)", value=s.nodes)
        yield GaugeMetricFamily("kvpool_master_recovering_segments", "Segments whose node is "
                                "still announcing what they hold after a master restart",
                                value=s.recovering_segments)
        yield GaugeMetricFamily("kvpool_master_leader", "1 if this master leads (serves), 0 on "
                                "a standby", value=int(self._leading()))
        lookups = CounterMetricFamily("kvpool_master_lookups", "Keys looked up (GetReplicas), "
                                      "by result", labels=["result"])
        lookups.add_metric(["hit"], s.hits)
        lookups.add_metric(["miss"], s.misses)
        yield lookups
        for name, value, doc in (
                ("hit_bytes", s.hit_bytes, "Sizes of the objects lookups found (the bytes "
                 "readers were sent to read)"),
                ("committed", s.committed, "Puts completed (objects committed by PutEnd)"),
                ("committed_bytes", s.committed_bytes, "Sizes of the objects committed")):
            yield CounterMetricFamily(f"kvpool_master_{name}", doc, value=value)
        yield GaugeMetricFamily("kvpool_master_silent_nodes", "Store nodes not heard from "
                                "for a third of node_ttl_s (probably dead, not expired yet)",
                                value=s.silent_nodes)
        yield GaugeMetricFamily("kvpool_master_pinned_bytes", "Bytes held by hard pins "
                                "(never evicted)", value=s.pinned_bytes)
        yield GaugeMetricFamily("kvpool_master_leases", "Read leases running (granted by "
                                "lookups, not expired; a key read twice counts twice)",
                                value=s.leases)
        if s.recovery_s is not None:
            yield GaugeMetricFamily("kvpool_master_recovery_seconds", "How long the last "
                                    "rebuild of the index took (nodes re-announcing what they "
                                    "hold after a master restart)", value=s.recovery_s)
        by_ns = CounterMetricFamily("kvpool_master_namespace_lookups", "Keys looked up, by "
                                    "key namespace and result (master/reads.py)",
                                    labels=["namespace", "result"])
        for ns, hits, misses in s.namespaces:
            by_ns.add_metric([ns, "hit"], hits)
            by_ns.add_metric([ns, "miss"], misses)
        yield by_ns
        held = GaugeMetricFamily("kvpool_master_tenant_bytes", "Sizes of each tenant's "
                                 "objects, each once whatever its replicas (master/quotas.py)",
                                 labels=["tenant"])
        count = GaugeMetricFamily("kvpool_master_tenant_objects", "Objects of each tenant, "
                                  "pending and complete", labels=["tenant"])
        quota = GaugeMetricFamily("kvpool_master_tenant_quota_bytes", "Each tenant's byte "
                                  "quota (tenants with one)", labels=["tenant"])
        for t, n, b, q in s.tenants:
            held.add_metric([t], b)
            count.add_metric([t], n)
            if q is not None:
                quota.add_metric([t], q)
        yield from (held, count, quota)
        calls = CounterMetricFamily("kvpool_master_lookup_port_calls", "Calls answered on "
                                    "the lookup port (plain tcp; the gRPC ones are in "
                                    "kvpool_master_rpcs_total)", labels=["method"])
        for method, n in f.lookup_port_calls.items():
            calls.add_metric([method], n)
        yield calls
        unacked = GaugeMetricFamily("kvpool_master_manifest_unacked", "Manifest messages a "
                                    "store node has not acknowledged yet (its lag)",
                                    labels=["node"])
        for node, n in f.manifest_unacked.items():
            unacked.add_metric([node], n)
        yield unacked
        for name, value, doc in (
                ("nodes_expired", s.nodes_expired, "Store nodes declared dead (silent for "
                 "node_ttl_s): their segments and replicas dropped"),
                ("manifest_wait_timeouts", f.manifest_wait_timeouts, ("Calls answered before "
                 "every node acknowledged their manifest change (a node slower than 3 s): "
                 "what they changed is at risk if the master dies at once")),
                ("evictions", s.evictions, "Objects evicted to make room"),
                ("demotions", s.demotions, "Objects moved one tier down (kept)"),
                ("promotions", s.promotions, "Objects moved one tier up"),
                ("corrupt_replicas", s.corrupt_replicas, ("Replicas dropped because their "
                 "bytes failed the checksum (a reader's or the scrubber's report)"))):
            yield CounterMetricFamily(f"kvpool_master_{name}", doc, value=value)
        yield GaugeMetricFamily("kvpool_master_routing_instances", "Serving instances the "
                                "routing index knows from their KV events", value=f.routing_instances)
        yield GaugeMetricFamily("kvpool_master_routing_blocks", "Blocks the routing index "
                                "holds for those instances (every tier)", value=f.routing_blocks)
        yield CounterMetricFamily("kvpool_master_routing_dropped_blocks", "Blocks of KV events "
                                  "dropped at the routing index's caps (--max-routing-blocks, "
                                  "--max-routing-blocks-per-instance)",
                                  value=f.routing_dropped_blocks)
        for name, doc, figure in _SEGMENT_FIGURES:
            family = GaugeMetricFamily(f"kvpool_segment_{name}", doc,
                                       labels=["node", "segment", "tier"])
            for g in s.segments:
                family.add_metric([g.node_id, g.info.segment_id, g.info.tier], figure(g))
            yield family


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Times every unary RPC of the master's gRPC services and counts it by method and status
    code (``kvpool_master_rpc_seconds``, ``kvpool_master_rpcs_total``); the lookup port's calls,
    the same methods, too (:meth:`observe`). Streams (the manifest watch) are not timed: they
    last as long as their node."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._seconds = Histogram("kvpool_master_rpc_seconds", "Time to answer a call (gRPC "
                                  "unary, or on the lookup port), by method", ["method"],
                                  registry=registry, buckets=RPC_BUCKETS_S)
        self._calls = Counter("kvpool_master_rpcs", "Calls answered (gRPC unary, or on the "
                              "lookup port), by method and status code", ["method", "code"],
                              registry=registry)

    def observe(self, method: str, code: str, seconds: float) -> None:
        """Count a call answered elsewhere (the lookup port): ``code`` a gRPC status name."""
        self._seconds.labels(method).observe(seconds)
        self._calls.labels(method, code).inc()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = details.method.rpartition("/")[2]
        seconds, calls, inner = self._seconds.labels(method), self._calls, handler.unary_unary

        async def timed(request, context):
            start = time.perf_counter()
            failed = True
            try:
                response = await inner(request, context)
                failed = False
                return response
            finally:
                seconds.observe(time.perf_counter() - start)
                code = context.code()
                calls.labels(method, code.name if code is not None
                             else ("UNKNOWN" if failed else "OK")).inc()
        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


class GcPauses:
    """Times each of this process's cycle collections, by generation
    (``kvpool_master_gc_pause_seconds``): the master answers nothing while one runs
    (tools/master_cmd.py ``gc_for_a_large_index`` keeps them short), and what is frozen out of
    them (``kvpool_master_gc_frozen_objects``: the index, mostly). The collector's callback
    only counts (no lock: a collection can start in a thread that holds a metric's); a scrape
    reads the counts. ``close`` removes the callback."""

    def __init__(self) -> None:
        self._start = 0.0
        self._counts = [[0] * (len(GC_BUCKETS_S) + 1) for _ in range(3)]   # the last: +Inf
        self._sums = [0.0] * 3
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
            return
        took, generation = now - self._start, info["generation"]
        self._counts[generation][bisect.bisect_left(GC_BUCKETS_S, took)] += 1
        self._sums[generation] += took

    def collect(self):
        family = HistogramMetricFamily(
            "kvpool_master_gc_pause_seconds", "Time the master stood still for a cycle "
            "collection, by generation (0, 1: young; 2: full)", labels=["generation"])
        bounds = [*map(str, GC_BUCKETS_S), "+Inf"]
        for generation, counts in enumerate(self._counts):
            family.add_metric([str(generation)],
                              list(zip(bounds, itertools.accumulate(counts))),
                              self._sums[generation])
        yield family
        yield GaugeMetricFamily("kvpool_master_gc_frozen_objects", "Objects frozen out of "
                                "cycle collections (what outlived a generation-1 one)",
                                value=gc.get_freeze_count())

    def close(self) -> None:
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
