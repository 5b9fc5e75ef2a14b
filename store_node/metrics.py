"""A store node's Prometheus metrics, read from the node at each scrape (nothing is counted on
the data path). The names: README "Metrics, probes and logs"."""

from __future__ import annotations

from kvpool.store_node.node import StoreNode
from prometheus_client.core import GaugeMetricFamily


class NodeCollector:
    def __init__(self, node: StoreNode) -> None:
        self._node = node

    def collect(self):
        node = self._node
        capacity = GaugeMetricFamily("kvpool_node_segment_capacity_bytes", "Size of each "
                                     "segment this node serves",
                                     labels=["node", "segment", "tier"])
        for seg in list(node.segments.values()):   # a copy: start() may be adding segments
            capacity.add_metric([node.node_id, seg.info.segment_id, seg.info.tier],
                                seg.info.size_bytes)
        yield capacity
        for name, doc, value in (
                ("manifest_objects", ("Committed objects in this node's manifest (what it "
                                      "re-announces to a restarted master)"), len(node.manifest)),
                ("moves_queued", "Tier moves asked for and not made yet", node.moves_queued),
                ("ready", "1 when the node takes traffic (mounted, manifest stream open)",
                 int(node.not_ready() is None))):
            g = GaugeMetricFamily(f"kvpool_node_{name}", doc, labels=["node"])
            g.add_metric([node.node_id], value)
            yield g
