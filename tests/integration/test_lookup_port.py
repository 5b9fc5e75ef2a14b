"""The master's lookup port (net/lookup_port.py): a real master in this process, real sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest
from kvpool.common import pki, security
from kvpool.common.config import MasterConfig
from kvpool.common.errors import ClientClosed, InvalidArgument, MasterUnavailable
from kvpool.common.types import NodeEndpoints, SegmentInfo
from kvpool.master.server import MasterServer
from kvpool.master.servicer import MAX_BATCH
from kvpool.net import lookup_port
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.rpc.lookup import RETRY_AFTER_S, LookupChannel, LookupLost, Lookups
from kvpool.rpc.master_client import MasterClient, located


class CountCalls(grpc.aio.ServerInterceptor):
    """Counts the master's gRPC calls by method name."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    async def intercept_service(self, continuation, details):
        name = details.method.rsplit("/", 1)[-1]
        self.calls[name] = self.calls.get(name, 0) + 1
        return await continuation(details)


class Master:
    """A MasterServer on its own event-loop thread."""

    def __init__(self, port: int = 0, config: MasterConfig | None = None, **kw):
        self.counter = CountCalls()
        self.server = MasterServer(config or MasterConfig(), port=port,
                                   interceptors=[self.counter], **kw)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.address = self.run(self.server.start())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop(self) -> None:
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def master():
    m = Master()
    yield m
    m.stop()


def _store(mc: MasterClient, keys: list[str]) -> None:
    """Index ``keys`` (64 bytes each) in a segment no node backs: the master never reads it."""
    node = NodeEndpoints(node_id="n", boot_id="", tcp_endpoint="127.0.0.1:9")
    mc.mount_segment(node, SegmentInfo("n/0", 1 << 20))
    placed, _ = mc.put_start(keys, [64] * len(keys))
    assert not any(isinstance(p, Exception) for p in placed)
    assert not any(mc.put_end(keys))


def _columns(located) -> tuple:
    r = located.replicas
    return (located.statuses.tolist(), located.sizes.tolist(), located.versions.tolist(),
            r.offsets.tolist(), r.counts.tolist())


def test_lookups_go_to_the_lookup_port_once_a_grpc_answer_named_it(master):
    keys = [f"k{i}" for i in range(5)]
    with MasterClient(master.address) as mc:
        _store(mc, keys)
        first = mc.locate([*keys, "missing"])
        assert master.counter.calls["GetReplicas"] == 1
        assert mc._lookups.channel is not None
        again = mc.locate([*keys, "missing"])
        views = mc.locate(keys).views()
        assert master.counter.calls["GetReplicas"] == 1     # both over the lookup port
    assert _columns(again) == _columns(first)
    assert first.statuses.tolist()[-1] == pb.STATUS_NOT_FOUND
    assert [v.size for v in views] == [64] * 5


def test_a_packed_answer_says_what_the_repeated_fields_say(master):
    """KeysRequest.packed (the columns as arrays: how MasterClient.locate asks)."""
    keys = [f"k{i}" for i in range(200)]
    ask = [*reversed(keys), "missing", *keys[:3]]
    with MasterClient(master.address) as mc:
        _store(mc, keys)
        packed = mc.locate(ask)
        plain = located(ask, mc.locate_answer(ask))
        raw = mc._lookups.channel.call(lookup_port.GET_REPLICAS,
                                       pb.KeysRequest(keys=ask, packed=True),
                                       pb.GetReplicasResponse)
    assert not raw.statuses and not raw.replicas.offsets and raw.packed
    assert _columns(packed) == _columns(plain)
    assert packed.checksums.tolist() == plain.checksums.tolist()
    assert packed.replicas.location.tolist() == plain.replicas.location.tolist()
    assert packed.statuses.tolist().count(pb.STATUS_NOT_FOUND) == 1
    assert len(packed.replicas.grants) == len(plain.replicas.grants) == len(ask) - 1
    assert [v.replicas[0].extent for v in packed.views() if not isinstance(v, Exception)] \
        == [v.replicas[0].extent for v in plain.views() if not isinstance(v, Exception)]


