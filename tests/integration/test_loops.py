"""No silent thread death (common/loops.py): an exception injected into each long-lived loop
of a store node, a master and the vLLM event bridge is logged once with its traceback, and the
loop runs again or the process (here: a recording ``fatal``) stops with a clear message.

Store nodes run in this process, on a real master in a subprocess; their faults come from a
real MasterClient that raises, or answers, what a test tells it to (passed to the node's
constructor). The master's tick fails through its injected clock."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter

import msgpack
import pytest
import structlog
import zmq
from kvpool.client import KVClient
from kvpool.client.router import Candidate, RouterClient
from kvpool.client.vllm_events import ZMQEventBridge
from kvpool.common.config import MasterConfig
from kvpool.common.hashing import HashSpec
from kvpool.common.loops import LoopCrashed, Supervisor
from kvpool.common.types import Extent, Move
from kvpool.master.server import MasterServer
from kvpool.rpc.master_client import MasterClient
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.memory import create_dram_segment
from kvpool.store_node.node import StoreNode

from .conftest import run_cluster

INTERVAL_S = 0.05


class Fatal:
    """A ``fatal`` hook that records instead of ending the test process."""

    def __init__(self):
        self.errors: list[LoopCrashed] = []

    def __call__(self, error: LoopCrashed) -> None:
        self.errors.append(error)


class FaultyMaster(MasterClient):
    """A real client of the master; a method named in ``faults`` raises that exception on its
    next call (on every call if also in ``always``); ``moves`` go to the node with its next
    heartbeat answer, after the master's own."""

    def __init__(self, address: str, node_id: str):
        # With the node's own credentials (the cluster's CA issues them): it mounts as it.
        super().__init__(address, timeout_s=2.0, role="node", identity=node_id)
        self.faults: dict[str, Exception] = {}
        self.always: set[str] = set()
        self.moves: list = []
        self.calls: Counter[str] = Counter()
        self.failed_moves: list[int] = []

    def _inject(self, method: str) -> None:
        self.calls[method] += 1
        error = self.faults.get(method) if method in self.always \
            else self.faults.pop(method, None)
        if error is not None:
            raise error

    def heartbeat_moves(self, node_id, done=(), failed=()):
        self._inject("heartbeat_moves")
        self.failed_moves += failed
        committed, removed, moves = super().heartbeat_moves(node_id, done, failed)
        injected, self.moves = self.moves, []
        return committed, removed, [*moves, *injected]

    def watch_manifest(self, node_id, deadline_s):
        self._inject("watch_manifest")
        return super().watch_manifest(node_id, deadline_s)


