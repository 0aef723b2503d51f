"""Bad input sent to a running stage over real gRPC is refused with a gRPC status and a one-line message
naming the field; the server keeps serving and the stage's state is untouched.

The stage here is a minimal stand-in for the runtime's stage: it knows its current step and micro-batches,
expects activations of one shape and dtype, and validates them with protocol.codec.decode_tensor before
touching its state (which is what the real stage handlers do).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.tls import process_tls
from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.chunking import encode_chunk, split_envelope
from tasklet.protocol.codec import decode_tensor, encode_tensor
from tasklet.protocol.errors import BadMessage, Refused, Rejected

SHAPE = (4, 8, 16)
CONFIG = TransportConfig(max_message_bytes=256 * 1024, chunk_bytes=64 * 1024, max_envelope_bytes=1 << 20)


class Stage:
    """Receives ACTIVATION messages for (step, micro-batch) and keeps them."""

    def __init__(self, step: int, microbatches: set[int]) -> None:
        self.step = step
        self.microbatches = microbatches
        self.received: dict[int, torch.Tensor] = {}
        self.lock = threading.Lock()

    def on_activation(self, env: pb.Envelope) -> None:
        if env.key.step != self.step:
            raise Rejected(f"key.step: unknown step {env.key.step}, this stage is at step {self.step}")
        if env.key.microbatch not in self.microbatches:
            raise Rejected(f"key.microbatch: unknown micro-batch {env.key.microbatch} of step {self.step}")
        if len(env.tensors) != 1:
            raise BadMessage("tensors", f"expected 1 tensor, got {len(env.tensors)}")
        t = decode_tensor(env.tensors[0], expect_shape=SHAPE, expect_dtype=torch.float32, max_elements=4096)
        with self.lock:
            self.received[env.key.microbatch] = t


@pytest.fixture
def stage_server() -> Iterator[tuple[Stage, PeerServer, PeerClient]]:
    stage = Stage(step=3, microbatches={0, 1})
    server = PeerServer(CONFIG)
    server.register_push("ACTIVATION", stage.on_activation)
    server.start()
    client = PeerClient(server.endpoint, CONFIG, sender="upstream")
    try:
        yield stage, server, client
    finally:
        client.close()
        server.stop(grace=0.5)


def activation(
    t: torch.Tensor | None = None,
    step: int = 3,
    microbatch: int = 0,
    tweak: Callable[[pb.Tensor], None] | None = None,
) -> pb.Envelope:
    env = pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=pb.ACTIVATION, sender="upstream")
    env.key.step = step
    env.key.microbatch = microbatch
    msg = encode_tensor("hidden", torch.randn(SHAPE) if t is None else t)
    if tweak is not None:
        tweak(msg)
    env.tensors.append(msg)
    return env


def _truncate(msg: pb.Tensor) -> None:
    msg.data = msg.data[:-4]


def _nan() -> torch.Tensor:
    t = torch.randn(SHAPE)
    t[1, 2, 3] = float("nan")
    return t


def _inf() -> torch.Tensor:
    t = torch.randn(SHAPE)
    t[0, 0, 0] = float("-inf")
    return t


def _wrong_version() -> pb.Envelope:
    env = activation()
    env.protocol_version = PROTOCOL_VERSION + 1
    return env


def _two_tensors() -> pb.Envelope:
    env = activation()
    env.tensors.append(encode_tensor("extra", torch.ones(1)))
    return env


def _set_dtype(name: str) -> Callable[[pb.Tensor], None]:
    def tweak(msg: pb.Tensor) -> None:
        msg.dtype = name

    return tweak


def _claim_shape(shape: list[int]) -> Callable[[pb.Tensor], None]:
    def tweak(msg: pb.Tensor) -> None:
        msg.shape[:] = shape

    return tweak


BAD_ENVELOPES: list[tuple[str, Callable[[], pb.Envelope], str, str]] = [
    (
        "wrong dtype",
        lambda: activation(torch.randn(SHAPE).to(torch.float16)),
        "INVALID_ARGUMENT",
        "tensor['hidden'].dtype: expected float32, got float16",
    ),
    (
        "unknown dtype",
        lambda: activation(tweak=_set_dtype("float8")),
        "INVALID_ARGUMENT",
        "tensor['hidden'].dtype: unknown dtype 'float8'",
    ),
    (
        "wrong shape",
        lambda: activation(torch.randn(4, 8, 15)),
        "INVALID_ARGUMENT",
        "tensor['hidden'].shape: expected [4, 8, 16], got [4, 8, 15]",
    ),
    (
        "size mismatch",
        lambda: activation(tweak=_truncate),
        "INVALID_ARGUMENT",
        "tensor['hidden'].data: 2044 bytes, but shape [4, 8, 16] of float32 needs 2048",
    ),
    (
        "oversized tensor",
        lambda: activation(tweak=_claim_shape([4096, 8, 16])),
        "INVALID_ARGUMENT",
        "tensor['hidden'].shape: [4096, 8, 16] has 524288 elements, more than the limit 4096",
    ),
    (
        "oversized envelope",
        lambda: activation(torch.randn(600, 1000)),
        "INVALID_ARGUMENT",
        "chunk.total_bytes: message of 24000",
    ),
    (
        "unknown step",
        lambda: activation(step=99),
        "FAILED_PRECONDITION",
        "key.step: unknown step 99, this stage is at step 3",
    ),
    (
        "unknown micro-batch",
        lambda: activation(microbatch=7),
        "FAILED_PRECONDITION",
        "key.microbatch: unknown micro-batch 7 of step 3",
    ),
    (
        "wrong protocol version",
        _wrong_version,
        "INVALID_ARGUMENT",
        f"envelope.protocol_version: message speaks protocol version {PROTOCOL_VERSION + 1}, "
        f"this peer speaks version {PROTOCOL_VERSION}",
    ),
    (
        "NaN",
        lambda: activation(_nan()),
        "INVALID_ARGUMENT",
        "tensor['hidden'].data: 1 of 512 values are NaN or inf",
    ),
    (
        "inf",
        lambda: activation(_inf()),
        "INVALID_ARGUMENT",
        "tensor['hidden'].data: 1 of 512 values are NaN or inf",
    ),
    ("two tensors", _two_tensors, "INVALID_ARGUMENT", "tensors: expected 1 tensor, got 2"),
]


def _assert_untouched_then_serving(stage: Stage, server: PeerServer, client: PeerClient) -> None:
    assert stage.received == {}
    assert server.stats["pushes"] == 0
    good = torch.randn(SHAPE)
    client.push(activation(good, microbatch=1), timeout_s=10)
    assert torch.equal(stage.received[1], good)


@pytest.mark.parametrize(
    ("case", "make", "code", "message"), BAD_ENVELOPES, ids=[c[0] for c in BAD_ENVELOPES]
)
def test_bad_envelope_is_refused_and_stage_keeps_serving(
    stage_server: tuple[Stage, PeerServer, PeerClient],
    case: str,
    make: Callable[[], pb.Envelope],
    code: str,
    message: str,
) -> None:
    stage, server, client = stage_server
    with pytest.raises(Refused) as info:
        client.push(make(), timeout_s=10)
    assert info.value.code == code, case
    assert message in info.value.detail, info.value.detail
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    _assert_untouched_then_serving(stage, server, client)


def _raw_push(endpoint: str, chunks: list[bytes]) -> grpc.RpcError:
    """Push hand-made chunk bytes (bypassing PeerClient's own framing); return the error it ends with."""
    with process_tls().channel(endpoint, options=[("grpc.max_send_message_length", 4 << 20)]) as channel:
        push = channel.stream_unary(
            "/tasklet.v1.Peer/Push", request_serializer=None, response_deserializer=pb.Ack.FromString
        )
        with pytest.raises(grpc.RpcError) as info:
            push(iter(chunks), timeout=10)
        return info.value


def _good_chunks() -> list[bytes]:
    return list(split_envelope(activation(), 512))


BAD_STREAMS: list[tuple[str, Callable[[], list[bytes]], grpc.StatusCode, str]] = [
    (
        "chunk version",
        lambda: [encode_chunk(10, 0, b"0123456789", version=PROTOCOL_VERSION + 5)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "chunk.protocol_version: message speaks protocol version",
    ),
    ("not a chunk", lambda: [b"\xff\xfe\xfd"], grpc.StatusCode.INVALID_ARGUMENT, "chunk: not a valid Chunk"),
    (
        "chunks out of order",
        lambda: [_good_chunks()[0], _good_chunks()[2]],
        grpc.StatusCode.INVALID_ARGUMENT,
        "chunk.seq: expected chunk 1, got 2",
    ),
    (
        "stream cut short",
        lambda: _good_chunks()[:-1],
        grpc.StatusCode.INVALID_ARGUMENT,
        "chunk.total_bytes: stream ended after",
    ),
    (
        "oversized gRPC message",
        lambda: [encode_chunk(1 << 20, 0, bytes(1 << 20))],
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
    ),
    (
        "not an envelope",
        lambda: [encode_chunk(6, 0, b"\xff" * 6)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "envelope: payload is not a valid Envelope",
    ),
]


@pytest.mark.parametrize(("case", "make", "code", "message"), BAD_STREAMS, ids=[c[0] for c in BAD_STREAMS])
def test_bad_stream_is_refused_and_stage_keeps_serving(
    stage_server: tuple[Stage, PeerServer, PeerClient],
    case: str,
    make: Callable[[], list[bytes]],
    code: grpc.StatusCode,
    message: str,
) -> None:
    stage, server, client = stage_server
    error = _raw_push(server.endpoint, make())
    assert error.code() == code, (case, error.details())
    assert message in (error.details() or ""), error.details()
    _assert_untouched_then_serving(stage, server, client)


def test_wrong_version_on_control_calls_is_refused(
    stage_server: tuple[Stage, PeerServer, PeerClient],
) -> None:
    _, server, client = stage_server
    with process_tls().channel(server.endpoint) as channel:
        ping = channel.unary_unary(
            "/tasklet.v1.Peer/Ping",
            request_serializer=pb.PingRequest.SerializeToString,
            response_deserializer=pb.PingReply.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            ping(pb.PingRequest(protocol_version=PROTOCOL_VERSION + 1), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ping.protocol_version" in info.value.details()
    assert client.ping(timeout_s=5) > 0
