"""Best-fit range allocator for one segment: offsets only, the master never touches the bytes.

Sizes are rounded up to ``alignment_bytes`` so every extent starts on an aligned boundary
(cache lines for CPU copies, and RDMA is happier with aligned buffers). A capacity that is not a
multiple of the alignment leaves its tail unusable: ``capacity_bytes`` is the aligned-down size.

An extent of at least ``PHASED_MIN_BYTES`` starts half a page past a page boundary (``offset %
4096 == PHASE_BYTES``). Why: a copy past glibc's non-temporal threshold (a batch's adjacent
blocks are one copy) slows down to a third when its destination lies less than ~1 KiB ahead of
its source modulo 4 KiB (4K aliasing: loads wait on stores they only seem to overlap), and
callers' buffers start on a page or a few bytes past one (malloc's 16, torch's 64). Extents at
any 64-byte offset were that close for a quarter of the offsets, a batch's all at once (a 512
MiB put over shm: 77 ms against 37-48). Half a page from such a buffer, neither a put (buffer
to extent) nor a get (extent to buffer) is that close. On a page, a put would not be either,
but a get would: gets were 20% slower that way. Blocks whose size is a multiple of 4 KiB (KV
blocks) stay adjacent, so a batch is still one copy; before an extent of another size, the gap
(under 4 KiB) stays free for smaller objects. The cost: a segment of exactly N such blocks
holds N - 1, the first starting 2 KiB in.
"""

from __future__ import annotations

from sortedcontainers import SortedDict, SortedList

_MAX_SHARED_LENGTHS = 1024
PAGE_BYTES = 4096
PHASE_BYTES = 2048                 # where a large extent starts within its page
PHASED_MIN_BYTES = 64 << 10
# Ranges looked at past the best fit for one that fits once its start is moved to the phase;
# beyond them, the first range with room for any move is taken.
_PHASE_SCAN = 16


