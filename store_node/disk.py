"""The disk tier of a store node: one preallocated file per node, and its manifest next to it.

Layout of ``--disk-path DIR``::

    DIR/kvpool-disk.json      {"node_id", "segment_id", "size_bytes"}: who owns the data
    DIR/kvpool-disk.data      the segment's bytes (posix_fallocate'd up front)
    DIR/kvpool-disk.manifest  the committed objects in it, one JSON line per change
    DIR/kvpool-disk.lock      flock'd while a node uses the directory

I/O choice: buffered ``pread``/``pwrite`` of whole objects, plus a ``MAP_SHARED`` mapping of the
file for the tcp data server and the scrubber. Buffered, not O_DIRECT: the master aligns extents
to 64 bytes, not the 4 KiB O_DIRECT needs, and the page cache turns a block demoted and soon read
again into a memory copy; its pages are clean after write-back, so the kernel reclaims them
before it touches the DRAM tier (memfds, not page cache). Demotion and promotion copy each object
with one syscall (``pwrite`` from / ``preadv`` into the DRAM segment's mapping), which releases
the GIL and lets the kernel do large sequential I/O. Same-host clients read a disk replica over
tcp: handing them the file's fd is unsafe (a regular file cannot be sealed against truncation,
which would SIGBUS the node) and would make them map the whole file.

Restart: the segment id, size and node id persist in the JSON file, and the manifest log is
replayed, so a restarted node mounts the same segment and re-announces what it holds there.
The log is flushed to the kernel on every change (a crashed node process loses nothing) and
fsync'ed on a clean stop. Every write into the segment (a demotion, a put that found DRAM full)
first logs the removal of the records it overlaps, so a record never outlives its bytes even
when the master reused the space before its removal reached this node. A crashed *host* may
lose the log's last changes: those objects are lost as cache entries, and a record that
survived a write it should not have fails its checksum when read with ``verify=True`` or
scrubbed, and is dropped then.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import ssl
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from kvpool.common.config import format_size
from kvpool.common.errors import InvalidArgument, NoSpace
from kvpool.common.logging import get_logger
from kvpool.common.types import ObjectRecord, SegmentInfo
from kvpool.store_node.manifest import Manifest
from kvpool.store_node.memory import MappedSegment, new_segment_id
from sortedcontainers import SortedDict

log = get_logger(__name__)

META, DATA, MANIFEST, LOCK = ("kvpool-disk.json", "kvpool-disk.data", "kvpool-disk.manifest",
                              "kvpool-disk.lock")
DISK_SEGMENT_INDEX = 1000   # segment ids <node>/1000-<random>: apart from DRAM's 0, 1, ...


class DiskSegment(MappedSegment):
    """A segment backed by a preallocated file (see the module docstring for the I/O choice)."""

    def __init__(self, segment_id: str, size_bytes: int, path: str | os.PathLike) -> None:
        if size_bytes <= 0:
            raise InvalidArgument(f"segment size must be positive, not {size_bytes}")
        self._path = str(path)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size_bytes)   # blocks reserved now, not on a write
        except OSError as e:
            os.close(fd)
            if e.errno != errno.ENOSPC:
                raise
            raise NoSpace(f"cannot reserve {format_size(size_bytes)} in {self._path}: "
                          "the file system is full; use a smaller --disk-size") from None
        super().__init__(SegmentInfo(segment_id=segment_id, size_bytes=size_bytes, tier="disk"),
                         fd)
        # Called with (offset, length) before anything writes there: DiskTier forgets the
        # manifest records the write overlaps (DiskManifest.forget_range).
        self.before_write: Callable[[int, int], None] | None = None

    @property
    def fd(self) -> int:
        return -1   # never handed to clients: see the module docstring

    def read_into(self, offset: int, view: memoryview) -> None:
        """One ``preadv`` per call (retried on a short read)."""
        self.check_range(offset, len(view))
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"short read at {offset + done} in {self._path}")
            done += n

    def write_from(self, offset: int, view: memoryview) -> None:
        """One ``pwrite`` per call (retried on a short write)."""
        self.check_range(offset, len(view))
        if self.before_write is not None:
            self.before_write(offset, len(view))
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def view_to_send(self, offset: int, length: int) -> None:
        return None   # sent its own way (send_to)

    def send_to(self, sock, offset: int, length: int, header: bytes = b"") -> None:
        """With sendfile(2): the kernel reads ahead and copies page cache -> socket, with no
        page faults on the mapping (several times faster cold). OSError if the file came up
        short. Over TLS (--data-tls) the bytes must pass through it: the mapping is sent."""
        if isinstance(sock, ssl.SSLSocket):
            return super().send_to(sock, offset, length, header)
        self.check_range(offset, length)
        sock.sendall(header)
        done = 0
        while done < length:
            n = os.sendfile(sock.fileno(), self._fd, offset + done, length - done)
            if n == 0:
                raise OSError(errno.EIO, f"short read at {offset + done} in {self._path}")
            done += n

    def recv_from(self, recv_exact, offset: int, length: int) -> None:
        """A tcp WRITE (a put that found DRAM full), after forgetting the records it
        overlaps."""
        self.check_range(offset, length)
        if self.before_write is not None:
            self.before_write(offset, length)
        super().recv_from(recv_exact, offset, length)

    def sync(self) -> None:
        """Flush written data to the device (a clean stop does it)."""
        if not self.closed:
            os.fdatasync(self._fd)

    def __repr__(self) -> str:
        return f"DiskSegment({self._info.segment_id!r}, {self._info.size_bytes}, {self._path!r})"


class DiskManifest:
    """The disk segment's committed objects, persisted as a log of manifest deltas.

    Fed the same deltas as the node's in-memory :class:`Manifest`; keeps only what concerns the
    disk segment: commits there, and the removal of an object that was there (removed, or
    moved to another tier: its commit elsewhere supersedes the disk record).
    """

    def __init__(self, path: str | os.PathLike, segment_id: str) -> None:
        self._path = Path(path)
        self._segment_id = segment_id
        self._lock = threading.Lock()
        self._state = Manifest()
        if self._path.exists():
            self._replay()
        # offset -> key of every record: which ones a write into the segment overlaps.
        self._by_offset = SortedDict({r.offset: r.key for r in self._state.records()})
        # Rewritten compactly at every start: the log only grows while the node runs.
        tmp = self._path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.writelines(_commit_line(r) for r in self._state.records())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)
        self._file = open(self._path, "a")  # noqa: SIM115 - open until close()

    def records(self) -> list[ObjectRecord]:
        return self._state.records()

    def apply(self, committed: Iterable[ObjectRecord], removed: Iterable[tuple[str, int]]) -> None:
        """Log the part of one delta that concerns the disk segment."""
        lines: list[str] = []
        with self._lock:
            for r in committed:
                if r.segment_id == self._segment_id:
                    if (old := self._state.get(r.key)) is not None:
                        self._by_offset.pop(old.offset, None)
                    stale = self._by_offset.get(r.offset)
                    if stale is not None and stale != r.key:
                        self._drop(stale, lines)
                    self._state.apply([r], ())
                    self._by_offset[r.offset] = r.key
                    lines.append(_commit_line(r))
                elif self._state.get(r.key) is not None:   # moved to another tier
                    self._drop(r.key, lines)
            for key, version in removed:
                old = self._state.get(key)
                if old is not None and old.version == version:
                    self._drop(key, lines)
            self._write(lines)

    def forget_range(self, offset: int, length: int) -> None:
        """Drop (and log) every record overlapping ``[offset, offset + length)``, before the
        node writes there: the master may reuse space whose removal has not reached this node
        yet, and a record must never outlive the bytes it describes (a restart would announce
        another object's bytes under its key)."""
        lines: list[str] = []
        with self._lock:
            i = self._by_offset.bisect_left(offset + length)
            overlapping = []
            # Records never overlap each other: walk back until one ends before the range.
            while i > 0:
                i -= 1
                start, key = self._by_offset.peekitem(i)
                if start + self._state.get(key).size <= offset:
                    break
                overlapping.append(key)
            for key in overlapping:
                self._drop(key, lines)
            self._write(lines)

    def _drop(self, key: str, lines: list[str]) -> None:
        old = self._state.get(key)
        self._state.apply((), [(key, old.version)])
        if self._by_offset.get(old.offset) == key:
            del self._by_offset[old.offset]
        lines.append(_remove_line(key, old.version))

    def _write(self, lines: list[str]) -> None:
        if lines:   # to the kernel at once: a crash of the node process loses nothing
            self._file.write("".join(lines))
            self._file.flush()

    def forget(self, keys: Iterable[str]) -> None:
        """Drop records the master refused when they were announced."""
        self.apply((), [(k, r.version) for k in keys if (r := self._state.get(k)) is not None])

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def _replay(self) -> None:
        bad = 0
        with open(self._path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                    if "c" in entry:   # 6 to 8 fields (parent and pin when there are)
                        self._state.apply([ObjectRecord(*entry["c"][:8])], ())
                    else:
                        k, ver = entry["r"]
                        self._state.apply((), [(k, ver)])
                except (ValueError, KeyError, TypeError):
                    bad += 1   # a line torn by a crash mid-write: the last change is lost
        if bad:
            log.warning("disk_manifest_lines_skipped", path=str(self._path), lines=bad)


def _commit_line(r: ObjectRecord) -> str:
    fields = [r.key, r.segment_id, r.offset, r.size, r.checksum, r.version]
    if r.parent is not None or r.pinned:
        fields.append(r.parent)
    if r.pinned:
        fields.append(True)
    return json.dumps({"c": fields}) + "\n"


def _remove_line(key: str, version: int) -> str:
    return json.dumps({"r": [key, version]}) + "\n"


class DiskTier:
    """Opens (or creates) a node's disk directory: lock, identity, data file, manifest."""

    def __init__(self, path: str | os.PathLike, size_bytes: int, node_id: str | None) -> None:
        """Raises InvalidArgument (bad directory, another node's data, a size that differs
        from the existing file) or NoSpace (not enough free space) with a message for the
        command line."""
        self.path = Path(path)
        _prepare_dir(self.path)
        self._lock_fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise InvalidArgument(f"--disk-path {self.path} is in use by another store "
                                      "node") from None
            meta = _read_meta(self.path / META)
            if meta is not None:
                if node_id is not None and meta["node_id"] != node_id:
                    raise InvalidArgument(
                        f"--disk-path {self.path} holds the disk tier of node "
                        f"{meta['node_id']!r}, not {node_id!r}; start that node (or omit "
                        "--node-id), or use another directory")
                if meta["size_bytes"] != size_bytes:
                    raise InvalidArgument(
                        f"--disk-path {self.path} holds a {format_size(meta['size_bytes'])} disk "
                        f"tier, not {format_size(size_bytes)}; pass --disk-size "
                        f"{meta['size_bytes']} to keep its objects, or use an empty directory")
                self.node_id, segment_id = meta["node_id"], meta["segment_id"]
            else:
                _check_free(self.path, size_bytes)
                self.node_id = node_id
                segment_id = ""
            self._meta_exists = meta is not None
            self._segment_id = segment_id
            self._size = size_bytes
            self.segment: DiskSegment | None = None
            self.manifest: DiskManifest | None = None
        except BaseException:
            os.close(self._lock_fd)
            raise

    def open(self, node_id: str) -> DiskSegment:
        """Create or reopen the data file as ``node_id``'s disk segment; load its manifest."""
        if not self._meta_exists:
            self._segment_id = new_segment_id(node_id, DISK_SEGMENT_INDEX)
            # The data file first: a crash before the meta is written leaves no identity behind.
            self.segment = DiskSegment(self._segment_id, self._size, self.path / DATA)
            (self.path / MANIFEST).unlink(missing_ok=True)
            tmp = self.path / (META + ".tmp")
            tmp.write_text(json.dumps({"node_id": node_id, "segment_id": self._segment_id,
                                       "size_bytes": self._size}))
            os.replace(tmp, self.path / META)
        else:
            self.segment = DiskSegment(self._segment_id, self._size, self.path / DATA)
        self.manifest = DiskManifest(self.path / MANIFEST, self._segment_id)
        self.segment.before_write = self.manifest.forget_range
        log.info("disk_tier_opened", path=str(self.path), segment=self._segment_id,
                 size_bytes=self._size, objects=len(self.manifest.records()))
        return self.segment

    def close(self) -> None:
        """Sync data and manifest, close them, release the directory. Idempotent."""
        if self.segment is not None:
            try:
                self.segment.sync()
            except (OSError, ValueError):
                pass
            self.segment.close()
        if self.manifest is not None:
            self.manifest.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _prepare_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise InvalidArgument(f"--disk-path {path} is not a directory")
    if not path.exists():
        if not path.parent.is_dir():
            raise InvalidArgument(f"--disk-path {path}: its parent directory does not exist")
        try:
            path.mkdir()
        except OSError as e:
            raise InvalidArgument(f"--disk-path {path}: cannot create it: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidArgument(f"--disk-path {path} is not writable by this user")


def _read_meta(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
        if not (isinstance(meta["node_id"], str) and isinstance(meta["segment_id"], str)
                and isinstance(meta["size_bytes"], int)):
            raise TypeError
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        raise InvalidArgument(f"{path} is damaged; move the directory away to start an empty "
                              "disk tier") from None


def _check_free(path: Path, size_bytes: int) -> None:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if size_bytes > free:
        raise NoSpace(f"--disk-size {format_size(size_bytes)} does not fit in the "
                      f"{format_size(free)} free at {path}; use a smaller --disk-size")
