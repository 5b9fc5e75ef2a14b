"""Property-based fuzzing of every decoder a client reaches, against running processes: a store
node's tcp data-port frames and its shm hand-off requests, the master's lookup-port frames,
and protobuf on every gRPC method. The invariant: the processes stay up, keep answering other
clients, and no stored byte changes (known objects are put first, hard-pinned so that no
fuzzed put may evict them, and read back with their checksums verified at the end).

Well-formed WRITEs, RESERVEs and SEALs into the real segment are fuzzed too: without the
master's grant (common/capabilities.py) the node refuses them. Another tenant names the known
keys in every form it can (tenants' namespaces, common/tenants.py). Not fuzzed here: KV events
(the bridge's fuzzing is in test_kv_events_malformed.py). Each property runs a bounded number
of examples.
"""

from __future__ import annotations

import socket
import struct
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpool.client import KVClient
from kvpool.common import tenants
from kvpool.net import lookup_port
from kvpool.net.data_port import HANDOFF_REQUEST, MAGIC, REQUEST, Op
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.protos.kvpool.v1 import master_pb2_grpc, routing_pb2_grpc
from kvpool.rpc.master_client import MasterClient

from .conftest import SessionSocket, channel_to, run_cluster

KNOWN = 12
examples: dict[str, int] = {}   # examples run per property (hypothesis may stop early)


def count(name: str) -> None:
    examples[name] = examples.get(name, 0) + 1
FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """A cluster holding KNOWN hard-pinned objects of known bytes; checked after all the
    module's fuzzing: every process up, every byte as it was, and the cluster still serving."""
    tmp = tmp_path_factory.mktemp("fuzz")
    gen = run_cluster(tmp)
    cluster = next(gen)
    rng = np.random.default_rng(15)
    values = {f"known/{i}": rng.integers(0, 256, 4096 + 977 * i, np.uint8).tobytes()
              for i in range(KNOWN)}
    with KVClient(cluster.master) as kv:
        for key, value in values.items():
            kv.put(key, value, pin=True)
        with MasterClient(cluster.master) as mc:
            views = mc.locate(list(values)).views()
    node = views[0].replicas[0].node
    host, _, port = node.tcp_endpoint.rpartition(":")
    yield SimpleNamespace(cluster=cluster, values=values, tcp=(host, int(port)),
                          shm=node.shm_endpoint, segment=views[0].replicas[0].extent.segment_id)
    assert cluster.master_proc.alive(), "the master died"
    assert all(n.alive() for n in cluster.nodes), "a store node died"
    assert sum(examples.values()) >= 5 * 100, examples   # each property ran its examples
    with KVClient(cluster.master) as kv:
        assert kv.batch_get(list(values), verify=True) == list(values.values())
        kv.put("after-fuzz", b"still serving")
        assert kv.get("after-fuzz") == b"still serving"
    with pytest.raises(StopIteration):   # stops the cluster, fails on a traceback in a log
        next(gen)


def exchange(sock: socket.socket, data: bytes, timeout_s: float = 0.5) -> None:
    """Send ``data``, end our side, read what comes back until the peer closes or goes quiet."""
    sock.settimeout(timeout_s)
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 20):
            pass
    except OSError:   # reset, timeout: the server chose to close or to wait; both are fine
        pass


def still_serving(fuzzed) -> None:
    with KVClient(fuzzed.cluster.master) as kv:
        key = next(iter(fuzzed.values))
        assert kv.get(key) == fuzzed.values[key]


# -- the store node's tcp data port ------------------------------------------------------------

_segment_ids = st.one_of(st.text(max_size=40).map(str.encode), st.binary(max_size=80))


