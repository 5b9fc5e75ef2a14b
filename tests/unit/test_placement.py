"""BatchPlacer (master/placement.py): a PutStart's objects of one size placed as one
choose_segments call per object would place them, on segments of several nodes and tiers, some
part full, some with holes, some too small."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import pytest
from kvpool.common.types import SegmentInfo
from kvpool.master.allocator import RangeAllocator
from kvpool.master.placement import BatchPlacer, choose_segments


@dataclass
class _Segment:
    node_id: str
    info: SegmentInfo
    allocator: RangeAllocator


def _cluster(rng: random.Random, size: int) -> list[_Segment]:
    segments = []
    for k in range(rng.randrange(1, 7)):
        capacity = rng.choice([0, size // 2, 3 * size, 20 * size, 20 * size + 4096, 64 * size])
        seg = _Segment(f"node{rng.randrange(3)}",
                       SegmentInfo(f"s{k}", capacity, rng.choice(["dram", "dram", "hbm", "disk"])),
                       RangeAllocator(capacity, 64, track=False))
        live = []
        for _ in range(rng.randrange(12)):   # some used, some freed again: holes
            if live and rng.random() < 0.3:
                seg.allocator.free(*live.pop(rng.randrange(len(live))))
            elif (at := seg.allocator.allocate(n := rng.choice([100, size, 3 * size]))) is not None:
                live.append((at, n))
        segments.append(seg)
    return segments


@pytest.mark.parametrize("size", [4096, 64 << 10, (2 << 20) + 64, 2 << 20])
def test_a_batch_is_placed_as_one_call_per_object_would_place_it(size):
    rng = random.Random(size)
    for _ in range(150):
        segments = _cluster(rng, size)
        alone = copy.deepcopy(segments)
        count = rng.randrange(1, 80)
        taken = rng.randrange(count + 1)   # keys refused before placement take none
        placer = BatchPlacer(segments, size, count)
        batch = [placer.take() for _ in range(taken)]
        placer.release()
        one_by_one = [choose_segments(alone, size, 1) for _ in range(taken)]
        assert batch == one_by_one
        for seg, other in zip(segments, alone):
            assert seg.allocator.free_ranges() == other.allocator.free_ranges()
            assert seg.allocator.used_bytes == other.allocator.used_bytes


def test_equally_free_segments_take_turns_in_mount_order():
    segments = [_Segment(f"node{k}", SegmentInfo(f"s{k}", 1 << 30), RangeAllocator(1 << 30))
                for k in range(3)]
    placer = BatchPlacer(segments, 4096, 6)
    assert [placer.take()[0].segment_id for _ in range(6)] == ["s0", "s1", "s2"] * 2
    placer.release()


def test_a_placer_with_no_room_answers_none():
    full = _Segment("n", SegmentInfo("s", 8192), RangeAllocator(8192))
    placer = BatchPlacer([full], 4096, 3)
    assert [placer.take() is not None for _ in range(3)] == [True, True, False]
    placer.release()
    assert full.allocator.free_bytes == 0
