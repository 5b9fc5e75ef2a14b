from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_OK: _ClassVar[Status]
    STATUS_NOT_FOUND: _ClassVar[Status]
    STATUS_ALREADY_EXISTS: _ClassVar[Status]
    STATUS_NO_SPACE: _ClassVar[Status]
    STATUS_TOO_LARGE: _ClassVar[Status]
    STATUS_INVALID_ARGUMENT: _ClassVar[Status]
    STATUS_NOT_PENDING: _ClassVar[Status]
    STATUS_UNKNOWN_NODE: _ClassVar[Status]
    STATUS_CONFLICT: _ClassVar[Status]
    STATUS_QUOTA_EXCEEDED: _ClassVar[Status]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_DRAM: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
STATUS_OK: Status
STATUS_NOT_FOUND: Status
STATUS_ALREADY_EXISTS: Status
STATUS_NO_SPACE: Status
STATUS_TOO_LARGE: Status
STATUS_INVALID_ARGUMENT: Status
STATUS_NOT_PENDING: Status
STATUS_UNKNOWN_NODE: Status
STATUS_CONFLICT: Status
STATUS_QUOTA_EXCEEDED: Status
TIER_DRAM: Tier
TIER_HBM: Tier
TIER_DISK: Tier

class NodeEndpoints(_message.Message):
    __slots__ = ("node_id", "boot_id", "tcp_endpoint", "shm_endpoint", "rdma_device", "rdma_gid", "rdma_port", "tcp_tls")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SHM_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RDMA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    RDMA_GID_FIELD_NUMBER: _ClassVar[int]
    RDMA_PORT_FIELD_NUMBER: _ClassVar[int]
    TCP_TLS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    boot_id: str
    tcp_endpoint: str
    shm_endpoint: str
    rdma_device: str
    rdma_gid: str
    rdma_port: int
    tcp_tls: bool
    def __init__(self, node_id: _Optional[str] = ..., boot_id: _Optional[str] = ..., tcp_endpoint: _Optional[str] = ..., shm_endpoint: _Optional[str] = ..., rdma_device: _Optional[str] = ..., rdma_gid: _Optional[str] = ..., rdma_port: _Optional[int] = ..., tcp_tls: _Optional[bool] = ...) -> None: ...

