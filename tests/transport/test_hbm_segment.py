"""The HBM tier's segment: one torch allocation served through pinned staging over tcp, and
copied to and from DRAM by the node. The ``gpu`` tests run on a CUDA device and skip where
there is none; the others run the same code on torch's CPU device (the staging path and the
copies are the same calls; only the device differs)."""

from __future__ import annotations

import os
import time

import pytest
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.errors import InvalidArgument
from kvpool.common.host import local_boot_id
from kvpool.common.types import Extent, NodeEndpoints, Replica
from kvpool.net.rdma_probe import unavailable_reason as no_rdma_reason
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.hbm import (
    STAGING_BYTES,
    DmaBufUnavailable,
    HbmSegment,
    check_hbm,
    cuda_dmabuf_fd,
    hbm_unavailable_reason,
)
from kvpool.store_node.memory import create_dram_segment

torch = pytest.importorskip("torch")
NO_GPU = hbm_unavailable_reason(0)
NO_RDMA = no_rdma_reason()
SIZE = 32 << 20


def _devices():
    return ["cpu", pytest.param("cuda:0", marks=[
        pytest.mark.gpu, pytest.mark.skipif(bool(NO_GPU), reason=f"gpu: {NO_GPU}")])]


def read_gbps(transport, ops: list[IoOp]) -> float:
    """One timed batched read of ``ops``, in GB/s."""
    start = time.perf_counter()
    assert transport.read(ops) == [None] * len(ops)
    return sum(len(op.buffer) for op in ops) / (time.perf_counter() - start) / 1e9


@pytest.fixture(params=_devices())
def hbm(request):
    seg = HbmSegment("n1/2000-test", SIZE, request.param)
    yield seg
    seg.close()


def test_an_hbm_segment_is_written_and_read_over_tcp(hbm):
    server = DataServer({hbm.info.segment_id: hbm}, shm=False)
    server.start()
    transport = TCPTransport(timeout_s=10)
    try:
        node = NodeEndpoints("n1", local_boot_id(), server.tcp_endpoint)
        payload = os.urandom(STAGING_BYTES + 12345)   # more than one staging piece
        replica = Replica(node, Extent(hbm.info.segment_id, 4096, len(payload)), tier="hbm")
        assert transport.write([IoOp(replica, memoryview(payload))]) == [None]
        out = bytearray(len(payload))
        assert transport.read([IoOp(replica, memoryview(out))]) == [None]
        assert out == payload
        assert hbm.fd == -1 and not hbm.host_addressable
    finally:
        transport.close()
        server.stop()


def test_demotion_and_promotion_copies_with_dram(hbm):
    dram = create_dram_segment("n1", 0, 1 << 20)
    try:
        data = os.urandom(500_000)
        hbm.write_from(1024, memoryview(data))
        hbm.read_into(1024, dram.buffer[64:64 + len(data)])          # HBM -> DRAM
        assert bytes(dram.buffer[64:64 + len(data)]) == data
        hbm.write_from(0, dram.buffer[64:64 + len(data)])           # DRAM -> HBM
        back = bytearray(len(data))
        hbm.read_into(0, memoryview(back))
        assert back == data
        with pytest.raises(ValueError):
            hbm.write_from(SIZE - 1, memoryview(b"xy"))
    finally:
        dram.close()


def test_no_gpu_is_a_clear_error_not_a_crash():
    if not NO_GPU:
        pytest.skip("this host has a GPU")
    with pytest.raises(InvalidArgument, match="--hbm-size: "):
        check_hbm(0, 1 << 30)


