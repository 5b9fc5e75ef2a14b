"""Memory segments a store node serves: the bytes that replicas live in.

A segment is one contiguous byte range with a cluster-unique id. DRAM segments are anonymous
memfds (``memfd_create``): populated (committed) when created, shareable with same-host
clients by passing the fd over a unix socket (the shm transport), and with no name in /dev/shm,
so nothing leaks when the node is SIGKILLed. Disk segments (:mod:`kvpool.store_node.disk`)
implement the same ABC over a file; HBM segments over one CUDA allocation.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvpool.common.errors import InvalidArgument
from kvpool.common.host import map_populated
from kvpool.common.logging import get_logger
from kvpool.common.types import SegmentInfo
from kvpool.net.data_port import MAX_SEGMENT_ID_BYTES
from kvpool.net.sockets import send_all

log = get_logger(__name__)

# Sealed so that a client holding the fd cannot ftruncate it: a shrunk memfd would SIGBUS the
# node (and every other client) on the next access to the lost pages.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MEMFD_NAME_MAX = 249   # memfd_create(2): 249 bytes plus the "memfd:" prefix


def new_segment_id(node_id: str, index: int) -> str:
    """A segment id unique across the cluster and across node restarts.

    ``<node_id>/<index>-<random>``: the node id and index keep it readable in logs; the random
    token keeps a restarted node's segments distinct from its previous life's, so a stale
    descriptor can never address the new memory.
    """
    if not node_id:
        raise InvalidArgument("node_id must not be empty")
    segment_id = f"{node_id}/{index}-{secrets.token_hex(8)}"
    if len(segment_id.encode("utf-8")) > MAX_SEGMENT_ID_BYTES:
        raise InvalidArgument(
            f"node_id is too long for a segment id (limit {MAX_SEGMENT_ID_BYTES} bytes)")
    return segment_id


class Segment(ABC):
    """One mounted byte range of a store node."""

    #: ``buffer`` works (False for device memory: read_into / write_from copy instead).
    host_addressable = True

    @property
    @abstractmethod
    def info(self) -> SegmentInfo:
        """Id, size and tier."""

    @property
    @abstractmethod
    def fd(self) -> int:
        """An fd same-host clients can mmap (MAP_SHARED) to reach the bytes; -1 if none."""

    @property
    def readonly_fd(self) -> int:
        """An fd of the same bytes that can only be mapped PROT_READ (a reader's hand-off):
        opened O_RDONLY on an inode only its owner may open writable; -1 if none."""
        return -1

    @property
    @abstractmethod
    def buffer(self) -> memoryview:
        """A writable, contiguous memoryview (format "B") over the whole segment."""

    @abstractmethod
    def close(self) -> None:
        """Release the memory. Idempotent; views sliced earlier keep their pages alive."""

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return False

    def read_into(self, offset: int, view: memoryview) -> None:
        """Copy ``[offset, offset + len(view))`` into ``view`` (demotion and promotion use it;
        a disk segment does it with one large pread instead of faulting pages in)."""
        view[:] = self.buffer[offset:offset + len(view)]

    def write_from(self, offset: int, view: memoryview) -> None:
        """Copy ``view`` to ``[offset, offset + len(view))``."""
        self.buffer[offset:offset + len(view)] = view

    def send_to(self, sock: socket.socket, offset: int, length: int, header: bytes = b"") -> None:
        """Send ``header`` then ``[offset, offset + length)`` on a connected blocking socket
        (a tcp READ's reply). ValueError, with nothing sent, if the segment is closed or the
        range is outside it. This default sends a slice of :attr:`buffer` and the header in
        one gathered send; a disk segment overrides it with sendfile(2), HBM with staging."""
        self.check_range(offset, length)
        with self.buffer[offset:offset + length] as view:
            send_all(sock, [header, view])

    def view_to_send(self, offset: int, length: int) -> memoryview | None:
        """``[offset, offset + length)`` as a view of :attr:`buffer`, for a READ's reply sent
        later with others (store_node/data_server.py ``_Conn.answer``); None where the
        segment sends its bytes its own way (disk: sendfile, HBM: staging). ValueError as
        :meth:`send_to`."""
        self.check_range(offset, length)
        return self.buffer[offset:offset + length]

    def recv_from(self, recv_exact: Callable[[memoryview], None], offset: int,
                  length: int) -> None:
        """Fill ``[offset, offset + length)`` with ``recv_exact(view)`` (a tcp WRITE's
        payload). ValueError, with nothing received, if the segment is closed or the range
        is outside it. This default receives into a slice of :attr:`buffer`."""
        self.check_range(offset, length)
        with self.buffer[offset:offset + length] as view:
            recv_exact(view)

    def check_range(self, offset: int, length: int) -> None:
        """ValueError if the segment is closed or ``[offset, offset + length)`` is outside it."""
        if self.closed:
            raise ValueError(f"segment {self.info.segment_id} is closed")
        if offset < 0 or length < 0 or offset + length > self.info.size_bytes:
            raise ValueError(f"[{offset}, {offset + length}) is outside segment "
                             f"{self.info.segment_id!r} of {self.info.size_bytes} bytes")


def _map(fd: int, length: int, populate: bool) -> mmap.mmap:
    if populate:
        return map_populated(fd, length)
    return mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


class MappedSegment(Segment):
    """A segment that is one MAP_SHARED mapping of an fd (DRAM: a memfd; disk: a file)."""

    def __init__(self, info: SegmentInfo, fd: int, populate: bool = False) -> None:
        """Map ``fd``, which this segment owns from now on (closed here if mapping fails);
        ``populate``: with every page in place and writable now, not on first touch."""
        self._info = info
        self._lock = threading.Lock()
        try:
            self._mmap: mmap.mmap | None = _map(fd, info.size_bytes, populate)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._buffer: memoryview | None = memoryview(self._mmap)

    @property
    def info(self) -> SegmentInfo:
        return self._info

    @property
    def buffer(self) -> memoryview:
        buf = self._buffer
        if buf is None:
            raise ValueError(f"segment {self._info.segment_id} is closed")
        return buf

    @property
    def closed(self) -> bool:
        return self._buffer is None

    def close(self) -> None:
        with self._lock:
            if self._buffer is None:
                return
            self._buffer.release()
            self._buffer = None
            mm, self._mmap = self._mmap, None
            try:
                mm.close()
            except BufferError:
                # A request in flight still holds a slice: the mapping is unmapped when the last
                # view is released and the mmap object is collected; dropping it is enough.
                log.debug("segment_unmap_deferred", segment=self._info.segment_id)
            os.close(self._fd)


class DramSegment(MappedSegment):
    """A DRAM segment backed by a sealed memfd mapped MAP_SHARED; with ``hugepages``, a
    hugetlbfs memfd (``MFD_HUGETLB``: 2 MiB pages reserved by the operator, see
    :func:`check_hugepages`), which same-host clients map and RDMA registers the same way."""

    def __init__(self, segment_id: str, size_bytes: int, hugepages: bool = False) -> None:
        if size_bytes <= 0:
            raise InvalidArgument(f"segment size must be positive, not {size_bytes}")
        name = f"kvpool:{segment_id}".encode()[:_MEMFD_NAME_MAX].decode("utf-8", "ignore")
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if hugepages else 0)
        fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(fd, size_bytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            # A memfd is created mode 0777: anyone holding a read-only fd of it could reopen it
            # writable through /proc/self/fd/N. Owner-only, a reader of another uid cannot.
            os.fchmod(fd, 0o600)
            self._ro_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(fd)
            raise
        # Populated up front, as an RDMA registration would pin it: first-touch page faults
        # (kernel zeroing) otherwise cut put throughput several-fold. Measured on 2 MiB
        # blocks over shm: ~0.7 GiB/s lazily, ~6 GiB/s populated.
        try:
            super().__init__(SegmentInfo(segment_id=segment_id, size_bytes=size_bytes,
                                         tier="dram"), fd, populate=True)
        except BaseException:
            os.close(self._ro_fd)
            raise

    @property
    def fd(self) -> int:
        if self._buffer is None:
            raise ValueError(f"segment {self._info.segment_id} is closed")
        return self._fd

    @property
    def readonly_fd(self) -> int:
        if self._buffer is None:
            raise ValueError(f"segment {self._info.segment_id} is closed")
        return self._ro_fd

    def close(self) -> None:
        super().close()
        with self._lock:
            fd, self._ro_fd = self._ro_fd, -1
        if fd >= 0:
            os.close(fd)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"DramSegment({self._info.segment_id!r}, {self._info.size_bytes}, {state})"


def create_dram_segment(node_id: str, index: int, size_bytes: int,
                        hugepages: bool = False) -> DramSegment:
    """Allocate DRAM segment number ``index`` of ``node_id`` (populated at once), in huge
    pages if ``hugepages`` (call :func:`check_hugepages` first for a clear error)."""
    return DramSegment(new_segment_id(node_id, index), size_bytes, hugepages)


def check_hugepages(sizes: list[int], meminfo: str = "/proc/meminfo") -> None:
    """InvalidArgument, saying what to do, unless segments of ``sizes`` fit in this host's
    free huge pages: each a whole number of pages, all of them in the pages free. Huge pages
    are reserved by the operator (``sysctl vm.nr_hugepages=N``), never by kvpool."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f)
        page = int(fields["Hugepagesize"].split()[0]) * 1024
        free = int(fields["HugePages_Free"].split()[0])
    except (OSError, KeyError, ValueError):
        raise InvalidArgument("--hugepages: this kernel reports no huge pages "
                              f"(no Hugepagesize in {meminfo})") from None
    odd = [size for size in sizes if size % page]
    if odd:
        raise InvalidArgument(f"--hugepages: a segment of {odd[0]} bytes is not a whole number "
                              f"of {page >> 20} MiB huge pages")
    needed = sum(sizes) // page
    if needed > free:
        raise InvalidArgument(
            f"--hugepages: the segments need {needed} huge pages of {page >> 20} MiB and this "
            f"host has {free} free; reserve them first (as root: sysctl "
            f"vm.nr_hugepages={needed + int(fields['HugePages_Total'].split()[0]) - free})")
