"""The transport contract, run over every transport against a real node in another process."""

from __future__ import annotations

import random
import signal
import threading
import time
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from kvpool.client.transport.base import IoOp, Transport
from kvpool.common.checksum import checksum
from kvpool.common.errors import (
    ClientClosed,
    InvalidArgument,
    SegmentBoundsError,
    TransportError,
)
from kvpool.common.types import Extent, NodeEndpoints, Replica

MiB = 1 << 20


def ok(results) -> None:
    assert results == [None] * len(results), results


def is_bounds(result) -> bool:
    return isinstance(result, SegmentBoundsError)


def is_failure(result) -> bool:
    """A transport failure, not a refusal: the client should try another replica."""
    return isinstance(result, TransportError) and not isinstance(result, SegmentBoundsError)


def roundtrip(transport, replica: Replica, data: bytes) -> bytes:
    ok(transport.write([IoOp(replica, memoryview(data))]))
    out = bytearray(len(data))
    ok(transport.read([IoOp(replica, memoryview(out))]))
    return bytes(out)


def test_can_reach_its_node(transport, node):
    assert transport.can_reach(node.node)


@pytest.mark.parametrize("length", [1, 2, 7, 4096, 65537, 1 * MiB + 3])
def test_write_then_read_back(transport, node, length):
    rng = random.Random(length)
    size = node.segments[0].size_bytes
    for offset in (0, size - length, rng.randrange(0, size - length)):
        data = rng.randbytes(length)
        assert roundtrip(transport, node.replica(0, offset, length), data) == data


def test_whole_segment(transport, node):
    size = node.segments[1].size_bytes
    data = random.Random(1).randbytes(size)
    assert roundtrip(transport, node.replica(1, 0, size), data) == data


def test_random_sizes_and_offsets(transport, node):
    rng = random.Random(7)
    for _ in range(40):
        seg = rng.randrange(2)
        size = node.segments[seg].size_bytes
        length = rng.choice([1, rng.randrange(1, 4096), rng.randrange(1, 512 * 1024)])
        offset = rng.randrange(0, size - length + 1)
        data = rng.randbytes(length)
        assert roundtrip(transport, node.replica(seg, offset, length), data) == data


def test_batched_ops_across_both_segments(transport, node):
    rng = random.Random(3)
    ops, expected = [], []
    for i in range(300):   # non-overlapping, interleaved across segments: exercises pipelining
        seg, slot = i % 2, i // 2
        length = rng.randrange(1, 20_000)
        data = rng.randbytes(length)
        ops.append((node.replica(seg, slot * 20_000, length), data))
        expected.append(data)
    ok(transport.write([IoOp(r, memoryview(d)) for r, d in ops]))
    outs = [bytearray(len(d)) for d in expected]
    ok(transport.read([IoOp(r, memoryview(o)) for (r, _), o in zip(ops, outs)]))
    assert [bytes(o) for o in outs] == expected


def test_empty_batch_and_zero_length_ops(transport, node):
    assert transport.read([]) == []
    assert transport.write([]) == []
    size = node.segments[0].size_bytes
    for offset in (0, size):   # an empty range at the very end is still inside the segment
        replica = node.replica(0, offset, 0)
        ok(transport.write([IoOp(replica, memoryview(b""))]))
        ok(transport.read([IoOp(replica, memoryview(bytearray()))]))


