"""RangeAllocator: best fit, alignment, coalescing, and its invariants under random operations."""

from __future__ import annotations

import copy
import random
from itertools import pairwise

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)
from kvpool.master.allocator import PHASE_BYTES, PHASED_MIN_BYTES, RangeAllocator


def test_fresh_allocator_is_one_free_range():
    a = RangeAllocator(4096, 64)
    assert a.free_ranges() == [(0, 4096)]
    assert (a.capacity_bytes, a.used_bytes, a.free_bytes, a.largest_free_bytes) == \
        (4096, 0, 4096, 4096)


def test_sizes_round_up_to_alignment():
    a = RangeAllocator(4096, 64)
    assert a.allocate(1) == 0
    assert a.allocate(65) == 64          # the first took a whole 64-byte block
    assert a.used_bytes == 64 + 128
    assert a.free_ranges() == [(192, 4096 - 192)]


def test_unaligned_capacity_tail_is_unusable():
    a = RangeAllocator(1000, 64)
    assert a.capacity_bytes == 960
    assert a.allocate(960) == 0
    assert a.allocate(1) is None
    assert a.free_bytes == 0


def test_capacity_below_alignment_holds_nothing():
    a = RangeAllocator(63, 64)
    assert a.capacity_bytes == 0 and a.free_ranges() == [] and a.largest_free_bytes == 0
    assert a.allocate(1) is None


def _with_holes(a: RangeAllocator, hole_sizes: list[int]) -> dict[int, int]:
    """Fill ``a`` with alternating holes and fences; returns hole size -> hole offset."""
    holes = {}
    for size in hole_sizes:
        holes[size] = a.allocate(size)
        assert a.allocate(64) is not None   # fence, so holes do not coalesce
    tail = a.largest_free_bytes
    assert a.allocate(tail) is not None
    for size, offset in holes.items():
        a.free(offset, size)
    return holes


def test_best_fit_takes_the_smallest_range_that_fits():
    a = RangeAllocator(4096, 64)
    holes = _with_holes(a, [512, 128, 256])
    assert a.allocate(100) == holes[128]     # 128 is the smallest hole >= 100 (rounded to 128)
    assert a.allocate(200) == holes[256]
    assert a.allocate(64) == holes[512]      # only the 512 hole is left
    assert a.free_ranges() == [(holes[512] + 64, 448)]


def test_best_fit_prefers_the_lowest_offset_among_equal_ranges():
    a = RangeAllocator(4096, 64)
    first = a.allocate(128)
    a.allocate(64)
    second = a.allocate(128)
    a.allocate(a.largest_free_bytes)   # fill the tail
    a.free(second, 128)
    a.free(first, 128)
    assert a.allocate(128) == first
    assert a.allocate(128) == second


def test_exhaustion_returns_none_and_free_makes_room_again():
    a = RangeAllocator(1024, 64)
    offsets = [a.allocate(256) for _ in range(4)]
    assert offsets == [0, 256, 512, 768]
    assert a.allocate(1) is None
    assert a.used_bytes == 1024 and a.free_bytes == 0
    a.free(512, 256)
    assert a.allocate(300) is None           # rounds to 320 > 256
    assert a.allocate(256) == 512


def test_free_coalesces_with_both_neighbours():
    a = RangeAllocator(1024, 64)
    x, y, z = a.allocate(256), a.allocate(256), a.allocate(256)
    a.free(x, 256)
    a.free(z, 256)
    assert a.free_ranges() == [(0, 256), (512, 512)]
    a.free(y, 256)
    assert a.free_ranges() == [(0, 1024)]
    assert a.largest_free_bytes == 1024


