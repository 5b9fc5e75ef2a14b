"""Replicas a reader reported corrupt, waiting for their own node to re-check them (sans-IO).

A reader's ReportCorrupt used to drop the replica at once: any client could empty the cache by
naming objects (issue 15: a good, hard-pinned, 2-replica object reported away). Now the master
only asks the node holding the replica (in its next HeartbeatResponse); the node checksums the
bytes it holds and reports back, as itself, those that really fail (store_node/scrubber.py
``recheck``); only that drops the replica.
"""

from __future__ import annotations

# Re-checks waiting per node: past it, reports are dropped until the node takes them (a
# flood of reports costs the master this much memory per node, never more).
MAX_WAITING_PER_NODE = 4096

Suspect = tuple[str, int, str]   # key, version, segment id


class Rechecks:
    """What each node is to re-check, each suspect once."""

    def __init__(self, per_node: int = MAX_WAITING_PER_NODE) -> None:
        self._per_node = per_node
        self._waiting: dict[str, dict[Suspect, None]] = {}
        self.dropped = 0   # reports past the limit

    def ask(self, node_id: str, suspect: Suspect) -> None:
        """Have ``node_id`` re-check ``suspect`` (once, however often it is reported)."""
        waiting = self._waiting.setdefault(node_id, {})
        if suspect in waiting:
            return
        if len(waiting) >= self._per_node:
            self.dropped += 1
            return
        waiting[suspect] = None

    def take(self, node_id: str) -> list[Suspect]:
        """The suspects for ``node_id`` (each handed out once)."""
        return list(self._waiting.pop(node_id, ()))

    def waiting(self) -> int:
        return sum(map(len, self._waiting.values()))
