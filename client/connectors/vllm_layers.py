"""How the vLLM connector moves one layer's blocks between the engine's paged KV cache and the
host buffers kvpool reads and writes: the layout of each layer's cache, read from its tensor;
the copies, on a CUDA stream of the connector's own or, on CPU, run by whichever thread waits
for them; and the pinned, registered host buffers those copies stage through.

The same code runs on CPU and on CUDA: only :class:`CopyStream` differs, so a CPU run
exercises the staging, the stream's ordering and the layer-by-layer hand-offs that a GPU run
uses, and what only a GPU shows is the device copies themselves. torch is imported by the
caller (the engine has it); nothing here imports it at module import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerLayout:
    """One layer's paged KV cache as a tensor with a block dimension: a block is the tensor
    indexed at ``block_dim``, in logical order (K and V both, wherever the layout puts them),
    ``block_bytes`` bytes. Works for any strides (vLLM's backends permute their caches with
    a stride order): the copies gather and scatter along ``block_dim``."""

    name: str
    block_dim: int
    row_shape: tuple[int, ...]   # a block's logical shape (the tensor's, without block_dim)
    dtype: Any
    block_bytes: int

    @classmethod
    def of(cls, name: str, t, num_blocks: int) -> LayerLayout:
        """The layout of layer ``name``'s cache ``t`` of ``num_blocks`` blocks. vLLM's
        attention backends put the block dimension first (``(num_blocks, ...)``: CPU,
        FlashInfer, MLA) or second after K/V (``(2, num_blocks, ...)``: FlashAttention,
        Triton, XFormers); anything else is refused, naming the shape."""
        shape = tuple(t.shape)
        if len(shape) >= 2 and shape[0] == num_blocks:
            dim = 0
        elif len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks:
            dim = 1
        else:
            raise ValueError(f"KVPoolConnector: layer {name}'s KV cache has shape {shape}: "
                             f"no block dimension of {num_blocks} blocks first, nor second "
                             "after K/V (supported: (num_blocks, ...) and (2, num_blocks, "
                             "...) layouts)")
        row = shape[:dim] + shape[dim + 1:]
        n = 1
        for d in row:
            n *= d
        return cls(name, dim, row, t.dtype, n * t.element_size())

    def gather(self, t, ids, out) -> None:
        """Copy blocks ``ids`` (a long tensor on ``t``'s device) of ``t`` into ``out``
        (``(len(ids), block_bytes)`` uint8, host; rows may be strided)."""
        picked = t.index_select(self.block_dim, ids).movedim(self.block_dim, 0)
        out.view(self.dtype).unflatten(1, self.row_shape).copy_(picked, non_blocking=True)

    def scatter(self, t, ids, src) -> None:
        """Copy ``src`` (``(len(ids), block_bytes)`` uint8, host; rows may be strided) into
        blocks ``ids`` of ``t``."""
        rows = src.view(self.dtype).unflatten(1, self.row_shape)
        if rows.device != t.device:
            rows = rows.to(t.device, non_blocking=True)
        t.index_copy_(self.block_dim, ids, rows.movedim(0, self.block_dim))


class CopyStream:
    """Where the connector's device copies run: a CUDA stream of its own (the engine's compute
    stream waits for a copy only where vLLM needs its bytes), or on CPU none: a copy is run
    by the first thread that waits for it, so a save's copy runs on the save thread, off the
    forward pass, as a CUDA copy runs on its stream."""

    def __init__(self, device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        if self._cuda:
            import torch
            self._torch = torch
            self._stream = torch.cuda.Stream(device=device)

    @property
    def pinned(self) -> bool:
        """Whether host buffers should be pinned (page-locked) for these copies."""
        return self._cuda

    def submit(self, copy: Callable[[], None], *, after_compute: bool) -> CopyEvent:
        """Start ``copy``; ``after_compute``: it reads what the engine's compute stream has
        written so far (a save), so it is ordered after it."""
        if not self._cuda:
            return _Deferred(copy)
        torch = self._torch
        with torch.cuda.stream(self._stream):
            if after_compute:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            copy()
            event = torch.cuda.Event()
            event.record(self._stream)
        return _CudaEvent(event, torch, self.device)

    def fence(self) -> None:
        """Order the engine's compute stream after every copy submitted so far."""
        if self._cuda:
            self._torch.cuda.current_stream(self.device).wait_stream(self._stream)


class CopyEvent:
    """A submitted copy."""

    def synchronize(self) -> None:
        """Return once the copy is done (raising what it raised)."""
        raise NotImplementedError

    def order_compute(self) -> None:
        """Make the engine's compute stream wait for the copy (CPU: run it now if no one
        has)."""
        self.synchronize()


class _Deferred(CopyEvent):
    def __init__(self, copy: Callable[[], None]) -> None:
        self._copy: Callable[[], None] | None = copy
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def synchronize(self) -> None:
        with self._lock:
            if self._copy is not None:
                copy, self._copy = self._copy, None
                try:
                    copy()
                except BaseException as e:   # noqa: BLE001  (re-raised to every waiter)
                    self._error = e
        if self._error is not None:
            raise self._error


class _CudaEvent(CopyEvent):
    def __init__(self, event, torch, device) -> None:
        self._event, self._torch, self._device = event, torch, device

    def synchronize(self) -> None:
        self._event.synchronize()

    def order_compute(self) -> None:
        self._torch.cuda.current_stream(self._device).wait_event(self._event)


class StagingPool:
    """Host buffers for the copies, reused: pinned when the caches are on a GPU, each
    registered once with the store (``register``: e.g. ``LazyStore.register``, so RDMA
    moves them without another copy). A buffer is taken for one step's load or save and
    given back when that is done."""

    # Buffers are made in multiples of this, so steps of slightly different sizes share them.
    _GRAIN = 1 << 20

    def __init__(self, stream: CopyStream, register: Callable[[Any], None]) -> None:
        self._stream, self._register = stream, register
        self._free: list = []
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        """A uint8 host tensor of at least ``nbytes`` bytes."""
        import torch
        with self._lock:
            # By position: tensors compare element-wise, so list.remove would not do.
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        size = max(self._GRAIN, -(-nbytes // self._GRAIN) * self._GRAIN)
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._stream.pinned)
        self._register(buf)
        return buf

    def give_back(self, buf) -> None:
        with self._lock:
            self._free.append(buf)