@pytest.mark.gpu
@pytest.mark.skipif(bool(NO_GPU), reason=f"gpu: {NO_GPU}")
def test_hbm_to_remote_read_throughput():
    """Prints the HBM -> tcp client read GB/s (staging path) on a GPU machine."""
    seg = HbmSegment("n1/2000-bench", 1 << 30, "cuda:0")
    server = DataServer({seg.info.segment_id: seg}, shm=False)
    server.start()
    transport = TCPTransport(timeout_s=30)
    try:
        node = NodeEndpoints("n1", local_boot_id(), server.tcp_endpoint)
        block = 2 << 20
        ops = [IoOp(Replica(node, Extent(seg.info.segment_id, i * block, block), tier="hbm"),
                    memoryview(bytearray(block))) for i in range(256)]
        transport.read(ops)
        print(f"\nHBM -> tcp client read: {read_gbps(transport, ops):.2f} GB/s "
              "(256 x 2 MiB, staging path)")
    finally:
        transport.close()
        server.stop()
        seg.close()


def test_memory_that_cannot_be_exported_as_a_dma_buf_says_why(hbm):
    """On a GPU the segment exports a dma-buf fd where the driver can (open kernel modules,
    CUDA 11.7+) and otherwise says why; on the CPU device it says so at once."""
    try:
        fd = hbm.export_dmabuf()
    except DmaBufUnavailable as exc:
        assert str(exc)
        if hbm.device.type != "cuda":
            assert "not in CUDA memory" in str(exc)
        else:
            print(f"\nno dma-buf export on this GPU: {exc}")
    else:
        assert hbm.device.type == "cuda"
        try:
            assert os.fstat(fd).st_size in (0, -(-SIZE // 4096) * 4096)
        finally:
            os.close(fd)


def test_dma_buf_export_without_a_cuda_driver_is_a_clear_error():
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(DmaBufUnavailable, match="CUDA driver library cannot be loaded"):
            cuda_dmabuf_fd(0, 4096, 0)
    else:
        pytest.skip("this host has a CUDA driver")


@pytest.mark.gpu
@pytest.mark.rdma
@pytest.mark.skipif(bool(NO_GPU) or bool(NO_RDMA), reason=f"gpu and rdma: {NO_GPU or NO_RDMA}")
def test_hbm_over_rdma_through_a_dma_buf_region_or_staging():
    """On a GPU host with an RDMA NIC: the HBM segment is registered through a dma-buf and
    read and written one-sided, NIC to GPU, byte for byte; where the driver or NIC refuses,
    it is left unregistered (served over tcp through staging). Prints which, and GB/s."""
    from kvpool.client.transport.rdma import RDMATransport
    from kvpool.store_node.rdma import open_node_rdma
    seg = HbmSegment("n1/2000-dmabuf", 1 << 30, "cuda:0")
    rdma = open_node_rdma(required=False)
    info = rdma.register(seg)
    server = DataServer({seg.info.segment_id: seg}, shm=False, rdma=rdma)
    server.start()
    transport = RDMATransport(timeout_s=30)
    try:
        if not info.rdma_rkey:
            print("\nHBM not registered for rdma here (see the log): tcp through staging")
            return
        node = rdma.advertise(NodeEndpoints("n1", local_boot_id(), server.tcp_endpoint))
        block = 2 << 20
        payload = [os.urandom(block) for _ in range(4)]

        def replica(i: int) -> Replica:
            return Replica(node, Extent(seg.info.segment_id, i * block, block),
                           rdma_addr=info.rdma_addr, rdma_rkey=info.rdma_rkey,
                           rdma_length=info.size_bytes, tier="hbm")
        assert transport.write([IoOp(replica(i), memoryview(p))
                                for i, p in enumerate(payload)]) == [None] * 4
        back = bytearray(block)
        seg.read_into(block, memoryview(back))             # landed in GPU memory
        assert back == payload[1]
        ops = [IoOp(replica(i), memoryview(bytearray(block))) for i in range(256)]
        assert transport.read(ops[:4]) == [None] * 4
        assert [bytes(op.buffer) for op in ops[:4]] == payload
        print(f"\nHBM -> rdma client read: {read_gbps(transport, ops):.2f} GB/s "
              "(256 x 2 MiB, dma-buf region)")
    finally:
        transport.close()
        server.stop()
        rdma.close()
        seg.close()