def test_exists_goes_to_the_lookup_port_and_finds_it_by_itself(master):
    with MasterClient(master.address) as writer:
        _store(writer, ["a", "b"])
    with MasterClient(master.address) as mc:
        calls = dict(master.counter.calls)
        assert mc.exists(["a", "x", "b"]) == [True, False, True]   # gRPC; asks for the port
        assert mc.exists(["b", "y"]) == [True, False]              # the lookup port
        assert master.counter.calls["Exists"] == 1
        assert master.counter.calls["GetReplicas"] == calls.get("GetReplicas", 0) + 1


def test_put_calls_go_to_the_lookup_port_and_answer_as_grpc_does(master):
    with MasterClient(master.address) as mc:
        _store(mc, ["a"])   # PutStart over gRPC (then an empty GetReplicas names the port)
        assert master.counter.calls["PutStart"] == 1
        assert "PutEnd" not in master.counter.calls
        _store(mc, ["b", "c"])
        placed, timeout_s = mc.put_start(["b", "d", "e"], [64, 0, 64])
        assert timeout_s == MasterConfig().put_timeout_s
        assert [type(p).__name__ for p in placed[:2]] == ["AlreadyExists", "InvalidArgument"]
        assert placed[2][0].extent.length == 64
        assert mc.put_revoke(["e", "never"])[0] is None
        assert type(mc.put_revoke(["e"])[0]).__name__ == "NotPending"
        assert type(mc.put_end(["e"])[0]).__name__ == "NotPending"
        with pytest.raises(InvalidArgument, match="2 keys but 1 sizes"):
            mc._lookups.channel.call(lookup_port.PUT_START,
                                     pb.PutStartRequest(keys=["x", "y"], sizes=[1]),
                                     pb.PutStartResponse)
        assert master.counter.calls["PutStart"] == 1 and "PutEnd" not in master.counter.calls
        assert mc.exists(["a", "b", "c", "e"]) == [True, True, True, False]
    assert master.server._lookup.calls[lookup_port.PUT_START] == 3   # the refused one too


def test_a_batch_over_the_limit_is_invalid_on_the_lookup_port_too(master):
    with MasterClient(master.address) as mc:
        _store(mc, ["k"])
        mc.locate(["k"])
        with pytest.raises(InvalidArgument, match="limit"):
            mc.locate([f"x{i}" for i in range(MAX_BATCH + 1)])
        assert master.counter.calls["GetReplicas"] == 1   # refused there, not retried on gRPC
        assert mc.locate(["k"]).sizes.tolist() == [64]    # and the port still serves


def test_a_malformed_frame_is_answered_invalid_and_the_connection_closed(master):
    with socket.create_connection(("127.0.0.1", master.server._servicer.lookup_port), 5) as s:
        s.sendall(b"HTTP" + bytes(lookup_port.REQUEST.size - 4))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    status, length = lookup_port.RESPONSE.unpack(data[:lookup_port.RESPONSE.size])
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"malformed" in data[lookup_port.RESPONSE.size:] and len(data) == 8 + length


def test_a_spin_frame_is_not_answered_and_keeps_the_masters_loop_polling(master):
    """SPIN (net/lookup_port.py): a client about to copy a large put asks the master to keep
    polling; the frame has no answer, the call after it is answered in order, and a SPIN
    that is not one ends the connection as any malformed frame does."""
    spinner = master.server._lookup._spinner
    port = master.server._servicer.lookup_port
    spin = lookup_port.encode_request(lookup_port.SPIN, lookup_port.SPIN_BODY.pack(300_000))
    exists = lookup_port.encode_request(lookup_port.EXISTS,
                                        pb.KeysRequest(keys=["k"]).SerializeToString())
    with socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(spin)
        # Polled for MAX_SPIN_US (what was asked, capped), then not.
        held = master.run(_held(spinner))
        assert 0.8 * lookup_port.MAX_SPIN_US / 1e6 <= held < 1.0, held
        s.sendall(exists)
        head = s.recv(lookup_port.RESPONSE.size, socket.MSG_WAITALL)
        status, length = lookup_port.RESPONSE.unpack(head)
        body = s.recv(length, socket.MSG_WAITALL)
        assert status == 0 and list(pb.StatusesResponse.FromString(body).statuses) == \
            [pb.STATUS_NOT_FOUND]
        s.settimeout(0.2)
        with pytest.raises(TimeoutError):   # nothing else came: the SPIN had no answer
            s.recv(1)
        s.settimeout(5)
        s.sendall(lookup_port.encode_request(lookup_port.SPIN, b"\0\0\0"))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert lookup_port.RESPONSE.unpack(data[:lookup_port.RESPONSE.size])[0] == \
        grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"malformed SPIN" in data
    with MasterClient(master.address) as mc:   # and a client's spin is a hint, never an error
        mc.spin(0.001)
        mc.locate(["k"])
        mc.spin(0.001)
        assert mc.locate(["k"]).statuses.tolist() == [pb.STATUS_NOT_FOUND]