@st.composite
def data_frames(draw, real_segment: str) -> bytes:
    """A frame: anything, or a request header with odd fields, the real segment's included
    (no frame here carries a grant: the node refuses every one that would touch a byte)."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    op = draw(st.sampled_from([Op.READ, Op.WRITE, Op.CONNECT_QP, Op.RESERVE, Op.SEAL, 0,
                               255]))
    real = draw(st.booleans())
    sid = real_segment.encode() if real else draw(_segment_ids)
    magic = MAGIC if draw(st.integers(0, 4)) else draw(st.binary(min_size=4, max_size=4))
    sid_len = len(sid) if draw(st.integers(0, 3)) else draw(st.integers(0, 65535))
    offset = draw(st.one_of(st.integers(0, 1 << 26), st.integers(0, (1 << 64) - 1)))
    length = draw(st.one_of(st.integers(0, 1 << 16), st.integers(0, (1 << 64) - 1)))
    if op == Op.READ and real and length > 1 << 20:
        length = 1 << 20   # a real read of up to 1 MiB: answered, and quick to drain
    frame = REQUEST.pack(magic, op, sid_len, offset, length) + sid
    return frame + draw(st.binary(max_size=64))


def test_fuzz_data_port_frames(fuzzed):
    @FUZZ
    @given(frames=st.lists(data_frames(fuzzed.segment), min_size=1, max_size=3))
    def run(frames):
        count("data")
        with socket.create_connection(fuzzed.tcp, timeout=5) as s:
            exchange(s, b"".join(frames))
    run()
    still_serving(fuzzed)


# -- the store node's shm hand-off -------------------------------------------------------------

@st.composite
def handoff_requests(draw, real_segment: str) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=120))
    sid = real_segment.encode() if draw(st.booleans()) else draw(_segment_ids)
    n = len(sid) if draw(st.integers(0, 3)) else draw(st.integers(0, 65535))
    return HANDOFF_REQUEST.pack(n) + sid + draw(st.binary(max_size=16))


def test_fuzz_shm_handoff(fuzzed):
    if not fuzzed.shm:
        pytest.skip("the node offers no shm hand-off")

    @FUZZ
    @given(request=handoff_requests(fuzzed.segment))
    def run(request):
        count("shm")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect("\0" + fuzzed.shm.lstrip("@\0"))
            exchange(s, request)   # an fd handed over is dropped with the unread message
    run()
    still_serving(fuzzed)


# -- the master's lookup port ------------------------------------------------------------------

def lookup_address(fuzzed) -> tuple[str, int]:
    channel = channel_to(fuzzed.cluster)
    with channel:
        port = master_pb2_grpc.MasterStub(channel).GetReplicas(
            pb.KeysRequest(keys=["probe"]), timeout=5).lookup_port
    if not port:
        pytest.skip("the master serves no lookup port")
    return fuzzed.cluster.master.rpartition(":")[0], port


@st.composite
def lookup_frames(draw) -> tuple[bytes, int, int | None, bytes] | bytes:
    """A frame for a session's connection: raw bytes (unsealed), or (magic, method, length
    or None for the sealed body's own, body) to seal under the session."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=200))
    method = draw(st.one_of(st.sampled_from(sorted(lookup_port.METHOD_NAMES)),
                            st.integers(0, 255)))
    body = draw(st.one_of(
        st.binary(max_size=200),
        st.builds(lambda k: pb.KeysRequest(keys=k).SerializeToString(),
                  st.lists(st.text(max_size=20), max_size=8)),
        st.builds(lambda k, s: pb.PutStartRequest(keys=k, sizes=s).SerializeToString(),
                  st.lists(st.text(min_size=1, max_size=20).map(lambda t: "fuzz/" + t),
                           max_size=4),
                  st.lists(st.integers(0, 1 << 40), max_size=4))))
    n = None if draw(st.integers(0, 3)) else draw(st.integers(0, (1 << 32) - 1))
    magic = lookup_port.MAGIC if draw(st.integers(0, 4)) else draw(
        st.binary(min_size=4, max_size=4))
    return magic, method, n, body


