"""The transport interface: how a client moves bytes to and from one replica.

The client asks the registry for the first transport (in preference order shm, rdma, tcp) whose
``can_reach`` accepts a replica's node, and falls back to the next replica (and finally raises
``NodeUnavailable``) when a transport reports a ``TransportError`` for it. A transport
implements ``read`` and ``write``; the fast paths (``write_summed``, ``read_at``) and buffer
registration have defaults built on those, which a transport overrides where it can do better.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from kvpool.client.buffers import view_at
from kvpool.common.checksum import Checksums
from kvpool.common.errors import InvalidArgument, TransportError
from kvpool.common.types import NodeEndpoints, Replica
from kvpool.net.data_port import PutRecord

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

    def write_summed(self, ops: Sequence[IoOp]
                     ) -> tuple[list[TransportError | None], list[int | None]]:
        """:meth:`write`, also returning each op's CRC-32C (None where it failed), taken from
        the caller's bytes as they leave. This default checksums each distinct buffer in a
        helper thread while :meth:`write` sends (see :class:`Checksums`); a transport that
        copies the bytes itself can checksum them as it copies (shm)."""
        distinct = list({id(op.buffer): op.buffer for op in ops}.values())
        with Checksums(distinct) as checksums:
            errors = self.write(ops)
            crc = dict(zip(map(id, distinct), checksums.result()))
        return errors, [None if e is not None else crc[id(op.buffer)]
                        for op, e in zip(ops, errors)]

    #: Whether :meth:`write_sealed` works: the put's writer then tells each node of its put
    #: itself, and the master answers PutStart and PutEnd without waiting for the nodes.
    seals: bool = False

    def write_sealed(self, ops: Sequence[IoOp], records: Sequence[PutRecord], *,
                     reserved: bool = False
                     ) -> tuple[list[TransportError | None], list[int | None]]:
        """:meth:`write_summed`, fenced and sealed at the node (net/data_port.py RESERVE and
        SEAL): each op's extent is reserved with ``records[k]`` (key, version, the granting
        master's epoch) before any byte of it is written, refused if that master is not the
        node's; once written, the record is sealed with the CRC-32C, which the node checks
        against the bytes it holds. An op is done (None) only when sealed. ``reserved``: the
        extents lie in slots the caller reserved already (:meth:`reserve`; only where
        ``slots``): no RESERVE. This default refuses every op: a transport that cannot reach
        the node's records (``seals`` False) is never asked."""
        error = TransportError(f"{self.scheme or type(self).__name__}: cannot seal puts")
        return [error] * len(ops), [None] * len(ops)

    #: Whether :meth:`reserve` works, and ``write_sealed_then(reserved=True)``: the writer
    #: reserves slots ahead of its puts (client/slots.py).
    slots: bool = False

    def reserve(self, ops: Sequence[IoOp], records: Sequence[PutRecord]
                ) -> list[TransportError | None]:
        """RESERVE each op's extent at its node with ``records[k]`` (a slot, ahead of the put
        that fills it); one result per op. This default refuses every op."""
        return [TransportError(f"{self.scheme or type(self).__name__}: cannot reserve slots")
                ] * len(ops)

    def write_sealed_then(self, op: IoOp, record: PutRecord, then: Callable[[int], object],
                          *, reserved: bool = False
                          ) -> tuple[TransportError | None, int | None, bool]:
        """:meth:`write_sealed` of one op, calling ``then(crc)`` once its bytes are written
        (the caller commits the put there): ``(error, crc, whether then ran)``. An error
        after ``then`` ran is the seal's: the node did not take the record. A transport
        that can overlap ``then`` with the seal's round trip does (shm); this default seals
        first. ``reserved``: the extent lies in a slot the caller reserved already
        (:meth:`reserve`; only where ``slots``): no RESERVE."""
        if reserved:
            raise TransportError(f"{self.scheme or type(self).__name__}: cannot fill slots")
        [error], [crc] = self.write_sealed([op], [record])
        if error is not None or crc is None:
            return error, None, False
        then(crc)
        return None, crc, True

    def read_at(self, segments: Sequence[Replica], which: np.ndarray, offsets: np.ndarray,
                lengths: np.ndarray, addresses: np.ndarray, grants: Sequence[bytes] = ()
                ) -> dict[int, TransportError]:
        """Copy extent k, ``[offsets[k], offsets[k] + lengths[k])`` of the segment of
        ``segments[which[k]]``, to the ``lengths[k]`` bytes at ``addresses[k]`` (arrays of
        one length, uint64 but ``which``), for every k: :meth:`read` of many extents without
        an op or a view per extent. The caller owns that memory, writable, and keeps it
        alive during the call. ``grants``: extent k's read grant (common/capabilities.py),
        or empty where none was minted. Returns the failures by k: empty when every extent
        arrived.

        This default reads through :meth:`read`, an op per extent; a transport that copies
        from a mapping reads the extents of a segment in place (shm)."""
        views = map(view_at, addresses.tolist(), lengths.tolist())
        grants = grants or [b""] * len(which)
        ops = [IoOp(segments[s].at(offset, length, grant), view)
               for s, offset, length, view, grant
               in zip(which.tolist(), offsets.tolist(), lengths.tolist(), views, grants)]
        return {k: e for k, e in enumerate(self.read(ops)) if e is not None}

    def read_local(self, key: str, buffer_for: Callable[[int], memoryview]) -> int | None:
        """The value stored under ``key`` (a stored key, common/tenants.py) read with no master
        call, into ``buffer_for(size)``: its size, or None where this transport cannot prove it
        has the object's bytes (the caller asks the master). This default: None; shm reads
        its nodes' indexes (net/shm_index.py)."""
        return None

    #: Whether :meth:`read_held` can succeed (tcp).
    reads_held: bool = False

    def read_held(self, replica: Replica, buffer: memoryview) -> bool:
        """A READ_HELD (net/data_port.py) at ``replica`` (its extent and grant the READ_HELD
        grant's) of the object of ``buffer.nbytes`` bytes at its start: True once ``buffer``
        holds the object's bytes, False where the node no longer holds it there, it has
        another size, or anything failed (the caller asks the master). This default: False."""
        return False

    def register_buffer(self, buffer) -> None:
        """Let ops on ``buffer`` (bytearray, numpy array, CPU tensor, writable memoryview) or
        on slices of it move bytes in place where this transport can (rdma: a memory
        region); pinned until :meth:`unregister_buffer` or :meth:`close`. This default does
        nothing: a transport that copies needs no registration."""

    def unregister_buffer(self, buffer) -> None:
        """Undo :meth:`register_buffer`; a no-op for memory that is not registered."""

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
