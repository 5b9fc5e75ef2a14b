"""A seal board: shared memory in which an shm writer seals its slot puts without a round trip.

A single put into a slot (client/slots.py) used to SEAL its record at the node on the hand-off
socket, beside its PutEnd to the master: the node's answer, and the node's re-check of the
bytes, were on every put's path. A trusted shm writer can write any byte of the segment
anyway, so the node's check guards nothing a writer could not get round; what the seal must
guarantee is only that the node holds the record before the put is acknowledged. Shared
memory the node owns gives that with no round trip: a write there is in the node's memory the
moment it is made.

The node hands each trusted writer's hand-off connection a board on request (``memfd``,
``CELLS`` cells of ``CELL_BYTES``; net/data_port.py ``HANDOFF_BOARD``). The writer names a
cell in each slot's RESERVE; the node binds that cell to the slot's place, epoch and version.
After copying the value the writer fills the cell (:func:`fill`: key, length, CRC-32C,
parent; the state word last) and sends PutEnd. The node reads a cell only when it must
(store_node/manifest.py): it takes a board's filled cells as SEALs (the same rules, in the
order they were filled) before its epoch changes (a restarted master is about to be told what
this node holds), when the writer binds a cell again, and when the writer's connection
closes; the master's commit at the slot's
place, or any reservation there (its space given again), voids the cell instead.

Cell layout (little-endian): ``state`` (u32, FILLED or 0), ``fields_crc`` (u32, CRC-32C of
what follows up to the parent's end: a cell read while being filled is taken as empty),
``seq`` (u64: the writer numbers its seals, and the node takes a board's filled cells in that
order, as SEAL frames would have come), ``length`` (u64), ``crc`` (u32, the value's
CRC-32C), key length (u16), parent length (u16), then the key and the parent (utf-8). A
record that does not fit a cell is sealed the usual way, on the hand-off socket.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct

from kvpool.common.checksum import checksum

CELL_BYTES = 512
CELLS = 256
BOARD_BYTES = CELL_BYTES * CELLS
FILLED = 0x5EA1ED01
_HEAD = struct.Struct("<II")       # state, fields_crc
_FIELDS = struct.Struct("<QQIHH")  # seq, length, crc, key length, parent length
_ROOM = CELL_BYTES - _HEAD.size - _FIELDS.size


def create() -> tuple[int, mmap.mmap]:
    """A new board (node side), sealed against shrinking and growing: its memfd (to hand to
    the writer; the caller closes it) and a shared mapping of it."""
    fd = os.memfd_create("kvpool-seal-board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, BOARD_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd, mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise


def fill(board, index: int, seq: int, key: str, length: int, crc: int,
         parent: str | None) -> bool:
    """The writer's seal of its put in cell ``index``, its ``seq``-th on this board; False if
    the record does not fit (the writer seals it the usual way)."""
    k, p = key.encode(), (parent or "").encode()
    if len(k) + len(p) > _ROOM:
        return False
    fields = _FIELDS.pack(seq, length, crc, len(k), len(p)) + k + p
    base = index * CELL_BYTES
    board[base + _HEAD.size:base + _HEAD.size + len(fields)] = fields
    _HEAD.pack_into(board, base, FILLED, checksum(fields))
    return True


def read(board, index: int) -> tuple[int, str, int, int, str | None] | None:
    """A filled cell's (seq, key, length, crc, parent); None if empty, or being filled."""
    base = index * CELL_BYTES
    state, fields_crc = _HEAD.unpack_from(board, base)
    if state != FILLED:
        return None
    start = base + _HEAD.size
    seq, length, crc, key_len, parent_len = _FIELDS.unpack_from(board, start)
    if key_len + parent_len > _ROOM or not key_len:
        return None
    fields = bytes(board[start:start + _FIELDS.size + key_len + parent_len])
    if checksum(fields) != fields_crc:
        return None
    try:
        key = fields[_FIELDS.size:_FIELDS.size + key_len].decode()
        parent = fields[_FIELDS.size + key_len:].decode() or None
    except UnicodeDecodeError:
        return None
    return seq, key, length, crc, parent


def clear(board, index: int) -> None:
    """Empty cell ``index`` (node side: read, or voided)."""
    _HEAD.pack_into(board, index * CELL_BYTES, 0, 0)
