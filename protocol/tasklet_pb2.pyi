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
    OTHER: _ClassVar[Kind]
NONE: Compression
FP16: Compression
INT8_BLOCKWISE: Compression
KIND_UNSPECIFIED: Kind
ACTIVATION: Kind
ACTIVATION_GRAD: Kind
GRAD_SHARD: Kind
PARAM_SHARD: Kind
STAGE_STATE: Kind
STAGE_ASSIGNMENT: Kind
COMMIT: Kind
CHECKPOINT: Kind
OTHER: Kind

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
    __slots__ = ("protocol_version", "kind", "key", "tensors", "microbatches", "sender", "meta")
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
    protocol_version: int
    kind: Kind
    key: Key
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    microbatches: _containers.RepeatedScalarFieldContainer[int]
    sender: str
    meta: _containers.ScalarMap[str, str]
    def __init__(self, protocol_version: _Optional[int] = ..., kind: _Optional[_Union[Kind, str]] = ..., key: _Optional[_Union[Key, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., microbatches: _Optional[_Iterable[int]] = ..., sender: _Optional[str] = ..., meta: _Optional[_Mapping[str, str]] = ...) -> None: ...

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
