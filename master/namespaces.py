"""Lookups counted per key namespace, so an engine's operator sees its own prefix reuse.

A key's namespace is its first ``depth`` "/"-separated components ("kvpool/vllm1/<model
namespace>" for the vLLM connector's keys at depth 3); a key with fewer is in the namespace of
all its components but the last ("" for a key with no "/"). A lookup batch is counted in its
first key's namespace: engines look up one request's blocks per batch, and reading every key's
namespace would cost more than the lookup itself (~0.5 us a key, against ~4 us). At most
``MAX_NAMESPACES`` namespaces are told apart; later ones are counted under ``OTHER``, so a client
inventing names cannot grow the master's memory or its metrics without bound.
"""

from __future__ import annotations

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
