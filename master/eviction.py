"""Eviction policies: the order in which complete objects are offered for eviction.

A policy only orders keys. Whether a candidate may actually go (leased, pinned, PENDING) is
the state's decision, so policies stay small and interchangeable: ``LRUPolicy`` (plain) and
``PrefixAwarePolicy`` (KV prefix chains: tails before parents, the design's eviction order).
The master takes the one ``MasterConfig.eviction`` names (``kvpool master --eviction``).

Who goes first under ``PrefixAwarePolicy`` (the default), for the keys the master may evict:

======================================  =====================================================
Object                                  When it is offered
======================================  =====================================================
chain tail (no stored child)            by LRU among all such leaves, oldest first
block whose children are all gone       becomes a leaf: offered in LRU turn by its own use
block shared by k chains                only after all k chains below it are gone: last
object put without a parent             a leaf from the start: plain LRU with the tails
parent named but not stored at PutEnd   not linked: the block counts as a chain head
announced after a master restart        no parent known (manifests carry none): a head
pinned / leased / PENDING (the state)   skipped; a pinned tail also holds its parents
======================================  =====================================================
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator
from itertools import islice

_ABSENT = object()


class EvictionPolicy(ABC):
    """Tracks the evictable population and orders it, best victim first."""

    @abstractmethod
    def on_insert(self, key: str, parent: str | None = None) -> None:
        """``key`` became evictable (its put completed); ``parent``: the key of the block it
        extends, None for none (policies that ignore chains ignore it)."""

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

    def on_insert(self, key: str, parent: str | None = None) -> None:
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


def make_eviction_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its MasterConfig.eviction name ("prefix" or "lru")."""
    if name == "lru":
        return LRUPolicy()
    if name == "prefix":
        return PrefixAwarePolicy()
    raise ValueError(f"unknown eviction policy {name!r}")   # MasterConfig validated it


class PrefixAwarePolicy(EvictionPolicy):
    """LRU over the *leaves* of the prefix forest: a block is a victim only once no block that
    extends its chain is left (as SGLang's radix cache and vLLM's reverse-order free queue do).

    Why: a chained KV block is useful only while every earlier block of its prompt is cached too.
    Plain LRU touches a prompt's blocks in order, so it evicts a chain's *head* first and
    strands the rest; here the tail goes first, and a block shared by many chains (a system
    prompt, an earlier conversation turn) stays while any chain below it does.

    ``on_insert(key, parent)`` names the block the key extends (None for a chain's first block);
    ``on_access`` of a block refreshes only that block, so callers touch a whole matched prefix.
    Cost: O(log n) per insert, access and victim, with stale heap entries dropped lazily.
    """

    def __init__(self) -> None:
        self._clock = 0
        self._stamp: dict[Hashable, int] = {}          # key -> last use (a logical clock)
        self._parent: dict[Hashable, Hashable | None] = {}
        self._children: dict[Hashable, int] = {}       # key -> how many tracked keys extend it
        self._leaves: list[tuple[int, Hashable]] = []  # heap (stamp, key); stale entries skipped

    def on_insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        if key in self._stamp:
            self.on_access(key)
            return
        self._parent[key] = parent
        self._children[key] = 0
        if parent in self._stamp:
            self._children[parent] += 1
        self._touch(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._stamp:
            self._touch(key)

    def on_remove(self, key: Hashable) -> None:
        if self._stamp.pop(key, _ABSENT) is _ABSENT:
            return
        del self._children[key]
        parent = self._parent.pop(key)
        # A parent removed before its children (remove, node loss) leaves them as chain heads;
        # if it comes back its count starts at 0, hence the guard.
        if parent in self._stamp and self._children[parent] > 0:
            self._children[parent] -= 1
            if self._children[parent] == 0:    # a leaf again: a victim in its own turn
                heapq.heappush(self._leaves, (self._stamp[parent], parent))

    def candidates(self) -> Iterator[Hashable]:
        offered: list[tuple[int, Hashable]] = []
        try:
            while self._leaves:
                entry = heapq.heappop(self._leaves)
                if not self._is_live_leaf(entry):
                    continue
                offered.append(entry)
                yield entry[1]
        finally:   # keys offered but not removed (leased, pinned) stay candidates
            for entry in offered:
                if self._is_live_leaf(entry):
                    heapq.heappush(self._leaves, entry)

    def __len__(self) -> int:
        return len(self._stamp)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._stamp

    def _touch(self, key: Hashable) -> None:
        self._clock += 1
        self._stamp[key] = self._clock
        if self._children[key] == 0:
            heapq.heappush(self._leaves, (self._clock, key))
            self._compact()

    def _is_live_leaf(self, entry: tuple[int, Hashable]) -> bool:
        stamp, key = entry
        return self._stamp.get(key) == stamp and self._children[key] == 0

    def _compact(self) -> None:
        # Touches leave stale entries behind; rebuild once they outnumber the live keys.
        if len(self._leaves) > 2 * len(self._stamp) + 1024:
            self._leaves = [(s, k) for k, s in self._stamp.items() if self._children[k] == 0]
            heapq.heapify(self._leaves)
