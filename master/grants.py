"""The master's side of data grants (common/capabilities.py): a key per store node, handed
over at MountSegment, and a grant minted per replica of every placement and location."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.common import capabilities


class GrantMinter:
    """Keys by node id (random per master process: a restarted master hands out new ones as
    its nodes mount again) and the grants of a batch, in ReplicaColumns' order."""

    def __init__(self, node_of: Callable[[str], str]) -> None:
        """``node_of(segment_id)``: the id of the node that holds a segment."""
        self._node_of = node_of
        self._signers: dict[str, capabilities.Signer] = {}

    def _signer(self, node_id: str) -> capabilities.Signer:
        signer = self._signers.get(node_id)
        if signer is None:
            signer = self._signers[node_id] = capabilities.Signer(capabilities.new_key())
        return signer

    def key_for(self, node_id: str) -> bytes:
        """The node's key, made on its first mount."""
        return self._signer(node_id).key

    def mint(self, op: int, counts: Sequence[int], segment_ids: Sequence[str],
             offsets: Sequence[int], sizes: Sequence[int], versions: Sequence[int],
             ttl_s: float, keys: Sequence[str] | None = None, joined: bool = False
             ) -> list[bytes] | bytes:
        """One grant per replica: object ``i`` has ``counts[i]`` replicas, each at
        ``(segment_ids[j], offsets[j])``, of ``sizes[i]`` bytes and version ``versions[i]``.
        ``keys``: each object's stored key, for WRITE grants with record tags. ``joined``
        (READ grants): the grants in one bytes object, one after another."""
        expiry = capabilities.expiry_ms(ttl_s)
        n = len(segment_ids)
        if n and len(counts) == n and counts.count(1) == n \
                and segment_ids.count(segment_ids[0]) == n:
            # One replica each, all in one segment (most batches): the columns as they are.
            sid = segment_ids[0]
            return self._signer(self._node_of(sid)).mint_many(
                op, sid.encode(), offsets, sizes, versions, expiry, keys, joined)
        # Grouped by segment (a batch's replicas share a few), minted per segment, then put
        # back in replica order.
        by_segment: dict[str, list[int]] = {}
        columns: dict[str, tuple[list[int], list[int], list[int], list[str] | None]] = {}
        j = 0
        for i, (count, size, version) in enumerate(zip(counts, sizes, versions)):
            for k in range(j, j + count):
                sid = segment_ids[k]
                if sid not in by_segment:
                    by_segment[sid] = []
                    columns[sid] = ([], [], [], [] if keys is not None else None)
                by_segment[sid].append(k)
                offs, lens, vers, named = columns[sid]
                offs.append(offsets[k])
                lens.append(size)
                vers.append(version)
                if named is not None:
                    named.append(keys[i])
            j += count
        grants: list[bytes] = [b""] * j
        for sid, where in by_segment.items():
            signer = self._signer(self._node_of(sid))
            for k, grant in zip(where, signer.mint_many(op, sid.encode(), *columns[sid][:3],
                                                        expiry, columns[sid][3])):
                grants[k] = grant
        return b"".join(grants) if joined else grants
