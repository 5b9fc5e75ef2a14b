"""What only the rdma transport promises, against a real node process on soft-RoCE.

Runs for real in the VM (``bash scripts/softroce/test.sh``); skips elsewhere, saying why.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import threading
import time

import pytest
from kvpool.client.transport.base import IoOp
from kvpool.common.errors import SegmentBoundsError, TransportError
from kvpool.net.rdma_probe import unavailable_reason

pytestmark = pytest.mark.rdma
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _needs_rdma():
    if reason := unavailable_reason():
        pytest.skip(f"rdma: {reason} (run bash scripts/softroce/test.sh)")


@pytest.fixture
def rdma(make_transport_of):
    return make_transport_of("rdma")


@pytest.fixture
def make_transport_of():
    from kvpool.client.transport.registry import create_transports
    made = []

    def make(scheme: str, **options):
        (t,) = create_transports([scheme], options={scheme: options} if options else None)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def test_reads_are_one_sided(rdma, make_transport_of, node):
    """100 objects read over rdma cost the node's data server zero requests."""
    rng = random.Random(11)
    replicas = [node.replica(i % 2, i * 8192, 4096 + i) for i in range(100)]
    payloads = [rng.randbytes(r.extent.length) for r in replicas]
    assert rdma.write([IoOp(r, memoryview(p)) for r, p in zip(replicas, payloads)]) \
        == [None] * 100
    before = node.request_counts()
    outs = [bytearray(r.extent.length) for r in replicas]
    for i in range(0, 100, 10):   # several batches: the queue pair is reused, not re-made
        assert rdma.read([IoOp(r, memoryview(o)) for r, o in
                          zip(replicas[i:i + 10], outs[i:i + 10])]) == [None] * 10
    after = node.request_counts()
    assert [bytes(o) for o in outs] == payloads
    assert after == before, (before, after)
    # the counter does count: the same reads over tcp are 100 requests
    tcp = make_transport_of("tcp")
    assert tcp.read([IoOp(r, memoryview(o)) for r, o in zip(replicas, outs)]) == [None] * 100
    assert node.request_counts().get("READ", 0) - before.get("READ", 0) == 100


def test_wrong_rkey_is_a_typed_refusal_and_the_node_keeps_serving(rdma, node):
    good = node.replica(0, 0, 64)
    bad = dataclasses.replace(good, rdma_rkey=good.rdma_rkey ^ 0x5A5A00)
    data = bytes(range(64))
    results = rdma.write([IoOp(good, memoryview(data)), IoOp(bad, memoryview(data)),
                          IoOp(node.replica(1, 0, 64), memoryview(data))])
    assert results[0] is None and results[2] is None, results
    assert isinstance(results[1], SegmentBoundsError), results
    out = bytearray(64)
    assert isinstance(rdma.read([IoOp(bad, memoryview(out))])[0], SegmentBoundsError)
    assert rdma.read([IoOp(good, memoryview(out))]) == [None] and out == data


def test_address_outside_the_region_is_a_typed_refusal(rdma, node):
    size = node.segments[0].size_bytes
    good = node.replica(0, 0, 4096)
    # A descriptor whose base address lies past the region: the client cannot tell, the
    # node's device refuses it.
    shifted = dataclasses.replace(good, rdma_addr=good.rdma_addr + size)
    below = dataclasses.replace(good, rdma_addr=good.rdma_addr - 2 * 4096)
    for bad in (shifted, below):
        out = bytearray(4096)
        results = rdma.read([IoOp(good, memoryview(bytearray(4096))), IoOp(bad, memoryview(out))])
        assert results[0] is None and isinstance(results[1], SegmentBoundsError), results
        assert isinstance(rdma.write([IoOp(bad, memoryview(bytes(4096)))])[0],
                          SegmentBoundsError)
    data = b"still serving"
    replica = node.replica(0, 0, len(data))
    assert rdma.write([IoOp(replica, memoryview(data))]) == [None]
    out = bytearray(len(data))
    assert rdma.read([IoOp(replica, memoryview(out))]) == [None] and out == data


def test_node_killed_mid_read_fails_fast_and_never_returns_wrong_bytes(make_transport_of,
                                                                       fresh_node):
    rdma = make_transport_of("rdma", timeout_s=20.0)
    size = fresh_node.segments[0].size_bytes
    data = random.Random(3).randbytes(size)
    assert rdma.write([IoOp(fresh_node.replica(0, 0, size), memoryview(data))]) == [None]
    replicas = [fresh_node.replica(0, 0, size)] * 12     # ~100 MiB of reads: ~1 s emulated
    outs = [bytearray(size) for _ in replicas]
    killer = threading.Timer(0.3, fresh_node.kill, args=(signal.SIGKILL,))
    killer.start()
    start = time.monotonic()
    results = rdma.read([IoOp(r, memoryview(o)) for r, o in zip(replicas, outs)])
    elapsed = time.monotonic() - start
    killer.join()
    assert elapsed < 10.0
    assert any(isinstance(r, TransportError) for r in results), "the kill came too late"
    for result, out in zip(results, outs):
        assert result is None or (isinstance(result, TransportError)
                                  and not isinstance(result, SegmentBoundsError)), result
        if result is None:
            assert out == data
    after = rdma.read([IoOp(replicas[0], memoryview(outs[0]))])
    assert isinstance(after[0], TransportError)


def test_registered_buffers_move_in_place(rdma, node):
    import numpy as np
    arena = np.zeros(4 * MiB, dtype=np.uint8)
    rdma.register_buffer(arena)
    rdma.register_buffer(arena)   # idempotent
    src = arena[:MiB]
    src[:] = np.frombuffer(random.Random(8).randbytes(MiB), dtype=np.uint8)
    replica = node.replica(1, 0, MiB)
    assert rdma.write([IoOp(replica, memoryview(src))]) == [None]
    dst = arena[2 * MiB:3 * MiB]
    assert rdma.read([IoOp(replica, memoryview(dst))]) == [None]
    assert np.array_equal(src, dst)
    rdma.unregister_buffer(arena)
    dst[:] = 0
    assert rdma.read([IoOp(replica, memoryview(dst))]) == [None]   # staged now
    assert np.array_equal(src, dst)