def wait_for(fn, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := fn()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def crashes(logs, loop):
    return [e for e in logs if e["event"] == "loop_crashed" and e["loop"] == loop]


@pytest.fixture
def master(tmp_path):
    """A real master (subprocess, fast timeouts), no nodes."""
    yield from run_cluster(tmp_path, nodes=0)


@pytest.fixture
def node(master):
    """A store node in this process, on a FaultyMaster and a recording ``fatal``."""
    fatal = Fatal()
    n = StoreNode(FaultyMaster(master.master, "loops0"), [8 << 20], node_id="loops0",
                  heartbeat_interval_s=INTERVAL_S,
                  rdma_device=False, scrub_bytes_per_s=0, supervisor=Supervisor(fatal))
    n.start()
    n.faulty, n.fatal = n._master, fatal
    yield n
    n.stop()


def test_a_crashed_heartbeat_is_logged_once_and_beats_again(node):
    with structlog.testing.capture_logs() as logs:
        node.faulty.faults["heartbeat_moves"] = RuntimeError("injected")
        assert wait_for(lambda: crashes(logs, "heartbeat"))
        beats = node.faulty.calls["heartbeat_moves"]
        assert wait_for(lambda: node.faulty.calls["heartbeat_moves"] >= beats + 5)
    [crash] = crashes(logs, "heartbeat")
    assert isinstance(crash["exc_info"], RuntimeError) and crash["then"] == "restart"
    assert not node.fatal.errors


def test_a_heartbeat_that_keeps_crashing_stops_the_node_with_a_clear_message(node):
    # Beats made before the fault (a slow start: one every INTERVAL_S) are not the crashes.
    beats = node.faulty.calls["heartbeat_moves"]
    with structlog.testing.capture_logs() as logs:
        node.faulty.always.add("heartbeat_moves")
        node.faulty.faults["heartbeat_moves"] = RuntimeError("injected")
        # Five restarts (back-offs 0.1 s to 1.6 s), then the end.
        assert wait_for(lambda: node.fatal.errors, timeout_s=20)
    [error] = node.fatal.errors
    assert str(error) == (
        "the heartbeat loop crashed (RuntimeError: injected, 6 times in a row) and cannot go "
        "on: a store node that cannot heartbeat or follow its manifest must not go on "
        "serving; stopping")
    assert len(crashes(logs, "heartbeat")) == 1          # the same crash: one traceback
    assert node.faulty.calls["heartbeat_moves"] - beats == 6


def test_a_crashed_manifest_watch_is_restarted_and_follows_puts_again(node, master):
    with structlog.testing.capture_logs() as logs:
        node.faulty.faults["watch_manifest"] = RuntimeError("injected")
        node.faulty.end_watches()        # the stream ends: the loop watches again, and crashes
        assert wait_for(lambda: crashes(logs, "manifest"))
        # Restarted: the node hears of the next put's commit by its new stream (only by it;
        # a writer that seals put the record there already, pending that word).
        with KVClient(master.master) as kv:
            kv.put("after", b"x" * 4096)
        assert wait_for(lambda: node.manifest.get("after") and not node.manifest.sealed())
    assert node.faulty.calls["watch_manifest"] >= 3
    assert len(crashes(logs, "manifest")) == 1 and not node.fatal.errors


def test_a_crashed_mover_makes_the_next_move(node):
    sid = next(iter(node.segments))
    with structlog.testing.capture_logs() as logs:
        # A move the mover cannot even read (no extents): a crash, not a refusal.
        node.faulty.moves.append(Move(1, "bad", 1, None, None))
        assert wait_for(lambda: crashes(logs, "mover"))
        # The next one (to a segment that does not exist) is refused and reported failed.
        node.faulty.moves.append(Move(2, "next", 1, Extent(sid, 0, 8), Extent("nowhere", 0, 8)))
        assert wait_for(lambda: 2 in node.faulty.failed_moves)
    [crash] = crashes(logs, "mover")
    assert isinstance(crash["exc_info"], AttributeError)
    assert 1 not in node.faulty.failed_moves and not node.fatal.errors


class CrashOnceDataServer(DataServer):
    """Its acceptor crashes on the first connection it accepts."""

    crashed = False

    def _accept(self, listener):
        if not self.crashed:
            self.crashed = True
            listener.accept()[0].close()
            raise RuntimeError("injected")
        super()._accept(listener)


def test_a_crashed_acceptor_accepts_again():
    seg = create_dram_segment("n", 0, 1 << 20)
    fatal = Fatal()
    server = CrashOnceDataServer({seg.info.segment_id: seg}, shm=False,
                                 supervisor=Supervisor(fatal))
    try:
        with structlog.testing.capture_logs() as logs:
            server.start()
            host, _, port = server.tcp_endpoint.rpartition(":")
            socket.create_connection((host, int(port)), timeout=5).close()
            assert wait_for(lambda: crashes(logs, "data-accept"))

            def served():   # a connection is served again: its bad frame is answered
                with socket.create_connection((host, int(port)), timeout=5) as s:
                    s.sendall(b"\0" * 24)
                    return s.recv(1)
            assert wait_for(served)
        assert len(crashes(logs, "data-accept")) == 1 and not fatal.errors
    finally:
        server.stop()
        seg.close()


def test_a_crashed_tick_stops_the_master_with_a_clear_message():
    class Clock:
        broken = False

        def __call__(self):
            if self.broken:
                raise RuntimeError("injected")
            return time.monotonic()

    async def main():
        clock, fatal = Clock(), Fatal()
        server = MasterServer(MasterConfig(node_ttl_s=0.5), clock=clock, lookup_port=None,
                              supervisor=Supervisor(fatal))
        await server.start()
        try:
            with structlog.testing.capture_logs() as logs:
                clock.broken = True
                deadline = time.monotonic() + 10
                while not fatal.errors and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                clock.broken = False
        finally:
            await server.stop(0)
        return fatal.errors, logs

    errors, logs = asyncio.run(main())
    assert [str(e) for e in errors] == [(
        "the tick loop crashed (RuntimeError: injected) and cannot go on: the master's index "
        "may be half updated; a restarted master rebuilds it from the store nodes; stopping")]
    [crash] = crashes(logs, "tick")
    assert crash["then"] == "stop" and isinstance(crash["exc_info"], RuntimeError)


class Publisher:
    """A ZMQ publisher on vLLM's KV-event wire format (see vllm_publisher.py)."""

    def __init__(self):
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)   # XPUB: a subscription can be waited for
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._seq = 0

    def wait_subscribed(self) -> None:
        self._pub.recv()

    def send(self, batch) -> None:
        self._pub.send_multipart((b"", self._seq.to_bytes(8, "big"), msgpack.packb(batch)))
        self._seq += 1

    def close(self) -> None:
        self._pub.close(linger=0)
        self._ctx.term()


