"""The HBM tier of a store node: GPU memory for the hottest blocks (``--hbm-size --gpu``).

One torch allocation on the GPU (``torch.empty(size, uint8, device="cuda:N")``), only where
CUDA exists: :func:`check_hbm` says clearly why not anywhere else, before anything is
allocated, instead of a torch traceback.

Two ways in, chosen when the node starts (store_node/rdma.py):

- **GPUDirect (dma-buf):** where the node has an RDMA device, the allocation is exported as a
  dma-buf (``cuMemGetHandleForAddressRange``: CUDA 11.7+ with the open kernel modules) and
  registered as a memory region (``ibv_reg_dmabuf_mr``); rdma clients then read and write
  it one-sided, NIC to GPU, as they do DRAM.
- **Pinned-host staging**, where that is refused (no RDMA, a driver without dma-buf export, a
  NIC that does not take one: soft-RoCE): the node serves the segment over tcp through a pinned
  host buffer: a READ copies device -> staging -> socket, a WRITE socket -> staging -> device,
  in staging-sized pieces. The node logs which path each HBM segment got, and why.

Demotion to DRAM copies device -> the DRAM segment's mapping directly, and promotion the other
way. Clients never map the segment (no fd): there is no shm path to it.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import warnings

from kvpool.common.config import format_size
from kvpool.common.errors import InvalidArgument
from kvpool.common.types import SegmentInfo
from kvpool.store_node.memory import Segment, new_segment_id

HBM_SEGMENT_INDEX = 2000     # segment ids <node>/2000-<random>
STAGING_BYTES = 8 << 20      # per connection at a time: large enough for full-speed copies
# CUDA driver API constants (cuda.h): CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED and
# CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD.
_CU_DMA_BUF_SUPPORTED = 124
_CU_DMA_BUF_FD = 1


class DmaBufUnavailable(Exception):
    """This memory cannot be exported as a dma-buf here; the message says why."""


class HbmSegment(Segment):
    """A segment in one torch allocation on ``device`` ("cuda:0"; tests may pass "cpu" to
    run the same code paths where there is no GPU)."""

    host_addressable = False

    def __init__(self, segment_id: str, size_bytes: int, device: str) -> None:
        import torch
        if size_bytes <= 0:
            raise InvalidArgument(f"segment size must be positive, not {size_bytes}")
        self._torch = torch
        self._info = SegmentInfo(segment_id=segment_id, size_bytes=size_bytes, tier="hbm")
        # Whole host pages: a dma-buf export covers page-aligned ranges only.
        pages = -(-size_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._tensor = torch.empty(pages, dtype=torch.uint8, device=device)[:size_bytes]
        self._cuda = self._tensor.is_cuda
        self._lock = threading.Lock()   # guards the staging buffer and closing
        self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=self._cuda)
        self._staging_view = memoryview(self._staging.numpy())

    @property
    def info(self) -> SegmentInfo:
        return self._info

    @property
    def fd(self) -> int:
        return -1

    @property
    def buffer(self) -> memoryview:
        raise ValueError(f"segment {self._info.segment_id} is in device memory: no host view")

    @property
    def device(self):
        return self._tensor.device

    def export_dmabuf(self) -> int:
        """A new dma-buf fd for the whole segment (the caller closes it), for registering it
        with an RDMA device. DmaBufUnavailable, with the reason, where it cannot be."""
        if not self._cuda:
            raise DmaBufUnavailable(f"segment {self._info.segment_id} is not in CUDA memory")
        storage = self._tensor.untyped_storage()
        return cuda_dmabuf_fd(self._tensor.data_ptr(), storage.nbytes(),
                              self._tensor.device.index or 0)

    def read_into(self, offset: int, view: memoryview) -> None:
        """Device -> host: straight into ``view`` (a DRAM segment's mapping, a buffer)."""
        self.check_range(offset, len(view))
        if len(view):
            host = self._torch.frombuffer(view, dtype=self._torch.uint8)
            host.copy_(self._tensor[offset:offset + len(view)])

    def write_from(self, offset: int, view: memoryview) -> None:
        """Host -> device, from ``view``."""
        self.check_range(offset, len(view))
        if len(view) == 0:
            return
        with warnings.catch_warnings():   # a read-only source is only read here
            warnings.simplefilter("ignore", UserWarning)
            host = self._torch.frombuffer(view, dtype=self._torch.uint8)
        self._tensor[offset:offset + len(view)].copy_(host)
        if self._cuda:
            self._torch.cuda.synchronize(self._tensor.device)

    def view_to_send(self, offset: int, length: int) -> None:
        return None   # sent its own way (send_to)

    def send_to(self, sock, offset: int, length: int, header: bytes = b"") -> None:
        """A tcp READ: device -> pinned staging -> socket, piece by piece."""
        self.check_range(offset, length)
        sock.sendall(header)
        with self._lock:
            done = 0
            while done < length:
                n = min(STAGING_BYTES, length - done)
                self._staging[:n].copy_(self._tensor[offset + done:offset + done + n])
                sock.sendall(self._staging_view[:n])
                done += n

    def recv_from(self, recv_exact, offset: int, length: int) -> None:
        """A tcp WRITE: ``recv_exact(view)`` fills pinned staging, then staging -> device."""
        self.check_range(offset, length)
        with self._lock:
            done = 0
            while done < length:
                n = min(STAGING_BYTES, length - done)
                recv_exact(self._staging_view[:n])
                self._tensor[offset + done:offset + done + n].copy_(self._staging[:n])
                done += n
            if self._cuda:
                self._torch.cuda.synchronize(self._tensor.device)

    def close(self) -> None:
        with self._lock:
            self._tensor = None
            self._staging_view.release()

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def __repr__(self) -> str:
        return f"HbmSegment({self._info.segment_id!r}, {self._info.size_bytes}, {self.device})"


def cuda_dmabuf_fd(address: int, length: int, gpu: int) -> int:
    """Export ``[address, address + length)`` of GPU ``gpu``'s memory (one allocation, both
    page aligned) as a dma-buf fd, through the CUDA driver API. DmaBufUnavailable, with the
    reason, where the driver cannot."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise DmaBufUnavailable(f"the CUDA driver library cannot be loaded: {exc}") from None
    export = getattr(cuda, "cuMemGetHandleForAddressRange", None)
    if export is None:
        raise DmaBufUnavailable("the CUDA driver is older than 11.7: no dma-buf export")
    if address % mmap.PAGESIZE or length % mmap.PAGESIZE:
        raise DmaBufUnavailable(f"[{address:#x}, +{length}) is not page aligned")
    device, supported = ctypes.c_int(), ctypes.c_int()
    _cu_check(cuda, cuda.cuDeviceGet(ctypes.byref(device), ctypes.c_int(gpu)), "cuDeviceGet")
    _cu_check(cuda, cuda.cuDeviceGetAttribute(ctypes.byref(supported),
                                              ctypes.c_int(_CU_DMA_BUF_SUPPORTED), device),
              "cuDeviceGetAttribute")
    if not supported.value:
        raise DmaBufUnavailable(f"GPU {gpu}'s driver does not export dma-buf "
                                "(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: it needs the "
                                "open GPU kernel modules)")
    fd = ctypes.c_int(-1)
    export.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_uint64, ctypes.c_size_t,
                       ctypes.c_int, ctypes.c_ulonglong]
    _cu_check(cuda, export(ctypes.byref(fd), address, length, _CU_DMA_BUF_FD, 0),
              "cuMemGetHandleForAddressRange")
    return fd.value


def _cu_check(cuda, result: int, call: str) -> None:
    if result == 0:
        return
    name = ctypes.c_char_p()
    if cuda.cuGetErrorName(ctypes.c_int(result), ctypes.byref(name)) == 0 and name.value:
        raise DmaBufUnavailable(f"{call} failed: {name.value.decode()}")
    raise DmaBufUnavailable(f"{call} failed: CUDA error {result}")


def create_hbm_segment(node_id: str, gpu: int, size_bytes: int) -> HbmSegment:
    """The node's HBM segment on GPU ``gpu`` (check_hbm first for a clear error)."""
    return HbmSegment(new_segment_id(node_id, HBM_SEGMENT_INDEX), size_bytes, f"cuda:{gpu}")


def hbm_unavailable_reason(gpu: int) -> str:
    """"" if GPU ``gpu`` can hold an HBM tier here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'kvpool[torch]' with a CUDA build)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available on this host (torch.cuda.is_available() is False)"
    if not 0 <= gpu < torch.cuda.device_count():
        return f"there is no GPU {gpu}: this host has {torch.cuda.device_count()}"
    return ""


def check_hbm(gpu: int, size_bytes: int) -> None:
    """Raise InvalidArgument with the reason where an HBM tier of ``size_bytes`` on GPU ``gpu``
    cannot be created."""
    reason = hbm_unavailable_reason(gpu)
    if not reason:
        import torch
        free, _ = torch.cuda.mem_get_info(gpu)
        if size_bytes <= free:
            return
        reason = (f"GPU {gpu} has {format_size(free)} free, less than --hbm-size "
                  f"{format_size(size_bytes)}")
    raise InvalidArgument(f"--hbm-size: {reason}")
