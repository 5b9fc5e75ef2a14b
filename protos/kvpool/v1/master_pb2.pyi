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
TIER_DRAM: Tier
TIER_HBM: Tier
TIER_DISK: Tier

class NodeEndpoints(_message.Message):
    __slots__ = ("node_id", "boot_id", "tcp_endpoint", "shm_endpoint")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SHM_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    boot_id: str
    tcp_endpoint: str
    shm_endpoint: str
    def __init__(self, node_id: _Optional[str] = ..., boot_id: _Optional[str] = ..., tcp_endpoint: _Optional[str] = ..., shm_endpoint: _Optional[str] = ...) -> None: ...

class SegmentInfo(_message.Message):
    __slots__ = ("segment_id", "size_bytes", "tier")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    size_bytes: int
    tier: Tier
    def __init__(self, segment_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("node", "segment_id", "offset", "length")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    node: NodeEndpoints
    segment_id: str
    offset: int
    length: int
    def __init__(self, node: _Optional[_Union[NodeEndpoints, _Mapping]] = ..., segment_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("node", "segment")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    node: NodeEndpoints
    segment: SegmentInfo
    def __init__(self, node: _Optional[_Union[NodeEndpoints, _Mapping]] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

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
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    def __init__(self, status: _Optional[_Union[Status, str]] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("keys", "sizes", "replicas")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    replicas: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., sizes: _Optional[_Iterable[int]] = ..., replicas: _Optional[int] = ...) -> None: ...

class PutStartResult(_message.Message):
    __slots__ = ("status", "replicas")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("results", "put_timeout_s")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PUT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutStartResult]
    put_timeout_s: float
    def __init__(self, results: _Optional[_Iterable[_Union[PutStartResult, _Mapping]]] = ..., put_timeout_s: _Optional[float] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class StatusesResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[Status]
    def __init__(self, statuses: _Optional[_Iterable[_Union[Status, str]]] = ...) -> None: ...

class GetReplicasResult(_message.Message):
    __slots__ = ("status", "size", "version", "replicas")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    size: int
    version: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., size: _Optional[int] = ..., version: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class GetReplicasResponse(_message.Message):
    __slots__ = ("results", "lease_ttl_s")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GetReplicasResult]
    lease_ttl_s: float
    def __init__(self, results: _Optional[_Iterable[_Union[GetReplicasResult, _Mapping]]] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SegmentStats(_message.Message):
    __slots__ = ("node_id", "segment", "used_bytes", "quarantined_bytes", "objects")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    segment: SegmentInfo
    used_bytes: int
    quarantined_bytes: int
    objects: int
    def __init__(self, node_id: _Optional[str] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., used_bytes: _Optional[int] = ..., quarantined_bytes: _Optional[int] = ..., objects: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("segments", "objects", "pending_objects", "hits", "misses", "evictions", "nodes")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentStats]
    objects: int
    pending_objects: int
    hits: int
    misses: int
    evictions: int
    nodes: int
    def __init__(self, segments: _Optional[_Iterable[_Union[SegmentStats, _Mapping]]] = ..., objects: _Optional[int] = ..., pending_objects: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., nodes: _Optional[int] = ...) -> None: ...
