"""The shm transport: same-host clients map a node's segment and copy with one memcpy.

On first use of a (node, segment) the client connects to the node's abstract unix socket
(``"\\0" + node.shm_endpoint``; the endpoint is published without its NUL), asks for the segment
by id and receives its memfd (SCM_RIGHTS), maps it MAP_SHARED and closes the fd. One unix
connection per node stays open: when it polls hung up (the node closed it, or the node's process
died and the kernel closed it), the node is gone; its mappings are dropped and ops on it fail with
TransportError, so the client falls back to another replica (whose memory may still be correct,
but nobody vouches for it any more).

Hand-off wire format (served by :class:`kvpool.store_node.data_server.DataServer`):
request ``HANDOFF_REQUEST`` (``!H`` segment id length) + segment id (utf-8); reply a
``frames.RESPONSE`` header: OK with the segment size in its length field and the fd attached,
or an error status with a utf-8 message of that length.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import mmap
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from kvpool.client.buffers import address_of, view_at
from kvpool.client.transport.base import IoOp, Transport, byte_views, group_by
from kvpool.common.checksum import Checksums, checksum
from kvpool.common.config import ConfigError, parse_size
from kvpool.common.errors import ClientClosed, NodeRefused, SegmentBoundsError, TransportError
from kvpool.common.host import advise, local_boot_id
from kvpool.common.logging import get_logger
from kvpool.common.loops import RESTART, Supervisor
from kvpool.common.types import NodeEndpoints, Replica
from kvpool.net import seal_board, shm_index
from kvpool.net.data_port import (
    HANDOFF_BOARD,
    HANDOFF_INDEX,
    HANDOFF_REQUEST,
    MAX_SEGMENT_ID_BYTES,
    RESPONSE,
    FrameStatus,
    Op,
    PutRecord,
    encode_handoff_record,
    encode_handoff_request,
    recv_refusal,
)
from kvpool.net.sockets import Spinner, recv_exact

log = get_logger(__name__)


# A node's fd must be sealed against shrinking: otherwise a truncated memfd would SIGBUS us.
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK
# write_summed: bytes of a large value copied per step before they are checksummed (while
# still in L2), and the batch size from which a helper thread takes half of the copying
# (read_at too).
_SUM_CHUNK_BYTES = 512 << 10
# write_summed: a value past _SUM_CHUNKED_MAX_BYTES and up to _SUM_WHOLE_MAX_BYTES is
# checksummed whole, then copied, not a chunk at a time. Alone (cold sources): 1 MiB 100-112
# us against 141-158 in chunks, 4 MiB 390-400 against 570, 16 MiB 2.3 ms both ways. In the
# bench (single puts over shm, p50, alternated pairs) 2 MiB 0.68 / 0.71 / 0.71 / 0.62 ->
# 0.61 / 0.55 / 0.61 / 0.57 ms, 4 MiB 1.47 / 1.44 -> 1.09 / 1.07; but 1 MiB 0.48 / 0.51 ->
# 0.58 / 0.63 (with Redis's turns beside it; 0.48 / 0.43 -> 0.45 / 0.45 without), so values
# up to 1 MiB (a core's L2 here) stay in chunks.
_SUM_WHOLE_MAX_BYTES = 16 << 20
_SUM_CHUNKED_MAX_BYTES = 1 << 20
# Copies at least this large fault their pages in with one madvise first (_Mapping.populate).
_POPULATE_MIN_BYTES = 1 << 20
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)     # Linux 5.14+; Python 3.12+
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# The prefaulter works in steps of this many bytes; a transport has at most
# $KVPOOL_SHM_PREFAULT (default 8 GiB, 16 MiB of page tables) of its mappings faulted in ahead.
_PREFAULT_CHUNK_BYTES = 1 << 20
PREFAULT_ENV = "KVPOOL_SHM_PREFAULT"
_PREFAULT_DEFAULT = "8GiB"
_SPLIT_MIN_BYTES = 8 << 20
# _memcpy: a destination this few bytes ahead of its source (modulo 4 KiB) is copied in pieces
# (768 B and more ran at full speed here; 512 B at half).
_ALIASED = 1024
_ALIASED_PIECE_BYTES = 1 << 20
# read_at: the pieces the helper thread's half is cut in (8 of a 32 MiB batch's half).
_READ_PIECE_BYTES = 2 << 20
# write_summed: runs at least this large on average are copied whole (one memcpy streams a
# large run faster than cache-sized pieces do) while a helper thread checksums the source.
_STREAM_RUN_BYTES = 32 << 20
# Not POLLIN: another thread's hand-off reply may be sitting in the socket. A peer that closes
# (or dies) sets RDHUP/HUP on a unix stream socket; ERR/NVAL are reported regardless.
_DEAD = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


class _Mapping:
    """A segment mapped into this process. Its page tables are filled in ahead of any copy, by
    the process's prefaulter thread (:class:`_Prefaulter`: ``[0, ready)`` is done), and a copy
    that reaches past ``ready`` fills in its own range first with one madvise: a fault per 4 KiB
    page as the copy reaches it costs more than the copy (a 512 MiB put: 0.15 s of faults
    against 0.05 s of memcpy here). Both madvise with the GIL released: a whole segment
    faulted in while holding it stalled a vLLM worker's other threads for seconds."""

    __slots__ = ("mmap", "size", "view", "ready", "_address", "_advice", "__weakref__")

    def __init__(self, mm: mmap.mmap, size: int, writable: bool) -> None:
        self.mmap = mm
        self.view = memoryview(mm)
        self.size = size
        self.ready = 0
        self._address = address_of(self.view) if size else 0
        self._advice: int | None = _MADV_POPULATE_WRITE if writable else _MADV_POPULATE_READ

    def populate(self, start: int, end: int, *, small: bool = False) -> None:
        """Fault ``[start, end)`` in now, in one call, rather than a fault per page as the
        copy reaches it (what the prefaulter has done is skipped). A kernel without
        MADV_POPULATE_* (before Linux 5.14) faults them as they come. ``small``: below
        ``_POPULATE_MIN_BYTES`` too. ValueError if the mapping was dropped meanwhile."""
        start = max(start, self.ready)
        if self._advice is None or end <= start or (end - start < _POPULATE_MIN_BYTES
                                                    and not small):
            return
        self._advise(start - start % mmap.PAGESIZE, end)

    def prefault(self, nbytes: int) -> bool:
        """Fault in the next ``nbytes`` past ``ready``; False once there is nothing left to
        do (all of it done, the mapping dropped, or the kernel cannot)."""
        start = self.ready
        end = min(self.size, start + nbytes)
        if self._advice is None or start >= end:
            return False
        try:
            self._advise(start, end)
        except ValueError:      # dropped by close()
            return False
        self.ready = end
        return end < self.size

    def _advise(self, start: int, end: int) -> None:
        # The slice pins the mapping: close() cannot unmap these pages while madvise runs.
        with self.view[start:end]:
            try:
                advise(self._address + start, end - start, self._advice)
            except OSError:
                self._advice = None

    def close(self) -> None:
        self.view.release()
        try:
            self.mmap.close()
        except BufferError:
            # Another thread is mid-copy on a slice; the pages go when its view is released.
            pass


