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
announced after a master restart        linked again (manifests carry the parent), even
                                        when a child is announced before its parent
pinned / leased / PENDING (the state)   skipped; a pinned tail also holds its parents
on a disk tier (the state)              ordered apart, by a second policy of the same kind:
                                        linked when the parent comes down too
soft-pinned within its TTL (the state)  after every other candidate, in the same order
======================================  =====================================================
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator
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

    #: Whether the reads of the keys a walk reaches are told then (PrefixAwarePolicy
    #: ``read_at``), so that a reader need not call ``on_access``.
    reads_later = False

    def on_access_many(self, keys: Iterable[str]) -> None:
        """``on_access`` of each key in turn (subclasses do it without a call per key)."""
        for key in keys:
            self.on_access(key)

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

    def __contains__(self, key: str) -> bool:
        """Whether the policy tracks ``key``."""
        return any(k == key for k in self.candidates())   # subclasses answer in O(1)

    def link(self, key: str, parent: str) -> bool:
        """Make tracked ``key`` (inserted without a parent) extend tracked ``parent``, as if
        it had been inserted with it: for a parent that arrives after its children (objects
        announced to a restarted master, blocks moved between tiers). False where nothing was
        linked (policies that ignore chains, an untracked key, a key with a parent, a cycle)."""
        return False

    def parent_of(self, key: str) -> str | None:
        """The key tracked ``key`` was linked to, or None (policies that ignore chains). The
        parent may have left this policy since (moved to another tier ahead of its child, or
        gone): the child still names it, so a move or a manifest record keeps the chain."""
        return None


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

    def on_access_many(self, keys: Iterable[str]) -> None:
        order = self._order
        pop = order.pop
        for key in keys:
            if pop(key, _ABSENT) is not _ABSENT:
                order[key] = None

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
            yield from chunk
            yielded.extend(chunk)
            chunk_size *= 2

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: str) -> bool:
        return key in self._order


