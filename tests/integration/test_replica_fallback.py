"""A node that stops answering costs a client one transport timeout, not one per call: after a
read from it fails, the client reads the other replicas first for a while (a real cluster; the
unreachable node is simulated by a tcp transport that refuses it)."""

from __future__ import annotations

from kvpool.client import KVClient
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.errors import TransportError
from kvpool.rpc.master_client import MasterClient


class _CutOff(TCPTransport):
    """tcp, except that one node is unreachable; records which node each read went to."""

    def __init__(self, dead: str):
        super().__init__(timeout_s=2.0)
        self.dead = dead
        self.tried: list[str] = []

    def read(self, ops):
        self.tried += [op.replica.node.node_id for op in ops]
        live = [op for op in ops if op.replica.node.node_id != self.dead]
        got = iter(super().read(live))
        return [TransportError(f"{self.dead}: timed out") if op.replica.node.node_id
                == self.dead else next(got) for op in ops]


def test_unreachable_node_is_tried_last_after_it_failed(cluster):
    with KVClient(cluster.master, transports=["tcp"]) as kv:
        for i in range(8):
            kv.put(f"k{i}", bytes([i]) * 4096, replicas=2)
    mc = MasterClient(cluster.master)
    try:
        found = mc.locate([f"k{i}" for i in range(8)]).views()
    finally:
        mc.close()
    dead = found[0].replicas[0].node.node_id
    first_there = [o.key for o in found if o.replicas[0].node.node_id == dead]
    cut = _CutOff(dead)
    with KVClient(cluster.master, transports=[cut]) as kv:
        assert kv.get(first_there[0]) == bytes([int(first_there[0][1:])]) * 4096
        assert cut.tried[0] == dead            # the first call finds out the hard way
        cut.tried.clear()
        for key in first_there:
            assert kv.get(key) == bytes([int(key[1:])]) * 4096
        assert dead not in cut.tried           # the next ones go to the live replica first