class _Prefaulter:
    """One thread per process, at the lowest priority, that fills in the page tables of each
    mapping the shm transport makes, ``_PREFAULT_CHUNK_BYTES`` at a time, so that copies
    find their pages in place: what a process maps comes to be faulted in by its copies
    anyway (8 bytes of page table per 4 KiB page), this only does it before they wait for
    it. Each transport says how much of its mappings it wants done ahead
    (``SHMTransport(prefault_bytes=...)``)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._queue: collections.deque[weakref.ref[_Mapping]] = collections.deque()
        self._busy = False
        self._pid = 0

    def add(self, mapping: _Mapping) -> None:
        with self._changed:
            self._queue.append(weakref.ref(mapping))
            if self._pid != os.getpid():    # first use, or a forked child (no thread of ours)
                self._pid = os.getpid()
                # A crash is logged and the loop restarted (common/loops.py): the mapping it
                # was on is left to its copies, the others are still done.
                Supervisor().start_thread("kvpool-shm-prefault", self._run, RESTART,
                                          threading.Event())
            self._changed.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every mapping given so far is done (or dropped); False after ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: not (self._queue or self._busy), timeout_s)

    def _run(self) -> None:
        with contextlib.suppress(OSError):     # niceness is per thread on Linux
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._changed:
                self._busy = False
                self._changed.notify_all()
                self._changed.wait_for(lambda: self._queue)
                ref, self._busy = self._queue.popleft(), True
            while (mapping := ref()) is not None and mapping.prefault(_PREFAULT_CHUNK_BYTES):
                del mapping     # a dropped mapping is not kept alive between chunks
            # Nor after: a mapping closed during a chunk stays mapped until it is collected.
            mapping = None


_prefaulter = _Prefaulter()


class _PrefaultBudget:
    """What a transport still hands the prefaulter: whole mappings while they fit. (Its links
    call it; a bound method of the transport would make each link and its mappings part of a
    reference cycle, kept mapped until the collector runs.)"""

    def __init__(self, nbytes: int) -> None:
        self._lock = threading.Lock()
        self._left = nbytes

    def __call__(self, mapping: _Mapping) -> None:
        with self._lock:
            if mapping.size > self._left:
                return
            self._left -= mapping.size
        _prefaulter.add(mapping)


def wait_prefaulted(timeout_s: float) -> bool:
    """Until the mappings this process made so far have their page tables filled in (those
    its transports asked for: ``prefault_bytes``), or ``timeout_s`` has passed (then False):
    for a benchmark that times copies in steady state, as a long-running client makes them."""
    return _prefaulter.wait_idle(timeout_s)


def _prefault_default() -> int:
    text = os.environ.get(PREFAULT_ENV, _PREFAULT_DEFAULT).strip()
    if text == "0":
        return 0
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"${PREFAULT_ENV}: {exc}") from None


class HandoffDenied(NodeRefused):
    """The node does not trust this process's uid/gid with that hand-off (net/data_port.py)."""


