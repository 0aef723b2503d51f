from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NONE: _ClassVar[Compression]
    FP16: _ClassVar[Compression]
    INT8_BLOCKWISE: _ClassVar[Compression]
    INT4_BLOCKWISE: _ClassVar[Compression]
    INT2_BLOCKWISE: _ClassVar[Compression]
    TOPK: _ClassVar[Compression]
    TOPK2: _ClassVar[Compression]
    TOPK4: _ClassVar[Compression]

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KIND_UNSPECIFIED: _ClassVar[Kind]
    ACTIVATION: _ClassVar[Kind]
    ACTIVATION_GRAD: _ClassVar[Kind]
    GRAD_SHARD: _ClassVar[Kind]
    PARAM_SHARD: _ClassVar[Kind]
    STAGE_STATE: _ClassVar[Kind]
    STAGE_ASSIGNMENT: _ClassVar[Kind]
    COMMIT: _ClassVar[Kind]
    CHECKPOINT: _ClassVar[Kind]
    LEASE: _ClassVar[Kind]
    CONTROL: _ClassVar[Kind]
    TIED_GRAD: _ClassVar[Kind]
    OTHER: _ClassVar[Kind]

class PoolStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_STATUS_UNSPECIFIED: _ClassVar[PoolStatus]
    POOL_WAIT: _ClassVar[PoolStatus]
    POOL_DONE: _ClassVar[PoolStatus]
    POOL_LEASED: _ClassVar[PoolStatus]
    POOL_COMMITTED: _ClassVar[PoolStatus]
    POOL_DUPLICATE: _ClassVar[PoolStatus]
    POOL_STALE: _ClassVar[PoolStatus]
NONE: Compression
FP16: Compression
INT8_BLOCKWISE: Compression
INT4_BLOCKWISE: Compression
INT2_BLOCKWISE: Compression
TOPK: Compression
TOPK2: Compression
TOPK4: Compression
KIND_UNSPECIFIED: Kind
ACTIVATION: Kind
ACTIVATION_GRAD: Kind
GRAD_SHARD: Kind
PARAM_SHARD: Kind
STAGE_STATE: Kind
STAGE_ASSIGNMENT: Kind
COMMIT: Kind
CHECKPOINT: Kind
LEASE: Kind
CONTROL: Kind
TIED_GRAD: Kind
OTHER: Kind
POOL_STATUS_UNSPECIFIED: PoolStatus
POOL_WAIT: PoolStatus
POOL_DONE: PoolStatus
POOL_LEASED: PoolStatus
POOL_COMMITTED: PoolStatus
POOL_DUPLICATE: PoolStatus
POOL_STALE: PoolStatus

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "compression", "scales", "block_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    compression: Compression
    scales: bytes
    block_size: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., compression: _Optional[_Union[Compression, str]] = ..., scales: _Optional[bytes] = ..., block_size: _Optional[int] = ...) -> None: ...

