"""Chunk wire codec and reassembly: byte-identical to protobuf, and every malformed stream refused."""

from __future__ import annotations

import pytest
import torch

from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.chunking import (
    Reassembler,
    decode_chunk,
    encode_chunk,
    iter_chunk_wire,
    join_chunks,
    split_bytes,
    split_envelope,
)
from tasklet.protocol.codec import decode_tensor, encode_tensor
from tasklet.protocol.errors import BadMessage


@pytest.mark.parametrize(
    ("version", "total", "seq", "payload"),
    [
        (1, 10, 0, b"0123456789"),
        (1, 0, 0, b""),
        (0, 5, 3, b"abc"),
        (300, 1 << 40, 70000, bytes(200)),
        (1, 2**64 - 1, 2**32 - 1, b"\xff"),
    ],
)
def test_encode_chunk_is_byte_identical_to_protobuf(
    version: int, total: int, seq: int, payload: bytes
) -> None:
    wire = encode_chunk(total, seq, memoryview(payload), version)
    assert (
        wire
        == pb.Chunk(protocol_version=version, total_bytes=total, seq=seq, payload=payload).SerializeToString()
    )
    view = decode_chunk(wire)
    assert (view.protocol_version, view.total_bytes, view.seq, bytes(view.payload)) == (
        version,
        total,
        seq,
        payload,
    )


def test_decode_chunk_accepts_any_valid_layout() -> None:
    canonical = pb.Chunk(protocol_version=1, total_bytes=3, seq=2, payload=b"xyz").SerializeToString()
    reordered = canonical[-5:] + canonical[:-5]  # payload first: valid protobuf, not the fast path's layout
    unknown = canonical + b"\x28\x07"  # an unknown varint field 5, as a newer peer might send
    for wire in (reordered, unknown):
        view = decode_chunk(wire)
        assert (view.protocol_version, view.total_bytes, view.seq, bytes(view.payload)) == (1, 3, 2, b"xyz")


@pytest.mark.parametrize("garbage", [b"\x22\x10abc", b"\xff\xff\xff", b"\x08"])
def test_decode_chunk_refuses_garbage(garbage: bytes) -> None:
    with pytest.raises(BadMessage, match="chunk: not a valid Chunk"):
        decode_chunk(garbage)


def _envelope(n: int) -> pb.Envelope:
    env = pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=pb.ACTIVATION, sender="a")
    env.key.step = 3
    env.tensors.append(encode_tensor("x", torch.arange(n, dtype=torch.float32)))
    return env


@pytest.mark.parametrize("chunk_bytes", [1, 100, 4096, 1 << 20])
def test_split_and_join_round_trip(chunk_bytes: int) -> None:
    env = _envelope(1000)
    wires = list(split_envelope(env, chunk_bytes))
    size = env.ByteSize()
    assert len(wires) == -(-size // chunk_bytes)
    back = join_chunks((decode_chunk(w) for w in wires), max_total_bytes=size)
    assert back == env
    assert torch.equal(decode_tensor(back.tensors[0]), torch.arange(1000, dtype=torch.float32))


def test_empty_data_is_one_chunk() -> None:
    chunks = list(split_bytes(b"", 10))
    assert len(chunks) == 1 and chunks[0].total_bytes == 0 and chunks[0].payload == b""
    assert len(list(iter_chunk_wire(b"abc", 10))) == 1


def _chunks(env: pb.Envelope, chunk_bytes: int = 64) -> list[pb.Chunk]:
    return [pb.Chunk.FromString(w) for w in split_envelope(env, chunk_bytes)]


def _refused(chunks: list[pb.Chunk], field: str, match: str, limit: int = 1 << 20) -> None:
    asm = Reassembler(limit)
    with pytest.raises(BadMessage, match=match) as info:
        for chunk in chunks:
            asm.add(chunk)
        asm.envelope()
    assert info.value.field == field


def test_reassembly_refuses_malformed_streams() -> None:
    env = _envelope(100)
    good = _chunks(env)
    assert len(good) > 3

    bad = _chunks(env)
    bad[1].protocol_version = PROTOCOL_VERSION + 1
    _refused(bad, "chunk.protocol_version", f"speaks protocol version {PROTOCOL_VERSION + 1}")

    _refused([good[0], good[2]], "chunk.seq", "expected chunk 1, got 2")
    _refused([good[1]], "chunk.seq", "expected chunk 0, got 1")
    _refused(good, "chunk.total_bytes", "exceeds this peer's limit of 100", limit=100)

    bad = _chunks(env)
    bad[2].total_bytes += 1
    _refused(bad, "chunk.total_bytes", "changed from")

    bad = _chunks(env)
    bad[-1].payload += b"extra bytes"
    _refused(bad, "chunk.payload", "more than the announced")

    bad = _chunks(env)
    bad[1].payload = b""
    _refused(bad, "chunk.payload", "empty chunk 1")

    _refused(good[:-1], "chunk.total_bytes", "stream ended after")
    _refused([], "chunk", "before its first chunk")

    garbage = list(split_bytes(b"\xff" * 50, 16))
    _refused(garbage, "envelope", "not a valid Envelope")

    old = _envelope(10)
    old.protocol_version = 0
    _refused(_chunks(old), "envelope.protocol_version", "speaks protocol version 0")


def test_oversized_claim_is_refused_before_buffering() -> None:
    asm = Reassembler(max_total_bytes=1 << 20)
    huge = pb.Chunk(protocol_version=PROTOCOL_VERSION, total_bytes=1 << 50, seq=0, payload=b"x")
    with pytest.raises(BadMessage, match="exceeds"):
        asm.add(huge)
    assert asm.received == 0