class _NodeLink:
    """The open hand-off connection to one node and the segments mapped through it: each
    segment read-only for reads and, once written, writable for writes (a reader's bug or a
    hostile reader cannot write through a PROT_READ mapping of a read-only fd)."""

    def __init__(self, endpoint: str, sock: socket.socket,
                 on_mapped: Callable[[_Mapping], object] = lambda mapping: None) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self._on_mapped = on_mapped
        self.lock = threading.Lock()        # serializes hand-offs on the socket
        self.mappings: dict[tuple[str, bool], _Mapping] = {}   # by (segment id, writable)
        self.closed = False
        self._answer = Spinner(sock)   # polls a while for RESERVE and SEAL answers
        # The seal board (net/seal_board.py): asked for with the first slot reserved here;
        # None if the node has none to give. Cells by the slot's place, with when the slot's
        # hold ends (a slot never filled frees its cell then).
        self._board: mmap.mmap | None = None
        self._board_asked = False
        self._cells_lock = threading.Lock()
        self._free_cells = list(range(seal_board.CELLS))
        self._cells: dict[tuple[str, int], tuple[int, float]] = {}
        self._seals = 0   # filled on the board so far: each cell's ``seq``
        # The node's index of its committed objects (net/shm_index.py), asked for once.
        self._index: shm_index.IndexReader | None = None
        self._index_asked = False

    def alive(self) -> bool:
        """False once the node hung up (closed its end, or its process died)."""
        if self.closed:
            return False
        poller = select.poll()
        poller.register(self.sock, _DEAD)
        return not poller.poll(0)

    def mapping(self, segment_id: str, timeout_s: float, writable: bool) -> _Mapping:
        key = (segment_id, writable)
        found = self.mappings.get(key)
        if found is not None:
            return found
        with self.lock:
            found = self.mappings.get(key)
            if found is None:
                if self.closed:
                    raise TransportError(f"shm node {self.endpoint} link closed")
                found = self._handoff(segment_id, timeout_s, writable)
                self.mappings[key] = found
                self._on_mapped(found)
            return found

    def _handoff(self, segment_id: str, timeout_s: float, writable: bool) -> _Mapping:
        request = encode_handoff_request(segment_id, writable)
        if len(request) - HANDOFF_REQUEST.size > MAX_SEGMENT_ID_BYTES:
            raise SegmentBoundsError(f"segment id of {len(request) - HANDOFF_REQUEST.size} "
                                     "bytes cannot exist")
        mm, length = self._mapped_fd(request, timeout_s, writable)
        log.debug("shm_segment_mapped", endpoint=self.endpoint, segment=segment_id, size=length,
                  writable=writable)
        return _Mapping(mm, length, writable)

    def _mapped_fd(self, request: bytes, timeout_s: float, writable: bool
                   ) -> tuple[mmap.mmap, int]:
        """Send a hand-off ``request`` and map the fd the node answers with (under
        ``self.lock``); the mapping and its length."""
        self.sock.settimeout(timeout_s)
        self.sock.sendall(request)
        data, fds, flags, _ = socket.recv_fds(self.sock, RESPONSE.size, 1)
        try:
            if flags & socket.MSG_CTRUNC:
                raise TransportError("shm hand-off: control data truncated")
            data += recv_exact(self.sock, RESPONSE.size - len(data), "shm hand-off: node")
            status, length = RESPONSE.unpack(data)
            if status != FrameStatus.OK:
                message = recv_refusal(self.sock, status, length, "shm hand-off: node")
                if status in (FrameStatus.UNKNOWN_SEGMENT, FrameStatus.OUT_OF_BOUNDS):
                    raise SegmentBoundsError(f"shm {self.endpoint}: {message}")
                if status == FrameStatus.DENIED:
                    raise HandoffDenied(f"shm {self.endpoint}: hand-off denied: {message}")
                raise TransportError(f"shm {self.endpoint}: hand-off refused: {message}")
            if len(fds) != 1:
                raise TransportError("shm hand-off: no fd in the reply")
            fd = fds[0]
            if os.fstat(fd).st_size < length:
                raise TransportError("shm hand-off: fd smaller than the segment")
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _REQUIRED_SEALS != _REQUIRED_SEALS:
                raise TransportError("shm hand-off: segment fd is not sealed against shrinking")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            return mmap.mmap(fd, length, mmap.MAP_SHARED, prot), length
        finally:
            for fd in fds:
                os.close(fd)

    def take_cell(self, place: tuple[str, int], until: float, timeout_s: float) -> int | None:
        """A cell of this link's seal board for the slot at ``place`` (segment id, offset),
        held until the slot is filled or ``until`` (monotonic); None: no board, or no cell
        free (the slot's put seals on the socket)."""
        if not self._board_asked:
            self._ask_board(timeout_s)
        if self._board is None:
            return None
        with self._cells_lock:
            if (old := self._cells.pop(place, None)) is not None:
                self._free_cells.append(old[0])
            if not self._free_cells:
                now = time.monotonic()
                for p in [p for p, (_, end) in self._cells.items() if end <= now]:
                    self._free_cells.append(self._cells.pop(p)[0])
            if not self._free_cells:
                return None
            cell = self._free_cells.pop()
            self._cells[place] = (cell, until)
            return cell

    def _ask_board(self, timeout_s: float) -> None:
        """Ask the node for this link's seal board, once (an older node has none to give)."""
        with self.lock:
            if self._board_asked or self.closed:
                return
            self._board_asked = True
            with contextlib.suppress(TransportError):
                mm, length = self._mapped_fd(HANDOFF_REQUEST.pack(HANDOFF_BOARD), timeout_s,
                                             True)
                if length < seal_board.BOARD_BYTES:
                    mm.close()
                    return
                self._board = mm

    def index(self, timeout_s: float) -> shm_index.IndexReader | None:
        """The node's shm index, asked for on first use; None if it has none to give."""
        if not self._index_asked:
            with self.lock:
                if not self._index_asked and not self.closed:
                    self._index_asked = True
                    with contextlib.suppress(TransportError, OSError, ValueError):
                        mm, _ = self._mapped_fd(HANDOFF_REQUEST.pack(HANDOFF_INDEX), timeout_s,
                                                writable=False)
                        try:
                            self._index = shm_index.IndexReader(mm)
                        except ValueError:
                            mm.close()
                            raise
        return self._index

    def cell_at(self, place: tuple[str, int]) -> int | None:
        """The cell taken for the slot at ``place``, if any."""
        got = self._cells.get(place)
        return None if got is None else got[0]

    def drop_cell(self, place: tuple[str, int]) -> int | None:
        """The cell taken for the slot at ``place`` (None if none), free again for another."""
        with self._cells_lock:
            got = self._cells.pop(place, None)
            if got is not None:
                self._free_cells.append(got[0])
            return None if got is None else got[0]

    def seal_in(self, cell: int, record: PutRecord, length: int) -> bool:
        """Seal ``record`` (its CRC-32C set) of ``length`` bytes in ``cell``: the node holds it
        from now on. False if it does not fit a cell (seal it on the socket)."""
        board = self._board
        if board is None:
            return False
        with self._cells_lock:
            self._seals += 1
            seq = self._seals
        try:
            return seal_board.fill(board, cell, seq, record.key, length, record.checksum,
                                   record.parent)
        except ValueError:   # the link was closed meanwhile: the SEAL frame says so
            return False

    def records(self, op: Op, items: list[tuple[IoOp, PutRecord]], timeout_s: float,
                meanwhile: Callable[[], object] | None = None
                ) -> list[TransportError | None]:
        """RESERVE or SEAL each ``(op, record)`` at the node, all sent at once and answered
        in order; one result per item (a refusal keeps the link usable). TransportError
        (raised) if the link failed. ``meanwhile``: called once the requests are sent, before
        their answers are read (the node works while the caller does), under this link's
        lock; whatever it raises is raised once the answers are read."""
        requests = [encode_handoff_record(op, io.replica.extent.segment_id,
                                          io.replica.extent.offset, io.replica.extent.length,
                                          record) for io, record in items]
        with self.lock:
            if self.closed:
                raise TransportError(f"shm node {self.endpoint} link closed")
            self.sock.settimeout(timeout_s)
            self.sock.sendall(b"".join(requests))
            if meanwhile is None:
                return self._answers(op, items)
            try:
                meanwhile()
            finally:   # read the answers whatever happened, or the link is out of step
                out = self._answers(op, items)
            return out

    def _answers(self, op: Op, items: list[tuple[IoOp, PutRecord]]
                 ) -> list[TransportError | None]:
        out: list[TransportError | None] = []
        self._answer.wait()
        for io, record in items:
            status, length = RESPONSE.unpack(recv_exact(self.sock, RESPONSE.size,
                                                        "shm node"))
            if status == FrameStatus.OK and length == 0:
                out.append(None)
                continue
            message = recv_refusal(self.sock, status, length, "shm node")
            if status == FrameStatus.BAD_REQUEST:
                raise TransportError(f"shm {self.endpoint}: {op.name} refused as "
                                     f"malformed: {message}")
            out.append(TransportError(f"shm {self.endpoint}: {op.name} of "
                                      f"{record.key!r} refused ({FrameStatus(status).name}): "
                                      f"{message}"))
        return out

    def close(self) -> None:
        with self.lock:
            self.closed = True
            mappings, self.mappings = self.mappings, {}
            for m in mappings.values():
                m.close()
            if self._board is not None:
                self._board.close()
            if self._index is not None:
                self._index.close()
            self.sock.close()