def test_fuzz_lookup_port_frames(fuzzed):
    """As an authenticated client: a session's connection, with frames sealed under it (the
    decoders past authentication) or not (what it refuses)."""
    address = lookup_address(fuzzed)
    with MasterClient(fuzzed.cluster.master, retries=0) as mc:
        session = mc.lookup_sessions(fuzzed.cluster.master)

    @FUZZ
    @given(frames=st.lists(lookup_frames(), min_size=1, max_size=3))
    def run(frames):
        count("lookup")
        with SessionSocket(fuzzed.cluster, address[1], session) as s:
            data = b""
            for frame in frames:
                if isinstance(frame, bytes):
                    data += frame
                    continue
                magic, method, n, body = frame
                sealed = s.frame(method, body, magic)
                if n is not None:   # a header whose length lies (the seal covers the truth)
                    sealed = struct.pack("!4sB3xI", magic, method, n) + sealed[12:]
                data += sealed
            exchange(s.sock, data)
    run()
    still_serving(fuzzed)


# -- tenants' namespaces -----------------------------------------------------------------------

def test_fuzz_a_tenants_keys_never_reach_anothers(fuzzed):
    """Another tenant names the known (default tenant's) keys every way it can, their stored
    forms included: none is found, and removing, pinning and putting them touches nothing (the
    module's end checks every known byte)."""
    mark = tenants.MARK
    named = st.one_of(st.sampled_from(sorted(fuzzed.values)), st.text(max_size=24))
    forms = named.flatmap(lambda k: st.sampled_from([
        k, mark + k, f"{mark}default{mark}{k}", f"{mark}{mark}{k}",
        f"{mark}fuzz-tenant{mark}{k}", tenants.scoped("default", mark + k)]))
    creds = str(fuzzed.cluster.credentials("client", "fuzz-tenant"))

    @FUZZ
    @given(keys=st.lists(forms, min_size=1, max_size=6, unique=True))
    def run(keys):
        count("tenant")
        assert mc.exists(keys) == [False] * len(keys)
        assert not mc.locate(keys).found().any()
        assert all(r is not None for r in mc.remove(keys))
        assert all(r is not None for r in mc.pin(keys))
        placed, _ = mc.put_start(keys, [64] * len(keys))
        mc.put_revoke([k for k, p in zip(keys, placed) if isinstance(p, tuple)])
    with MasterClient(fuzzed.cluster.master, timeout_s=5.0, retries=0,
                      credentials=creds) as mc:
        run()
    still_serving(fuzzed)


# -- protobuf on every gRPC method -------------------------------------------------------------

def _methods(module, service: str) -> list[tuple[str, bool]]:
    desc = module.DESCRIPTOR.services_by_name[service]
    return [(f"/{desc.full_name}/{m.name}", m.server_streaming) for m in desc.methods
            if not m.client_streaming]


METHODS = _methods(pb, "Master") + _methods(
    __import__("kvpool.protos.kvpool.v1.routing_pb2", fromlist=["x"]), "Router")
assert routing_pb2_grpc   # the Router service is fuzzed too (its unary methods)


def test_fuzz_grpc_protobuf(fuzzed):
    channel = channel_to(fuzzed.cluster)   # an authenticated client: past the role checks
    seen: set[grpc.StatusCode] = set()

    @FUZZ
    @given(method=st.sampled_from(METHODS), body=st.binary(max_size=300))
    def run(method, body):
        path, streaming = method
        count("grpc")
        ident = (lambda b: b)
        try:
            if streaming:
                for _ in channel.unary_stream(path, request_serializer=ident,
                                              response_deserializer=ident)(body, timeout=0.5):
                    pass
            else:
                channel.unary_unary(path, request_serializer=ident,
                                    response_deserializer=ident)(body, timeout=5)
        except grpc.RpcError as e:
            seen.add(e.code())
            # Typed: a client's mistake is never UNKNOWN (an unexpected error is INTERNAL,
            # a request cut by our timeout DEADLINE_EXCEEDED).
            assert e.code() != grpc.StatusCode.UNKNOWN, (path, body, e.details())
    with channel:
        run()
    assert grpc.StatusCode.INVALID_ARGUMENT in seen
    still_serving(fuzzed)
