"""Prefix chains: the eviction order of each tier and the links still waiting for a parent."""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterator

from kvpool.master.eviction import EvictionPolicy

# Children waiting for a parent that is not stored yet; past this many, new ones are plain
# chain heads. Bounds the master's memory against parents that never come.
_MAX_WAITING = 1 << 16


class Chains:
    """The COMPLETE objects in eviction order: ``policy`` for the tiers above disk,
    ``disk_policy`` for disk, each linking a block to its parent when that is in the same one."""

    def __init__(self, policy: EvictionPolicy, disk_policy: EvictionPolicy) -> None:
        self.policy = policy
        # Objects on a disk tier are ordered apart, by a policy of the same kind: there they
        # can only be dropped, and a chain block whose children all went down to disk must
        # become demotable itself (to the main policy, a child on disk is still a child).
        self.disk_policy = disk_policy
        # Chain links waiting for their parent to enter the child's policy (a child announced
        # before its parent after a restart, a block on another tier than its parent): parent
        # key -> children, and child -> parent. Linked when the parent arrives there; dropped
        # with the parent (or the child) leaving the index, and once recovery ends.
        self.waiting: dict[str, list[str]] = {}
        self.waiting_for: dict[str, str] = {}

    def track(self, key: str, parent: str | None, disk: bool) -> None:
        """Hand a complete object to its tier's policy, linked to ``parent`` if that one is
        there, else waiting for it; children waiting for ``key`` there are linked now."""
        policy = self.disk_policy if disk else self.policy
        if parent is not None and parent in policy:
            policy.on_insert(key, parent)
        else:
            policy.on_insert(key)
            if parent is not None:
                kids = self.waiting.setdefault(parent, [])
                if key not in kids:
                    kids.append(key)
                self.waiting_for[key] = parent
        kids = self.waiting.pop(key, None) if self.waiting else None
        if kids:
            left = []
            for child in kids:
                if self.waiting_for.get(child) != key:
                    continue   # gone, or linked since
                if policy.link(child, key) or child in policy:
                    del self.waiting_for[child]
                else:   # on the other tier: waits for this block to come there
                    left.append(child)
            if left:
                self.waiting[key] = left

    def may_wait(self) -> bool:
        """Room for one more child waiting for its parent (entries of children that left
        are pruned first when the table is full)."""
        if len(self.waiting_for) < _MAX_WAITING and len(self.waiting) < _MAX_WAITING:
            return True
        waiting_for = self.waiting_for
        self.waiting = {p: live for p, kids in self.waiting.items()
                        if (live := [c for c in kids if waiting_for.get(c) == p])}
        return len(waiting_for) < _MAX_WAITING and len(self.waiting) < _MAX_WAITING

    def parent_of(self, key: str, disk: bool) -> str | None:
        """The parent ``key`` is linked to (on its tier, or gone ahead to the other) or waits
        for."""
        # Also a parent that went to the other tier first (moves run side by side); not one
        # that left the index, which nobody should wait for.
        linked = (self.disk_policy if disk else self.policy).parent_of(key)
        if linked is not None and (linked in self.policy or linked in self.disk_policy):
            return linked
        return self.waiting_for.get(key) if self.waiting_for else None

    def moved(self, key: str, was_on_disk: bool) -> None:
        """``key`` went down to disk or back up: to the other policy, linked to its parent
        there or waiting for it (a chain is dropped from disk tail first)."""
        parent = self.parent_of(key, was_on_disk)
        (self.disk_policy if was_on_disk else self.policy).on_remove(key)
        self.waiting_for.pop(key, None)
        self.track(key, parent, not was_on_disk)

    def forget(self, key: str) -> None:
        """``key`` left the index: out of both orders, and no longer waited for."""
        self.policy.on_remove(key)
        self.disk_policy.on_remove(key)
        if self.waiting_for:
            self.waiting_for.pop(key, None)   # its entry in ``waiting``: dropped lazily
        if self.waiting:
            for child in self.waiting.pop(key, ()):
                if self.waiting_for.get(child) == key:
                    del self.waiting_for[child]

    def stop_waiting_for_absent(self, indexed: Container[str]) -> None:
        """Recovery ended: parents not ``indexed`` by now never come."""
        for parent in [p for p in self.waiting if p not in indexed]:
            for child in self.waiting.pop(parent):
                if self.waiting_for.get(child) == parent:
                    del self.waiting_for[child]

    def candidates(self, disk: bool, above: bool) -> Iterator[str]:
        """Eviction candidates: those on ``disk``, then those ``above`` it, each in order."""
        walks = []
        if disk:
            walks.append(self.disk_policy.candidates())
        if above:
            walks.append(self.policy.candidates())
        return itertools.chain.from_iterable(walks)
