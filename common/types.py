"""Domain value types shared by master, store nodes and clients (frozen, hashable)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvpool.common.errors import InvalidArgument

MAX_KEY_BYTES = 1024
# Memory tiers, fastest first: new objects go to a node's fastest tier with room, and a full
# tier demotes its objects to the next one down (common to master placement and stat output).
TIERS = ("hbm", "dram", "disk")
TIER_RANK = {t: i for i, t in enumerate(TIERS)}


class ObjectState(Enum):
    PENDING = "pending"      # space allocated, bytes being written; invisible to readers
    COMPLETE = "complete"    # readable; immutable


@dataclass(frozen=True, slots=True)
class NodeEndpoints:
    """How to reach a store node's data: tcp always, shm from the same host (same boot id),
    rdma where the node has a device (queue pairs are set up over ``tcp_endpoint``)."""

    node_id: str
    boot_id: str
    tcp_endpoint: str            # "host:port"
    shm_endpoint: str = ""       # abstract unix socket name for the fd hand-off; "" = none
    rdma_device: str = ""        # e.g. "rxe0"; "" = the node has no RDMA
    rdma_gid: str = ""           # the port's GID ("fe80:0000:...")
    rdma_port: int = 0           # the device port (1-based)
    tcp_tls: bool = False        # the tcp data port speaks TLS (store-node --data-tls)


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    segment_id: str              # unique across the cluster and across node restarts
    size_bytes: int
    tier: str = "dram"
    rdma_addr: int = 0           # the segment's RDMA memory region: base address and rkey;
    rdma_rkey: int = 0           # rkey 0 = not registered


@dataclass(frozen=True, slots=True)
class Extent:
    """A byte range inside one segment."""

    segment_id: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class Replica:
    """A descriptor: where one copy of an object's bytes lives and how to reach it.

    ``rdma_*`` describe the extent's segment as an RDMA memory region (rkey 0 = not
    registered): the bytes are at ``rdma_addr + extent.offset``, inside ``rdma_length``."""

    node: NodeEndpoints
    extent: Extent
    rdma_addr: int = 0
    rdma_rkey: int = 0
    rdma_length: int = 0
    tier: str = "dram"   # the segment's tier: clients reach "disk" replicas over tcp only
    # The master's grant for this extent (common/capabilities.py), opaque here: sent with each
    # tcp READ or WRITE of it. Empty where none was minted.
    grant: bytes = b""

    def at(self, offset: int, length: int, grant: bytes = b"") -> Replica:
        """This replica's segment at another extent (a columnar answer keeps one per segment),
        with that extent's ``grant``."""
        return Replica(self.node, Extent(self.extent.segment_id, offset, length), self.rdma_addr,
                       self.rdma_rkey, self.rdma_length, self.tier, grant)


def validate_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise InvalidArgument."""
    if not isinstance(key, str):
        raise InvalidArgument(f"key must be str, not {type(key).__name__}")
    if not key:
        raise InvalidArgument("key must not be empty")
    if key.isascii() and len(key) <= MAX_KEY_BYTES:   # the common case: nothing to encode
        return key
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as e:
        # A lone surrogate (from a bad decode upstream) cannot go on the wire: protobuf needs
        # UTF-8 strings, and would otherwise fail the whole batch instead of this key.
        raise InvalidArgument(f"key {key[:64]!r} is not valid UTF-8 ({e.reason} at "
                              f"character {e.start})") from None
    if size > MAX_KEY_BYTES:
        raise InvalidArgument(f"key is {size} bytes; the limit is {MAX_KEY_BYTES}")
    return key


@dataclass(frozen=True, slots=True)
class ObjectView:
    """A readable object as the master describes it: size, version and where its replicas are."""

    key: str
    size: int
    version: int             # unique per stored object; a key stored again gets a new one
    replicas: tuple[Replica, ...]
    checksum: int | None = None   # CRC-32C of the bytes (common/checksum.py); None = unknown


@dataclass(frozen=True, slots=True)
class Reservation:
    """Space a master restarted meanwhile must not hand out again before ``until`` (on the
    clock of whoever holds it): a put's extent while its writer may still write there (``key``
    names the put; its commit there ends the reservation), or space freed while a reader may
    still copy from it (``key`` is "")."""

    key: str
    segment_id: str
    offset: int
    size: int
    until: float


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """One committed object as a store node's manifest holds it: enough for a restarted master
    to index it again without reading a byte."""

    key: str
    segment_id: str
    offset: int
    size: int
    checksum: int | None      # CRC-32C (common/checksum.py); None = not recorded
    version: int
    # The key of the block this one extends (None: none or unknown), so a restarted master
    # re-links prefix chains and evicts them from their tails again.
    parent: str | None = None
    pinned: bool = False      # hard-pinned (soft pins, being short-lived, are not recorded)


@dataclass(frozen=True, slots=True)
class Move:
    """An instruction from the master to a store node: copy an object's bytes from ``src`` to
    ``dst``, two extents in the node's own segments (a demotion or a promotion)."""

    move_id: int
    key: str
    version: int
    src: Extent
    dst: Extent
