"""A store node's committed objects in shared memory: a same-host get with no master call.

A single get over shm was a GetReplicas round trip to the master (~0.1 ms, most of it the two
processes' wake-ups) and a 64 KiB copy (~0.015 ms). A trusted same-host peer can already read
every byte of the node's segments (SECURITY.md, "Shared memory"); what it lacks is where an
object is, and a proof that the bytes it copied are still that object's. This index gives both.

Who writes it: only the node's manifest (store_node/manifest.py), under its lock, so there is one
writer. A committed object (the master's word, or a seal a restarted master confirmed) gets an
entry; a removal, a record forgotten, and any reservation of space that
overlaps an entry (the master's on the manifest stream, a writer's RESERVE or slot, a move's
destination) void it, before the node acknowledges the change or answers the RESERVE. The master
hands space to a writer only after one of those reached the node, so no byte of an entry's
extent changes while its entry still stands. Sealed records that the master has not committed
are never entries: a put the master refuses must never be read.

How a peer reads it: each entry has a sequence number, odd while the node changes it. The
reader takes an entry whose key digest matches and whose number is even, copies the extent out
of its own mapping of the segment, and reads the number again; unchanged, the bytes are the
object's (the node bumped it before anyone could write there). Anything else (no entry, a
changed number, an unknown segment, an index its node closed) sends the get to the master.
The node checks a tcp READ_HELD against it the same way (net/data_port.py; ``holding``, then
``unchanged`` after the bytes are sent), so every node with DRAM segments keeps one.

Layout (little-endian): a header of ``HEADER_BYTES``: ``magic`` (u64; zeroed when the node
closes the index), ``buckets`` (u32, a power of two), then at ``SEGMENTS_AT`` one slot of
``SEGMENT_SLOT_BYTES`` per segment number (id length u16, the id in utf-8; length 0: no
segment). Then ``buckets`` buckets of ``WAYS`` entries of ``ENTRY.size`` bytes; a key lives in
the bucket its digest's first eight bytes name, in any way of it (a full bucket leaves the key
to the master). An entry: ``seq`` (u64), ``digest`` (16 bytes, BLAKE2b of the stored key;
all zero: free), ``offset``, ``length``, ``version`` (u64 each), ``crc`` (u32), ``segment``
(u16, its number), ``flags`` (u16: ``HAS_CRC``).
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
from dataclasses import dataclass

from sortedcontainers import SortedList

MAGIC = 0x4B56504F4F4C4958   # "KVPOOLIX"
HEAD = struct.Struct("<QI")
SEGMENTS_AT = 64
SEGMENT_SLOTS = 255
SEGMENT_SLOT_BYTES = 256
HEADER_BYTES = SEGMENTS_AT + SEGMENT_SLOTS * SEGMENT_SLOT_BYTES + 512   # 64 KiB
ENTRY = struct.Struct("<Q16sQQQIHH8x")
SEQ = struct.Struct("<Q")
WAYS = 8
BUCKET_BYTES = WAYS * ENTRY.size
HAS_CRC = 1
_FREE = bytes(16)
_SLOT = struct.Struct("<H")
_MAX_BUCKETS = 1 << 18   # 128 MiB of index at most


def digest(stored_key: str) -> bytes:
    """The 16-byte digest an entry names its stored key by."""
    return hashlib.blake2b(stored_key.encode(), digest_size=16).digest()


def buckets_for(capacity_bytes: int, typical_object_bytes: int = 64 << 10) -> int:
    """Buckets for segments of ``capacity_bytes`` in all: room for twice as many objects of
    ``typical_object_bytes`` as fit (smaller objects fill buckets sooner, and go to the master
    past that), a power of two."""
    want = max(64, 2 * capacity_bytes // typical_object_bytes // WAYS)
    return min(1 << (want - 1).bit_length(), _MAX_BUCKETS)


@dataclass(frozen=True, slots=True)
class Entry:
    """What a reader found: where the object lives, and the number to check again after."""

    position: int   # of the entry in the index
    seq: int
    segment: int
    offset: int
    length: int
    version: int
    crc: int | None


class IndexWriter:
    """The node's end: one memfd, written only under the manifest's lock. Keys are stored keys
    (common/tenants.py); only segments given to :meth:`add_segment` are indexed."""

    def __init__(self, buckets: int) -> None:
        if buckets <= 0 or buckets & (buckets - 1):
            raise ValueError(f"buckets must be a power of two, not {buckets}")
        self.buckets = buckets
        self.size = HEADER_BYTES + buckets * BUCKET_BYTES
        fd = os.memfd_create("kvpool-shm-index", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            os.fchmod(fd, 0o600)   # a reader's O_RDONLY fd cannot be reopened writable
            self.readonly_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._buf = mmap.mmap(fd, self.size, mmap.MAP_SHARED)
        self._segments: dict[str, int] = {}   # segment id -> number
        # key -> (entry position, segment id, offset, end); per segment (offset, end, key),
        # to void every entry a reservation overlaps.
        self._where: dict[str, tuple[int, str, int, int]] = {}
        self._extents: dict[str, SortedList] = {}
        self._longest: dict[str, int] = {}
        self.full = 0   # keys left out: their bucket was full
        HEAD.pack_into(self._buf, 0, MAGIC, buckets)

    def __len__(self) -> int:
        return len(self._where)

    def add_segment(self, segment_id: str) -> bool:
        """Index this segment's objects from now on; False if it cannot be (no number left,
        or an id too long for its slot)."""
        raw = segment_id.encode()
        if segment_id in self._segments:
            return True
        n = len(self._segments)
        if n == SEGMENT_SLOTS or len(raw) > SEGMENT_SLOT_BYTES - _SLOT.size:
            return False
        at = SEGMENTS_AT + n * SEGMENT_SLOT_BYTES
        self._buf[at + _SLOT.size:at + _SLOT.size + len(raw)] = raw
        _SLOT.pack_into(self._buf, at, len(raw))
        self._segments[segment_id] = n
        self._extents[segment_id] = SortedList()
        self._longest[segment_id] = 0
        return True

    def put(self, key: str, segment_id: str, offset: int, length: int, version: int,
            crc: int | None) -> None:
        """``key`` is committed at this extent (any entry it had, and any entry its extent
        overlaps, is voided first)."""
        self.remove(key)
        number = self._segments.get(segment_id)
        if number is None or self._buf.closed:
            return
        self.overwritten(segment_id, offset, length)
        d = digest(key)
        base = HEADER_BYTES + (int.from_bytes(d[:8], "little") & (self.buckets - 1)) \
            * BUCKET_BYTES
        for position in range(base, base + BUCKET_BYTES, ENTRY.size):
            if self._buf[position + 8:position + 24] == _FREE:
                break
        else:
            self.full += 1
            return
        (seq,) = SEQ.unpack_from(self._buf, position)
        SEQ.pack_into(self._buf, position, seq + 1)
        ENTRY.pack_into(self._buf, position, seq + 1, d, offset, length, version,
                        0 if crc is None else crc, number, 0 if crc is None else HAS_CRC)
        SEQ.pack_into(self._buf, position, seq + 2)   # last: the entry stands from here
        self._where[key] = (position, segment_id, offset, offset + length)
        self._extents[segment_id].add((offset, offset + length, key))
        if length > self._longest[segment_id]:
            self._longest[segment_id] = length

    def remove(self, key: str) -> None:
        """``key``'s entry, if it has one, is void."""
        if key in self._where:
            self._void(key)

    def overwritten(self, segment_id: str, offset: int, size: int) -> None:
        """Someone may write [offset, offset + size) of this segment from now on: every entry
        there is void."""
        extents = self._extents.get(segment_id)
        if not extents:
            return
        end = offset + size
        # Entries starting before ``end`` and less than the longest entry before ``offset``.
        lo = extents.bisect_left((offset - self._longest[segment_id],))
        hi = extents.bisect_left((end,))
        hit = [key for start, stop, key in extents[lo:hi] if stop > offset and start < end]
        for key in hit:
            self._void(key)

    def _void(self, key: str) -> None:
        position, segment_id, offset, end = self._where.pop(key)
        self._extents[segment_id].discard((offset, end, key))
        if self._buf.closed:   # (the node stopped: nobody reads it any more)
            return
        (seq,) = SEQ.unpack_from(self._buf, position)
        SEQ.pack_into(self._buf, position, seq + 1)
        self._buf[position + 8:position + 24] = _FREE
        SEQ.pack_into(self._buf, position, seq + 2)

    def holding(self, key: str, segment_id: str, offset: int, within: int, version: int
                ) -> tuple[tuple[int, int], int] | None:
        """The node's own check of a READ_HELD (net/data_port.py), under the manifest's lock:
        ``((position, seq), length)`` if ``key``'s entry stands at ``offset`` with this
        version and at most ``within`` bytes long, else None. :meth:`unchanged` tells later,
        given ``(position, seq)``, whether it stood all along."""
        where = self._where.get(key)
        if where is None or where[1] != segment_id or where[2] != offset \
                or where[3] - offset > within or self._buf.closed:
            return None
        seq, _, _, length, stored = ENTRY.unpack_from(self._buf, where[0])[:5]
        return ((where[0], seq), length) if stored == version else None

    def unchanged(self, held: tuple[int, int]) -> bool:
        """Whether the entry :meth:`holding` found still stands, unchanged since (any
        thread, no lock: the number is bumped before the entry changes)."""
        position, seq = held
        try:
            return SEQ.unpack_from(self._buf, position)[0] == seq
        except ValueError:   # closed: the node stops
            return False

    def close(self) -> None:
        """No reader may trust an entry from now on (the node stops); later changes are not
        written."""
        if self._buf.closed:
            return
        HEAD.pack_into(self._buf, 0, 0, self.buckets)
        self._buf.close()
        os.close(self.fd)
        os.close(self.readonly_fd)