class SegmentInfo(_message.Message):
    __slots__ = ("segment_id", "size_bytes", "tier", "rdma_addr", "rdma_rkey")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    RDMA_ADDR_FIELD_NUMBER: _ClassVar[int]
    RDMA_RKEY_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    size_bytes: int
    tier: Tier
    rdma_addr: int
    rdma_rkey: int
    def __init__(self, segment_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., rdma_addr: _Optional[int] = ..., rdma_rkey: _Optional[int] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("node", "segment_id", "offset", "length", "rdma_addr", "rdma_rkey", "rdma_length", "tier")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    RDMA_ADDR_FIELD_NUMBER: _ClassVar[int]
    RDMA_RKEY_FIELD_NUMBER: _ClassVar[int]
    RDMA_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    node: NodeEndpoints
    segment_id: str
    offset: int
    length: int
    rdma_addr: int
    rdma_rkey: int
    rdma_length: int
    tier: Tier
    def __init__(self, node: _Optional[_Union[NodeEndpoints, _Mapping]] = ..., segment_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., rdma_addr: _Optional[int] = ..., rdma_rkey: _Optional[int] = ..., rdma_length: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("node", "segment", "keeps_manifest", "recovering")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    KEEPS_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    RECOVERING_FIELD_NUMBER: _ClassVar[int]
    node: NodeEndpoints
    segment: SegmentInfo
    keeps_manifest: bool
    recovering: bool
    def __init__(self, node: _Optional[_Union[NodeEndpoints, _Mapping]] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., keeps_manifest: _Optional[bool] = ..., recovering: _Optional[bool] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ("epoch", "data_key")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATA_KEY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    data_key: bytes
    def __init__(self, epoch: _Optional[int] = ..., data_key: _Optional[bytes] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("node_id", "segment_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    segment_id: str
    def __init__(self, node_id: _Optional[str] = ..., segment_id: _Optional[str] = ...) -> None: ...

class UnmountSegmentResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    def __init__(self, status: _Optional[_Union[Status, str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "moves_done", "moves_failed")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MOVES_DONE_FIELD_NUMBER: _ClassVar[int]
    MOVES_FAILED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    moves_done: _containers.RepeatedScalarFieldContainer[int]
    moves_failed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., moves_done: _Optional[_Iterable[int]] = ..., moves_failed: _Optional[_Iterable[int]] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("move_id", "key", "version", "src_segment_id", "src_offset", "dst_segment_id", "dst_offset", "size")
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SRC_SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DST_SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    move_id: int
    key: str
    version: int
    src_segment_id: str
    src_offset: int
    dst_segment_id: str
    dst_offset: int
    size: int
    def __init__(self, move_id: _Optional[int] = ..., key: _Optional[str] = ..., version: _Optional[int] = ..., src_segment_id: _Optional[str] = ..., src_offset: _Optional[int] = ..., dst_segment_id: _Optional[str] = ..., dst_offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("status", "committed", "removed_keys", "removed_versions", "moves", "verify_keys", "verify_versions", "verify_segment_ids")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_KEYS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    committed: ObjectRecords
    removed_keys: _containers.RepeatedScalarFieldContainer[str]
    removed_versions: _containers.RepeatedScalarFieldContainer[int]
    moves: _containers.RepeatedCompositeFieldContainer[Move]
    verify_keys: _containers.RepeatedScalarFieldContainer[str]
    verify_versions: _containers.RepeatedScalarFieldContainer[int]
    verify_segment_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., committed: _Optional[_Union[ObjectRecords, _Mapping]] = ..., removed_keys: _Optional[_Iterable[str]] = ..., removed_versions: _Optional[_Iterable[int]] = ..., moves: _Optional[_Iterable[_Union[Move, _Mapping]]] = ..., verify_keys: _Optional[_Iterable[str]] = ..., verify_versions: _Optional[_Iterable[int]] = ..., verify_segment_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ObjectRecords(_message.Message):
    __slots__ = ("keys", "segment_ids", "offsets", "sizes", "checksums", "versions", "parents", "pinned")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    segment_ids: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[str]
    pinned: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., segment_ids: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[str]] = ..., pinned: _Optional[_Iterable[bool]] = ...) -> None: ...

class WatchManifestRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class ManifestChanges(_message.Message):
    __slots__ = ("committed", "removed_keys", "removed_versions", "seq", "reserved")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    committed: ObjectRecords
    removed_keys: _containers.RepeatedScalarFieldContainer[str]
    removed_versions: _containers.RepeatedScalarFieldContainer[int]
    seq: int
    reserved: Reservations
    def __init__(self, committed: _Optional[_Union[ObjectRecords, _Mapping]] = ..., removed_keys: _Optional[_Iterable[str]] = ..., removed_versions: _Optional[_Iterable[int]] = ..., seq: _Optional[int] = ..., reserved: _Optional[_Union[Reservations, _Mapping]] = ...) -> None: ...

class Reservations(_message.Message):
    __slots__ = ("keys", "segment_ids", "offsets", "sizes", "seconds")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    segment_ids: _containers.RepeatedScalarFieldContainer[str]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., segment_ids: _Optional[_Iterable[str]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class AckManifestRequest(_message.Message):
    __slots__ = ("node_id", "seq")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    seq: int
    def __init__(self, node_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class AckManifestResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AnnounceObjectsRequest(_message.Message):
    __slots__ = ("node_id", "objects", "done", "reserved")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    objects: ObjectRecords
    done: bool
    reserved: Reservations
    def __init__(self, node_id: _Optional[str] = ..., objects: _Optional[_Union[ObjectRecords, _Mapping]] = ..., done: _Optional[bool] = ..., reserved: _Optional[_Union[Reservations, _Mapping]] = ...) -> None: ...

class AnnounceObjectsResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("keys", "versions", "segment_ids", "node_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    versions: _containers.RepeatedScalarFieldContainer[int]
    segment_ids: _containers.RepeatedScalarFieldContainer[str]
    node_id: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., versions: _Optional[_Iterable[int]] = ..., segment_ids: _Optional[_Iterable[str]] = ..., node_id: _Optional[str] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("keys", "checksums", "sealed", "as_keys", "sizes", "parents")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    AS_KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    sealed: bool
    as_keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., checksums: _Optional[_Iterable[int]] = ..., sealed: _Optional[bool] = ..., as_keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[str]] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("keys", "sizes", "replicas", "parents", "fenced", "slots", "held")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    replicas: int
    parents: _containers.RepeatedScalarFieldContainer[str]
    fenced: bool
    slots: bool
    held: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., replicas: _Optional[int] = ..., parents: _Optional[_Iterable[str]] = ..., fenced: _Optional[bool] = ..., slots: _Optional[bool] = ..., held: _Optional[bool] = ...) -> None: ...

class ReplicaColumns(_message.Message):
    __slots__ = ("locations", "counts", "location", "offsets", "grants", "packed", "packed_grants")
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    PACKED_GRANTS_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[Replica]
    counts: _containers.RepeatedScalarFieldContainer[int]
    location: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    grants: _containers.RepeatedScalarFieldContainer[bytes]
    packed: bytes
    packed_grants: bytes
    def __init__(self, locations: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., counts: _Optional[_Iterable[int]] = ..., location: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., grants: _Optional[_Iterable[bytes]] = ..., packed: _Optional[bytes] = ..., packed_grants: _Optional[bytes] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("put_timeout_s", "statuses", "replicas", "space_summary", "epoch", "versions", "hold_s", "tenant", "quota_summary", "held_grants")
    PUT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SPACE_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    HELD_GRANTS_FIELD_NUMBER: _ClassVar[int]
    put_timeout_s: float
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    replicas: ReplicaColumns
    space_summary: str
    epoch: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    hold_s: float
    tenant: str
    quota_summary: str
    held_grants: bytes
    def __init__(self, put_timeout_s: _Optional[float] = ..., statuses: _Optional[_Iterable[_Union[Status, str]]] = ..., replicas: _Optional[_Union[ReplicaColumns, _Mapping]] = ..., space_summary: _Optional[str] = ..., epoch: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ..., hold_s: _Optional[float] = ..., tenant: _Optional[str] = ..., quota_summary: _Optional[str] = ..., held_grants: _Optional[bytes] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys", "packed", "held")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    packed: bool
    held: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., packed: _Optional[bool] = ..., held: _Optional[bool] = ...) -> None: ...

class StatusesResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ...) -> None: ...

class GetReplicasResponse(_message.Message):
    __slots__ = ("lease_ttl_s", "statuses", "sizes", "versions", "replicas", "checksums", "lookup_port", "packed", "tenant", "held_grants")
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PORT_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    HELD_GRANTS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_s: float
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    replicas: ReplicaColumns
    checksums: _containers.RepeatedScalarFieldContainer[int]
    lookup_port: int
    packed: bytes
    tenant: str
    held_grants: bytes
    def __init__(self, lease_ttl_s: _Optional[float] = ..., statuses: _Optional[_Iterable[_Union[Status, str]]] = ..., sizes: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[int]] = ..., replicas: _Optional[_Union[ReplicaColumns, _Mapping]] = ..., checksums: _Optional[_Iterable[int]] = ..., lookup_port: _Optional[int] = ..., packed: _Optional[bytes] = ..., tenant: _Optional[str] = ..., held_grants: _Optional[bytes] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "ttl_s", "unpin")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    ttl_s: float
    unpin: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., ttl_s: _Optional[float] = ..., unpin: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("audit",)
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    audit: bool
    def __init__(self, audit: _Optional[bool] = ...) -> None: ...

class SegmentStats(_message.Message):
    __slots__ = ("node_id", "segment", "used_bytes", "quarantined_bytes", "objects", "node", "indexed_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    segment: SegmentInfo
    used_bytes: int
    quarantined_bytes: int
    objects: int
    node: NodeEndpoints
    indexed_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., used_bytes: _Optional[int] = ..., quarantined_bytes: _Optional[int] = ..., objects: _Optional[int] = ..., node: _Optional[_Union[NodeEndpoints, _Mapping]] = ..., indexed_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("segments", "objects", "pending_objects", "hits", "misses", "evictions", "nodes", "demotions", "promotions", "hit_bytes", "committed", "committed_bytes", "tenants")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    HIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentStats]
    objects: int
    pending_objects: int
    hits: int
    misses: int
    evictions: int
    nodes: int
    demotions: int
    promotions: int
    hit_bytes: int
    committed: int
    committed_bytes: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    def __init__(self, segments: _Optional[_Iterable[_Union[SegmentStats, _Mapping]]] = ..., objects: _Optional[int] = ..., pending_objects: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., nodes: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., hit_bytes: _Optional[int] = ..., committed: _Optional[int] = ..., committed_bytes: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "objects", "bytes", "quota_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    objects: int
    bytes: int
    quota_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ...) -> None: ...

class OpenLookupSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenLookupSessionResponse(_message.Message):
    __slots__ = ("session_id", "key", "ttl_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    key: bytes
    ttl_s: float
    def __init__(self, session_id: _Optional[bytes] = ..., key: _Optional[bytes] = ..., ttl_s: _Optional[float] = ...) -> None: ...
