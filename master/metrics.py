"""The master's Prometheus metrics, read from ``MasterState.stats()`` at each scrape.

Nothing is counted on the request path: the index keeps its counters already, and a scrape
takes one snapshot of them on the master's event loop (where the state lives; the scrape comes
on the metrics server's thread). The names: README "Metrics, probes and logs".
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvpool.common.metrics import gauge
from kvpool.master.state import MasterState, MasterStats
from prometheus_client.core import CounterMetricFamily

SNAPSHOT_TIMEOUT_S = 5.0
_SEGMENT = ("node", "segment", "tier")


class MasterCollector:
    """Collects ``state``'s figures on ``loop``; ``leading()`` says whether this master serves
    (False on an HA standby)."""

    def __init__(self, state: MasterState, loop: asyncio.AbstractEventLoop,
                 leading: Callable[[], bool]) -> None:
        self._state, self._loop, self._leading = state, loop, leading

    def snapshot(self) -> MasterStats:
        """The state's stats, taken on its event loop (from any other thread)."""
        async def take() -> MasterStats:
            return self._state.stats()
        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(SNAPSHOT_TIMEOUT_S)

    def collect(self):
        s = self.snapshot()
        objects = gauge("kvpool_master_objects", "Objects indexed, by state", ("state",))
        objects.add_metric(["complete"], s.objects)
        objects.add_metric(["pending"], s.pending_objects)
        yield objects
        yield _one("kvpool_master_nodes", "Store nodes alive (mounted, heard from within "
                   "node_ttl_s)", s.nodes)
        yield _one("kvpool_master_recovering_segments", "Segments whose node is still "
                   "announcing what they hold after a master restart", s.recovering_segments)
        yield _one("kvpool_master_leader", "1 if this master leads (serves), 0 on a standby",
                   int(self._leading()))
        lookups = CounterMetricFamily("kvpool_master_lookups", "Keys looked up (GetReplicas), "
                                      "by result", labels=["result"])
        lookups.add_metric(["hit"], s.hits)
        lookups.add_metric(["miss"], s.misses)
        yield lookups
        for name, value, doc in (
                ("evictions", s.evictions, "Objects evicted to make room"),
                ("demotions", s.demotions, "Objects moved one tier down (kept)"),
                ("promotions", s.promotions, "Objects moved one tier up")):
            yield CounterMetricFamily(f"kvpool_master_{name}", doc, value=value)
        families = {
            "capacity": gauge("kvpool_segment_capacity_bytes", "Segment size", _SEGMENT),
            "used": gauge("kvpool_segment_used_bytes", "Bytes held by indexed objects "
                          "(aligned; pending and complete)", _SEGMENT),
            "quarantined": gauge("kvpool_segment_quarantined_bytes", "Bytes freed but kept "
                                 "out of reuse until a lease or put quarantine ends", _SEGMENT),
            "objects": gauge("kvpool_segment_objects", "Objects with a replica in the "
                             "segment", _SEGMENT),
        }
        for g in s.segments:
            labels = [g.node_id, g.info.segment_id, g.info.tier]
            families["capacity"].add_metric(labels, g.info.size_bytes)
            families["used"].add_metric(labels, g.used_bytes)
            families["quarantined"].add_metric(labels, g.quarantined_bytes)
            families["objects"].add_metric(labels, g.objects)
        yield from families.values()


def _one(name: str, doc: str, value: float):
    g = gauge(name, doc)
    g.add_metric([], value)
    return g
