"""A store node's Prometheus metrics, read from the node at each scrape: the data path keeps
plain counts under the lock it takes per request anyway, the scrubber and the manifest keep
theirs, and nothing else is counted as it happens. The names: README "Metrics, probes and
logs"."""

from __future__ import annotations

from kvpool.store_node.node import StoreNode
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# The data-path request kinds, by the transport that carries them: tcp frames on the data
# port (READ, WRITE, and CONNECT_QP: the handshake of an rdma queue pair, whose reads and
# writes are one-sided and never reach the node), and shm hand-offs of a segment's fd.
_TRANSPORT = {"READ": "tcp", "WRITE": "tcp", "CONNECT_QP": "tcp", "HANDOFF": "shm"}


class NodeCollector:
    def __init__(self, node: StoreNode) -> None:
        self._node = node

    def collect(self):
        node = self._node
        f = node.figures()
        tiers = {sid: seg.info.tier for sid, seg in list(node.segments.items())}
        capacity = GaugeMetricFamily("kvpool_node_segment_capacity_bytes", "Size of each "
                                     "segment this node serves",
                                     labels=["node", "segment", "tier"])
        # A copy: start() may be adding segments.
        for seg in list(node.segments.values()):
            capacity.add_metric([node.node_id, seg.info.segment_id, seg.info.tier],
                                seg.info.size_bytes)
        yield capacity
        used = GaugeMetricFamily("kvpool_node_segment_used_bytes", "Bytes of the committed "
                                 "objects in each segment (the disk tier's survive a restart)",
                                 labels=["node", "segment", "tier"])
        for sid, nbytes in f.segment_bytes.items():
            used.add_metric([node.node_id, sid, tiers.get(sid, "")], nbytes)
        yield used
        requests = CounterMetricFamily("kvpool_node_requests", "Data requests served, by "
                                       "transport and op", labels=["node", "transport", "op"])
        for op, n in f.requests.items():
            requests.add_metric([node.node_id, _TRANSPORT.get(op, "tcp"), op], n)
        yield requests
        moved = CounterMetricFamily("kvpool_node_bytes", "Payload bytes moved through the "
                                    "data port, by op", labels=["node", "transport", "op"])
        for op, n in f.bytes.items():
            moved.add_metric([node.node_id, "tcp", op], n)
        yield moved
        conns = GaugeMetricFamily("kvpool_node_connections", "Clients connected now, by "
                                  "transport", labels=["node", "transport"])
        for transport, n in f.connections.items():
            conns.add_metric([node.node_id, transport], n)
        yield conns
        for name, doc, value in (
                ("scrub_checked_objects", "Objects whose checksum the scrubber re-checked",
                 f.scrubbed_objects),
                ("scrub_checked_bytes", "Bytes the scrubber read to re-check checksums",
                 f.scrubbed_bytes),
                ("scrub_mismatches", "Replicas the scrubber found damaged (reported, dropped)",
                 f.corrupt_found),
                ("shm_index_left_out", ("Commits left out of the shm index: their bucket was "
                                        "full (those objects' gets ask the master)"),
                 index.full if (index := node.manifest.index) is not None else 0)):
            c = CounterMetricFamily(f"kvpool_node_{name}", doc, labels=["node"])
            c.add_metric([node.node_id], value)
            yield c
        for name, doc, value in (
                ("manifest_objects", ("Committed objects in this node's manifest (what it "
                                      "re-announces to a restarted master)"), len(node.manifest)),
                ("moves_queued", "Tier moves asked for and not made yet", node.moves_queued),
                ("shm_index_objects", ("Objects same-host clients find in this node's shm "
                                       "index (read with no master call)"),
                 len(index) if (index := node.manifest.index) is not None else 0),
                ("ready", "1 when the node takes traffic (mounted, manifest stream open)",
                 int(node.not_ready() is None))):
            g = GaugeMetricFamily(f"kvpool_node_{name}", doc, labels=["node"])
            g.add_metric([node.node_id], value)
            yield g