@pytest.mark.parametrize("offset,size", [
    (0, 64),        # double free (freed below)
    (64, 128),      # wrong size for a live allocation
    (32, 64),       # not an allocation's offset
    (960, 128),     # past the capacity
    (-64, 64),      # negative
])
def test_bad_free_raises_and_changes_nothing(offset, size):
    a = RangeAllocator(1024, 64)
    assert a.allocate(64) == 0
    assert a.allocate(64) == 64
    a.free(0, 64)
    before = (a.free_ranges(), a.used_bytes)
    with pytest.raises(ValueError):
        a.free(offset, size)
    assert (a.free_ranges(), a.used_bytes) == before


@pytest.mark.parametrize("offset,size", [
    (0, 64),        # double free (freed below)
    (0, 128),       # overlaps the freed range and a live one
    (128, 64),      # never allocated: free space
    (960, 128),     # past the capacity
    (-64, 64),      # negative
])
def test_an_untracked_allocator_still_refuses_frees_of_free_space(offset, size):
    # The master's segments (track=False): its index records the allocations, so only frees
    # that overlap free space can be told from good ones, and those are refused.
    a = RangeAllocator(1024, 64, track=False)
    assert a.allocate(64) == 0
    assert a.allocate(64) == 64
    a.free(0, 64)
    before = (a.free_ranges(), a.used_bytes)
    with pytest.raises(ValueError):
        a.free(offset, size)
    assert (a.free_ranges(), a.used_bytes) == before
    a.free(64, 64)
    assert a.free_ranges() == [(0, 1024)] and a.used_bytes == 0


@pytest.mark.parametrize("size", [0, -1])
def test_nonpositive_size_is_rejected(size):
    a = RangeAllocator(1024, 64)
    with pytest.raises(ValueError):
        a.allocate(size)
    with pytest.raises(ValueError):
        a.free(0, size)


def test_large_extents_start_half_a_page_in_and_a_batch_of_blocks_stays_adjacent():
    """Half a page from a buffer that starts on a page or a few bytes past one, whichever way
    a copy goes (4K aliasing: see the module's docstring)."""
    a = RangeAllocator(64 << 20, 64)
    blocks = [a.allocate(2 << 20) for _ in range(4)]
    assert blocks == [PHASE_BYTES + i * (2 << 20) for i in range(4)]
    assert a.allocate(100) == 0        # small objects take the gap before the first
    odd = a.allocate(PHASED_MIN_BYTES + 64)
    assert odd % 4096 == PHASE_BYTES
    # Where no range has room for the move, the best fit is taken where it starts.
    b = RangeAllocator(PHASED_MIN_BYTES, 64)
    assert b.allocate(PHASED_MIN_BYTES) == 0


@pytest.mark.parametrize("size", [100, 4096, PHASED_MIN_BYTES, PHASED_MIN_BYTES + 64, 70_000,
                                  (2 << 20) + 64, 2 << 20])
