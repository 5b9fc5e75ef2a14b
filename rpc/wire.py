"""Conversions between protobuf messages and the domain types, used by master and client alike."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
from kvpool.common import capabilities, checksum
from kvpool.common.errors import TransportError
from kvpool.common.types import (
    Extent,
    Move,
    NodeEndpoints,
    ObjectRecord,
    Replica,
    Reservation,
    SegmentInfo,
)
from kvpool.protos.kvpool.v1 import master_pb2 as pb

# Batches of hundreds of blocks with descriptors exceed gRPC's 4 MiB default.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]

_TIERS = {"dram": pb.TIER_DRAM, "hbm": pb.TIER_HBM, "disk": pb.TIER_DISK}
_TIER_NAMES = {v: k for k, v in _TIERS.items()}


def node_to_pb(node: NodeEndpoints) -> pb.NodeEndpoints:
    return pb.NodeEndpoints(node_id=node.node_id, boot_id=node.boot_id,
                            tcp_endpoint=node.tcp_endpoint, shm_endpoint=node.shm_endpoint,
                            rdma_device=node.rdma_device, rdma_gid=node.rdma_gid,
                            rdma_port=node.rdma_port, tcp_tls=node.tcp_tls)


def node_from_pb(msg: pb.NodeEndpoints) -> NodeEndpoints:
    return NodeEndpoints(node_id=msg.node_id, boot_id=msg.boot_id,
                         tcp_endpoint=msg.tcp_endpoint, shm_endpoint=msg.shm_endpoint,
                         rdma_device=msg.rdma_device, rdma_gid=msg.rdma_gid,
                         rdma_port=msg.rdma_port, tcp_tls=msg.tcp_tls)


def segment_to_pb(seg: SegmentInfo) -> pb.SegmentInfo:
    return pb.SegmentInfo(segment_id=seg.segment_id, size_bytes=seg.size_bytes, tier=_TIERS[seg.tier],
                          rdma_addr=seg.rdma_addr, rdma_rkey=seg.rdma_rkey)


def segment_from_pb(msg: pb.SegmentInfo) -> SegmentInfo:
    return SegmentInfo(segment_id=msg.segment_id, size_bytes=msg.size_bytes,
                       tier=_TIER_NAMES.get(msg.tier, "dram"),
                       rdma_addr=msg.rdma_addr, rdma_rkey=msg.rdma_rkey)


def replica_to_pb(r: Replica) -> pb.Replica:
    return pb.Replica(node=node_to_pb(r.node), segment_id=r.extent.segment_id,
                      offset=r.extent.offset, length=r.extent.length,
                      rdma_addr=r.rdma_addr, rdma_rkey=r.rdma_rkey, rdma_length=r.rdma_length,
                      tier=_TIERS[r.tier])


def replica_from_pb(msg: pb.Replica) -> Replica:
    return Replica(node=node_from_pb(msg.node),
                   extent=Extent(segment_id=msg.segment_id, offset=msg.offset, length=msg.length),
                   rdma_addr=msg.rdma_addr, rdma_rkey=msg.rdma_rkey, rdma_length=msg.rdma_length,
                   tier=_TIER_NAMES.get(msg.tier, "dram"))


def location_from_pb(msg: pb.Replica) -> Replica:
    """:func:`replica_from_pb` of a ReplicaColumns location, made once per distinct one: the
    same few segments describe answer after answer (~7 us each to make, 0.4 to serialize
    and look up). Equal wire bytes are an equal message, so a hit is the Replica it makes."""
    return _location(msg.SerializeToString())


@functools.lru_cache(maxsize=4096)
def _location(wire: bytes) -> Replica:
    return replica_from_pb(pb.Replica.FromString(wire))


class ReplicaColumnsWriter:
    """Builds a :class:`pb.ReplicaColumns`: each segment's descriptor once, then per replica only
    a location index and an offset (the batch form of ``replica_to_pb``)."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._locations: list[pb.Replica] = []
        self.counts: list[int] = []
        self.location: list[int] = []
        self.offsets: list[int] = []

    def add(self, replicas: Sequence[Replica]) -> None:
        """The next object's replicas (all as long as the object)."""
        self.counts.append(len(replicas))
        for r in replicas:
            i = self._index.get(r.extent.segment_id)
            if i is None:
                i = self._index[r.extent.segment_id] = len(self._locations)
                self._locations.append(descriptor(r))
            self.location.append(i)
            self.offsets.append(r.extent.offset)

    def skip(self) -> None:
        """The next object has no replicas (its status is an error)."""
        self.counts.append(0)

    def add_columns(self, counts: list[int], segment_ids: list[str], offsets: list[int],
                    descriptor_of: Callable[[str], pb.Replica]) -> None:
        """Many objects at once: ``counts[i]`` replicas each (0: an error), then per replica
        its ``(segment_ids[j], offsets[j])``; ``descriptor_of(id)`` is a segment's
        :func:`descriptor`, asked the first time the segment appears (never changed here)."""
        index = self._index
        for segment_id in dict.fromkeys(segment_ids):
            if segment_id not in index:
                index[segment_id] = len(self._locations)
                self._locations.append(descriptor_of(segment_id))
        self.counts += counts
        self.location += map(index.__getitem__, segment_ids)
        self.offsets += offsets

    def to_pb(self, grants: Sequence[bytes] | bytes = (), packed: bool = False
              ) -> pb.ReplicaColumns:
        """The columns, with ``grants`` (one per replica, in order) where minted; ``packed``:
        in ReplicaColumns.packed and packed_grants (:func:`pack_columns`; ``grants`` may be
        joined already)."""
        if packed:
            return pb.ReplicaColumns(
                locations=self._locations,
                packed_grants=grants if isinstance(grants, bytes) else b"".join(grants),
                packed=pack_columns(self.counts, self.location, self.offsets))
        return pb.ReplicaColumns(locations=self._locations, counts=self.counts,
                                 location=self.location, offsets=self.offsets, grants=grants)

    def segment_ids(self) -> list[str]:
        """Each replica's segment id, in order (what grants are minted for)."""
        ids = [loc.segment_id for loc in self._locations]
        return [ids[i] for i in self.location]


