"""The master's side of data grants (common/capabilities.py): a key per store node, handed
over at MountSegment, and a grant minted per replica of every placement and location."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.common import capabilities
from kvpool.common.types import Replica


class GrantMinter:
    """Keys by node id (random per master process: a restarted master hands out new ones as
    its nodes mount again) and the grants of a batch, in ReplicaColumns' order."""

    def __init__(self, replica_in: Callable[[str], Replica]) -> None:
        self._replica_in = replica_in
        self._keys: dict[str, bytes] = {}

    def key_for(self, node_id: str) -> bytes:
        """The node's key, made on its first mount."""
        key = self._keys.get(node_id)
        if key is None:
            key = self._keys[node_id] = capabilities.new_key()
        return key

    def mint(self, op: int, counts: Sequence[int], segment_ids: Sequence[str],
             offsets: Sequence[int], sizes: Sequence[int], versions: Sequence[int],
             ttl_s: float) -> list[bytes]:
        """One grant per replica: object ``i`` has ``counts[i]`` replicas, each at
        ``(segment_ids[j], offsets[j])``, of ``sizes[i]`` bytes and version ``versions[i]``."""
        expiry = capabilities.expiry_ms(ttl_s)
        key_of: dict[str, bytes] = {}
        grants: list[bytes] = []
        j = 0
        for count, size, version in zip(counts, sizes, versions):
            for k in range(j, j + count):
                sid = segment_ids[k]
                key = key_of.get(sid)
                if key is None:
                    key = key_of[sid] = self.key_for(self._replica_in(sid).node.node_id)
                grants.append(capabilities.mint(key, op, sid, offsets[k], size, version, expiry))
            j += count
        return grants
