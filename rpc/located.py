"""GetReplicas' answer kept in columns, so a read of hundreds of blocks builds no object per key.

The read path of a key with one replica works on the arrays directly
(:meth:`KVClient._read_fast`); a key with several asks :meth:`Located.view` for its
:class:`ObjectView`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from kvpool.common import checksum
from kvpool.common.errors import KVPoolError, error_for_status
from kvpool.common.types import ObjectView, Replica
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.rpc.wire import ReplicaArrays, replica_from_pb


@dataclass(frozen=True, slots=True)
class Located:
    """Per key (in request order): status, size, version and replicas, as arrays."""

    keys: Sequence[str]
    statuses: np.ndarray   # pb.Status values
    sizes: np.ndarray      # uint64; 0 where the status is not OK
    versions: np.ndarray   # uint64
    checksums: np.ndarray  # uint64, as on the wire (common/checksum.py: 0 = none recorded)
    replicas: ReplicaArrays
    lease_ttl_s: float     # each object found is leased this long from the request

    def found(self) -> np.ndarray:
        """A boolean mask of the keys whose status is OK."""
        return self.statuses == pb.STATUS_OK

    def single_location(self) -> np.ndarray:
        """Per key, the location index of its only replica, or -1 (not found, or several)."""
        r = self.replicas
        if len(r.location) == 0:
            return np.full(len(self.statuses), -1, dtype=np.int64)
        single = self.found() & (r.counts == 1)
        # first[i] of a key without replicas may point one past the end: clamp, then mask.
        return np.where(single, r.location[np.minimum(r.first, len(r.location) - 1)], -1)

    def views(self) -> list[ObjectView | KVPoolError]:
        """Every key's :meth:`view`, in request order: for callers that inspect a few keys'
        replicas (tools, tests), not for reads."""
        return [self.view(i) for i in range(len(self.keys))]

    def view(self, i: int) -> ObjectView | KVPoolError:
        """Key ``i`` as an ObjectView, or its error."""
        err = error_for_status(int(self.statuses[i]), self.keys[i])
        if err is not None:
            return err
        r, size = self.replicas, int(self.sizes[i])
        first = int(r.first[i])
        reps = tuple(r.locations[int(r.location[j])].at(int(r.offsets[j]), size,
                                                        r.grants[j] if r.grants else b"")
                     for j in range(first, first + int(r.counts[i])))
        return ObjectView(self.keys[i], size, int(self.versions[i]), reps,
                          checksum.decode(int(self.checksums[i])))


def only_replica(r: pb.GetReplicasResponse) -> Replica | None:
    """The answer's only replica (its extent the object's) when it is about one key, found,
    with one replica: a single get's common case, read without the columns' arrays
    (:class:`Located`). None otherwise."""
    cols = r.replicas
    if len(r.statuses) != 1 or r.statuses[0] != pb.STATUS_OK or len(cols.offsets) != 1:
        return None
    return replica_from_pb(cols.locations[cols.location[0]]).at(
        cols.offsets[0], r.sizes[0], cols.grants[0] if cols.grants else b"")
