"""Eviction policies: the order in which complete objects are offered for eviction.

A policy only orders keys. Whether a candidate may actually go (leased, pinned, PENDING) is
the state's decision, so policies stay small and interchangeable (LRU now; prefix-aware later).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from itertools import islice

_ABSENT = object()


class EvictionPolicy(ABC):
    """Tracks the evictable population and orders it, best victim first."""

    @abstractmethod
    def on_insert(self, key: str) -> None:
        """``key`` became evictable (its put completed)."""

    @abstractmethod
    def on_access(self, key: str) -> None:
        """``key`` was read; unknown keys are ignored."""

    @abstractmethod
    def on_remove(self, key: str) -> None:
        """``key`` left the index (removed, evicted, lost with its node); unknown keys ignored."""

    @abstractmethod
    def candidates(self) -> Iterator[str]:
        """Keys in eviction order, best victim first, produced lazily.

        The caller may ``on_remove`` keys (evict) and ``on_insert`` new ones while iterating;
        it must not ``on_access`` during the walk (the order could then skip keys).
        """

    @abstractmethod
    def __len__(self) -> int:
        """How many keys the policy tracks."""


class LRUPolicy(EvictionPolicy):
    """Exact least-recently-used order (the design asks for approximate LRU; exact is allowed)."""

    _FIRST_CHUNK = 64

    def __init__(self) -> None:
        # A plain dict keeps insertion order, and a pop + re-insert moves a key to the end: the
        # same exact LRU as an OrderedDict at less than half its memory per key (the master
        # tracks millions).
        self._order: dict[str, None] = {}   # oldest first

    def on_insert(self, key: str) -> None:
        self._order.pop(key, None)
        self._order[key] = None

    def on_access(self, key: str) -> None:
        if self._order.pop(key, _ABSENT) is not _ABSENT:
            self._order[key] = None

    def on_remove(self, key: str) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[str]:
        # A full snapshot per walk would cost O(n) on every put that needs eviction, although
        # the walk usually stops after a few keys. So copy the order in chunks that double in
        # size: the keys already yielded that are still here (skipped by the caller) are the
        # front of the order, since removals only shorten it and inserts go to the end.
        yielded: list[str] = []
        chunk_size = self._FIRST_CHUNK
        while True:
            yielded = [k for k in yielded if k in self._order]
            chunk = list(islice(self._order, len(yielded), len(yielded) + chunk_size))
            if not chunk:
                return
            for key in chunk:
                yield key
            yielded.extend(chunk)
            chunk_size *= 2

    def __len__(self) -> int:
        return len(self._order)