def descriptor(r: Replica) -> pb.Replica:
    """A location's descriptor: ``r`` without the extent's offset and length."""
    template = replica_to_pb(r)
    template.ClearField("offset")
    template.ClearField("length")
    return template


def replicas_from_columns(columns: pb.ReplicaColumns, lengths: Sequence[int]
                          ) -> list[tuple[Replica, ...]]:
    """Each object's replicas from a ReplicaColumns; ``lengths[i]`` is object i's size."""
    # Per location: Replica's positional arguments, with the extent's slot to fill per replica.
    templates = []
    for msg in columns.locations:
        r = location_from_pb(msg)
        templates.append((r.extent.segment_id, [getattr(r, name) for name in _REPLICA_FIELDS]))
    location, offsets = columns.location, columns.offsets
    grants = columns.grants or None
    out: list[tuple[Replica, ...]] = []
    j = 0
    for count, length in zip(columns.counts, lengths):
        if count == 1:   # the common case, without the loop
            segment_id, args = templates[location[j]]
            args[_EXTENT_ARG] = Extent(segment_id, offsets[j], length)
            args[_GRANT_ARG] = grants[j] if grants else b""
            out.append((Replica(*args),))
        else:
            reps = []
            for k in range(j, j + count):
                segment_id, args = templates[location[k]]
                args[_EXTENT_ARG] = Extent(segment_id, offsets[k], length)
                args[_GRANT_ARG] = grants[k] if grants else b""
                reps.append(Replica(*args))
            out.append(tuple(reps))
        j += count
    return out


_REPLICA_FIELDS = [f.name for f in fields(Replica)]
_EXTENT_ARG = _REPLICA_FIELDS.index("extent")
_GRANT_ARG = _REPLICA_FIELDS.index("grant")


@dataclass(frozen=True, slots=True)
class ReplicaArrays:
    """A :class:`pb.ReplicaColumns` decoded without a Python object per replica: the batch
    form of :func:`replicas_from_columns`, for read paths that move hundreds of blocks.

    Replica ``j`` lives in ``locations[location[j]]`` (a Replica whose extent has offset and
    length 0: it names the node and the segment) at ``offsets[j]``; object ``i`` owns the
    ``counts[i]`` replicas from ``first[i]`` on.
    """

    locations: list[Replica]
    counts: np.ndarray     # uint32, one per object
    first: np.ndarray      # int64, one per object: the index of its first replica
    location: np.ndarray   # int64, one per replica
    offsets: np.ndarray    # uint64, one per replica
    grants: Sequence[bytes] = ()   # one per replica, or empty (common/capabilities.py)


def replica_arrays(columns: pb.ReplicaColumns, objects: int) -> ReplicaArrays:
    """``columns`` (of ``objects`` objects) as arrays; TransportError if packed ones do not
    add up."""
    locations = [location_from_pb(m) for m in columns.locations]
    if columns.packed or columns.packed_grants:
        (counts,), (location, offsets) = unpack_columns(columns.packed, objects, 1, 2)
        counts = counts.astype(np.uint32)
        location = location.astype(np.int64)
        grants: Sequence[bytes] = PackedGrants(columns.packed_grants)
        if grants and len(grants) != len(offsets):
            raise TransportError(f"malformed answer: {len(grants)} grants for {len(offsets)} "
                                 "replicas")
    else:
        counts = np.array(columns.counts, dtype=np.uint32)
        location = np.array(columns.location, dtype=np.int64)
        offsets = np.array(columns.offsets, dtype=np.uint64)
        grants = columns.grants
    if len(location) and int(location.max()) >= len(locations):
        raise TransportError("malformed answer: a replica's location is not among its "
                             f"{len(locations)} locations")
    first = np.cumsum(counts, dtype=np.int64) - counts
    return ReplicaArrays(locations=locations, counts=counts, first=first, location=location,
                         offsets=offsets, grants=grants)


_PACKED = np.dtype("<u8")