def test_read_into_buffer_kinds(transport, node):
    data = random.Random(5).randbytes(64 * 1024)
    replica = node.replica(0, 4096, len(data))
    ok(transport.write([IoOp(replica, memoryview(data))]))

    into_bytearray = bytearray(len(data))
    into_numpy_bytes = np.zeros(len(data), dtype=np.uint8)
    into_numpy_f32 = np.zeros(len(data) // 4, dtype=np.float32)
    big = bytearray(b"\xaa" * (len(data) + 200))
    ok(transport.read([
        IoOp(replica, memoryview(into_bytearray)),
        IoOp(replica, memoryview(into_numpy_bytes)),
        IoOp(replica, memoryview(into_numpy_f32).cast("B")),
        IoOp(replica, memoryview(big)[100:100 + len(data)]),
    ]))
    assert into_bytearray == data
    assert into_numpy_bytes.tobytes() == data
    assert into_numpy_f32.tobytes() == data
    assert big[100:100 + len(data)] == data
    assert big[:100] == b"\xaa" * 100 and big[100 + len(data):] == b"\xaa" * 100


def test_write_from_numpy_and_slices(transport, node):
    arr = np.arange(8192, dtype=np.float32)
    replica = node.replica(1, 1000, arr.nbytes)
    ok(transport.write([IoOp(replica, memoryview(arr))]))   # non-"B" format: cast by the transport
    back = np.empty_like(arr)
    ok(transport.read([IoOp(replica, memoryview(back))]))
    np.testing.assert_array_equal(back, arr)


def test_buffer_of_wrong_size_is_refused_before_io(transport, node):
    with pytest.raises(InvalidArgument):
        transport.read([IoOp(node.replica(0, 0, 10), memoryview(bytearray(9)))])
    with pytest.raises(InvalidArgument):
        transport.read([IoOp(node.replica(0, 0, 4), memoryview(b"abcd"))])   # read-only
    with pytest.raises(InvalidArgument):
        transport.write([IoOp(node.replica(0, 0, 5), memoryview(bytearray(10))[::2])])


@pytest.mark.parametrize("offset_from_end, length", [(0, 1), (1, 2), (-1, 0), (100, 4096)])
def test_out_of_bounds_is_refused_and_node_keeps_serving(transport, node, offset_from_end,
                                                         length):
    size = node.segments[0].size_bytes
    offset = size - offset_from_end if offset_from_end >= 0 else size + 1
    bad = node.replica(0, offset, length)
    assert is_bounds(transport.read([IoOp(bad, memoryview(bytearray(length)))])[0])
    assert is_bounds(transport.write([IoOp(bad, memoryview(bytes(length)))])[0])
    data = b"still serving"
    assert roundtrip(transport, node.replica(0, 0, len(data)), data) == data


def test_unknown_segment_is_refused_and_node_keeps_serving(transport, node):
    ghost = Replica(node.node, Extent("test-node/9-deadbeef", 0, 16))
    assert is_bounds(transport.read([IoOp(ghost, memoryview(bytearray(16)))])[0])
    assert is_bounds(transport.write([IoOp(ghost, memoryview(bytes(16)))])[0])
    data = b"still serving"
    assert roundtrip(transport, node.replica(1, 0, len(data)), data) == data


def test_refusals_inside_a_batch_fail_only_their_ops(transport, node):
    size = node.segments[0].size_bytes
    ghost = Replica(node.node, Extent("no-such-segment", 0, 8))
    good = [node.replica(i % 2, 100_000 + i * 64, 8) for i in range(4)]
    replicas = [good[0], node.replica(0, size - 4, 8), good[1], ghost, good[2],
                node.replica(1, size, 8), good[3]]
    payloads = [bytes([i]) * 8 for i in range(len(replicas))]
    results = transport.write([IoOp(r, memoryview(p)) for r, p in zip(replicas, payloads)])
    assert [r is None for r in results] == [True, False, True, False, True, False, True], results
    assert all(is_bounds(r) for r in results if r is not None)
    outs = [bytearray(8) for _ in replicas]
    results = transport.read([IoOp(r, memoryview(o)) for r, o in zip(replicas, outs)])
    assert [r is None for r in results] == [True, False, True, False, True, False, True], results
    for i in (0, 2, 4, 6):
        assert outs[i] == payloads[i]


def test_concurrent_threads(transport, node):
    errors: list[BaseException] = []
    slot = 256 * 1024

    def worker(k: int) -> None:
        rng = random.Random(k)
        try:
            for _ in range(25):
                seg = k % 2
                length = rng.randrange(1, slot)
                replica = node.replica(seg, (k // 2) * slot * 2, length)
                data = rng.randbytes(length)
                other = node.replica(1 - seg, (k // 2) * slot * 2 + slot, 64)
                # a batch spanning both segments, from several threads at once
                ok(transport.write([IoOp(replica, memoryview(data)),
                                    IoOp(other, memoryview(data[:64].ljust(64, b"\0")))]))
                out = bytearray(length)
                ok(transport.read([IoOp(replica, memoryview(out))]))
                assert out == data
        except BaseException as exc:   # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_closed_transport_refuses_use(make_transport, node):
    transport = make_transport()
    assert roundtrip(transport, node.replica(0, 0, 3), b"abc") == b"abc"
    transport.close()
    transport.close()   # idempotent
    with pytest.raises(ClientClosed):
        transport.read([IoOp(node.replica(0, 0, 3), memoryview(bytearray(3)))])
    out = np.zeros(3, dtype=np.uint8)
    with pytest.raises(ClientClosed):
        transport.read_at([node.replica(0, 0, 0)], np.zeros(1, np.int64),
                          np.zeros(1, np.uint64), np.full(1, 3, np.uint64),
                          np.array([out.ctypes.data], dtype=np.uint64))


# -- the fast paths: each transport's own, and Transport's defaults run on every transport --

@pytest.fixture(params=["own", "default"])
def fast(request, transport):
    """``transport``'s fast paths as it implements them, or Transport's default
    implementations run on it: a default is exercised for real even where it is overridden."""
    if request.param == "own":
        return transport
    return SimpleNamespace(**{name: partial(getattr(Transport, name), transport)
                              for name in ("write_summed", "read_at")})


def test_write_summed_lands_the_bytes_and_returns_each_ops_crc(fast, transport, node):
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, size=(4, 20_000), dtype=np.uint8)
    odd = rng.integers(0, 256, size=1001, dtype=np.uint8)
    replicas = [node.replica(k % 2, 300_000 + k * 20_000, 20_000) for k in range(4)]
    bad = node.replica(0, node.segments[0].size_bytes, 1001)
    twice = [node.replica(0, 500_000, 1001), node.replica(1, 500_000, 1001)]  # one value, 2 copies
    errors, sums = fast.write_summed([*(IoOp(r, memoryview(row)) for r, row in zip(replicas, src)),
                                      IoOp(bad, memoryview(odd)),
                                      *(IoOp(r, memoryview(odd)) for r in twice)])
    assert errors[:4] + errors[5:] == [None] * 6 and is_bounds(errors[4]) and sums[4] is None
    assert sums[:4] + sums[5:] == [checksum(row) for row in src] + [checksum(odd)] * 2
    for r, data in [*zip(replicas, src), *((r, odd) for r in twice)]:
        out = np.zeros_like(data)
        ok(transport.read([IoOp(r, memoryview(out))]))
        assert np.array_equal(out, data)


def addresses(views) -> np.ndarray:
    return np.array([np.frombuffer(v, dtype=np.uint8).ctypes.data for v in views], np.uint64)


def test_read_at_moves_the_same_bytes_as_read(fast, transport, node):
    rng = np.random.default_rng(11)
    block = 4096
    src = rng.integers(0, 256, size=(7, block), dtype=np.uint8)
    # Runs in segment 0 (0-2; 3; 4-5, the second buffer apart), one extent in segment 1.
    where = [(0, 0), (0, block), (0, 2 * block), (0, 7 * block), (0, 5 * block),
             (0, 6 * block), (1, 3 * block)]
    replicas = [node.replica(seg, off, block) for seg, off in where]
    ok(transport.write([IoOp(r, memoryview(row)) for r, row in zip(replicas, src)]))
    dst, apart = np.zeros_like(src), np.zeros(block, dtype=np.uint8)
    views = [dst[0], apart, *dst[2:]]
    failed = fast.read_at([node.replica(0, 0, 0), node.replica(1, 0, 0)],
                          np.array([seg for seg, _ in where]),
                          np.array([off for _, off in where], dtype=np.uint64),
                          np.full(len(where), block, dtype=np.uint64), addresses(views))
    assert failed == {}
    assert np.array_equal(apart, src[1]) and np.array_equal(np.delete(dst, 1, 0),
                                                            np.delete(src, 1, 0))
    assert fast.read_at([], np.zeros(0, np.int64), *[np.zeros(0, np.uint64)] * 3) == {}


def test_read_at_reports_the_extents_that_failed(fast, transport, node):
    """An extent outside its segment fails (with its segment's others, at most); the
    extents of another segment arrive."""
    data = bytes(range(256)) * 16
    good = node.replica(1, 8192, len(data))
    ok(transport.write([IoOp(good, memoryview(data))]))
    size = node.segments[0].size_bytes
    outs = [np.zeros(len(data), dtype=np.uint8) for _ in range(3)]
    failed = fast.read_at([node.replica(0, 0, 0), node.replica(1, 0, 0)], np.array([0, 1, 1]),
                          np.array([size - 8, 8192, 8192], dtype=np.uint64),
                          np.full(3, len(data), dtype=np.uint64), addresses(outs))
    assert list(failed) == [0] and is_bounds(failed[0])
    assert outs[1].tobytes() == outs[2].tobytes() == data


def test_registered_buffers_are_read_and_written_in_place(transport, node):
    arena = np.zeros(4 * 8192, dtype=np.uint8)
    transport.register_buffer(arena)
    try:
        src = np.random.default_rng(2).integers(0, 256, size=8192, dtype=np.uint8)
        arena[:8192] = src
        replica = node.replica(0, 40_000, 8192)
        ok(transport.write([IoOp(replica, memoryview(arena[:8192]))]))
        ok(transport.read([IoOp(replica, memoryview(arena[8192:16384]))]))
        assert np.array_equal(arena[8192:16384], src)
    finally:
        transport.unregister_buffer(arena)
    transport.unregister_buffer(arena)   # not registered any more: a no-op
    assert roundtrip(transport, node.replica(0, 0, 4), b"more") == b"more"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_dead_node_fails_ops_instead_of_hanging(make_transport, fresh_node, sig):
    transport = make_transport(timeout_s=5.0)
    data = b"x" * 4096
    # establish connections / mappings to both segments first
    assert roundtrip(transport, fresh_node.replica(0, 0, len(data)), data) == data
    assert roundtrip(transport, fresh_node.replica(1, 0, len(data)), data) == data
    fresh_node.kill(sig)

    start = time.monotonic()
    outs = [bytearray(b"\x55" * len(data)) for _ in range(3)]
    replicas = [fresh_node.replica(0, 0, len(data)), fresh_node.replica(1, 0, len(data)),
                fresh_node.replica(0, 8192, len(data))]
    results = transport.read([IoOp(r, memoryview(o)) for r, o in zip(replicas, outs)])
    assert all(is_failure(r) for r in results), results
    results = transport.write([IoOp(r, memoryview(data)) for r in replicas])
    assert all(is_failure(r) for r in results), results
    assert time.monotonic() - start < 3.0
    # and it keeps failing (no stale connection or mapping brings the dead node back)
    assert is_failure(transport.read([IoOp(replicas[0], memoryview(outs[0]))])[0])


def test_hung_node_times_out(make_transport, fresh_node):
    transport = make_transport(timeout_s=0.5)
    fresh_node.kill(signal.SIGSTOP)
    try:
        start = time.monotonic()
        results = transport.read([IoOp(fresh_node.replica(0, 0, 16), memoryview(bytearray(16)))])
        assert is_failure(results[0]), results
        assert time.monotonic() - start < 5.0
    finally:
        fresh_node.kill(signal.SIGCONT)


def test_unreachable_endpoint_fails_with_transport_error(transport, scheme, node):
    import socket
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = NodeEndpoints(node_id="gone", boot_id=node.node.boot_id,
                         tcp_endpoint=f"127.0.0.1:{port}", shm_endpoint="kvpool-nobody-here")
    results = transport.read([IoOp(Replica(dead, Extent("gone/0-x", 0, 8)),
                                   memoryview(bytearray(8)))])
    assert is_failure(results[0]), results