class Key(_message.Message):
    __slots__ = ("run_id", "epoch", "step", "microbatch", "stage", "replica")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    epoch: int
    step: int
    microbatch: int
    stage: int
    replica: int
    def __init__(self, run_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., stage: _Optional[int] = ..., replica: _Optional[int] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("protocol_version", "kind", "key", "tensors", "microbatches", "sender", "meta", "control")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    kind: Kind
    key: Key
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    microbatches: _containers.RepeatedScalarFieldContainer[int]
    sender: str
    meta: _containers.ScalarMap[str, str]
    control: Control
    def __init__(self, protocol_version: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., key: _Optional[_Union[Key, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., microbatches: _Optional[_Iterable[int]] = ..., sender: _Optional[str] = ..., meta: _Optional[_Mapping[str, str]] = ..., control: _Optional[_Union[Control, _Mapping]] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartStep(_message.Message):
    __slots__ = ("step", "attempt", "feed", "record")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FEED_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    step: int
    attempt: int
    feed: bool
    record: str
    def __init__(self, step: _Optional[int] = ..., attempt: _Optional[int] = ..., feed: _Optional[bool] = ..., record: _Optional[str] = ...) -> None: ...

class DropStep(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class Reduce(_message.Message):
    __slots__ = ("step", "attempt", "participants", "commits", "outer", "apply")
    class CommitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    step: int
    attempt: int
    participants: _containers.RepeatedScalarFieldContainer[int]
    commits: _containers.ScalarMap[int, int]
    outer: bool
    apply: bool
    def __init__(self, step: _Optional[int] = ..., attempt: _Optional[int] = ..., participants: _Optional[_Iterable[int]] = ..., commits: _Optional[_Mapping[int, int]] = ..., outer: _Optional[bool] = ..., apply: _Optional[bool] = ...) -> None: ...

class Apply(_message.Message):
    __slots__ = ("step", "outer")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    step: int
    outer: bool
    def __init__(self, step: _Optional[int] = ..., outer: _Optional[bool] = ...) -> None: ...

class Resync(_message.Message):
    __slots__ = ("step", "trained_steps", "source")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    step: int
    trained_steps: int
    source: str
    def __init__(self, step: _Optional[int] = ..., trained_steps: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class Loss(_message.Message):
    __slots__ = ("step", "microbatch", "loss")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatch: int
    loss: float
    def __init__(self, step: _Optional[int] = ..., microbatch: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class Reduced(_message.Message):
    __slots__ = ("step", "attempt")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    step: int
    attempt: int
    def __init__(self, step: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class Synced(_message.Message):
    __slots__ = ("step", "trained_steps", "params_hash")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINED_STEPS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_HASH_FIELD_NUMBER: _ClassVar[int]
    step: int
    trained_steps: int
    params_hash: str
    def __init__(self, step: _Optional[int] = ..., trained_steps: _Optional[int] = ..., params_hash: _Optional[str] = ...) -> None: ...

class TaskError(_message.Message):
    __slots__ = ("what", "step", "error")
    WHAT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    what: str
    step: int
    error: str
    def __init__(self, what: _Optional[str] = ..., step: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PeerError(_message.Message):
    __slots__ = ("endpoint", "error")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    error: str
    def __init__(self, endpoint: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class BadPeer(_message.Message):
    __slots__ = ("stage", "replica", "sender", "error")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stage: int
    replica: int
    sender: str
    error: str
    def __init__(self, stage: _Optional[int] = ..., replica: _Optional[int] = ..., sender: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class Sketch(_message.Message):
    __slots__ = ("step", "microbatch", "points", "values")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    step: int
    microbatch: int
    points: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step: _Optional[int] = ..., microbatch: _Optional[int] = ..., points: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class PoolReply(_message.Message):
    __slots__ = ("status", "speculative")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    status: PoolStatus
    speculative: bool
    def __init__(self, status: _Optional[_Union[PoolStatus, str]] = ..., speculative: _Optional[bool] = ...) -> None: ...

class Control(_message.Message):
    __slots__ = ("stop", "start_step", "drop_step", "reduce", "apply", "resync", "loss", "reduced", "synced", "error", "peer_error", "bad_peer", "pool_reply", "sketch")
    STOP_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    DROP_STEP_FIELD_NUMBER: _ClassVar[int]
    REDUCE_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    REDUCED_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PEER_ERROR_FIELD_NUMBER: _ClassVar[int]
    BAD_PEER_FIELD_NUMBER: _ClassVar[int]
    POOL_REPLY_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    stop: Stop
    start_step: StartStep
    drop_step: DropStep
    reduce: Reduce
    apply: Apply
    resync: Resync
    loss: Loss
    reduced: Reduced
    synced: Synced
    error: TaskError
    peer_error: PeerError
    bad_peer: BadPeer
    pool_reply: PoolReply
    sketch: Sketch
    def __init__(self, stop: _Optional[_Union[Stop, _Mapping]] = ..., start_step: _Optional[_Union[StartStep, _Mapping]] = ..., drop_step: _Optional[_Union[DropStep, _Mapping]] = ..., reduce: _Optional[_Union[Reduce, _Mapping]] = ..., apply: _Optional[_Union[Apply, _Mapping]] = ..., resync: _Optional[_Union[Resync, _Mapping]] = ..., loss: _Optional[_Union[Loss, _Mapping]] = ..., reduced: _Optional[_Union[Reduced, _Mapping]] = ..., synced: _Optional[_Union[Synced, _Mapping]] = ..., error: _Optional[_Union[TaskError, _Mapping]] = ..., peer_error: _Optional[_Union[PeerError, _Mapping]] = ..., bad_peer: _Optional[_Union[BadPeer, _Mapping]] = ..., pool_reply: _Optional[_Union[PoolReply, _Mapping]] = ..., sketch: _Optional[_Union[Sketch, _Mapping]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("protocol_version", "total_bytes", "seq", "payload")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    total_bytes: int
    seq: int
    payload: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., seq: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("protocol_version", "bytes_received")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    bytes_received: int
    def __init__(self, protocol_version: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("protocol_version", "kind", "key", "sender", "meta")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    kind: Kind
    key: Key
    sender: str
    meta: _containers.ScalarMap[str, str]
    def __init__(self, protocol_version: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., key: _Optional[_Union[Key, _Mapping]] = ..., sender: _Optional[str] = ..., meta: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("protocol_version", "sender", "sent_ns")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sender: str
    sent_ns: int
    def __init__(self, protocol_version: _Optional[int] = ..., sender: _Optional[str] = ..., sent_ns: _Optional[int] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("protocol_version", "echo_sent_ns")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ECHO_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    echo_sent_ns: int
    def __init__(self, protocol_version: _Optional[int] = ..., echo_sent_ns: _Optional[int] = ...) -> None: ...

class ProbeChunk(_message.Message):
    __slots__ = ("protocol_version", "seq", "payload", "sender")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    seq: int
    payload: bytes
    sender: str
    def __init__(self, protocol_version: _Optional[int] = ..., seq: _Optional[int] = ..., payload: _Optional[bytes] = ..., sender: _Optional[str] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("protocol_version", "bytes_received", "first_chunk_bytes", "first_recv_ns", "last_recv_ns")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_RECV_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_RECV_NS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    bytes_received: int
    first_chunk_bytes: int
    first_recv_ns: int
    last_recv_ns: int
    def __init__(self, protocol_version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., first_chunk_bytes: _Optional[int] = ..., first_recv_ns: _Optional[int] = ..., last_recv_ns: _Optional[int] = ...) -> None: ...

class BulkLaneRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class BulkLaneReply(_message.Message):
    __slots__ = ("protocol_version", "port")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    port: int
    def __init__(self, protocol_version: _Optional[int] = ..., port: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("protocol_version", "json")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    json: str
    def __init__(self, protocol_version: _Optional[int] = ..., json: _Optional[str] = ...) -> None: ...
