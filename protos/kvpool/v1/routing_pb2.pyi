from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HashSpec(_message.Message):
    __slots__ = ("name", "block_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    block_size: int
    def __init__(self, name: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class RegisterClientRequest(_message.Message):
    __slots__ = ("client_id", "spec")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    spec: HashSpec
    def __init__(self, client_id: _Optional[str] = ..., spec: _Optional[_Union[HashSpec, _Mapping]] = ...) -> None: ...

class RegisterClientResponse(_message.Message):
    __slots__ = ("cluster_spec",)
    CLUSTER_SPEC_FIELD_NUMBER: _ClassVar[int]
    cluster_spec: HashSpec
    def __init__(self, cluster_spec: _Optional[_Union[HashSpec, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("instance_id", "ts", "events", "url", "role")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    url: str
    role: str
    def __init__(self, instance_id: _Optional[str] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., url: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class PublishKVEventsResponse(_message.Message):
    __slots__ = ("batches", "events")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    batches: int
    events: int
    def __init__(self, batches: _Optional[int] = ..., events: _Optional[int] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("instance_id", "queue_depth", "inflight_prefill_tokens", "prefill_tokens_per_s", "store_tokens_per_s", "decoding_requests")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STORE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    queue_depth: int
    inflight_prefill_tokens: int
    prefill_tokens_per_s: float
    store_tokens_per_s: float
    decoding_requests: int
    def __init__(self, instance_id: _Optional[str] = ..., queue_depth: _Optional[int] = ..., inflight_prefill_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., store_tokens_per_s: _Optional[float] = ..., decoding_requests: _Optional[int] = ...) -> None: ...

class ExtraKey(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("token_ids", "extra_keys", "block_hashes", "candidates", "policy", "prompt_tokens", "tenant")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedCompositeFieldContainer[ExtraKey]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    policy: str
    prompt_tokens: int
    tenant: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[_Union[ExtraKey, _Mapping]]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., policy: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class TierHits(_message.Message):
    __slots__ = ("tier", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    blocks: int
    def __init__(self, tier: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("instance_id", "hits", "estimated_ttft_s", "policy", "blocks", "lookup_port")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PORT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    hits: _containers.RepeatedCompositeFieldContainer[TierHits]
    estimated_ttft_s: float
    policy: str
    blocks: int
    lookup_port: int
    def __init__(self, instance_id: _Optional[str] = ..., hits: _Optional[_Iterable[_Union[TierHits, _Mapping]]] = ..., estimated_ttft_s: _Optional[float] = ..., policy: _Optional[str] = ..., blocks: _Optional[int] = ..., lookup_port: _Optional[int] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("instance_id", "url", "role", "gpu_blocks", "cpu_blocks", "seen_s_ago")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEEN_S_AGO_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    url: str
    role: str
    gpu_blocks: int
    cpu_blocks: int
    seen_s_ago: float
    def __init__(self, instance_id: _Optional[str] = ..., url: _Optional[str] = ..., role: _Optional[str] = ..., gpu_blocks: _Optional[int] = ..., cpu_blocks: _Optional[int] = ..., seen_s_ago: _Optional[float] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ...) -> None: ...
