from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transfer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STREAM: _ClassVar[Transfer]
    TRANSFER_SHM: _ClassVar[Transfer]
TRANSFER_STREAM: Transfer
TRANSFER_SHM: Transfer

class Layout(_message.Message):
    __slots__ = ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_tokens", "model_revision", "kv_kind", "tp_rank", "tp_size", "pp_rank", "pp_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    KV_KIND_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    model_revision: str
    kv_kind: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_tokens: _Optional[int] = ..., model_revision: _Optional[str] = ..., kv_kind: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("version", "arena_path", "arena_bytes", "max_message_bytes", "max_blocks_per_call", "arena_id", "kv_events", "slab")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    version: str
    arena_path: str
    arena_bytes: int
    max_message_bytes: int
    max_blocks_per_call: int
    arena_id: str
    kv_events: str
    slab: Slab
    def __init__(self, version: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_blocks_per_call: _Optional[int] = ..., arena_id: _Optional[str] = ..., kv_events: _Optional[str] = ..., slab: _Optional[_Union[Slab, _Mapping]] = ...) -> None: ...

class Slab(_message.Message):
    __slots__ = ("id", "size", "device", "path", "device_uuid", "ipc_handle", "ipc_storage_bytes", "ipc_storage_offset", "ipc_ref_counter_handle", "ipc_ref_counter_offset", "ipc_event_handle", "ipc_event_sync_required")
    ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    IPC_STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IPC_STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IPC_REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    IPC_REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IPC_EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    IPC_EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    id: str
    size: int
    device: str
    path: str
    device_uuid: str
    ipc_handle: bytes
    ipc_storage_bytes: int
    ipc_storage_offset: int
    ipc_ref_counter_handle: bytes
    ipc_ref_counter_offset: int
    ipc_event_handle: bytes
    ipc_event_sync_required: bool
    def __init__(self, id: _Optional[str] = ..., size: _Optional[int] = ..., device: _Optional[str] = ..., path: _Optional[str] = ..., device_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., ipc_storage_bytes: _Optional[int] = ..., ipc_storage_offset: _Optional[int] = ..., ipc_ref_counter_handle: _Optional[bytes] = ..., ipc_ref_counter_offset: _Optional[int] = ..., ipc_event_handle: _Optional[bytes] = ..., ipc_event_sync_required: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "prefetch", "layout", "each")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EACH_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prefetch: bool
    layout: Layout
    each: bool
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., prefetch: _Optional[bool] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., each: _Optional[bool] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("hits", "found", "tiers", "read_bandwidth")
    class ReadBandwidthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    HITS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    READ_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    hits: int
    found: _containers.RepeatedScalarFieldContainer[bool]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    read_bandwidth: _containers.ScalarMap[str, float]
    def __init__(self, hits: _Optional[int] = ..., found: _Optional[_Iterable[bool]] = ..., tiers: _Optional[_Iterable[str]] = ..., read_bandwidth: _Optional[_Mapping[str, float]] = ...) -> None: ...