@pytest.fixture
def publisher():
    p = Publisher()
    yield p
    p.close()


GOOD = [0.0, [["BlockStored", [b"e0" * 16], None, list(range(16)), 16, None, "GPU"]], 0]


class BuggyTranslator:
    """The bridge's translator with a bug: its first ``crashes`` calls raise TypeError (a
    malformed event no longer stands in for a bug: the bridge skips those, issue 15)."""

    def __init__(self, inner, crashes: int):
        self.inner, self.crashes = inner, crashes

    def translate(self, events):
        if self.crashes > 0:
            self.crashes -= 1
            raise TypeError("a bug in the translation")
        return self.inner.translate(events)


def buggy_bridge(publisher, master, crashes: int) -> ZMQEventBridge:
    bridge = ZMQEventBridge(publisher.endpoint, "vllm-0", master.master,
                            HashSpec.of(16, model="m"))
    bridge.translator = BuggyTranslator(bridge.translator, crashes)
    return bridge.start()


def test_a_crashed_event_bridge_goes_on_with_the_next_batch(master, publisher):
    with structlog.testing.capture_logs() as logs:
        bridge = buggy_bridge(publisher, master, crashes=1)
        try:
            publisher.wait_subscribed()                 # subscribed
            publisher.send(GOOD)                        # crashes the loop once
            assert wait_for(lambda: crashes(logs, "vllm-events-vllm-0"))
            publisher.send(GOOD)
            assert wait_for(lambda: bridge.batches == 1)
            with RouterClient(master.master) as router:
                got = router.route(token_ids=list(range(16)), extra_keys={"model": "m"},
                                   candidates=[Candidate("vllm-0")])
            assert got.hits["gpu"] == 1
        finally:
            bridge.stop()
    assert isinstance(crashes(logs, "vllm-events-vllm-0")[0]["exc_info"], TypeError)
    assert bridge.error is None


def test_an_event_bridge_that_keeps_crashing_stops_and_says_why(master, publisher):
    bridge = buggy_bridge(publisher, master, crashes=6)
    try:
        publisher.wait_subscribed()
        for _ in range(6):   # each crash costs its batch; the sixth in a row ends the bridge
            publisher.send(GOOD)
        assert wait_for(lambda: bridge.error is not None, timeout_s=20)
    finally:
        with pytest.raises(LoopCrashed, match=r"the vllm-events-vllm-0 loop crashed "
                           r"\(TypeError: .*, 6 times in a row\) .*: the KV-event bridge stops"):
            bridge.stop()


class FailOnce:
    """A monotonic clock whose first call raises (a bug's stand-in)."""

    def __init__(self):
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected")
        return time.monotonic()


def test_a_crashed_election_campaigns_again_and_a_crashed_lease_ends_as_lost():
    """serve_ha's two loops (master/ha.py), restarted after a crash: the campaign goes on
    (against an etcd that is not there: it keeps trying), the lease keeper finds no lease and
    returns, as when a lease is lost (then the master exits)."""
    from kvpool.common.addresses import EtcdURL
    from kvpool.common.loops import RESTART
    from kvpool.master.ha import LeaderElection

    async def main():
        fatal = Fatal()
        campaigner = LeaderElection(EtcdURL(("127.0.0.1:1",)), "127.0.0.1:2", clock=FailOnce())
        keeper = LeaderElection(EtcdURL(("127.0.0.1:1",)), "127.0.0.1:3", clock=FailOnce())
        with structlog.testing.capture_logs() as logs:
            campaign = asyncio.create_task(
                Supervisor(fatal).run("election", campaigner.campaign, RESTART))
            await asyncio.wait_for(Supervisor(fatal).run("lease", keeper.hold, RESTART), 10)
            deadline = time.monotonic() + 10
            while not any(e["event"] == "etcd_unreachable" for e in logs) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            campaign.cancel()
            with pytest.raises(asyncio.CancelledError):
                await campaign
        await campaigner.close()
        await keeper.close()
        return fatal.errors, logs

    errors, logs = asyncio.run(main())
    assert not errors
    assert len(crashes(logs, "election")) == 1 and len(crashes(logs, "lease")) == 1
    assert any(e["event"] == "etcd_unreachable" for e in logs)    # campaigning again
    assert any(e["event"] == "leadership_lost" for e in logs)     # the keeper's end
