"""shm copies a run of adjacent ops (extents back to back in a segment, buffers back to back in
memory) as one memcpy: the bytes must land exactly as if copied op by op."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
from kvpool.client.transport import shm
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.shm import SHMTransport
from kvpool.common.checksum import checksum
from kvpool.common.errors import SegmentBoundsError

BLOCK = 4096


def test_adjacent_and_scattered_ops_move_the_right_bytes(node):
    transport = SHMTransport()
    try:
        rng = np.random.default_rng(7)
        src = rng.integers(0, 256, size=(8, BLOCK), dtype=np.uint8)
        # Blocks 0-3 back to back (one run), then 4-7 at scattered offsets, out of order.
        offsets = [0, BLOCK, 2 * BLOCK, 3 * BLOCK, 9 * BLOCK, 5 * BLOCK, 7 * BLOCK, 20 * BLOCK]
        replicas = [node.replica(0, off, BLOCK) for off in offsets]
        assert transport.write([IoOp(r, memoryview(row)) for r, row in zip(replicas, src)]) \
            == [None] * 8
        dst = np.zeros_like(src)                       # rows back to back: one buffer
        assert transport.read([IoOp(r, memoryview(row)) for r, row in zip(replicas, dst)]) \
            == [None] * 8
        assert np.array_equal(dst, src)
        # Extents back to back but buffers not: must not be merged.
        apart = [bytearray(BLOCK) for _ in range(4)]
        assert transport.read([IoOp(r, memoryview(b)) for r, b in zip(replicas[:4], apart)]) \
            == [None] * 4
        assert [bytes(b) for b in apart] == [row.tobytes() for row in src[:4]]
        # Buffers back to back but extents in reverse order: must not be merged either.
        rev = np.zeros((2, BLOCK), dtype=np.uint8)
        assert transport.read([IoOp(replicas[1], memoryview(rev[0])),
                               IoOp(replicas[0], memoryview(rev[1]))]) == [None, None]
        assert np.array_equal(rev, src[[1, 0]])
    finally:
        transport.close()


def test_a_refused_op_inside_a_run_fails_alone(node):
    transport = SHMTransport()
    try:
        dst = np.zeros((3, BLOCK), dtype=np.uint8)
        size = node.segments[0].size_bytes
        replicas = [node.replica(0, 0, BLOCK), node.replica(0, size, BLOCK),
                    node.replica(0, 2 * BLOCK, BLOCK)]
        result = transport.read([IoOp(r, memoryview(row)) for r, row in zip(replicas, dst)])
        assert result[0] is None and result[2] is None
        assert isinstance(result[1], SegmentBoundsError)
    finally:
        transport.close()


@pytest.mark.parametrize("block", [BLOCK, 1 << 20])   # 1 MiB: the whole segment, two threads
def test_read_at_moves_the_same_bytes_as_read(node, block):
    """The copies read_at finds with numpy (runs, split between two threads) move the bytes
    read would (the contract suite checks read_at at block sizes that take one thread)."""
    transport = SHMTransport()
    try:
        rng = np.random.default_rng(11)
        src = rng.integers(0, 256, size=(6, block), dtype=np.uint8)
        offsets = [0, block, 2 * block, 7 * block, 5 * block, 6 * block]   # runs: 0-2, 3, 4-5
        replicas = [node.replica(0, off, block) for off in offsets]
        assert transport.write([IoOp(r, memoryview(row)) for r, row in zip(replicas, src)]) \
            == [None] * 6
        dst = np.zeros_like(src)
        apart = np.zeros(block, dtype=np.uint8)    # one buffer elsewhere: splits the first run
        views = [dst[0], apart, *dst[2:]]
        assert transport.read_at([node.replica(0, 0, 0)], np.zeros(6, dtype=np.int64),
                                 np.array(offsets, dtype=np.uint64),
                                 np.full(6, block, dtype=np.uint64),
                                 np.array([v.ctypes.data for v in views], dtype=np.uint64)) == {}
        assert np.array_equal(apart, src[1])
        assert np.array_equal(dst[[0, 2, 3, 4, 5]], src[[0, 2, 3, 4, 5]])
    finally:
        transport.close()


@pytest.mark.parametrize("blocks, block", [(3, BLOCK), (12, 1 << 20)])   # 12 MiB: two threads
@pytest.mark.parametrize("whole", [True, False])   # each value checksummed whole, or in chunks
def test_write_summed_lands_the_bytes_and_returns_each_ops_crc(node, blocks, block, whole,
                                                               monkeypatch):
    monkeypatch.setattr(shm, "_SUM_CHUNKED_MAX_BYTES" if whole else "_SUM_WHOLE_MAX_BYTES", 0)
    transport = SHMTransport()
    try:
        rng = np.random.default_rng(5)
        src = rng.integers(0, 256, size=(blocks, block), dtype=np.uint8)
        odd = bytes(rng.integers(0, 256, size=block // 3 + 1, dtype=np.uint8))   # not a chunk
        # Alternating between the node's two segments; the odd-sized value after them.
        replicas = [node.replica(k % 2, k // 2 * block, block) for k in range(blocks)]
        bad = node.replica(0, node.segments[0].size_bytes, len(odd))
        tail = node.replica(0, (blocks // 2 + 1) * block, len(odd))
        ops = [IoOp(r, memoryview(row)) for r, row in zip(replicas, src)]
        errors, sums = transport.write_summed([*ops, IoOp(bad, odd), IoOp(tail, odd)])
        assert errors[:blocks] == [None] * blocks and errors[-1] is None
        assert isinstance(errors[blocks], SegmentBoundsError) and sums[blocks] is None
        assert sums[:blocks] + sums[-1:] == [checksum(row) for row in src] + [checksum(odd)]
        dst = np.zeros_like(src)
        assert transport.read([IoOp(r, memoryview(row)) for r, row in zip(replicas, dst)]) \
            == [None] * blocks
        assert np.array_equal(dst, src)
    finally:
        transport.close()


def test_write_summed_streams_long_runs_while_a_helper_checksums(node, monkeypatch):
    """Runs long enough are copied whole while a helper thread takes the checksums: the bytes
    and CRCs must be those of the fused path, and a refused op still fails alone."""
    monkeypatch.setattr(shm, "_STREAM_RUN_BYTES", 1 << 20)
    monkeypatch.setattr(shm, "_SPLIT_MIN_BYTES", 1 << 20)
    block = 1 << 20
    transport = SHMTransport()
    try:
        src = np.random.default_rng(9).integers(0, 256, size=(6, block), dtype=np.uint8)
        replicas = [node.replica(0, k * block, block) for k in range(6)]   # one run
        bad = node.replica(1, node.segments[1].size_bytes, block)
        errors, sums = transport.write_summed(
            [*(IoOp(r, memoryview(row)) for r, row in zip(replicas, src)),
             IoOp(bad, memoryview(src[0]))])
        assert errors[:6] == [None] * 6 and isinstance(errors[6], SegmentBoundsError)
        assert sums == [checksum(row) for row in src] + [None]
        dst = np.zeros_like(src)
        assert transport.read([IoOp(r, memoryview(row)) for r, row in zip(replicas, dst)]) \
            == [None] * 6
        assert np.array_equal(dst, src)
    finally:
        transport.close()


def _mapped_kib(transport: SHMTransport) -> list[int]:
    """Rss (KiB) of each segment ``transport`` has mapped, in the order mapped, from this
    process's /proc/self/smaps (matched by address: other tests' clients in this process may
    still map segments of the same size)."""
    mine = {m._address: m.size for link in transport._links.values()
            for m in link.mappings.values()}
    found, current = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:    # a mapping's first line: range, perms...
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                current = lo if mine.get(lo) == hi - lo else None
            elif current is not None and head[0] == "Rss:":
                found[current] = int(head[1])
    return [found[address] for address in mine if address in found]


def test_a_client_maps_a_segment_but_faults_in_only_what_it_copies(fresh_node):
    """A client asked to fault in ahead less than a segment (``prefault_bytes``) maps it with
    no page tables but for what it wrote: page tables for every segment of a large pool
    would cost a client 8 bytes per 4 KiB page of it."""
    size = fresh_node.segments[0].size_bytes
    transport = SHMTransport(prefault_bytes=size - 1)
    try:
        assert transport.write([IoOp(fresh_node.replica(0, 0, BLOCK),
                                     memoryview(bytes(range(256)) * 16))]) == [None]
        [rss] = _mapped_kib(transport)
        assert rss <= 256, f"{rss} KiB of a {size >> 10} KiB segment faulted in for 4 KiB"
        # A large copy faults its range in at once (one madvise), and only its range.
        big = np.ones(2 << 20, dtype=np.uint8)
        assert transport.write([IoOp(fresh_node.replica(0, 1 << 20, big.nbytes),
                                     memoryview(big))]) == [None]
        [rss] = _mapped_kib(transport)
        assert 2048 <= rss <= 2048 + 512, rss
    finally:
        transport.close()


def test_a_client_faults_its_mappings_in_ahead_of_its_copies(fresh_node):
    """By default the segments a client maps are faulted in by a background thread, read and
    write mappings alike, so that copies find their page tables in place: a 512 MiB put into
    pages not yet faulted in spent 0.15 s in faults against 0.05 s copying."""
    size = fresh_node.segments[0].size_bytes
    transport = SHMTransport()
    try:
        assert transport.write([IoOp(fresh_node.replica(0, 0, BLOCK),
                                     memoryview(bytes(BLOCK)))]) == [None]
        assert transport.read([IoOp(fresh_node.replica(0, 0, BLOCK),
                                    memoryview(bytearray(BLOCK)))]) == [None]
        assert shm.wait_prefaulted(30)
        rss = _mapped_kib(transport)
        assert rss == [size >> 10] * 2, f"{rss} KiB of two {size >> 10} KiB mappings"
    finally:
        transport.close()


def test_the_prefaulter_leaves_a_dropped_mapping_and_goes_on_with_the_next(tmp_path):
    """A mapping closed while it waits or is being faulted in is left where it is (no
    exception in the thread, no madvise on pages no longer mapped), and one whose step fails
    (a bug) is left too; the next is done."""
    def mapping(size: int) -> shm._Mapping:
        fd = os.memfd_create("prefault-test")
        try:
            os.ftruncate(fd, size)
            return shm._Mapping(mmap.mmap(fd, size), size, writable=True)
        finally:
            os.close(fd)

    class Broken:
        def prefault(self, nbytes: int) -> bool:
            raise RuntimeError("a bug in one step")

    dropped, kept, broken = mapping(64 << 20), mapping(8 << 20), Broken()
    dropped.close()
    assert dropped.prefault(1 << 20) is False and dropped.ready == 0
    shm._prefaulter.add(dropped)
    shm._prefaulter.add(broken)     # the thread crashes on it, is restarted, and goes on
    shm._prefaulter.add(kept)
    assert shm.wait_prefaulted(30)
    assert (dropped.ready, kept.ready) == (0, kept.size)
    kept.close()


@pytest.mark.parametrize("distance", [0, 16, 64, 1000, 2048, 4080])
def test_a_copy_lands_whole_at_every_distance_modulo_a_page(distance):
    """Copies whose destination lies a little ahead of the source (modulo 4 KiB) go in pieces
    (glibc's large copy is slow there); every byte lands, the tail piece too."""
    n = 3 * shm._ALIASED_PIECE_BYTES + 123
    src_buf = np.random.default_rng(distance).integers(0, 256, n + 8192, dtype=np.uint8)
    dst_buf = np.zeros(n + 8192, dtype=np.uint8)
    src = src_buf[(-src_buf.ctypes.data) % 4096:][:n]
    at = ((-dst_buf.ctypes.data) % 4096 + distance) % 4096
    dst = dst_buf[at:at + n]
    assert (dst.ctypes.data - src.ctypes.data) % 4096 == distance
    shm._memcpy(dst, src)
    assert np.array_equal(dst, src)
    assert not dst_buf[:at].any() and not dst_buf[at + n:].any()
