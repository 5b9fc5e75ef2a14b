"""Pins on their own: the hard-pin quota and its bytes, soft pins ending, soft-pinned last."""

from __future__ import annotations

import pytest
from kvpool.common.config import MasterConfig
from kvpool.common.errors import NoSpace
from kvpool.common.types import Extent, SegmentInfo
from kvpool.master.allocator import RangeAllocator
from kvpool.master.index import COMPLETE, ObjectIndex
from kvpool.master.membership import Segment
from kvpool.master.pins import Pins


def setup(capacity: int = 1000):
    segments = {"s": Segment("n1", SegmentInfo("s", capacity), RangeAllocator(capacity, 1))}
    index = ObjectIndex()
    objs = [index.add(f"k{i}", 200, [Extent("s", 200 * i, 200)], state=COMPLETE)
            for i in range(4)]
    return Pins(MasterConfig(pin_quota_fraction=0.5, alignment_bytes=1), segments, index.more), \
        objs


def test_hard_pins_hold_their_sizes_within_the_quota():
    pins, (a, b, c, _) = setup()
    assert pins.pin(a, None, 0.0) and pins.pin(b, None, 0.0)
    assert not pins.pin(a, None, 0.0)   # already hard: no change to record
    with pytest.raises(NoSpace, match="over the quota of 500"):
        pins.pin(c, None, 0.0)
    assert pins.pin(c, None, 0.0, quota=False) and pins.hard_bytes == 600
    assert pins.unpin(a) and not pins.unpin(a)
    pins.forget(b)
    assert pins.hard_bytes == 200 and not pins.is_hard(a) and pins.is_hard(c)


def test_soft_pins_go_last_until_they_end_and_never_soften_a_hard_one():
    pins, (a, b, c, d) = setup()
    assert not pins.pin(a, 10.0, 0.0)
    assert not pins.pin(b, 5.0, 0.0)
    pins.pin(b, 1.0, 0.0)               # pinning again never shortens it
    pins.pin(d, None, 0.0)
    assert not pins.pin(d, 1.0, 0.0)    # a hard pin stays hard: no soft end for it
    keys = [o.key for o in (a, b, c, d)]
    assert list(pins.soft_last(keys, 1.0)) == ["k2", "k3", "k0", "k1"]
    pins.expire(6.0)
    assert list(pins.soft_last(keys, 6.0)) == ["k1", "k2", "k3", "k0"]
    pins.unpin(a)
    assert list(pins.soft_last(keys, 6.0)) == keys