def make_eviction_policy(name: str, clock: Callable[[], float] | None = None,
                         read_at: Callable[[Hashable], float | None] | None = None
                         ) -> EvictionPolicy:
    """A fresh policy by its MasterConfig.eviction name ("prefix" or "lru"); ``clock`` and
    ``read_at``: see :class:`PrefixAwarePolicy` (LRUPolicy takes every read as it comes)."""
    if name == "lru":
        return LRUPolicy()
    if name == "prefix":
        return PrefixAwarePolicy(clock, read_at)
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

    Layout, kept small (a master tracks millions of keys): each key sits in exactly one of three
    dicts, with the time of its last use. ``_leaves`` holds the leaves in exact LRU order (a
    touch re-appends), so the common case costs one dict entry per key and a touch is O(1).
    ``_inner`` holds blocks with children. A block whose last child goes becomes a leaf *in its
    own LRU turn*, which may be anywhere in ``_leaves``: it waits in ``_revived`` (plus a heap by
    time, stale entries skipped) and the walk merges both by time. ``_parent`` and
    ``_children`` hold entries only for keys that have a parent / children.

    Time is counted in epochs of ``_EPOCH_TOUCHES`` touches, one int object per epoch shared by
    every key touched in it (an int per key would add 32 bytes to each): the merge is exact
    across epochs, and within one a revived block goes before the leaves.

    Reads told later (``read_at``, with ``clock``: the master's). A master's reads are not
    touches: a touch is a pop and an insert in a dict of millions, two cache misses a key, a
    fifth of a batched lookup's time. Instead ``read_at(key)`` says when a key was last read
    (its read lease's time: master/leases.py), and the walk moves a key read since it took
    its place to the end of the order, in its read's epoch, instead of offering it: what a
    touch did, done only to the keys a walk reaches. Epochs are then ``1 / _EPOCHS_PER_S``
    of the clock: even for a key's place, odd for a read in it, so a read in the epoch a key
    was placed in still counts as later. The order is approximate as CLOCK's second chance
    is: keys moved by a walk go in the order it reaches them, not that of their reads.
    """

    _FIRST_CHUNK = 64
    _EPOCH_TOUCHES = 256
    _EPOCHS_PER_S = 10
    # Keys one walk moves at most: the first walk after a long spell of reads without one
    # would otherwise move every key read meanwhile (millions: seconds of a master's time).
    # Past it, the walk offers keys where they stand; the next walk goes on moving.
    _MAX_MOVES = 1 << 16

    def __init__(self, clock: Callable[[], float] | None = None,
                 read_at: Callable[[Hashable], float | None] | None = None) -> None:
        if (clock is None) != (read_at is None):
            raise ValueError("reads told later need both a clock and read_at")
        self._clock, self._read_at = clock, read_at
        self._touches = 0
        self._epoch = 0
        self._moves = 0   # keys the current walk may still move (read_at)
        self._leaves: dict[Hashable, int] = {}    # leaf -> last use; dict order = use order
        self._inner: dict[Hashable, int] = {}     # key with children -> last use
        self._revived: dict[Hashable, int] = {}   # leaf again since its last child went
        self._revived_heap: list[tuple[int, Hashable]] = []   # (last use, key); may be stale
        self._parent: dict[Hashable, Hashable] = {}   # key -> the tracked key it extends
        self._children: dict[Hashable, int] = {}      # key -> how many tracked keys extend it

    def on_insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        if key in self:
            self.on_access(key)
            return
        self._leaves[key] = self._now()
        if parent is not None:
            self.link(key, parent)

    def link(self, key: Hashable, parent: Hashable) -> bool:
        if key == parent or key not in self or parent not in self or key in self._parent:
            return False
        if key in self._children:   # only a key with children can close a cycle, which
            up = parent             # would keep every block on it inner: never evicted
            for _ in range(len(self._parent)):   # bounded: entries of removed parents linger
                if (up := self._parent.get(up)) is None:
                    break
                if up == key:
                    return False
        self._parent[key] = parent
        count = self._children.get(parent, 0)
        self._children[parent] = count + 1
        if count == 0:   # its first child: no longer a leaf
            used = self._leaves.pop(parent, None)
            self._inner[parent] = self._revived.pop(parent) if used is None else used
        return True

    def parent_of(self, key: Hashable) -> Hashable | None:
        return self._parent.get(key)   # popped when ``key`` leaves

    def on_access(self, key: Hashable) -> None:
        if key in self._leaves:
            del self._leaves[key]                 # re-appended: the newest leaf
        elif key in self._inner:
            self._inner[key] = self._now()
            return
        elif self._revived.pop(key, None) is None:
            return                                # unknown
        self._leaves[key] = self._now()

    def on_access_many(self, keys: Iterable[Hashable]) -> None:
        # ``on_access`` inlined (a read of a prompt touches hundreds of blocks), ``_now`` too:
        # the same epochs as one call per key.
        if self._clock is not None:   # epochs of time (reads_later): the clock's, per key
            super().on_access_many(keys)
            return
        leaves, inner, revived = self._leaves, self._inner, self._revived
        take_leaf = leaves.pop   # one lookup for a leaf, not two: reads touch mostly leaves
        touches, epoch, every = self._touches, self._epoch, self._EPOCH_TOUCHES
        for key in keys:
            if take_leaf(key, None) is not None:
                into = leaves
            elif key in inner:
                into = inner
            elif revived.pop(key, None) is not None:
                into = leaves
            else:
                continue                          # unknown
            touches += 1
            if touches % every == 0:
                epoch = touches
            into[key] = epoch
        self._touches, self._epoch = touches, epoch

    def on_remove(self, key: Hashable) -> None:
        if (self._leaves.pop(key, None) is None and self._inner.pop(key, None) is None
                and self._revived.pop(key, None) is None):
            return
        # A parent removed before its children (remove, node loss) leaves them as chain heads;
        # if it comes back it has no count, hence the guard below.
        self._children.pop(key, None)
        parent = self._parent.pop(key, None)
        if parent is None or parent not in self._children:
            return
        count = self._children[parent] - 1
        if count:
            self._children[parent] = count
            return
        del self._children[parent]                # a leaf again: a victim in its own turn
        used = self._revived[parent] = self._inner.pop(parent)
        heapq.heappush(self._revived_heap, (used, parent))
        if len(self._revived_heap) > 2 * len(self._revived) + 1024:   # drop stale entries
            self._revived_heap = [(t, k) for k, t in self._revived.items()]
            heapq.heapify(self._revived_heap)

    def candidates(self) -> Iterator[Hashable]:
        # Leaves in chunks as LRUPolicy walks its order (the ones yielded and still here are
        # the front of _leaves), merged by last use with the revived ones.
        yielded: list[Hashable] = []
        offered: list[tuple[int, Hashable]] = []   # revived entries popped from the heap
        chunk_size = self._FIRST_CHUNK
        self._moves = self._MAX_MOVES
        try:
            while True:
                yielded = [k for k in yielded if k in self._leaves]
                chunk = list(islice(self._leaves.items(), len(yielded),
                                    len(yielded) + chunk_size))
                for key, used in chunk:
                    yield from self._revived_before(used, offered)
                    if self._leaves.get(key) != used:   # removed (or made a parent) since
                        yielded.append(key)
                    elif (read := self._read_since(key, used)) is not None:
                        del self._leaves[key]   # to the end, in its read's turn
                        self._leaves[key] = read
                    else:
                        yielded.append(key)
                        yield key
                if not chunk:
                    yield from self._revived_before(None, offered)
                    return
                chunk_size *= 2
        finally:   # revived keys offered but not removed (leased, pinned) stay candidates
            for entry in offered:
                if self._revived.get(entry[1]) == entry[0]:
                    heapq.heappush(self._revived_heap, entry)

    def _revived_before(self, used: int | None, offered: list) -> Iterator[Hashable]:
        """Pop and yield the revived keys last used before ``used`` or in its epoch (all: None),
        oldest first."""
        heap = self._revived_heap
        while heap and (used is None or heap[0][0] <= used):
            entry = heapq.heappop(heap)
            if self._revived.get(entry[1]) == entry[0]:
                if (read := self._read_since(entry[1], entry[0])) is not None:
                    self._revived[entry[1]] = read   # read since: later in the turn of it
                    heapq.heappush(heap, (read, entry[1]))
                    continue
                offered.append(entry)
                yield entry[1]

    def _now(self) -> int:
        """The current epoch, counting this touch."""
        if self._clock is not None:
            epoch = self._tenth(self._clock())
            if epoch != self._epoch:
                self._epoch = epoch   # one int object per epoch, shared
            return self._epoch
        self._touches += 1
        if self._touches % self._EPOCH_TOUCHES == 0:
            self._epoch = self._touches
        return self._epoch

    def _tenth(self, t: float) -> int:
        """The (even) epoch of clock time ``t``."""
        return 2 * math.floor(t * self._EPOCHS_PER_S)

    @property
    def reads_later(self) -> bool:
        """Whether reads are told by ``read_at`` when a walk comes to them, not touched."""
        return self._read_at is not None

    def _read_since(self, key: Hashable, used: int) -> int | None:
        """In a walk: the epoch of ``key``'s last read if that came after ``used`` (the key
        is then moved), else None; None too once the walk has moved ``_MAX_MOVES`` keys."""
        at = self._read_at(key) if self._read_at is not None and self._moves else None
        if at is None:
            return None
        epoch = self._tenth(at) + 1   # odd: a read, after a place taken in the same tenth
        if epoch <= used:
            return None
        self._moves -= 1
        return epoch

    def __len__(self) -> int:
        return len(self._leaves) + len(self._inner) + len(self._revived)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._leaves or key in self._inner or key in self._revived