async def _held(spinner) -> float:
    """For how long ``spinner`` polls, from when it starts (within a second)."""
    end = time.perf_counter() + 1.0
    while not spinner.spinning and time.perf_counter() < end:
        await asyncio.sleep(0)
    started = time.perf_counter()
    while spinner.spinning:
        await asyncio.sleep(0.0005)
    return time.perf_counter() - started


def test_a_refusing_lookup_port_sends_lookups_back_to_grpc():
    m = Master(lookup_refusal=lambda: "master x does not lead")
    try:
        with MasterClient(m.address) as mc:
            _store(mc, ["k"])   # PutEnd: refused on the port it learned, then over gRPC
            assert m.counter.calls["PutEnd"] == 1
            before = m.counter.calls["GetReplicas"]
            for _ in range(3):
                assert mc.locate(["k"]).sizes.tolist() == [64]
            # Learned, refused (UNAVAILABLE), then left alone: every answer came over gRPC.
            assert m.counter.calls["GetReplicas"] == before + 3
            assert mc._lookups.channel is None
    finally:
        m.stop()


def test_a_master_without_a_lookup_port_is_asked_over_grpc():
    m = Master(lookup_port=None)
    try:
        with MasterClient(m.address) as mc:
            _store(mc, ["k"])
            mc.locate(["k"])
            assert mc._lookups.channel is None
    finally:
        m.stop()


def test_a_restarted_master_is_found_on_its_new_lookup_port():
    m = Master()
    port = int(m.address.rpartition(":")[2])
    with MasterClient(m.address) as mc:
        _store(mc, ["k"])
        mc.locate(["k"])
        old = mc._lookups.channel.target
        m.stop()
        m = Master(port=port)
        try:
            _store(mc, ["k"])
            assert mc.locate(["k"]).sizes.tolist() == [64]   # the old port: lost, then gRPC
            assert mc._lookups.channel is not None and mc._lookups.channel.target != old
            assert mc.locate(["k"]).sizes.tolist() == [64]
            assert m.counter.calls["GetReplicas"] == 1
        finally:
            m.stop()


def test_a_lookup_port_that_failed_is_left_alone_for_a_while():
    with socket.socket() as s:      # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    now = [0.0]
    lookups = Lookups(1.0, lambda code, message, what: InvalidArgument(message),
                      clock=lambda: now[0])
    assert lookups.wants_port("127.0.0.1:1234")
    lookups.learn("127.0.0.1:1234", dead)
    channel = lookups.channel
    assert isinstance(channel, LookupChannel)
    with pytest.raises(LookupLost):
        channel.call(lookup_port.GET_REPLICAS, pb.KeysRequest(keys=["k"]), pb.GetReplicasResponse)
    lookups.lost(channel)
    assert not lookups.wants_port("127.0.0.1:1234")
    lookups.learn("127.0.0.1:1234", dead)
    assert lookups.channel is None
    lookups.learn("127.0.0.1:1234", dead + 1)   # a new port (a restarted master): at once
    assert lookups.channel is not None
    lookups.learn("127.0.0.1:1234", 0)          # none
    assert lookups.channel is None and not lookups.wants_port("127.0.0.1:1234")
    assert lookups.wants_port("127.0.0.1:5678")  # another master
    lookups.learn("127.0.0.1:1234", dead)
    now[0] += RETRY_AFTER_S + 1
    assert lookups.wants_port("127.0.0.1:1234")  # the failed port, after a while
    lookups.learn("127.0.0.1:1234", dead)
    assert lookups.channel is not None
    lookups.close()