def test_allocate_many_is_allocate_that_many_times(size):
    """On free lists left by random allocations and frees of mixed sizes (a long-lived
    segment), allocate_many gives what as many allocate calls would, down to the free ranges
    left: a range carved until what is left of it no longer fits at the phase, then the next."""
    rng = random.Random(size)
    for _ in range(40):
        a = RangeAllocator(rng.choice([1 << 20, 8 << 20, 24 << 20 | 4032]), 64, track=False)
        live = []
        for _ in range(rng.randrange(60)):
            if live and rng.random() < 0.4:
                a.free(*live.pop(rng.randrange(len(live))))
            elif (offset := a.allocate(n := rng.choice([64, 3000, 70_000, size]))) is not None:
                live.append((offset, n))
        sequential = copy.deepcopy(a)
        count = rng.randrange(1, 40)
        expected = [o for o in (sequential.allocate(size) for _ in range(count)) if o is not None]
        assert a.allocate_many(size, count) == expected
        assert a.free_ranges() == sequential.free_ranges()
        assert a.used_bytes == sequential.used_bytes


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError):
        RangeAllocator(1024, 0)
    with pytest.raises(ValueError):
        RangeAllocator(-1, 64)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model of the live extents."""

    extents = Bundle("extents")

    def __init__(self) -> None:
        super().__init__()
        self.alloc: RangeAllocator | None = None
        self.live: dict[int, int] = {}   # offset -> requested size

    @precondition(lambda self: self.alloc is None)
    @rule(capacity=st.one_of(st.integers(0, 8192), st.integers(0, 1 << 20)),
          alignment=st.sampled_from([1, 8, 64, 100]),
          track=st.booleans())
    def create(self, capacity, alignment, track):
        self.alloc = RangeAllocator(capacity, alignment, track=track)
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment

    def rounded(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    @precondition(lambda self: self.alloc is not None)
    @rule(target=extents, size=st.one_of(st.integers(1, 2048),
                                         st.integers(PHASED_MIN_BYTES - 64, 200 << 10)))
    def allocate(self, size):
        largest = self.alloc.largest_free_bytes
        free = self.alloc.free_ranges()
        offset = self.alloc.allocate(size)
        # Best fit fails exactly when no free range is large enough.
        assert (offset is None) == (self.rounded(size) > largest)
        if offset is None:
            return None
        # A large extent starts at the phase whenever some free range has room for that.
        length = self.rounded(size)
        if length >= PHASED_MIN_BYTES and PHASE_BYTES % self.alignment == 0 and any(
                n >= (PHASE_BYTES - o) % 4096 + length for o, n in free):
            assert offset % 4096 == PHASE_BYTES
        self.live[offset] = size
        return (offset, size)

    @precondition(lambda self: self.alloc is not None)
    @rule(target=extents, size=st.one_of(st.integers(1, 2048), st.integers(60 << 10, 200 << 10),
                                         st.sampled_from([PHASED_MIN_BYTES, 8192])),
          count=st.integers(0, 12))
    def allocate_many(self, size, count):
        # The same offsets, and the same free ranges after, as allocate() count times over.
        sequential = copy.deepcopy(self.alloc)
        expected = []
        for _ in range(count):
            if (offset := sequential.allocate(size)) is None:
                break
            expected.append(offset)
        assert self.alloc.allocate_many(size, count) == expected
        assert self.alloc.free_ranges() == sequential.free_ranges()
        self.live.update(dict.fromkeys(expected, size))
        return multiple(*[(offset, size) for offset in expected])

    @precondition(lambda self: self.alloc is not None)
    @rule(extent=consumes(extents))
    def free(self, extent):
        if extent is None:
            return
        offset, size = extent
        self.alloc.free(offset, size)
        del self.live[offset]
        with pytest.raises(ValueError):
            self.alloc.free(offset, size)   # a second free of the same range must fail

    @invariant()
    def consistent(self):
        if self.alloc is None:
            return
        a = self.alloc
        spans = sorted((off, self.rounded(size)) for off, size in self.live.items())
        for off, length in spans:
            assert off % self.alignment == 0
            assert 0 <= off and off + length <= self.capacity
        for (o1, l1), (o2, _) in pairwise(spans):
            assert o1 + l1 <= o2, "live extents overlap"
        free = a.free_ranges()
        for (o1, l1), (o2, _) in pairwise(free):
            assert o1 + l1 < o2, "free ranges adjacent or overlapping: not coalesced"
        # Live and free ranges tile the usable capacity exactly.
        tiles = sorted(spans + free)
        pos = 0
        for off, length in tiles:
            assert off == pos
            pos += length
        assert pos == self.capacity
        assert a.capacity_bytes == self.capacity
        assert a.used_bytes == sum(length for _, length in spans)
        assert a.used_bytes + a.free_bytes == a.capacity_bytes
        assert a.largest_free_bytes == max((length for _, length in free), default=0)

    def teardown(self):
        if self.alloc is None:
            return
        for offset, size in list(self.live.items()):
            self.alloc.free(offset, size)
        expected = [(0, self.capacity)] if self.capacity else []
        assert self.alloc.free_ranges() == expected
        assert self.alloc.used_bytes == 0


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