class RangeAllocator:
    """Allocates aligned ranges inside ``[0, capacity_bytes)``; O(log n) per operation.

    Free space is kept twice: ``_by_size`` (length, offset) answers "the smallest range that
    fits" with one bisect, and ``_by_offset`` (offset -> length) finds the neighbours to
    coalesce with on free. Live allocations are remembered so a double or bogus free is an
    error instead of silent corruption of the free lists.

    ``track=False`` (the master's segments): live allocations are not remembered, because the
    caller's own index already records each one (a master's object index holds every extent,
    and frees exactly those); remembering them again cost ~45 bytes per indexed object. A free
    is then checked against the free ranges only: a double free, or any free that overlaps
    free space, still raises ValueError and changes nothing; a free of a range inside live
    allocations that is not one of them (wrong size or offset) is not caught.
    """

    def __init__(self, capacity_bytes: int, alignment_bytes: int = 64, *,
                 track: bool = True) -> None:
        if alignment_bytes < 1:
            raise ValueError(f"alignment_bytes must be >= 1, not {alignment_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, not {capacity_bytes}")
        self._alignment = alignment_bytes
        # Large extents start at PHASE_BYTES within their page where the alignment allows it.
        self._phased = alignment_bytes <= PHASE_BYTES and PHASE_BYTES % alignment_bytes == 0
        self._capacity = capacity_bytes - capacity_bytes % alignment_bytes
        self._by_size: SortedList = SortedList()
        self._by_offset: SortedDict = SortedDict()
        # offset -> rounded length; None: not tracked (``track=False``)
        self._allocated: dict[int, int] | None = {} if track else None
        # One int object per distinct rounded length, shared by every allocation of it: a
        # master holds millions of allocations of a few block sizes (28 bytes each saved).
        self._lengths: dict[int, int] = {}
        self._used = 0
        if self._capacity:
            self._add_free(0, self._capacity)

    @property
    def capacity_bytes(self) -> int:
        """Usable capacity: the constructor's capacity rounded down to the alignment."""
        return self._capacity

    @property
    def alignment_bytes(self) -> int:
        return self._alignment

    @property
    def used_bytes(self) -> int:
        """Bytes in live allocations (rounded sizes)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def largest_free_bytes(self) -> int:
        """Length of the largest free range: an allocation of up to this many bytes succeeds."""
        return self._by_size[-1][0] if self._by_size else 0

    def aligned_size(self, size: int) -> int:
        """``size`` rounded up to the alignment: what an allocation of ``size`` really takes."""
        if size <= 0:
            raise ValueError(f"size must be >= 1, not {size}")
        return -(-size // self._alignment) * self._alignment

    def allocate(self, size: int) -> int | None:
        """Allocate ``size`` bytes (best fit); return the offset, or None if no range fits."""
        length = self.aligned_size(size)
        by_size = self._by_size
        # (length, -1) sorts before every (length, offset): the first hit is the smallest range
        # that fits, lowest offset among ranges of that length.
        i = by_size.bisect_left((length, -1))
        if i == len(by_size):
            return None
        free_len, offset = by_size[i]
        gap = 0
        if length >= PHASED_MIN_BYTES and self._phased:
            gap = (PHASE_BYTES - offset) % PAGE_BYTES
            if free_len < gap + length:   # the next ranges by size, then any with room
                for j in range(i + 1, min(i + _PHASE_SCAN, len(by_size))):
                    free_len, offset = by_size[j]
                    gap = (PHASE_BYTES - offset) % PAGE_BYTES
                    if free_len >= gap + length:
                        break
                else:   # none with room for the move: the best fit where it starts
                    j = by_size.bisect_left((length + PAGE_BYTES - self._alignment, -1))
                    free_len, offset = by_size[j if j < len(by_size) else i]
                    gap = (PHASE_BYTES - offset) % PAGE_BYTES if j < len(by_size) else 0
        self._remove_free(offset, free_len)
        if gap:
            self._add_free(offset, gap)
            offset += gap
            free_len -= gap
        if free_len > length:
            self._add_free(offset + length, free_len - length)
        self._remember(offset, length)
        return offset

    def allocate_many(self, size: int, count: int) -> list[int]:
        """``allocate(size)`` ``count`` times over, up to the first that fails: the same
        offsets in the same order, the free lists updated once per range carved from instead
        of once per extent (a PutStart of a prompt's blocks: master/placement.py).

        Why the same: the best fit R is the smallest range that fits (the lowest offset among
        equals), so what is left of R after an extent, if it still fits one, is smaller than
        every other range that does: the next best fit. A large extent that does not fit at
        its phase in what is left takes :meth:`allocate`'s own path."""
        length = self.aligned_size(size)
        phased = length >= PHASED_MIN_BYTES and self._phased
        by_size = self._by_size
        out: list[int] = []
        while len(out) < count:
            i = by_size.bisect_left((length, -1))
            if i == len(by_size):
                break
            free_len, at = by_size[i]
            end = at + free_len
            if phased and free_len < (PHASE_BYTES - at) % PAGE_BYTES + length:
                out.append(self.allocate(size))   # found a range above, so it succeeds
                continue
            self._remove_free(at, free_len)
            while len(out) < count:
                gap = (PHASE_BYTES - at) % PAGE_BYTES if phased else 0
                if end - at < gap + length:
                    break
                if gap:
                    self._add_free(at, gap)
                    at += gap
                at |= 0   # its exact size: the index keeps it (see _add_free)
                out.append(at)
                self._remember(at, length)
                at += length
            if end > at:
                self._add_free(at, end - at)
        return out

    def allocate_at(self, offset: int, size: int) -> bool:
        """Allocate exactly ``[offset, offset + aligned size)`` if it is free and aligned; return
        whether it was. A restarted master rebuilds its allocators this way from the extents
        store nodes announce."""
        length = self.aligned_size(size)
        if offset < 0 or offset % self._alignment or offset + length > self._capacity:
            return False
        i = self._by_offset.bisect_right(offset)
        if i == 0:
            return False
        free_off, free_len = self._by_offset.peekitem(i - 1)
        if free_off + free_len < offset + length:
            return False
        self._remove_free(free_off, free_len)
        if offset > free_off:
            self._add_free(free_off, offset - free_off)
        if free_off + free_len > offset + length:
            self._add_free(offset + length, free_off + free_len - offset - length)
        self._remember(offset, length)
        return True

    def _remember(self, offset: int, length: int) -> None:
        if self._allocated is not None:
            if len(self._lengths) < _MAX_SHARED_LENGTHS:
                length = self._lengths.setdefault(length, length)
            self._allocated[offset] = length
        self._used += length

    def free(self, offset: int, size: int) -> None:
        """Free an allocation made by ``allocate(size)`` that returned ``offset``.

        Only whole allocations can be freed; anything else (double free, wrong size, a range
        never allocated or outside the capacity) raises ValueError and changes nothing.
        """
        length = self.aligned_size(size)
        if offset < 0 or offset + length > self._capacity:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the capacity "
                             f"{self._capacity}")
        if self._allocated is None:
            if self._overlaps_free(offset, length):
                raise ValueError(f"range [{offset}, {offset + length}) is not allocated "
                                 "(double free: it overlaps free space)")
        elif self._allocated.get(offset) != length:
            raise ValueError(f"range [{offset}, {offset + length}) is not allocated "
                             "(double free, or not the range allocate returned)")
        else:
            del self._allocated[offset]
        self._used -= length
        # Coalesce with the free range ending exactly here and the one starting right after.
        i = self._by_offset.bisect_left(offset)
        if i > 0:
            prev_off, prev_len = self._by_offset.peekitem(i - 1)
            if prev_off + prev_len == offset:
                self._remove_free(prev_off, prev_len)
                offset, length = prev_off, prev_len + length
        next_len = self._by_offset.get(offset + length)
        if next_len is not None:
            self._remove_free(offset + length, next_len)
            length += next_len
        self._add_free(offset, length)

    def _overlaps_free(self, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` shares a byte with a free range."""
        i = self._by_offset.bisect_right(offset)
        if i > 0:   # the free range starting at or before ``offset``
            free_off, free_len = self._by_offset.peekitem(i - 1)
            if free_off + free_len > offset:
                return True
        # the first free range starting after ``offset``
        return i < len(self._by_offset) and self._by_offset.peekitem(i)[0] < offset + length

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges as (offset, length), sorted by offset."""
        return list(self._by_offset.items())

    def _add_free(self, offset: int, length: int) -> None:
        # A free range's offset is the next allocation's, kept by the caller's index for as
        # long as the object lives. A sum like ``offset + length`` keeps room for a carry
        # digit it may not need (48 bytes in pymalloc for an offset past 2**30, where 32
        # hold it); ``| 0`` copies it at its exact size: 16 bytes less per indexed object.
        offset |= 0
        self._by_offset[offset] = length
        self._by_size.add((length, offset))

    def _remove_free(self, offset: int, length: int) -> None:
        del self._by_offset[offset]
        self._by_size.remove((length, offset))