def _adjacent_runs(ready: list[tuple[int, _Mapping]], ops: Sequence[IoOp],
                   views: list[memoryview]) -> list[list[tuple[int, _Mapping]]]:
    """Split ``ready`` (in op order) into runs that one memcpy can move: consecutive ops whose
    extents follow each other in one segment and whose buffers follow each other in memory.

    A prompt's blocks are allocated back to back and engines keep KV blocks in one large
    tensor, so a batch is usually a few runs: one large copy per run streams at memcpy speed,
    where hundreds of block-sized copies do not.
    """
    runs: list[list[tuple[int, _Mapping]]] = []
    end_mapping, end_offset, end_address = None, -1, -1
    for item in ready:
        i, mapping = item
        extent = ops[i].replica.extent
        if extent.length == 0:   # nothing to copy, and an empty buffer has no address
            runs.append([item])
            end_mapping = None
            continue
        if mapping is end_mapping and extent.offset == end_offset:
            address = address_of(views[i])
            if address == end_address:
                runs[-1].append(item)
                end_offset, end_address = extent.end, address + extent.length
                continue
        else:
            address = None
        runs.append([item])
        end_mapping, end_offset = mapping, extent.end
        end_address = (address_of(views[i]) if address is None else address) + extent.length
    return runs


def _copy_run(link: _NodeLink, run: list[tuple[int, _Mapping]], ops: Sequence[IoOp],
              views: list[memoryview], write: bool) -> None:
    first, mapping = run[0]
    start = ops[first].replica.extent.offset
    end = ops[run[-1][0]].replica.extent.end
    if len(run) == 1:
        buf = views[first]
    else:   # the run's buffers are one contiguous range: view it whole (they outlive the copy)
        buf = view_at(address_of(views[first]), end - start)
    _copy(link, mapping, start, end, buf, write)


def _region(link: _NodeLink, mapping: _Mapping, start: int, end: int) -> memoryview:
    try:
        mapping.populate(start, end)
        return mapping.view[start:end]
    except ValueError as exc:   # released: the link was dropped by another thread
        raise TransportError(f"shm node {link.endpoint} mapping dropped") from exc


def _copy(link: _NodeLink, mapping: _Mapping, start: int, end: int, buf: memoryview,
          write: bool) -> None:
    """Move ``buf`` to or from ``[start, end)`` of ``mapping``."""
    with _region(link, mapping, start, end) as region:
        # numpy's copy is a memcpy that releases the GIL, where a memoryview's holds it: the
        # caller's other threads (and a put's checksum thread) run meanwhile.
        theirs, ours = np.frombuffer(region, dtype=np.uint8), np.frombuffer(buf, dtype=np.uint8)
        if write:
            _memcpy(theirs, ours)
        else:
            _memcpy(ours, theirs)


