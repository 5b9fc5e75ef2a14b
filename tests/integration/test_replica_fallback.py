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


class _Forged(TCPTransport):
    """tcp, with the grants of the first ``read_at`` (a get's fast path) spoilt: the node
    answers DENIED, as it does to a grant that expired; counts each path's calls."""

    def __init__(self):
        super().__init__(timeout_s=2.0)
        self.fast = self.ops = 0      # read_at calls; ops read one by one (the generic path)
        self._in_fast = False

    def read_at(self, segments, which, offsets, lengths, addresses, grants=()):
        self.fast += 1
        if self.fast == 1:
            grants = [bytes(len(g)) for g in grants]
        self._in_fast = True          # tcp's read_at reads through read
        try:
            return super().read_at(segments, which, offsets, lengths, addresses, grants)
        finally:
            self._in_fast = False

    def read(self, ops):
        if not self._in_fast:
            self.ops += len(ops)
        return super().read(ops)


def test_a_node_that_refuses_a_read_is_not_routed_around(cluster):
    """A refusal (here DENIED for a bad grant) comes from a node that answered: the read is
    retried op by op at once, and the node is not taken for unreachable, so the next call
    reads it by the fast path again (it used to be skipped for _UNREACHABLE_S)."""
    keys = [f"refused{i}" for i in range(4)]
    with KVClient(cluster.master, transports=["tcp"]) as kv:
        kv.batch_put(keys, [bytes([i]) * 4096 for i in range(4)])
    forged = _Forged()
    with KVClient(cluster.master, transports=[forged]) as kv:
        assert kv.batch_get(keys) == [bytes([i]) * 4096 for i in range(4)]
        assert forged.fast == 1 and forged.ops == 4     # refused, then read op by op
        assert kv.batch_get(keys) == [bytes([i]) * 4096 for i in range(4)]
        assert forged.fast >= 2 and forged.ops == 4, (forged.fast, forged.ops)
