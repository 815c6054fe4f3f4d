from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STATE_UNSPECIFIED: _ClassVar[BlockState]
    BLOCK_STATE_MISS: _ClassVar[BlockState]
    BLOCK_STATE_HIT: _ClassVar[BlockState]
    BLOCK_STATE_HIT_PENDING: _ClassVar[BlockState]

class DaemonState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DAEMON_STATE_UNSPECIFIED: _ClassVar[DaemonState]
    DAEMON_STATE_STARTING: _ClassVar[DaemonState]
    DAEMON_STATE_SERVING: _ClassVar[DaemonState]
    DAEMON_STATE_DRAINING: _ClassVar[DaemonState]
BLOCK_STATE_UNSPECIFIED: BlockState
BLOCK_STATE_MISS: BlockState
BLOCK_STATE_HIT: BlockState
BLOCK_STATE_HIT_PENDING: BlockState
DAEMON_STATE_UNSPECIFIED: DaemonState
DAEMON_STATE_STARTING: DaemonState
DAEMON_STATE_SERVING: DaemonState
DAEMON_STATE_DRAINING: DaemonState

class EngineIdentity(_message.Message):
    __slots__ = ("engine_id", "engine_kind", "engine_version", "pid", "hostname")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    engine_kind: str
    engine_version: str
    pid: int
    hostname: str
    def __init__(self, engine_id: _Optional[str] = ..., engine_kind: _Optional[str] = ..., engine_version: _Optional[str] = ..., pid: _Optional[int] = ..., hostname: _Optional[str] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("block_bytes", "num_ranks", "shard_bytes", "tokens_per_block", "dtype", "max_key_bytes")
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_bytes: int
    num_ranks: int
    shard_bytes: int
    tokens_per_block: int
    dtype: str
    max_key_bytes: int
    def __init__(self, block_bytes: _Optional[int] = ..., num_ranks: _Optional[int] = ..., shard_bytes: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., dtype: _Optional[str] = ..., max_key_bytes: _Optional[int] = ...) -> None: ...

class RegisterSessionRequest(_message.Message):
    __slots__ = ("engine", "model", "layout", "layout_salt")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SALT_FIELD_NUMBER: _ClassVar[int]
    engine: EngineIdentity
    model: str
    layout: KvLayout
    layout_salt: str
    def __init__(self, engine: _Optional[_Union[EngineIdentity, _Mapping]] = ..., model: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., layout_salt: _Optional[str] = ...) -> None: ...

class RegisterSessionResponse(_message.Message):
    __slots__ = ("session_id", "namespace_id", "epoch", "slot_bytes", "pool_bytes", "heartbeat_interval_ms", "liveness_timeout_ms", "default_lease_ms", "daemon_version", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace_id: str
    epoch: int
    slot_bytes: int
    pool_bytes: int
    heartbeat_interval_ms: int
    liveness_timeout_ms: int
    default_lease_ms: int
    daemon_version: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., namespace_id: _Optional[str] = ..., epoch: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., liveness_timeout_ms: _Optional[int] = ..., default_lease_ms: _Optional[int] = ..., daemon_version: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "prefix", "lease_ms", "req_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prefix: bool
    lease_ms: int
    req_id: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., prefix: _Optional[bool] = ..., lease_ms: _Optional[int] = ..., req_id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("states", "epoch", "slot_offsets", "lease_ms")
    STATES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[BlockState]
    epoch: int
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    lease_ms: int
    def __init__(self, states: _Optional[_Iterable[_Union[BlockState, str]]] = ..., epoch: _Optional[int] = ..., slot_offsets: _Optional[_Iterable[int]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class PrepareLoadRequest(_message.Message):
    __slots__ = ("keys", "req_id", "positions")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    req_id: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., req_id: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareLoadResponse(_message.Message):
    __slots__ = ("slot_offsets", "epoch")
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    def __init__(self, slot_offsets: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ...) -> None: ...

class CompleteLoadRequest(_message.Message):
    __slots__ = ("keys", "req_id", "epoch")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    req_id: str
    epoch: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., req_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class CompleteLoadResponse(_message.Message):
    __slots__ = ("ignored",)
    IGNORED_FIELD_NUMBER: _ClassVar[int]
    ignored: bool
    def __init__(self, ignored: _Optional[bool] = ...) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("keys", "req_id")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    req_id: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., req_id: _Optional[str] = ...) -> None: ...

class TouchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrepareStoreRequest(_message.Message):
    __slots__ = ("keys", "req_id", "positions")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    req_id: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., req_id: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareStoreResponse(_message.Message):
    __slots__ = ("cannot_store", "keys_to_store", "slot_offsets", "evicted_keys", "epoch")
    CANNOT_STORE_FIELD_NUMBER: _ClassVar[int]
    KEYS_TO_STORE_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    cannot_store: bool
    keys_to_store: _containers.RepeatedScalarFieldContainer[bytes]
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    evicted_keys: _containers.RepeatedScalarFieldContainer[bytes]
    epoch: int
    def __init__(self, cannot_store: _Optional[bool] = ..., keys_to_store: _Optional[_Iterable[bytes]] = ..., slot_offsets: _Optional[_Iterable[int]] = ..., evicted_keys: _Optional[_Iterable[bytes]] = ..., epoch: _Optional[int] = ...) -> None: ...

class CompleteStoreRequest(_message.Message):
    __slots__ = ("keys", "success", "req_id", "epoch", "slot_offsets")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    success: bool
    req_id: str
    epoch: int
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., success: _Optional[bool] = ..., req_id: _Optional[str] = ..., epoch: _Optional[int] = ..., slot_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class CompleteStoreResponse(_message.Message):
    __slots__ = ("ignored", "completed", "mismatched")
    IGNORED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_FIELD_NUMBER: _ClassVar[int]
    ignored: bool
    completed: int
    mismatched: int
    def __init__(self, ignored: _Optional[bool] = ..., completed: _Optional[int] = ..., mismatched: _Optional[int] = ...) -> None: ...

class RequestFinishedRequest(_message.Message):
    __slots__ = ("req_id",)
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    def __init__(self, req_id: _Optional[str] = ...) -> None: ...

class RequestFinishedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HintRequest(_message.Message):
    __slots__ = ("req_id", "session", "retain_ms")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RETAIN_MS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    session: str
    retain_ms: int
    def __init__(self, req_id: _Optional[str] = ..., session: _Optional[str] = ..., retain_ms: _Optional[int] = ...) -> None: ...

class HintResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OffloadEvent(_message.Message):
    __slots__ = ("keys", "removed", "metadata_only")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    METADATA_ONLY_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    removed: bool
    metadata_only: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., removed: _Optional[bool] = ..., metadata_only: _Optional[bool] = ...) -> None: ...

class TakeEventsRequest(_message.Message):
    __slots__ = ("max_events",)
    MAX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    max_events: int
    def __init__(self, max_events: _Optional[int] = ...) -> None: ...

class TakeEventsResponse(_message.Message):
    __slots__ = ("events", "more", "events_dropped")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[OffloadEvent]
    more: bool
    events_dropped: int
    def __init__(self, events: _Optional[_Iterable[_Union[OffloadEvent, _Mapping]]] = ..., more: _Optional[bool] = ..., events_dropped: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("epoch", "dropped_blocks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    dropped_blocks: int
    def __init__(self, epoch: _Optional[int] = ..., dropped_blocks: _Optional[int] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("count", "evict")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    count: int
    evict: bool
    def __init__(self, count: _Optional[int] = ..., evict: _Optional[bool] = ...) -> None: ...

class GrantResponse(_message.Message):
    __slots__ = ("slot_offsets",)
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class StoreGrantedRequest(_message.Message):
    __slots__ = ("keys", "req_id", "positions", "granted_keys", "granted_offsets")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    req_id: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    granted_keys: _containers.RepeatedScalarFieldContainer[bytes]
    granted_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., req_id: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ..., granted_keys: _Optional[_Iterable[bytes]] = ..., granted_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class StoreGrantedResponse(_message.Message):
    __slots__ = ("accepted", "duplicates", "refused", "evicted_keys", "epoch")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    refused: int
    evicted_keys: _containers.RepeatedScalarFieldContainer[bytes]
    epoch: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., refused: _Optional[int] = ..., evicted_keys: _Optional[_Iterable[bytes]] = ..., epoch: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "req_id", "positions", "slot_offsets")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    req_id: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., req_id: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ..., slot_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pinned", "epoch")
    PINNED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    pinned: int
    epoch: int
    def __init__(self, pinned: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReleaseHeldRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseHeldResponse(_message.Message):
    __slots__ = ("released_pins", "released_slots")
    RELEASED_PINS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    released_pins: int
    released_slots: int
    def __init__(self, released_pins: _Optional[int] = ..., released_slots: _Optional[int] = ...) -> None: ...

class StepOp(_message.Message):
    __slots__ = ("lookup", "prepare_load", "complete_load", "touch", "prepare_store", "complete_store", "request_finished", "take_events", "reset", "release_held", "grant", "store_granted", "pin", "hint")
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    PREPARE_LOAD_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_LOAD_FIELD_NUMBER: _ClassVar[int]
    TOUCH_FIELD_NUMBER: _ClassVar[int]
    PREPARE_STORE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_STORE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TAKE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    RELEASE_HELD_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    STORE_GRANTED_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    lookup: LookupRequest
    prepare_load: PrepareLoadRequest
    complete_load: CompleteLoadRequest
    touch: TouchRequest
    prepare_store: PrepareStoreRequest
    complete_store: CompleteStoreRequest
    request_finished: RequestFinishedRequest
    take_events: TakeEventsRequest
    reset: ResetRequest
    release_held: ReleaseHeldRequest
    grant: GrantRequest
    store_granted: StoreGrantedRequest
    pin: PinRequest
    hint: HintRequest
    def __init__(self, lookup: _Optional[_Union[LookupRequest, _Mapping]] = ..., prepare_load: _Optional[_Union[PrepareLoadRequest, _Mapping]] = ..., complete_load: _Optional[_Union[CompleteLoadRequest, _Mapping]] = ..., touch: _Optional[_Union[TouchRequest, _Mapping]] = ..., prepare_store: _Optional[_Union[PrepareStoreRequest, _Mapping]] = ..., complete_store: _Optional[_Union[CompleteStoreRequest, _Mapping]] = ..., request_finished: _Optional[_Union[RequestFinishedRequest, _Mapping]] = ..., take_events: _Optional[_Union[TakeEventsRequest, _Mapping]] = ..., reset: _Optional[_Union[ResetRequest, _Mapping]] = ..., release_held: _Optional[_Union[ReleaseHeldRequest, _Mapping]] = ..., grant: _Optional[_Union[GrantRequest, _Mapping]] = ..., store_granted: _Optional[_Union[StoreGrantedRequest, _Mapping]] = ..., pin: _Optional[_Union[PinRequest, _Mapping]] = ..., hint: _Optional[_Union[HintRequest, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("lookup", "prepare_load", "complete_load", "touch", "prepare_store", "complete_store", "request_finished", "take_events", "reset", "release_held", "grant", "store_granted", "pin", "hint")
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    PREPARE_LOAD_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_LOAD_FIELD_NUMBER: _ClassVar[int]
    TOUCH_FIELD_NUMBER: _ClassVar[int]
    PREPARE_STORE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_STORE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TAKE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    RELEASE_HELD_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    STORE_GRANTED_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    lookup: LookupResponse
    prepare_load: PrepareLoadResponse
    complete_load: CompleteLoadResponse
    touch: TouchResponse
    prepare_store: PrepareStoreResponse
    complete_store: CompleteStoreResponse
    request_finished: RequestFinishedResponse
    take_events: TakeEventsResponse
    reset: ResetResponse
    release_held: ReleaseHeldResponse
    grant: GrantResponse
    store_granted: StoreGrantedResponse
    pin: PinResponse
    hint: HintResponse
    def __init__(self, lookup: _Optional[_Union[LookupResponse, _Mapping]] = ..., prepare_load: _Optional[_Union[PrepareLoadResponse, _Mapping]] = ..., complete_load: _Optional[_Union[CompleteLoadResponse, _Mapping]] = ..., touch: _Optional[_Union[TouchResponse, _Mapping]] = ..., prepare_store: _Optional[_Union[PrepareStoreResponse, _Mapping]] = ..., complete_store: _Optional[_Union[CompleteStoreResponse, _Mapping]] = ..., request_finished: _Optional[_Union[RequestFinishedResponse, _Mapping]] = ..., take_events: _Optional[_Union[TakeEventsResponse, _Mapping]] = ..., reset: _Optional[_Union[ResetResponse, _Mapping]] = ..., release_held: _Optional[_Union[ReleaseHeldResponse, _Mapping]] = ..., grant: _Optional[_Union[GrantResponse, _Mapping]] = ..., store_granted: _Optional[_Union[StoreGrantedResponse, _Mapping]] = ..., pin: _Optional[_Union[PinResponse, _Mapping]] = ..., hint: _Optional[_Union[HintResponse, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[StepOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[StepOp, _Mapping]]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "epoch", "error_code", "error_message")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    epoch: int
    error_code: int
    error_message: str
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., epoch: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class SessionHeartbeat(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class SessionNotice(_message.Message):
    __slots__ = ("seq", "epoch", "state")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    epoch: int
    state: DaemonState
    def __init__(self, seq: _Optional[int] = ..., epoch: _Optional[int] = ..., state: _Optional[_Union[DaemonState, str]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAgentSessionsRequest(_message.Message):
    __slots__ = ("session", "tenant", "limit")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    session: str
    tenant: str
    limit: int
    def __init__(self, session: _Optional[str] = ..., tenant: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class AgentSessionInfo(_message.Message):
    __slots__ = ("session", "tenant", "namespace_id", "model", "retained_blocks", "retained_bytes", "expires_in_seconds", "tagged_blocks", "below_blocks")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TAGGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BELOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session: str
    tenant: str
    namespace_id: str
    model: str
    retained_blocks: int
    retained_bytes: int
    expires_in_seconds: float
    tagged_blocks: int
    below_blocks: int
    def __init__(self, session: _Optional[str] = ..., tenant: _Optional[str] = ..., namespace_id: _Optional[str] = ..., model: _Optional[str] = ..., retained_blocks: _Optional[int] = ..., retained_bytes: _Optional[int] = ..., expires_in_seconds: _Optional[float] = ..., tagged_blocks: _Optional[int] = ..., below_blocks: _Optional[int] = ...) -> None: ...

class ListAgentSessionsResponse(_message.Message):
    __slots__ = ("sessions", "tenant")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[AgentSessionInfo]
    tenant: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[AgentSessionInfo, _Mapping]]] = ..., tenant: _Optional[str] = ...) -> None: ...

class ReleaseAgentSessionRequest(_message.Message):
    __slots__ = ("session", "tenant")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session: str
    tenant: str
    def __init__(self, session: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ReleaseAgentSessionResponse(_message.Message):
    __slots__ = ("released_blocks", "namespaces")
    RELEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    released_blocks: int
    namespaces: int
    def __init__(self, released_blocks: _Optional[int] = ..., namespaces: _Optional[int] = ...) -> None: ...

class PrewarmAgentSessionRequest(_message.Message):
    __slots__ = ("session", "tenant", "keys", "namespace_id", "retain_ms")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    RETAIN_MS_FIELD_NUMBER: _ClassVar[int]
    session: str
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    namespace_id: str
    retain_ms: int
    def __init__(self, session: _Optional[str] = ..., tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., namespace_id: _Optional[str] = ..., retain_ms: _Optional[int] = ...) -> None: ...

class PrewarmAgentSessionResponse(_message.Message):
    __slots__ = ("promoting_blocks", "in_pool_blocks", "namespaces")
    PROMOTING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    promoting_blocks: int
    in_pool_blocks: int
    namespaces: int
    def __init__(self, promoting_blocks: _Optional[int] = ..., in_pool_blocks: _Optional[int] = ..., namespaces: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class AdminResetRequest(_message.Message):
    __slots__ = ("namespace_id",)
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    def __init__(self, namespace_id: _Optional[str] = ...) -> None: ...

class AdminResetResponse(_message.Message):
    __slots__ = ("dropped_blocks", "namespaces", "dropped_below_blocks")
    DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BELOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    dropped_blocks: int
    namespaces: int
    dropped_below_blocks: int
    def __init__(self, dropped_blocks: _Optional[int] = ..., namespaces: _Optional[int] = ..., dropped_below_blocks: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_ms",)
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    def __init__(self, timeout_ms: _Optional[int] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("started",)
    STARTED_FIELD_NUMBER: _ClassVar[int]
    started: bool
    def __init__(self, started: _Optional[bool] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "engine", "namespace_id", "model", "tenant", "peer_uid", "peer_gid", "peer_pid", "pins", "pending_stores", "leases", "age_seconds", "idle_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PEER_UID_FIELD_NUMBER: _ClassVar[int]
    PEER_GID_FIELD_NUMBER: _ClassVar[int]
    PEER_PID_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PENDING_STORES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine: EngineIdentity
    namespace_id: str
    model: str
    tenant: str
    peer_uid: int
    peer_gid: int
    peer_pid: int
    pins: int
    pending_stores: int
    leases: int
    age_seconds: float
    idle_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., engine: _Optional[_Union[EngineIdentity, _Mapping]] = ..., namespace_id: _Optional[str] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ..., peer_uid: _Optional[int] = ..., peer_gid: _Optional[int] = ..., peer_pid: _Optional[int] = ..., pins: _Optional[int] = ..., pending_stores: _Optional[int] = ..., leases: _Optional[int] = ..., age_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "total", "reclaim_holders")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    total: int
    reclaim_holders: _containers.RepeatedCompositeFieldContainer[ReclaimHolder]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., total: _Optional[int] = ..., reclaim_holders: _Optional[_Iterable[_Union[ReclaimHolder, _Mapping]]] = ...) -> None: ...

class ReclaimHolder(_message.Message):
    __slots__ = ("namespace_id", "session_id", "pid", "live", "held_seconds", "published_epoch", "waiting_epoch", "slots_waiting")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    HELD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WAITING_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    session_id: str
    pid: int
    live: bool
    held_seconds: float
    published_epoch: int
    waiting_epoch: int
    slots_waiting: int
    def __init__(self, namespace_id: _Optional[str] = ..., session_id: _Optional[str] = ..., pid: _Optional[int] = ..., live: _Optional[bool] = ..., held_seconds: _Optional[float] = ..., published_epoch: _Optional[int] = ..., waiting_epoch: _Optional[int] = ..., slots_waiting: _Optional[int] = ...) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetConfigResponse(_message.Message):
    __slots__ = ("toml", "json")
    TOML_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    toml: str
    json: str
    def __init__(self, toml: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...
