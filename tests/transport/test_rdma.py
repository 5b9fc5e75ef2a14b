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
from kvpool.net.data_port import RESPONSE, RKEY, FrameStatus, Op, encode_request
from kvpool.net.rdma_probe import unavailable_reason
from kvpool.net.sockets import recv_exact

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
    """100 objects read over rdma cost the node's data server no READ: it registers a region
    per object (RKEY_READ, asked for ten at a time here, one batch per call) and moves no
    byte itself."""
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
    moved = {op: after.get(op, 0) - before.get(op, 0) for op in after}
    assert {op: n for op, n in moved.items() if n} == {"RKEY_READ": 100}, (before, after)
    # the counter does count: the same reads over tcp are 100 requests
    tcp = make_transport_of("tcp")
    assert tcp.read([IoOp(r, memoryview(o)) for r, o in zip(replicas, outs)]) == [None] * 100
    assert node.request_counts().get("READ", 0) - before.get("READ", 0) == 100


def _region(rdma, replica, op: Op) -> tuple[int, int]:
    """Ask the node for a region over ``replica``'s extent, as any client may."""
    link = rdma._link(replica.node.tcp_endpoint)
    e = replica.extent
    link.sock.sendall(encode_request(op, e.segment_id, e.offset, e.length, replica.grant))
    status, length = RESPONSE.unpack(recv_exact(link.sock, RESPONSE.size))
    assert (status, length) == (FrameStatus.OK, RKEY.size)
    return RKEY.unpack(recv_exact(link.sock, RKEY.size))


def _post(rdma, endpoint: str, opcode: int, addr: int, rkey: int, length: int) -> int:
    """One RDMA op posted by hand at (addr, rkey), as a client forging its descriptor would;
    its completion status (a refused op breaks the queue pair: the next call makes a new
    one)."""
    from kvpool.net import verbs
    link = rdma._link(endpoint)
    stage = verbs.buffer_address(rdma._stage)
    verbs.post_rdma(link.qp, 0, opcode, stage, length, rdma._stage_mr.lkey, addr, rkey)
    statuses, fatal = rdma._wait(link, 1)
    assert fatal is None, fatal
    if statuses[0] != verbs.SUCCESS:
        rdma._drop(link, "refused, as the test meant")
    return statuses[0]


def test_a_region_reaches_only_the_extent_it_was_granted_for(rdma, node):
    """The rkey a client gets reaches exactly its extent, that way only: bytes beside it, a
    write through a read region, and the segment's own rkey are refused by the device."""
    from kvpool.net import verbs
    data = random.Random(5).randbytes(8192)
    assert rdma.write([IoOp(node.replica(0, 0, 8192), memoryview(data))]) == [None]
    endpoint = node.node.tcp_endpoint
    with rdma._lock:
        addr, rkey = _region(rdma, node.replica(0, 4096, 64), Op.RKEY_READ)
        assert _post(rdma, endpoint, verbs.RDMA_READ, addr, rkey, 64) == verbs.SUCCESS
        assert bytes(rdma._stage[:64]) == data[4096:4160]
        refusals = verbs.REMOTE_REFUSALS
        for where, n in ((addr + 64, 64), (addr - 64, 64), (addr, 65), (addr + 32, 64)):
            assert _post(rdma, endpoint, verbs.RDMA_READ, where, rkey, n) in refusals, where
        addr, rkey = _region(rdma, node.replica(0, 4096, 64), Op.RKEY_READ)
        assert _post(rdma, endpoint, verbs.RDMA_WRITE, addr, rkey, 64) in refusals
        whole = node.replica(0, 0, 64)
        assert _post(rdma, endpoint, verbs.RDMA_READ, whole.rdma_addr, whole.rdma_rkey, 64) \
            in refusals
    out = bytearray(8192)
    assert rdma.read([IoOp(node.replica(0, 0, 8192), memoryview(out))]) == [None]
    assert out == data   # nothing written through any of it


def test_re_reads_go_through_the_regions_kept_and_a_lost_one_is_asked_for_again(rdma, node):
    """A read of extents read before goes through the regions the node registered then: no
    RKEY_READ, and the bytes the extents hold now (written since). A kept region the device
    refuses (here: its rkey replaced by the segment's own, which reaches nothing) is asked for
    again on a new queue pair, and the read still returns the right bytes."""
    rng = random.Random(12)
    replicas = [node.replica(1, 1 * MiB + i * 8192, 4096 + i) for i in range(10)]
    outs = [bytearray(r.extent.length) for r in replicas]

    def write_then_read(payloads: list[bytes]) -> list[bytes]:
        assert rdma.write([IoOp(r, memoryview(p)) for r, p in zip(replicas, payloads)]) \
            == [None] * 10
        assert rdma.read([IoOp(r, memoryview(o)) for r, o in zip(replicas, outs)]) \
            == [None] * 10
        assert [bytes(o) for o in outs] == payloads
        return payloads

    write_then_read([rng.randbytes(r.extent.length) for r in replicas])
    before = node.request_counts()
    payloads = write_then_read([rng.randbytes(r.extent.length) for r in replicas])
    after = node.request_counts()
    assert after.get("RKEY_READ", 0) == before.get("RKEY_READ", 0)
    assert after.get("RKEY_WRITE", 0) - before.get("RKEY_WRITE", 0) == 10

    link = rdma._link(node.node.tcp_endpoint)
    e = replicas[3].extent
    addr, _, expiry_s, sequence = link.read_regions._kept[(e.segment_id, e.offset, e.length)]
    link.read_regions._kept[(e.segment_id, e.offset, e.length)] = (
        addr, replicas[3].rdma_rkey, expiry_s, sequence)
    outs = [bytearray(r.extent.length) for r in replicas]
    assert rdma.read([IoOp(r, memoryview(o)) for r, o in zip(replicas, outs)]) == [None] * 10
    assert [bytes(o) for o in outs] == payloads
    again = node.request_counts()
    assert again.get("RKEY_READ", 0) - after.get("RKEY_READ", 0) >= 1


def test_an_extent_outside_the_segment_gets_no_region(rdma, node):
    """A descriptor that claims more than the segment holds: the node registers nothing past
    it (OUT_OF_BOUNDS, a typed refusal), and keeps serving."""
    size = node.segments[0].size_bytes
    good = node.replica(0, 0, 4096)
    past = dataclasses.replace(good, extent=dataclasses.replace(good.extent, offset=size),
                               rdma_length=2 * size)
    out = bytearray(4096)
    results = rdma.read([IoOp(good, memoryview(bytearray(4096))), IoOp(past, memoryview(out))])
    assert results[0] is None and isinstance(results[1], SegmentBoundsError), results
    assert isinstance(rdma.write([IoOp(past, memoryview(bytes(4096)))])[0], SegmentBoundsError)
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