def test_a_master_restarted_on_the_same_lookup_port_is_asked_there_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        fixed = s.getsockname()[1]
    m = Master(lookup_port=fixed)
    port = int(m.address.rpartition(":")[2])
    with MasterClient(m.address) as mc:
        _store(mc, ["k"])
        mc.locate(["k"])
        mc.locate(["k"])    # a kept connection now
        m.stop()
        m = Master(port=port, lookup_port=fixed)
        try:
            _store(mc, ["k"])
            # The kept connection is dead: a new one, to the same port, without gRPC.
            assert mc.locate(["k"]).sizes.tolist() == [64]
            assert m.counter.calls.get("GetReplicas", 0) == 0
        finally:
            m.stop()


def _watch(mc: MasterClient, node_id: str, got: list, stop: threading.Event) -> threading.Thread:
    """A node's manifest watch, as store_node/node.py runs it, in a thread."""
    def run():
        while not stop.is_set():
            for seq, committed, removed, _ in mc.watch_manifest(node_id, 0.5):
                got.extend(r.key for r in committed)
                got.extend(f"-{k}" for k, _ in removed)
                if seq:
                    mc.ack_manifest(node_id, seq)
                if stop.is_set():
                    return
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("port", [True, False], ids=["lookup-port", "grpc"])
def test_a_nodes_manifest_stream_and_its_acks_go_by_the_lookup_port(port):
    m = Master(lookup_port=0 if port else None)
    stop, got = threading.Event(), []
    try:
        with MasterClient(m.address) as node, MasterClient(m.address) as mc:
            endpoints = NodeEndpoints(node_id="n", boot_id="", tcp_endpoint="127.0.0.1:9")
            node.mount_segment(endpoints, SegmentInfo("n/0", 1 << 20), keeps_manifest=True)
            watcher = _watch(node, "n", got, stop)
            for i in range(20):
                _store(mc, [f"k{i}"])   # each PutEnd waits for the node's acknowledgement
            assert mc.remove(["k0"]) == [None]
            assert got == [f"k{i}" for i in range(20)] + ["-k0"]
            assert m.server._servicer.manifest_lag()[1] == 0   # no wait ran out
            acks = m.counter.calls.get("AckManifest", 0)
            assert (acks == 0) if port else (acks >= 21)
            assert ("WatchManifest" in m.counter.calls) is not port
            stop.set()
            watcher.join(5)
    finally:
        m.stop()


@pytest.mark.parametrize("port", [True, False], ids=["lookup-port", "grpc"])
def test_a_manifest_stream_for_a_node_the_master_does_not_know_is_refused(port):
    m = Master(lookup_port=0 if port else None)
    try:
        with MasterClient(m.address) as node:
            with pytest.raises(MasterUnavailable, match="NOT_FOUND: node 'nobody' is not known"):
                list(node.watch_manifest("nobody", 1.0))
    finally:
        m.stop()


def test_route_goes_to_the_lookup_port_once_a_grpc_answer_named_it(master):
    from kvpool.client.router import Candidate, RouterClient
    from kvpool.common.hashing import HashSpec
    from kvpool.common.kv_events import BlockStored

    spec = HashSpec.of(16, model="m")
    prompt = list(range(64))
    with RouterClient(master.address) as router:
        router.register(spec)
        router.publish("b", [BlockStored(tuple(spec.hashes(prompt)[:3]))])
        idle = [Candidate("a"), Candidate("b")]
        answers = [router.route(token_ids=prompt, extra_keys={"model": "m"}, candidates=idle)
                   for _ in range(3)]
        assert master.counter.calls["Route"] == 1          # then twice on the port
        assert answers[0] == answers[1] == answers[2]
        assert answers[0].instance_id == "b" and answers[0].hits["gpu"] == 3
        with pytest.raises(InvalidArgument, match="not both"):
            router.route(token_ids=prompt, block_hashes=[b"x" * 32])
        assert master.counter.calls["Route"] == 1          # refused there, not asked again
    assert master.server._lookup.calls[lookup_port.ROUTE] == 3


