"""What the master counts of reads beyond hits and misses: lookups per key namespace, so an
engine's operator sees its own prefix reuse, and the read leases still running.

A key's namespace is its first ``depth`` "/"-separated components ("kvpool/vllm1/<model
namespace>" for the vLLM connector's keys at depth 3); a key with fewer is in the namespace of
all its components but the last ("" for a key with no "/"). A lookup batch is counted in its
first key's namespace: engines look up one request's blocks per batch, and reading every key's
namespace would cost more than the lookup itself (~0.5 us a key, against ~4 us). At most
``MAX_NAMESPACES`` namespaces are told apart; later ones are counted under ``OTHER``, so a client
inventing names cannot grow the master's memory or its metrics without bound.
"""

from __future__ import annotations

import collections

MAX_NAMESPACES = 64
OTHER = "(other)"


def namespace_of(key: str, depth: int) -> str:
    parts = key.split("/", depth)
    return "/".join(parts[:depth] if len(parts) > depth else parts[:-1])


class NamespaceLookups:
    """Hits and misses per namespace (see the module docstring); depth 0 counts nothing."""

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self.counts: dict[str, list[int]] = {}   # namespace -> [hits, misses]

    def count(self, first_key: object, hits: int, misses: int) -> None:
        if not self._depth or not isinstance(first_key, str):
            return
        ns = namespace_of(first_key, self._depth)
        entry = self.counts.get(ns)
        if entry is None:
            if len(self.counts) >= MAX_NAMESPACES:
                ns = OTHER
            entry = self.counts.setdefault(ns, [0, 0])
        entry[0] += hits
        entry[1] += misses


class LeaseCount:
    """Read leases granted and not expired yet, counted per lookup batch (one deque entry a
    batch, not a walk of the index): a key read twice within its lease counts twice."""

    def __init__(self) -> None:
        self._batches: collections.deque[tuple[float, int]] = collections.deque()
        self._live = 0

    def granted(self, until: float, keys: int, now: float) -> None:
        if keys:
            self._batches.append((until, keys))
            self._live += keys
        self._expire(now)

    def live(self, now: float) -> int:
        self._expire(now)
        return self._live

    def _expire(self, now: float) -> None:
        batches = self._batches
        while batches and batches[0][0] <= now:   # all leases are equally long: FIFO
            self._live -= batches.popleft()[1]
