"""Shared fixtures for the pure unit tests."""

from __future__ import annotations

import itertools
import socket

import pytest
from kvpool.common import checksum
from kvpool.common.errors import KVPoolError
from kvpool.common.types import ObjectView


class FakeClock:
    """A monotonic clock that only moves when a test advances it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pair():
    """Two connected sockets (socketpair), closed after the test."""
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def get_replicas(state, keys) -> list[ObjectView | KVPoolError]:
    """``state.locate_columns(keys)`` as one row per key (the tests' form of GetReplicas'
    answer; clients read the columns): leases, touches and counts hits as a read does."""
    c = state.locate_columns(keys)
    places = zip(c.segment_ids, c.offsets)
    return [c.errors[i] if i in c.errors else
            ObjectView(key, c.sizes[i], c.versions[i],
                       tuple(state.replica_in(sid, offset, c.sizes[i])
                             for sid, offset in itertools.islice(places, count)),
                       checksum.decode(c.checksums[i]))
            for i, (key, count) in enumerate(zip(keys, c.counts))]
