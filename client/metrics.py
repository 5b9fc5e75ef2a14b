"""The client's figures in the caller's Prometheus registry (``KVClient(metrics=registry)``), so
an engine that serves ``/metrics`` already shows kvpool's hits, misses, bytes and latency too.

Counted per call, never per key on the data path: a batch's keys are tallied once it returns,
its bytes per transport from the sizes the transports were handed. Off (``metrics=None``,
the default) it costs one ``is None`` test per call. The names: README "Metrics, probes and
logs".
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

from kvpool.common.errors import AlreadyExists, ObjectNotFound
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

# From 50 us (a small get over shm) to 10 s (a large batch over a slow network).
OP_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

# One set of series per registry: every KVClient of a process adds to the same ones (a
# registry refuses a second metric of the same name).
_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, ClientMetrics] = \
    weakref.WeakKeyDictionary()


def client_metrics(registry: CollectorRegistry | None = None) -> ClientMetrics:
    """The client metrics of ``registry`` (default: prometheus-client's global one), made on
    first use."""
    registry = REGISTRY if registry is None else registry
    if registry not in _BY_REGISTRY:
        _BY_REGISTRY[registry] = ClientMetrics(registry)
    return _BY_REGISTRY[registry]


class ClientMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._keys = Counter("kvpool_client_keys", "Keys a put or get asked for, by op and "
                             "result (get: hit, miss, error; put: stored, exists, error)",
                             ["op", "result"], registry=registry)
        self._bytes = Counter("kvpool_client_bytes", "Value bytes moved, by op and transport",
                              ["op", "transport"], registry=registry)
        self._seconds = Histogram("kvpool_client_op_seconds", "Time of a put or get call (a "
                                  "batch is one call), by op", ["op"], registry=registry,
                                  buckets=OP_BUCKETS_S)

    def moved(self, op: str, transport: str, nbytes: int) -> None:
        """``nbytes`` of values went ``op`` ("put", "get") over ``transport`` (its scheme)."""
        self._bytes.labels(op, transport).inc(nbytes)

    def done(self, op: str, results: Sequence, started: float) -> None:
        """A call that began at ``started`` (time.perf_counter) returned ``results``, per key
        None or a byte count for success, else the error."""
        self._seconds.labels(op).observe(time.perf_counter() - started)
        ok = absent = 0
        for r in results:
            if r is None or isinstance(r, int):
                ok += 1
            elif isinstance(r, ObjectNotFound | AlreadyExists):
                absent += 1
        names = ("hit", "miss") if op == "get" else ("stored", "exists")
        for result, n in ((names[0], ok), (names[1], absent),
                          ("error", len(results) - ok - absent)):
            if n:
                self._keys.labels(op, result).inc(n)