def test_a_manifest_stream_ended_on_purpose_leaves_the_port_in_use_and_close_ends_it(master):
    with MasterClient(master.address) as node:
        endpoints = NodeEndpoints(node_id="n", boot_id="", tcp_endpoint="127.0.0.1:9")
        node.mount_segment(endpoints, SegmentInfo("n/0", 1 << 20), keeps_manifest=True)
        stream = node.watch_manifest("n", 30.0)
        assert next(stream)[0] == 0            # open, on the port
        node.end_watches()                     # a re-mount ends it: not a failed port
        with pytest.raises(MasterUnavailable, match="ended"):
            next(stream)
        assert node._lookups.channel is not None
        stream = node.watch_manifest("n", 30.0)
        assert next(stream)[0] == 0
        ended = threading.Thread(target=lambda: pytest.raises(ClientClosed, next, stream))
        ended.start()
    ended.join(5)
    assert not ended.is_alive()                # close() ended the stream at once
    assert "WatchManifest" not in master.counter.calls


def test_a_node_whose_stream_connection_drops_is_unwatched_at_once(master):
    """A node gone from its port stream (killed, partitioned) is no longer watched: its changes
    wait for its next stream, not for a dead one's acknowledgement."""
    with MasterClient(master.address) as node:
        endpoints = NodeEndpoints(node_id="n", boot_id="", tcp_endpoint="127.0.0.1:9")
        node.mount_segment(endpoints, SegmentInfo("n/0", 1 << 20), keeps_manifest=True)
        stream = node.watch_manifest("n", 30.0)
        assert next(stream)[0] == 0
        watchers = master.server._servicer._watchers
        assert "n" in watchers.unacked()              # watched on its open stream
        node._port_watches["n"].close()               # the connection drops, nothing sent
        deadline = time.monotonic() + 2.0
        while "n" in watchers.unacked():
            assert time.monotonic() < deadline, "the dead stream stayed watched"
            time.sleep(0.01)
        stream.close()


def test_a_session_that_ended_is_refused_and_its_client_opens_another_before(tmp_path):
    """A master with credentials seals its lookup port under sessions (net/lookup_port.py):
    a client renews its session before the master ends it, and a connection used past its
    session's end is refused there (the call is then answered over gRPC)."""
    ca = tmp_path / "ca"
    pki.make_ca(ca)
    m = Master(credentials=security.load(pki.issue(ca, "master", "m", hosts=("127.0.0.1",))),
               config=MasterConfig(lookup_session_ttl_s=2.0))
    try:
        with MasterClient(m.address, credentials=str(pki.issue(ca, "client", "default"))) \
                as mc:
            assert mc.exists(["k"]) == [False]   # learns the port
            assert mc.exists(["k"]) == [False]
            channel = mc._lookups.channel
            first, calls = channel._session, m.server._lookup.calls[lookup_port.EXISTS]
            assert first is not None and calls >= 1
            time.sleep(1.9)   # past the client's renewal (a tenth of the life before its end)
            assert mc.exists(["k"]) == [False]
            assert channel._session.session_id != first.session_id
            assert m.server._lookup.calls[lookup_port.EXISTS] == calls + 1
            # A connection kept past its session's end (as if the client had not renewed).
            [conn] = channel._idle
            conn.renew_at = float("inf")
            grpc_calls = m.counter.calls.get("Exists", 0)
            time.sleep(2.1)
            assert mc.exists(["k"]) == [False]
            assert m.counter.calls.get("Exists", 0) == grpc_calls + 1
            assert m.server._lookup.calls[lookup_port.EXISTS] == calls + 1
    finally:
        m.stop()
