"""`kvpool kv-events` survives any event an engine (or anyone on its ZMQ port) publishes: each
malformed batch or event is logged (a few lines a minute) and skipped, the bridge keeps
running and well-formed events after it still reach the router. Real processes: this test
publishes on a ZMQ XPUB socket; the bridge is the `kvpool kv-events` command."""

from __future__ import annotations

import subprocess
import sys
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpool.client.router import Candidate, RouterClient

BS = 16
MALFORMED = [
    [b"a string timestamp", [], 0],
    {"ts": "soon", "events": []},
    [1.0, [["BlockStored", [{"a map": "as a hash"}], None, list(range(BS)), BS, None, "GPU"]], 0],
    [1.0, [["BlockStored", [b"h"]]], 0],                                  # wrong arity
    [1.0, [["Teleported", [b"h"]]], 0],                                   # unknown tag
    [1.0, [["BlockStored", [b"h"], {"p": 1}, list(range(BS)), BS, None, "GPU"]], 0],
    [1.0, [["BlockStored", [b"h"], None, ["x"] * BS, BS, None, "GPU"]], 0],
    [1.0, [["BlockRemoved", 7, None]], 0],
    [1.0, 12, 0],
    "just a string",
    [None, [None], None],
]


@pytest.fixture
def bridge(cluster, tmp_path):
    """(publish(payload), the bridge process, its stderr path): a `kvpool kv-events` process
    subscribed to this test's XPUB socket, stopped after the test."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    err = tmp_path / "bridge.err"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool", "kv-events", "--master", cluster.master,
             "--endpoint", endpoint, "--instance-id", "vllm-0", "--block-size", str(BS),
             "--model", "m"], stdout=subprocess.PIPE, stderr=stderr, text=True)
    seq = iter(range(1 << 62))
    try:
        assert proc.stdout.readline().startswith("kv-events: vllm-0")
        assert pub.poll(20000), "the bridge never subscribed"
        pub.recv()

        def publish(payload: bytes) -> None:
            pub.send_multipart((b"", next(seq).to_bytes(8, "big"), payload))
        yield publish, proc, err
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        pub.close(linger=0)
        ctx.term()


def routed(cluster, tokens) -> dict:
    with RouterClient(cluster.master) as router:
        return router.route(token_ids=tokens, extra_keys={"model": "m"},
                            candidates=[Candidate("vllm-0")], policy="prefix_affinity").hits


def wait_for_gpu_hits(cluster, tokens, want, timeout_s=20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        got = routed(cluster, tokens)["gpu"]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def stored_batch(hash_: bytes, tokens: list[int]) -> bytes:
    return msgpack.packb([time.time(), [["BlockStored", [hash_], None, tokens, BS, None,
                                         "GPU"]], 0])


def test_malformed_events_are_skipped_and_the_bridge_goes_on(cluster, bridge):
    publish, proc, err = bridge
    for _ in range(50):   # each a few times: logged a few times, not 550
        for batch in MALFORMED:
            publish(msgpack.packb(batch))
        publish(b"\xc1 not msgpack")
    tokens = list(range(1000, 1000 + BS))
    publish(stored_batch(b"good", tokens))
    assert wait_for_gpu_hits(cluster, tokens, 1) == 1
    assert proc.poll() is None, "the bridge exited"
    log = err.read_text()
    assert "Traceback" not in log
    assert log.count("vllm_event_") <= 40, log.count("vllm_event_")


# Anything msgpack can carry, in the shapes of a batch and of an event.
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                  st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8))
_any = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20)
_event = st.one_of(_any, st.tuples(st.sampled_from(["BlockStored", "BlockRemoved",
                                                    "AllBlocksCleared", "x"]),
                                   st.lists(_any, max_size=8)).map(lambda t: [t[0], *t[1]]))
_batch = st.one_of(_any, st.tuples(_any, st.lists(_event, max_size=4), _any).map(list),
                   st.binary(max_size=64))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batches=st.lists(_batch, min_size=1, max_size=5))
def fuzz_batches(publish, batches):
    for b in batches:
        publish(b if isinstance(b, bytes) else msgpack.packb(b))


def test_fuzzed_events_never_stop_the_bridge(cluster, bridge):
    publish, proc, err = bridge
    fuzz_batches(publish)
    tokens = list(range(2000, 2000 + BS))
    publish(stored_batch(b"after-fuzz", tokens))
    assert wait_for_gpu_hits(cluster, tokens, 1) == 1
    assert proc.poll() is None, "the bridge exited"
    assert "Traceback" not in err.read_text()