class BlockRef(_message.Message):
    __slots__ = ("offset", "length", "tier", "in_slab")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    IN_SLAB_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    tier: str
    in_slab: bool
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., tier: _Optional[str] = ..., in_slab: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("namespace", "layout", "keys", "transfer", "prior_keys", "slab_ok", "whole")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PRIOR_KEYS_FIELD_NUMBER: _ClassVar[int]
    SLAB_OK_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    layout: Layout
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    transfer: Transfer
    prior_keys: _containers.RepeatedScalarFieldContainer[bytes]
    slab_ok: bool
    whole: bool
    def __init__(self, namespace: _Optional[bytes] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., transfer: _Optional[_Union[Transfer, str]] = ..., prior_keys: _Optional[_Iterable[bytes]] = ..., slab_ok: _Optional[bool] = ..., whole: _Optional[bool] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("hits", "lease_id", "blocks", "block_index", "chunk_offset", "data", "arena_id", "more", "slab_id")
    HITS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    SLAB_ID_FIELD_NUMBER: _ClassVar[int]
    hits: int
    lease_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    block_index: int
    chunk_offset: int
    data: bytes
    arena_id: str
    more: bool
    slab_id: str
    def __init__(self, hits: _Optional[int] = ..., lease_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., block_index: _Optional[int] = ..., chunk_offset: _Optional[int] = ..., data: _Optional[bytes] = ..., arena_id: _Optional[str] = ..., more: _Optional[bool] = ..., slab_id: _Optional[str] = ...) -> None: ...

class PublishChunk(_message.Message):
    __slots__ = ("namespace", "layout", "keys", "block_index", "chunk_offset", "data", "prior_keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PRIOR_KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    layout: Layout
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_index: int
    chunk_offset: int
    data: bytes
    prior_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., block_index: _Optional[int] = ..., chunk_offset: _Optional[int] = ..., data: _Optional[bytes] = ..., prior_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ("stored", "present")
    STORED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    stored: int
    present: int
    def __init__(self, stored: _Optional[int] = ..., present: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace", "layout", "keys", "prior_keys", "writer")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_KEYS_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    layout: Layout
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prior_keys: _containers.RepeatedScalarFieldContainer[bytes]
    writer: str
    def __init__(self, namespace: _Optional[bytes] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., prior_keys: _Optional[_Iterable[bytes]] = ..., writer: _Optional[str] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("lease_id", "needed", "blocks", "arena_id", "more")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NEEDED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    needed: _containers.RepeatedScalarFieldContainer[bool]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRef]
    arena_id: str
    more: bool
    def __init__(self, lease_id: _Optional[int] = ..., needed: _Optional[_Iterable[bool]] = ..., blocks: _Optional[_Iterable[_Union[BlockRef, _Mapping]]] = ..., arena_id: _Optional[str] = ..., more: _Optional[bool] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "blocks", "used_bytes", "capacity_bytes", "pinned_blocks", "evictions", "hits", "bytes_read", "bytes_written", "read_bandwidth", "degraded", "degraded_reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    READ_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    blocks: int
    used_bytes: int
    capacity_bytes: int
    pinned_blocks: int
    evictions: int
    hits: int
    bytes_read: int
    bytes_written: int
    read_bandwidth: float
    degraded: bool
    degraded_reason: str
    def __init__(self, name: _Optional[str] = ..., blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., hits: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., read_bandwidth: _Optional[float] = ..., degraded: _Optional[bool] = ..., degraded_reason: _Optional[str] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("version", "uptime_s", "tiers", "lookups", "hit_blocks", "miss_blocks", "integrity_failures", "active_leases", "demotions", "promotions", "stored_blocks", "remote", "inflight_rpcs", "expired_leases", "shed_rpcs", "kv_events_published", "kv_events_dropped", "lifts_skipped", "sessions_ended", "session_blocks_marked", "host_prefaulted_bytes", "fenced_leases", "fenced_bytes", "late_fetches", "prefetches", "prefetched_blocks")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_RPCS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    SHED_RPCS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LIFTS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ENDED_FIELD_NUMBER: _ClassVar[int]
    SESSION_BLOCKS_MARKED_FIELD_NUMBER: _ClassVar[int]
    HOST_PREFAULTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FENCED_LEASES_FIELD_NUMBER: _ClassVar[int]
    FENCED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LATE_FETCHES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    lookups: int
    hit_blocks: int
    miss_blocks: int
    integrity_failures: int
    active_leases: int
    demotions: int
    promotions: int
    stored_blocks: int
    remote: RemoteStats
    inflight_rpcs: int
    expired_leases: int
    shed_rpcs: int
    kv_events_published: int
    kv_events_dropped: int
    lifts_skipped: int
    sessions_ended: int
    session_blocks_marked: int
    host_prefaulted_bytes: int
    fenced_leases: int
    fenced_bytes: int
    late_fetches: int
    prefetches: int
    prefetched_blocks: int
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., integrity_failures: _Optional[int] = ..., active_leases: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., remote: _Optional[_Union[RemoteStats, _Mapping]] = ..., inflight_rpcs: _Optional[int] = ..., expired_leases: _Optional[int] = ..., shed_rpcs: _Optional[int] = ..., kv_events_published: _Optional[int] = ..., kv_events_dropped: _Optional[int] = ..., lifts_skipped: _Optional[int] = ..., sessions_ended: _Optional[int] = ..., session_blocks_marked: _Optional[int] = ..., host_prefaulted_bytes: _Optional[int] = ..., fenced_leases: _Optional[int] = ..., fenced_bytes: _Optional[int] = ..., late_fetches: _Optional[int] = ..., prefetches: _Optional[int] = ..., prefetched_blocks: _Optional[int] = ...) -> None: ...

class RemoteStats(_message.Message):
    __slots__ = ("url", "available", "queue_depth", "queue_capacity", "queued_writes", "shed_writes", "written_blocks", "failed_writes", "lost_writes", "errors", "timeouts", "breaker_opens", "skipped_calls", "integrity_failures", "lookup_hits", "dropped_writes")
    URL_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    QUEUED_WRITES_FIELD_NUMBER: _ClassVar[int]
    SHED_WRITES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FAILED_WRITES_FIELD_NUMBER: _ClassVar[int]
    LOST_WRITES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    BREAKER_OPENS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_CALLS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    url: str
    available: bool
    queue_depth: int
    queue_capacity: int
    queued_writes: int
    shed_writes: int
    written_blocks: int
    failed_writes: int
    lost_writes: int
    errors: int
    timeouts: int
    breaker_opens: int
    skipped_calls: int
    integrity_failures: int
    lookup_hits: int
    dropped_writes: int
    def __init__(self, url: _Optional[str] = ..., available: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., queue_capacity: _Optional[int] = ..., queued_writes: _Optional[int] = ..., shed_writes: _Optional[int] = ..., written_blocks: _Optional[int] = ..., failed_writes: _Optional[int] = ..., lost_writes: _Optional[int] = ..., errors: _Optional[int] = ..., timeouts: _Optional[int] = ..., breaker_opens: _Optional[int] = ..., skipped_calls: _Optional[int] = ..., integrity_failures: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., dropped_writes: _Optional[int] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EndSessionReply(_message.Message):
    __slots__ = ("marked",)
    MARKED_FIELD_NUMBER: _ClassVar[int]
    marked: int
    def __init__(self, marked: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace", "all")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    all: bool
    def __init__(self, namespace: _Optional[bytes] = ..., all: _Optional[bool] = ...) -> None: ...

class ClearReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class EngineBlocks(_message.Message):
    __slots__ = ("key", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "group_idx", "kv_cache_spec_kind", "sliding_window")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_name: str
    group_idx: int
    kv_cache_spec_kind: str
    sliding_window: int
    def __init__(self, key: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., group_idx: _Optional[int] = ..., kv_cache_spec_kind: _Optional[str] = ..., sliding_window: _Optional[int] = ...) -> None: ...

class DescribeBlocksRequest(_message.Message):
    __slots__ = ("namespace", "blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[EngineBlocks]
    def __init__(self, namespace: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[EngineBlocks, _Mapping]]] = ...) -> None: ...

class DescribeBlocksReply(_message.Message):
    __slots__ = ("described",)
    DESCRIBED_FIELD_NUMBER: _ClassVar[int]
    described: int
    def __init__(self, described: _Optional[int] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("tier", "blocks", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    blocks: int
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "layout", "tiers", "tenant")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    layout: Layout
    tiers: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    tenant: str
    def __init__(self, namespace: _Optional[bytes] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ..., tenant: _Optional[str] = ...) -> None: ...

class InspectReply(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ...) -> None: ...