def _memcpy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto``, in pieces where one copy would hit 4K aliasing: glibc copies a buffer
    past its non-temporal threshold with a loop that runs at a third of its speed when the
    destination lies a little ahead of the source modulo 4 KiB (a segment's extents start on
    a page; a numpy or torch buffer often 16 or 64 bytes past one, so a read into it is the
    slow case: 512 MiB in 114-144 ms against 33 here). Pieces of ``_ALIASED_PIECE_BYTES``
    take glibc's other loop, which does not mind (58 ms); where the distance is safe one
    copy is fastest."""
    n = src.nbytes
    if n >= _ALIASED_PIECE_BYTES and 0 < (dst.ctypes.data - src.ctypes.data) % 4096 < _ALIASED:
        for at in range(0, n, _ALIASED_PIECE_BYTES):
            np.copyto(dst[at:at + _ALIASED_PIECE_BYTES], src[at:at + _ALIASED_PIECE_BYTES])
    else:
        np.copyto(dst, src)


def _write_summed(link: _NodeLink, mapping: _Mapping, start: int, end: int,
                  buf: memoryview) -> int:
    """Copy ``buf`` to ``[start, end)`` of ``mapping``; returns the CRC-32C of ``buf``. Past
    ``_SUM_CHUNKED_MAX_BYTES`` and up to ``_SUM_WHOLE_MAX_BYTES``: checksummed, then copied
    (the copy reads it from cache); else a cache-sized chunk at a time, each chunk
    checksummed right after its copy, from cache: one pass over memory where a copy and a
    separate checksum would take two."""
    with _region(link, mapping, start, end) as region:
        theirs, ours = np.frombuffer(region, dtype=np.uint8), np.frombuffer(buf, dtype=np.uint8)
        if _SUM_CHUNKED_MAX_BYTES < len(ours) <= _SUM_WHOLE_MAX_BYTES:
            crc = checksum(ours)
            _memcpy(theirs, ours)
            return crc
        crc = 0
        for at in range(0, len(ours), _SUM_CHUNK_BYTES):
            chunk = ours[at:at + _SUM_CHUNK_BYTES]
            np.copyto(theirs[at:at + _SUM_CHUNK_BYTES], chunk)
            crc = checksum(chunk, crc)
        return crc


def _halve(copies: list[tuple[int, int, memoryview]]
           ) -> tuple[list[tuple[int, int, memoryview]], list[tuple[int, int, memoryview]]]:
    """Split ``(start, end, buffer)`` copies into two lists of equal bytes, cutting the copy
    that straddles the middle in two."""
    half = sum(end - start for start, end, _ in copies) // 2
    for k, (start, end, buf) in enumerate(copies):
        if end - start < half:
            half -= end - start
            continue
        return ([*copies[:k], (start, start + half, buf[:half])],
                [(start + half, end, buf[half:]), *copies[k + 1:]])
    return copies, []


def _pieces(copies: list[tuple[int, int, memoryview]], piece_bytes: int
            ) -> list[tuple[int, int, memoryview]]:
    """``(start, end, buffer)`` copies cut into pieces of at most ``piece_bytes``."""
    out = []
    for start, end, buf in copies:
        for at in range(0, end - start, piece_bytes):
            stop = min(at + piece_bytes, end - start)
            out.append((start + at, start + stop, buf[at:stop]))
    return out


def _split_by_bytes(items: list, nbytes: Callable[[object], int]) -> int:
    """The index that splits ``items`` into two halves of about equal bytes."""
    half, total = sum(map(nbytes, items)) / 2, 0
    for k, item in enumerate(items):
        total += nbytes(item)
        if total >= half:
            return k + 1
    return len(items)


class SHMTransport(Transport):
    """Reads and writes same-host nodes' segments through shared mappings (one memcpy per op).

    ``boot_id`` defaults to this host's (injectable for tests); a node is reachable when it
    publishes an shm endpoint and the same non-empty boot id. ``timeout_s`` bounds the unix
    connect and each hand-off; ``retry_after_s`` is how long a node whose hand-off socket
    refused us (e.g. another network namespace) is failed fast before trying again.
    """

    scheme = "shm"

    def __init__(self, timeout_s: float = 10.0, *, boot_id: str | None = None,
                 retry_after_s: float = 5.0, prefault_bytes: int | None = None) -> None:
        self._timeout_s = timeout_s
        self._prefault = _PrefaultBudget(_prefault_default() if prefault_bytes is None
                                         else prefault_bytes)
        self._boot_id = local_boot_id() if boot_id is None else boot_id
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._links: dict[str, _NodeLink] = {}
        self._refused_until: dict[str, float] = {}
        self._executor: ThreadPoolExecutor | None = None   # write_summed's helper, on first use
        self._closed = False

    def can_reach(self, node: NodeEndpoints) -> bool:
        return bool(node.shm_endpoint) and bool(self._boot_id) and node.boot_id == self._boot_id

    def read(self, ops: Sequence[IoOp]) -> list[TransportError | None]:
        return self._run(ops, byte_views(ops, writable=True), write=False)

    def write(self, ops: Sequence[IoOp]) -> list[TransportError | None]:
        return self._run(ops, byte_views(ops, writable=False), write=True)

    def write_summed(self, ops: Sequence[IoOp]
                     ) -> tuple[list[TransportError | None], list[int | None]]:
        """:meth:`write`, also returning each op's CRC-32C (None where it failed), computed
        while copying (see :func:`_write_summed`). A batch of at least ``_SPLIT_MIN_BYTES`` is
        split by bytes between the caller's thread and a helper thread (numpy copies and
        crc32c release the GIL): on two free cores a put then costs about one memcpy."""
        sums: list[int | None] = [None] * len(ops)
        return self._run(ops, byte_views(ops, writable=False), write=True, sums=sums), sums

    def read_at(self, segments: Sequence[Replica], which: np.ndarray, offsets: np.ndarray,
                lengths: np.ndarray, addresses: np.ndarray, grants: Sequence[bytes] = ()
                ) -> dict[int, TransportError]:
        """Each segment's extents copied in place from its mapping, the runs found with numpy
        (see :meth:`Transport.read_at`); a segment whose copy fails fails all its extents.
        ``grants`` are not needed: a peer the node trusts maps the whole segment."""
        if self._closed:
            raise ClientClosed("transport is closed")
        failed: dict[int, TransportError] = {}
        for s in np.flatnonzero(np.bincount(which)).tolist():
            ks = np.flatnonzero(which == s)
            try:
                self._read_segment(segments[s], offsets[ks], lengths[ks], addresses[ks])
            except TransportError as exc:
                failed.update(dict.fromkeys(ks.tolist(), exc))
        return failed

    def _read_segment(self, segment: Replica, offsets: np.ndarray, lengths: np.ndarray,
                      addresses: np.ndarray) -> None:
        """:meth:`read_at` for the extents of one segment: all or nothing, TransportError
        (SegmentBoundsError for an extent outside the segment) if any fails."""
        endpoint = segment.node.shm_endpoint
        link = self._link(endpoint)
        if not link.alive():
            self._drop(link, "node hung up")
            raise TransportError(f"shm node {endpoint} hung up (node gone)")
        mapping = self._segment(link, segment.extent.segment_id, writable=False)
        ends = offsets + lengths
        if int(ends.max()) > mapping.size:
            raise SegmentBoundsError(f"an extent ends past segment "
                                     f"{segment.extent.segment_id!r} of {mapping.size} bytes")
        # A new run wherever the next extent or the next buffer does not follow on.
        follows = (offsets[1:] == ends[:-1]) & (addresses[1:] == addresses[:-1] + lengths[:-1])
        starts = np.flatnonzero(~follows) + 1
        copies = []
        for first, stop in zip([0, *starts.tolist()], [*starts.tolist(), len(offsets)]):
            start, end = int(offsets[first]), int(ends[stop - 1])
            copies.append((start, end, view_at(int(addresses[first]), end - start)))

        def read(part: Iterable[tuple[int, int, memoryview]]) -> None:
            for start, end, buf in part:
                _copy(link, mapping, start, end, buf, write=False)

        try:
            if int(ends.max() - offsets.min()) < _SPLIT_MIN_BYTES:   # cheap upper bound
                read(copies)
            else:
                # Half the bytes each, each half copied front to back (two streams far apart
                # copy faster here than two threads taking turns at neighbouring pieces: 29
                # against 37 ms for 512 MiB). The helper's half is cut in pieces, and this
                # thread, once done with its own, takes them from the back: a helper that
                # wakes late (a sleeping core takes a while here) copies less instead of
                # holding up the end, and is not waited for if it never started.
                first_half, second_half = _halve(copies)
                theirs = collections.deque(_pieces(second_half, _READ_PIECE_BYTES))

                def take_from_front() -> None:
                    with contextlib.suppress(IndexError):
                        while True:
                            start, end, buf = theirs.popleft()
                            _copy(link, mapping, start, end, buf, write=False)

                helper = self._helper().submit(take_from_front)
                try:
                    read(first_half)
                    with contextlib.suppress(IndexError):
                        while True:
                            start, end, buf = theirs.pop()
                            _copy(link, mapping, start, end, buf, write=False)
                finally:
                    if not helper.cancel():
                        helper.result()
        except TransportError as exc:
            self._drop(link, str(exc))
            raise

    def read_local(self, key: str, buffer_for: Callable[[int], memoryview]) -> int | None:
        """Read the object stored under ``key`` (a stored key) from a same-host node's shm
        index (net/shm_index.py) with no master call: its size once copied into
        ``buffer_for(size)``, or None (not indexed on a node this client has a link to, or
        changed during the copy: ask the master). A reader's own bug (a buffer too small:
        InvalidArgument) is raised."""
        if self._closed:
            return None
        found, digest = None, shm_index.digest(key)
        for link in list(self._links.values()):
            index = link.index(self._timeout_s)
            if index is not None and (entry := index.find(digest)) is not None:
                found = link, index, entry
                break
        if found is None:
            return None
        link, index, entry = found
        if not index.open or not link.alive():   # its node stopped: every entry is void
            self._drop(link, "node hung up")
            return None
        segment_id = index.segment_id(entry.segment)
        if segment_id is None:
            return None
        try:
            mapping = link.mapping(segment_id, self._timeout_s, writable=False)
            if entry.offset + entry.length > mapping.size:
                return None
            buf = buffer_for(entry.length)
            _copy(link, mapping, entry.offset, entry.offset + entry.length, buf, write=False)
        except (TransportError, OSError):
            return None
        return entry.length if index.still(entry) else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = self._links, {}
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        for link in links.values():
            link.close()

    seals = True

    def write_sealed(self, ops: Sequence[IoOp], records: Sequence[PutRecord], *,
                     reserved: bool = False
                     ) -> tuple[list[TransportError | None], list[int | None]]:
        """:meth:`Transport.write_sealed`: a RESERVE round trip on each node's hand-off link,
        the copy (checksummed as it goes), a SEAL round trip. ``reserved``: the extents lie
        in slots reserved already (no RESERVE); a slot's seal goes in its seal board cell
        (no round trip), else in a SEAL."""
        results: list[TransportError | None] = [None] * len(ops) if reserved else \
            list(self._records(Op.RESERVE, ops, records))
        todo = [k for k, e in enumerate(results) if e is None]
        sums: list[int | None] = [None] * len(ops)
        if todo:
            errors, crcs = self.write_summed([ops[k] for k in todo])
            for k, e, c in zip(todo, errors, crcs):
                results[k], sums[k] = e, c
        sealed = {k: PutRecord(records[k].key, records[k].version, records[k].epoch,
                               records[k].hold_s, sums[k], records[k].parent)
                  for k, e in enumerate(results) if e is None}
        if reserved:
            for k, op in enumerate(ops):
                if self._sealed_in_cell(op, sealed.get(k)):
                    del sealed[k]
        if sealed:
            for k, e in zip(sealed, self._records(Op.SEAL, [ops[k] for k in sealed],
                                                  list(sealed.values()))):
                results[k] = e
        return results, [None if e is not None else c for e, c in zip(results, sums)]

    def _sealed_in_cell(self, op: IoOp, sealed: PutRecord | None) -> bool:
        """Seal ``sealed`` (None: its write failed) in the seal board cell of the slot ``op``
        filled, and free the cell; False where that slot has no cell, or the record does not
        fit one (seal it on the socket)."""
        place = (op.replica.extent.segment_id, op.replica.extent.offset)
        link = self._links.get(op.replica.node.shm_endpoint)
        if link is None or (cell := link.cell_at(place)) is None:
            return False
        # The cell is freed only once filled: a cell taken again meanwhile would be bound to
        # another slot at the node, and this record read as that slot's.
        done = sealed is not None and link.seal_in(cell, sealed, op.replica.extent.length)
        link.drop_cell(place)
        return done

    slots = True

    def reserve(self, ops: Sequence[IoOp], records: Sequence[PutRecord]
                ) -> list[TransportError | None]:
        """:meth:`Transport.reserve`: one exchange per node on its hand-off link, each naming
        a cell of the link's seal board that the slot's put will seal in (net/seal_board.py);
        then each extent reserved is faulted into this process's page tables, so that the put
        filling it copies into mapped pages (a 1 MiB copy into unmapped ones took ~0.7 ms
        here)."""
        records = [self._with_cell(op, r) for op, r in zip(ops, records)]
        results = self._records(Op.RESERVE, ops, records)
        for op, record, error in zip(ops, records, results):
            e = op.replica.extent
            if error is not None:
                if record.cell is not None:
                    with contextlib.suppress(OSError):
                        self._link(op.replica.node.shm_endpoint).drop_cell(
                            (e.segment_id, e.offset))
                continue
            with contextlib.suppress(OSError):   # TransportError too: the put says so
                link = self._link(op.replica.node.shm_endpoint)
                self._mapping(link, op, True).populate(e.offset, e.end, small=True)
        return results

    def _with_cell(self, op: IoOp, record: PutRecord) -> PutRecord:
        e = op.replica.extent
        try:
            cell = self._link(op.replica.node.shm_endpoint).take_cell(
                (e.segment_id, e.offset), time.monotonic() + record.hold_s, self._timeout_s)
        except OSError:   # the RESERVE fails the same way, and says so
            return record
        return record if cell is None else dataclasses.replace(record, cell=cell)

    def write_sealed_then(self, op: IoOp, record: PutRecord, then: Callable[[int], object],
                          *, reserved: bool = False
                          ) -> tuple[TransportError | None, int | None, bool]:
        """:meth:`Transport.write_sealed_then`: ``then`` runs while the SEAL is on its way and
        being checked (one round trip on the node's hand-off link, beside the caller's). A
        slot reserved with a seal board cell is sealed in the cell instead, before ``then``
        runs: no round trip to the node at all."""
        if not reserved:
            [error] = self._records(Op.RESERVE, [op], [record])
            if error is not None:
                return error, None, False
        [error], [crc] = self.write_summed([op])
        if error is not None or crc is None:
            if reserved:
                self._sealed_in_cell(op, None)   # its cell is free again
            return error, None, False
        sealed = PutRecord(record.key, record.version, record.epoch, record.hold_s, crc,
                           record.parent)
        if reserved and self._sealed_in_cell(op, sealed):
            then(crc)
            return None, crc, True
        called = False

        def once() -> None:
            nonlocal called
            if not called:
                called = True
                then(crc)
        [error] = self._records(Op.SEAL, [op], [sealed], once)
        once()   # the link failed before the SEAL went out: ``then`` still runs, once
        return error, crc, True

    def _records(self, op: Op, ops: Sequence[IoOp], records: Sequence[PutRecord],
                 meanwhile: Callable[[], object] | None = None
                 ) -> list[TransportError | None]:
        """RESERVE or SEAL each op's record at its node, one exchange per node; with
        ``meanwhile`` (one node only), called while that exchange is under way."""
        results: list[TransportError | None] = [None] * len(ops)
        for endpoint, indexes in group_by(ops, lambda op: op.replica.node.shm_endpoint).items():
            try:
                link = self._link(endpoint)
                try:
                    got = link.records(op, [(ops[k], records[k]) for k in indexes],
                                       self._timeout_s, meanwhile)
                except OSError as exc:   # TransportError too: the link is no longer in step
                    self._drop(link, str(exc))
                    raise
            except OSError as exc:
                got = [TransportError(f"shm {endpoint}: {op.name} failed: {exc}")] * len(indexes)
            for k, e in zip(indexes, got):
                results[k] = e
        return results

    # ----------------------------------------------------------------

    def _run(self, ops: Sequence[IoOp], views: list[memoryview], *, write: bool,
             sums: list[int | None] | None = None) -> list[TransportError | None]:
        if self._closed:
            raise ClientClosed("transport is closed")
        results: list[TransportError | None] = [None] * len(ops)
        for endpoint, indexes in group_by(ops, lambda op: op.replica.node.shm_endpoint).items():
            try:
                link = self._link(endpoint)
                if not link.alive():
                    self._drop(link, "node hung up")
                    raise TransportError(f"shm node {endpoint} hung up (node gone)")
            except TransportError as exc:
                for i in indexes:
                    results[i] = TransportError(str(exc))
                continue
            # Resolve every op first (hand-offs, bounds), then copy what resolved, so that a
            # failed hand-off fails only the ops from it on, as if copied one by one.
            ready: list[tuple[int, _Mapping]] = []
            failure: TransportError | None = None
            failed: list[int] = []
            for pos, i in enumerate(indexes):
                try:
                    ready.append((i, self._mapping(link, ops[i], write)))
                except SegmentBoundsError as exc:
                    results[i] = exc
                except TransportError as exc:
                    failure, failed = exc, list(indexes[pos:])
                    break
            if sums is not None:
                exc, undone = self._write_all_summed(link, ready, ops, views, sums)
                if exc is not None:
                    failure, failed = exc, undone + failed
            else:
                runs = _adjacent_runs(ready, ops, views)
                for k, run in enumerate(runs):
                    try:
                        _copy_run(link, run, ops, views, write)
                    except TransportError as exc:
                        failure = exc
                        failed = [i for later in runs[k:] for i, _ in later] + failed
                        break
            if failure is not None:
                self._drop(link, str(failure))
                for j in failed:
                    results[j] = TransportError(str(failure))
        return results

    def _write_all_summed(self, link: _NodeLink, ready: list[tuple[int, _Mapping]],
                          ops: Sequence[IoOp], views: list[memoryview], sums: list
                          ) -> tuple[TransportError | None, list[int]]:
        """Write every ready op with :func:`_write_summed`, its CRC into ``sums``; a large
        batch in two halves, the second by the helper thread. Returns the first failure and
        the ops it left unwritten."""
        def write(items: list[tuple[int, _Mapping]]) -> tuple[TransportError | None, list[int]]:
            for pos, (i, mapping) in enumerate(items):
                extent = ops[i].replica.extent
                try:
                    sums[i] = _write_summed(link, mapping, extent.offset, extent.end, views[i])
                except TransportError as exc:
                    return exc, [j for j, _ in items[pos:]]
            return None, []

        total = sum(views[i].nbytes for i, _ in ready)
        if len(ready) < 2 or total < _SPLIT_MIN_BYTES:
            return write(ready)
        runs = _adjacent_runs(ready, ops, views)
        if total >= _STREAM_RUN_BYTES * len(runs):
            return self._write_runs_summed(link, runs, ops, views, sums)
        half = _split_by_bytes(ready, lambda item: views[item[0]].nbytes)
        second = self._helper().submit(write, ready[half:])
        first_exc, first_undone = write(ready[:half])
        second_exc, second_undone = second.result()
        return first_exc or second_exc, first_undone + second_undone

    @staticmethod
    def _write_runs_summed(link: _NodeLink, runs: list[list[tuple[int, _Mapping]]],
                           ops: Sequence[IoOp], views: list[memoryview], sums: list
                           ) -> tuple[TransportError | None, list[int]]:
        """Large runs: one memcpy per run in this thread (a copy that large streams past the
        cache), while a helper thread checksums the caller's buffers (:class:`Checksums`)."""
        order = [i for run in runs for i, _ in run]
        with Checksums([views[i] for i in order]) as checksums:
            for k, run in enumerate(runs):
                try:
                    _copy_run(link, run, ops, views, True)
                except TransportError as exc:
                    return exc, [i for later in runs[k:] for i, _ in later]
            for i, crc in zip(order, checksums.result()):
                sums[i] = crc
        return None, []

    def _helper(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise ClientClosed("transport is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-shm-write")
            return self._executor

    def _mapping(self, link: _NodeLink, op: IoOp, writable: bool) -> _Mapping:
        """The mapping of ``op``'s segment, with ``op``'s extent checked against it."""
        extent = op.replica.extent
        mapping = self._segment(link, extent.segment_id, writable)
        if extent.offset < 0 or extent.length < 0 or extent.end > mapping.size:
            raise SegmentBoundsError(
                f"[{extent.offset}, {extent.end}) is outside segment {extent.segment_id!r} "
                f"of {mapping.size} bytes")
        return mapping

    def _segment(self, link: _NodeLink, segment_id: str, writable: bool) -> _Mapping:
        """The mapping of a segment of ``link``'s node (handed off on first use); a node that
        denies us is failed fast for ``retry_after_s``, as one whose socket refused us."""
        try:
            return link.mapping(segment_id, self._timeout_s, writable)
        except HandoffDenied:
            with self._lock:
                self._refused_until[link.endpoint] = time.monotonic() + self._retry_after_s
            raise
        except TransportError:
            raise
        except OSError as exc:
            raise TransportError(f"shm hand-off with {link.endpoint} failed: {exc}") from exc

    def _link(self, endpoint: str) -> _NodeLink:
        with self._lock:
            link = self._links.get(endpoint)
            if link is not None:
                return link
            if not endpoint:
                raise TransportError("node publishes no shm endpoint")
            if self._refused_until.get(endpoint, 0.0) > time.monotonic():
                raise TransportError(f"shm node {endpoint} refused the hand-off recently")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self._timeout_s)
        try:
            sock.connect("\0" + endpoint)
        except OSError as exc:
            sock.close()
            now = time.monotonic()
            with self._lock:
                for stale in [e for e, t in self._refused_until.items() if t <= now]:
                    del self._refused_until[stale]
                self._refused_until[endpoint] = now + self._retry_after_s
            raise TransportError(f"shm node {endpoint} unreachable: {exc}") from exc
        with self._lock:
            if self._closed:
                sock.close()
                raise ClientClosed("transport is closed")
            link = self._links.setdefault(endpoint, _NodeLink(endpoint, sock, self._prefault))
        if link.sock is not sock:   # another thread connected first
            sock.close()
        return link

    def _drop(self, link: _NodeLink, reason: str) -> None:
        with self._lock:
            if self._links.get(link.endpoint) is link:
                del self._links[link.endpoint]
        if not link.closed:
            log.info("shm_node_dropped", endpoint=link.endpoint, reason=reason)
        link.close()
