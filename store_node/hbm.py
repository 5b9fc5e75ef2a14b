"""The HBM tier of a store node: GPU memory for the hottest blocks (``--hbm-size --gpu``).

One torch allocation on the GPU (``torch.empty(size, uint8, device="cuda:N")``), only where
CUDA exists: :func:`check_hbm` says clearly why not anywhere else, before anything is
allocated, instead of a torch traceback.

Device memory has no host address, so the segment is served through a pinned host staging
buffer: a tcp READ copies device -> staging -> socket, a WRITE socket -> staging -> device, in
staging-sized pieces; demotion to DRAM copies device -> the DRAM segment's mapping directly, and
promotion the other way. Clients never map it (no fd) and reach it over tcp only. Not done: an
RDMA registration of the allocation with a dma-buf memory region (GPUDirect), which would let
rdma clients read it one-sided; until then the staging path is the only path.
"""

from __future__ import annotations

import threading
import warnings

from kvpool.common.config import format_size
from kvpool.common.errors import InvalidArgument
from kvpool.common.types import SegmentInfo
from kvpool.store_node.memory import Segment, new_segment_id

HBM_SEGMENT_INDEX = 2000     # segment ids <node>/2000-<random>
STAGING_BYTES = 8 << 20      # per connection at a time: large enough for full-speed copies


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
        self._tensor = torch.empty(size_bytes, dtype=torch.uint8, device=device)
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

    def send_to(self, sock, offset: int, length: int) -> None:
        """A tcp READ: device -> pinned staging -> socket, piece by piece."""
        self.check_range(offset, length)
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