class IndexReader:
    """A peer's end: a read-only mapping of a node's index (as its hand-off gave it)."""

    def __init__(self, buf: mmap.mmap) -> None:
        magic, buckets = HEAD.unpack_from(buf, 0)
        if magic != MAGIC or buckets <= 0 or buckets & (buckets - 1) \
                or len(buf) < HEADER_BYTES + buckets * BUCKET_BYTES:
            raise ValueError("not a kvpool shm index")
        self._buf, self._mask = buf, buckets - 1

    @property
    def open(self) -> bool:
        """False once its node closed it."""
        return not self._buf.closed and HEAD.unpack_from(self._buf, 0)[0] == MAGIC

    def find(self, key_digest: bytes) -> Entry | None:
        """The standing entry of the key with this digest, or None."""
        buf = self._buf
        base = HEADER_BYTES + (int.from_bytes(key_digest[:8], "little") & self._mask) \
            * BUCKET_BYTES
        at = buf.find(key_digest, base + 8, base + BUCKET_BYTES)
        while at >= 0 and (at - base - 8) % ENTRY.size:   # not at a digest's place
            at = buf.find(key_digest, at + 1, base + BUCKET_BYTES)
        if at < 0:
            return None
        position = at - 8
        seq, d, offset, length, version, crc, segment, flags = ENTRY.unpack_from(buf, position)
        if seq & 1 or d != key_digest:
            return None
        return Entry(position, seq, segment, offset, length, version,
                     crc if flags & HAS_CRC else None)

    def still(self, entry: Entry) -> bool:
        """Whether ``entry`` stood unchanged all along (checked after the copy)."""
        return SEQ.unpack_from(self._buf, entry.position)[0] == entry.seq

    def segment_id(self, number: int) -> str | None:
        """The id of segment ``number``, or None."""
        if not 0 <= number < SEGMENT_SLOTS:
            return None
        at = SEGMENTS_AT + number * SEGMENT_SLOT_BYTES
        (n,) = _SLOT.unpack_from(self._buf, at)
        if not n or n > SEGMENT_SLOT_BYTES - _SLOT.size:
            return None
        try:
            return bytes(self._buf[at + _SLOT.size:at + _SLOT.size + n]).decode()
        except UnicodeDecodeError:
            return None

    def close(self) -> None:
        self._buf.close()
