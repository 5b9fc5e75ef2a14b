"""The transport interface: how a client moves bytes to and from one replica.

The client asks the registry for the first transport (in preference order shm, rdma, tcp) whose
``can_reach`` accepts a replica's node, and falls back to the next replica (and finally raises
``NodeUnavailable``) when a transport reports a ``TransportError`` for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvpool.common.errors import InvalidArgument, TransportError
from kvpool.common.types import NodeEndpoints, Replica

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class IoOp:
    """Move ``buffer`` (exactly ``replica.extent.length`` bytes) to or from ``replica``."""

    replica: Replica
    buffer: memoryview   # contiguous, format "B"; writable for reads


class Transport(ABC):
    """Moves bytes between local buffers and store-node segments. Thread-safe."""

    scheme: str = ""

    @abstractmethod
    def can_reach(self, node: NodeEndpoints) -> bool:
        """Whether this transport can serve replicas on ``node`` from this process (cheap)."""

    @abstractmethod
    def read(self, ops: Sequence[IoOp]) -> list[TransportError | None]:
        """Copy each replica's bytes into its op's buffer; one result per op (None = done)."""

    @abstractmethod
    def write(self, ops: Sequence[IoOp]) -> list[TransportError | None]:
        """Copy each op's buffer into its replica; one result per op (None = done)."""

    def close(self) -> None:
        """Release connections and mappings. Idempotent."""


def byte_views(ops: Sequence[IoOp], *, writable: bool) -> list[memoryview]:
    """Each op's buffer as a flat format-"B" memoryview of exactly ``extent.length`` bytes.

    Accepts anything with the buffer protocol that is C-contiguous (bytearray, numpy arrays of
    any dtype, memoryview slices). Raises InvalidArgument up front (before any I/O) for a buffer
    of the wrong size, a non-contiguous one, or a read-only one where bytes must land.
    """
    views = []
    for i, op in enumerate(ops):
        try:
            view = memoryview(op.buffer)
        except TypeError:
            raise InvalidArgument(f"ops[{i}].buffer does not support the buffer protocol") from None
        if not view.c_contiguous:
            raise InvalidArgument(f"ops[{i}].buffer is not contiguous")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if writable and view.readonly:
            raise InvalidArgument(f"ops[{i}].buffer is read-only")
        if view.nbytes != op.replica.extent.length:
            raise InvalidArgument(f"ops[{i}].buffer has {view.nbytes} bytes; "
                                  f"the extent has {op.replica.extent.length}")
        views.append(view)
    return views


def group_by(ops: Sequence[IoOp], key: Callable[[IoOp], K]) -> dict[K, list[int]]:
    """Op indexes grouped by ``key(op)``, in first-seen order; order kept within a group."""
    groups: dict[K, list[int]] = {}
    for i, op in enumerate(ops):
        groups.setdefault(key(op), []).append(i)
    return groups