def u64_array(column: Sequence[int] | np.ndarray) -> np.ndarray:
    """A column of non-negative ints as :func:`pack_columns` packs it (an array already in
    that form as it is)."""
    return np.asarray(column, _PACKED)


def pack_columns(*columns: Sequence[int] | np.ndarray) -> bytes:
    """Columns of non-negative ints (each below 2**64) as one run of little-endian uint64s,
    one column after another: a packed answer's form (KeysRequest.packed). A batch's columns
    in the repeated fields cost the master a conversion per number (a 256-key GetReplicas
    answer ~79 us to build, the client ~42 to read into arrays)."""
    return np.concatenate([u64_array(c) for c in columns]).tobytes()


def unpack_columns(packed: bytes, rows: int, per_row: int, per_item: int = 0
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """:func:`pack_columns`' columns: ``per_row`` of ``rows`` numbers, then ``per_item``
    columns of as many numbers as the first column sums to (a replica column's: each row's
    count). Read-only uint64 views of ``packed``; TransportError where they do not add up."""
    if len(packed) % _PACKED.itemsize:
        raise TransportError(f"malformed answer: packed columns of {len(packed)} bytes")
    numbers = np.frombuffer(packed, _PACKED)
    head = rows * per_row
    items = int(numbers[:rows].sum()) if per_item and len(numbers) >= rows else 0
    if len(numbers) != head + items * per_item:
        raise TransportError(f"malformed answer: {len(numbers)} packed numbers, not "
                             f"{per_row} columns of {rows} and {per_item} of {items}")
    return ([numbers[i * rows:(i + 1) * rows] for i in range(per_row)],
            [numbers[head + i * items:head + (i + 1) * items] for i in range(per_item)])


class PackedGrants(Sequence[bytes]):
    """A packed answer's grants (ReplicaColumns.packed_grants), each
    ``capabilities.GRANT.size`` bytes, as a sequence of them; empty (false) for none."""

    __slots__ = ("_flat",)
    SIZE = capabilities.GRANT.size

    def __init__(self, flat: bytes) -> None:
        if len(flat) % self.SIZE:
            raise TransportError(f"malformed answer: grants of {len(flat)} bytes")
        self._flat = flat

    def __len__(self) -> int:
        return len(self._flat) // self.SIZE

    def __getitem__(self, j):   # an int (a slice: a list)
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        n = len(self)
        if not -n <= j < n:
            raise IndexError("grant index out of range")
        j %= n
        return self._flat[j * self.SIZE:(j + 1) * self.SIZE]


def move_to_pb(m: Move) -> pb.Move:
    return pb.Move(move_id=m.move_id, key=m.key, version=m.version,
                   src_segment_id=m.src.segment_id, src_offset=m.src.offset,
                   dst_segment_id=m.dst.segment_id, dst_offset=m.dst.offset, size=m.src.length)


def move_from_pb(msg: pb.Move) -> Move:
    return Move(msg.move_id, msg.key, msg.version,
                Extent(msg.src_segment_id, msg.src_offset, msg.size),
                Extent(msg.dst_segment_id, msg.dst_offset, msg.size))


def records_to_pb(records: Sequence[ObjectRecord]) -> pb.ObjectRecords:
    """Manifest entries in columns (HeartbeatResponse.committed, AnnounceObjectsRequest)."""
    return pb.ObjectRecords(keys=[r.key for r in records],
                            segment_ids=[r.segment_id for r in records],
                            offsets=[r.offset for r in records], sizes=[r.size for r in records],
                            checksums=[checksum.encode(r.checksum) for r in records],
                            versions=[r.version for r in records],
                            # Left out when no record has one (objects put without parents).
                            parents=[r.parent or "" for r in records]
                            if any(r.parent for r in records) else [],
                            pinned=[r.pinned for r in records]
                            if any(r.pinned for r in records) else [])


def reservations_to_pb(items: Sequence[Reservation], now: float) -> pb.Reservations:
    """Reservations in columns, their ends as seconds from ``now`` (clocks are per process)."""
    return pb.Reservations(keys=[r.key for r in items], segment_ids=[r.segment_id for r in items],
                           offsets=[r.offset for r in items], sizes=[r.size for r in items],
                           seconds=[max(0.0, r.until - now) for r in items])


def reservations_from_pb(msg: pb.Reservations, now: float) -> list[Reservation]:
    return [Reservation(k, sid, off, size, now + sec) for k, sid, off, size, sec
            in zip(msg.keys, msg.segment_ids, msg.offsets, msg.sizes, msg.seconds)]


def records_from_pb(msg: pb.ObjectRecords) -> list[ObjectRecord]:
    parents = msg.parents if len(msg.parents) == len(msg.keys) else itertools.repeat("")
    pinned = msg.pinned if len(msg.pinned) == len(msg.keys) else itertools.repeat(False)
    return [ObjectRecord(k, sid, off, size, checksum.decode(c), v, p or None, pin)
            for k, sid, off, size, c, v, p, pin in zip(msg.keys, msg.segment_ids, msg.offsets,
                                                       msg.sizes, msg.checksums, msg.versions,
                                                       parents, pinned)]
