"""tasklet.protocol.message: envelopes whose tensor bytes travel outside protobuf.

The wire form must be a valid serialized Envelope (protobuf reads it as the same message), the receiver's walk
must read any valid Envelope exactly as protobuf does, however the stream is cut, and refuse what protobuf
refuses; tensors decode without a copy, and received buffers are reused only once nothing refers to them.
"""

from __future__ import annotations

import random

import pytest
import torch

from tasklet.protocol import PROTOCOL_VERSION, fastcopy
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.chunking import Reassembler, decode_chunk, iter_chunk_wire, iter_segment_chunks
from tasklet.protocol.codec import decode_tensor, encode_tensor
from tasklet.protocol.errors import BadMessage
from tasklet.protocol.message import MAX_WALKED_FIELDS, BufferPool, StreamReader, WireEnvelope, varint


def _wire_envelope() -> tuple[WireEnvelope, dict[str, torch.Tensor]]:
    env = WireEnvelope(pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=pb.STAGE_STATE, sender="me"))
    env.key.step = 7
    env.meta["why"] = "join"
    env.microbatches.extend([3, 1])
    tensors = {
        "w": torch.randn(33, 17),
        "b": torch.randn(0),
        "steps": torch.arange(-5, 5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(9).to(torch.bfloat16),
    }
    for name, t in tensors.items():
        env.add_tensor(name, t)
    env.add_tensor("q", tensors["w"], "int8")
    return env, tensors


def _cut(data: bytes, rng: random.Random) -> list[memoryview]:
    """`data` cut at random places (as chunks of any sizes would)."""
    cuts = sorted(rng.sample(range(1, len(data)), k=min(12, len(data) - 1))) if len(data) > 1 else []
    view = memoryview(data)
    return [view[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def read(pieces: list[memoryview]) -> WireEnvelope:
    """What a receiver makes of a stream arriving in these pieces."""
    reader = StreamReader(sum(p.nbytes for p in pieces))
    for piece in pieces:
        reader.feed(piece)
    return reader.finish()


def test_wire_form_is_a_valid_envelope_and_round_trips() -> None:
    env, tensors = _wire_envelope()
    data = b"".join(env.segments())
    assert env.nbytes == len(data)
    parsed = pb.Envelope.FromString(data)  # protobuf reads the same message
    assert parsed == env.to_pb()
    assert [t.name for t in parsed.tensors] == [*tensors, "q"]
    rng = random.Random(0)
    for _ in range(5):
        back = read(_cut(data, rng))
        assert back.to_pb() == parsed
        assert back.sender == "me" and back.key.step == 7 and dict(back.meta) == {"why": "join"}
        assert list(back.microbatches) == [3, 1]
        for wire, (name, t) in zip(back.tensors, tensors.items(), strict=False):
            assert wire.name == name and torch.equal(decode_tensor(wire), t)


def test_received_tensor_decodes_as_a_view_of_its_buffer() -> None:
    env = WireEnvelope(pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=pb.ACTIVATION))
    t = torch.randn(1000)
    env.add_tensor("h", t)
    back = read([memoryview(b"".join(env.segments()))])
    out = decode_tensor(back.tensors[0])
    assert torch.equal(out, t)
    assert out.data_ptr() == torch.frombuffer(back.tensors[0].payload, dtype=torch.uint8).data_ptr()
    out.add_(1.0)  # writable: the handler owns it
    assert torch.equal(decode_tensor(back.tensors[0]), t + 1.0)


def test_sender_sends_the_tensors_own_storage() -> None:
    t = torch.randn(100)
    env = WireEnvelope(pb.Envelope(kind=pb.ACTIVATION))
    wire = env.add_tensor("h", t)
    assert torch.frombuffer(wire.payload, dtype=torch.float32).data_ptr() == t.data_ptr()  # no copy


def test_pb_envelopes_parse_the_same_way() -> None:
    """An Envelope serialized by protobuf (tensors' data inline, canonical field order) walks to the same."""
    env = pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=pb.ACTIVATION, sender="s")
    env.tensors.append(encode_tensor("a", torch.randn(50)))
    env.tensors.append(encode_tensor("b", torch.randn(7), "fp16"))
    env.meta["k"] = "v"
    data = env.SerializeToString()
    back = read(_cut(data, random.Random(1)))
    assert back.to_pb() == env
    assert WireEnvelope.from_pb(env).to_pb() == env


def test_uncommon_layouts_fall_back_to_protobuf() -> None:
    """What the walk does not expect is left to protobuf's own parser of the whole, with the same result, however
    the stream is cut: a repeated data field (protobuf keeps the last), a well-formed group (an unknown field to
    protobuf), more fields than the walk's budget."""
    head = pb.Tensor(name="x", dtype="uint8", shape=[3]).SerializeToString()
    tensor = head + b"\x22\x02ab" + b"\x22\x03xyz"
    prefix = bytes([0x08, PROTOCOL_VERSION, 0x10, pb.OTHER])
    first = pb.Tensor(name="first", dtype="float32", shape=[2], data=bytes(8)).SerializeToString()
    before = prefix + b"\x22" + bytes([len(first)]) + first  # a walked tensor before the odd part
    repeated = before + b"\x22" + bytes([len(tensor)]) + tensor
    group = before + b"\x5b\x08\x01\x5c" + b"\x22" + bytes([len(tensor)]) + tensor  # group 11 {varint 1 = 1}
    many = prefix + b"\x28\x01" * (MAX_WALKED_FIELDS + 1)  # microbatches, unpacked, one field each
    empties = prefix + b"\x22\x00" * (MAX_WALKED_FIELDS + 1)  # as many empty tensors: an object each if walked
    for data in (repeated, group, many, empties):
        want = pb.Envelope.FromString(data)
        for seed in range(3):
            assert read(_cut(data, random.Random(seed))).to_pb() == want
    assert read([memoryview(repeated)]).tensors[1].data == b"xyz"
    reader = StreamReader(len(empties))
    reader.feed(memoryview(empties))
    assert len(reader._tensors) == 0 and reader._rest is not None  # gave up, holding the bytes only
    assert len(reader.finish().tensors) == MAX_WALKED_FIELDS + 1


def test_field_number_zero_is_refused() -> None:
    data = bytes([0x08, PROTOCOL_VERSION, 0x10, pb.OTHER]) + bytes(64)
    with pytest.raises(BadMessage):
        read([memoryview(data)])


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x22\x05\x22\x10abc",  # a tensor whose data runs past its end
        b"\x22",  # truncated length
        b"\x08\x01\x22\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # overlong varint
        b"\x0b\x01",  # a start-group tag, never closed
        b"\x22\x03\x22\x05a",  # data longer than the tensor
    ],
)
def test_malformed_envelopes_are_refused(garbage: bytes) -> None:
    for seed in range(3):
        with pytest.raises(BadMessage):
            read(_cut(garbage, random.Random(seed)))


def test_segment_chunks_equal_chunks_of_the_joined_bytes() -> None:
    env, _ = _wire_envelope()
    data = b"".join(env.segments())
    for chunk_bytes in (1, 7, 64, 1000, len(data), 10 * len(data)):
        assert list(iter_segment_chunks(env.segments(), chunk_bytes)) == list(iter_chunk_wire(data, chunk_bytes))
    assert list(iter_segment_chunks([b"", memoryview(b"")], 10)) == list(iter_chunk_wire(b"", 10))


def test_reassembler_message_matches_envelope() -> None:
    env, tensors = _wire_envelope()
    chunks = list(iter_segment_chunks(env.segments(), 100))
    asm, asm2 = Reassembler(1 << 20), Reassembler(1 << 20)
    for raw in chunks:
        asm.add(decode_chunk(raw))
        asm2.add(decode_chunk(raw))
    assert asm.message().to_pb() == asm2.envelope() == env.to_pb()


def test_one_byte_chunks() -> None:
    """A stream of one-byte chunks is read like any other (heads cut anywhere)."""
    env, tensors = _wire_envelope()
    asm = Reassembler(1 << 20)
    for raw in iter_chunk_wire(b"".join(env.segments()), 1):
        asm.add(decode_chunk(raw))
    back = asm.message()
    assert back.to_pb() == env.to_pb() and torch.equal(decode_tensor(back.tensors[0]), tensors["w"])


def test_buffer_pool_reuses_only_free_buffers() -> None:
    pool = BufferPool(max_bytes=10_000, max_buffer_bytes=4_000, idle_s=60)
    a = pool.take(1000)
    b = pool.take(1000)
    assert a.ctypes.data != b.ctypes.data and pool.held_bytes == 2000
    kept = torch.frombuffer(memoryview(a), dtype=torch.uint8)  # e.g. a decoded tensor a handler keeps
    del a
    c = pool.take(1000)
    assert c.ctypes.data not in (kept.data_ptr(), b.ctypes.data)  # still in use: not handed out again
    del kept
    d = pool.take(900)  # a free buffer of a fitting size is reused
    assert pool.held_bytes == 3000 and d.nbytes == 900
    big = pool.take(5000)  # above max_buffer_bytes: not pooled
    assert big.nbytes == 5000 and pool.held_bytes == 3000
    del b, c, d
    for _ in range(20):  # never beyond max_bytes
        pool.take(3999)
    assert pool.held_bytes <= 10_000


def test_copies_bytes_parts_and_replaced_data_read_like_protobuf() -> None:
    """What the runtime's senders rely on: CopyFrom, assigning a tensor's data, and byte parts sent from a view
    serialize exactly as the protobuf Envelope built the old way."""
    env, _ = _wire_envelope()
    blob = bytes(range(256)) * 5
    env.add_bytes("file", memoryview(blob)[100:900])
    copy = WireEnvelope()
    copy.CopyFrom(env)
    assert b"".join(copy.segments()) == b"".join(env.segments())
    copy.tensors[-1].data = b"changed"  # replaces the copy's buffer; the original is untouched
    assert env.tensors[-1].data == blob[100:900] and copy.tensors[-1].data == b"changed"
    expected = env.to_pb()
    expected.tensors[-1].data = b"changed"
    expected.tensors[-1].shape[:] = [len(b"changed")]
    copy.tensors[-1].header.shape[:] = [len(b"changed")]
    assert pb.Envelope.FromString(b"".join(copy.segments())) == expected
    from_pb = WireEnvelope()
    from_pb.CopyFrom(expected)
    assert from_pb.to_pb() == expected
    file = env.tensors[-1]
    assert (file.dtype, list(file.shape)) == ("uint8", [800])
    assert decode_tensor(file).tolist() == list(blob[100:900])
    legacy = WireEnvelope()
    legacy.CopyFrom(env)
    legacy.tensors.append(encode_tensor("late", torch.arange(4.0), "int8"))  # the protobuf way: sent as is
    want = env.to_pb()
    want.tensors.append(encode_tensor("late", torch.arange(4.0), "int8"))
    assert pb.Envelope.FromString(b"".join(legacy.segments())) == want == legacy.to_pb()


@pytest.fixture(params=["c", "numpy"])
def float32_copy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the receiver copies and checks float32 data: the C routine (when built; tests/
    test_protocol_fastcopy.py requires it wherever a C compiler exists) and numpy."""
    if request.param == "c" and not fastcopy.AVAILABLE:
        pytest.skip("tasklet.protocol._copycheck is not built here")
    monkeypatch.setattr(fastcopy, "AVAILABLE", request.param == "c")
    return str(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_nan_and_inf_checked_as_the_data_arrives_are_refused_wherever_they_are(dtype: torch.dtype,
                                                                                float32_copy: str) -> None:
    """The receiver's check while copying must refuse exactly what decode_tensor's own check refuses: a NaN or
    inf anywhere (in any cut of the stream), and accept finite values whose sum overflows."""
    rng = random.Random(5)
    n = 3 * (256 * 1024) // dtype.itemsize + 7  # several check steps, not a whole number of them
    for bad_at, bad in [(None, None), (0, float("nan")), (n - 1, float("inf")), (n // 2, float("-inf"))]:
        x = torch.randn(n).to(dtype)
        if bad_at is not None:
            x[bad_at] = bad
        env = WireEnvelope(pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=pb.ACTIVATION))
        env.add_tensor("x", x)
        wire = b"".join(env.segments())
        for pieces in (_cut(wire, rng), [memoryview(wire)]):  # small pieces, and one spanning every step
            got = read(pieces).tensors[0]
            assert got.finite_checked is (bad_at is None)
            if bad_at is None:
                assert torch.equal(decode_tensor(got), x)
            else:
                with pytest.raises(BadMessage, match="NaN or inf"):
                    decode_tensor(got)
                kept = decode_tensor(got, allow_nonfinite=True)  # every byte still arrived, after the bad one too
                assert kept[bad_at].isnan() == (bad != bad)
                assert torch.equal(kept.view(torch.uint8), x.view(torch.uint8))  # bit for bit
    huge = torch.full((1000,), torch.finfo(dtype).max / 2, dtype=dtype)  # finite, but the sum overflows
    env = WireEnvelope(pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=pb.ACTIVATION))
    env.add_tensor("x", huge)
    got = read(_cut(b"".join(env.segments()), rng)).tensors[0]
    # numpy's sum overflows, and decode's exact check decides; the C check is exact itself
    assert got.finite_checked is (dtype == torch.float32 and float32_copy == "c")
    assert torch.equal(decode_tensor(got), huge)


def test_the_arrival_check_is_trusted_only_for_what_was_checked() -> None:
    """A dtype or compression field after the data (protobuf keeps the last), replaced data, or a tensor that
    never came through the receiver: decode_tensor checks the data itself."""
    x = torch.randn(64)
    x[3] = float("nan")
    env = WireEnvelope(pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=pb.ACTIVATION))
    env.add_tensor("ids", x.view(torch.int32))  # checked as nothing: int32
    tail = pb.Tensor(dtype="float32").SerializeToString()  # ... then retyped float32 after the data
    wire = b"".join(env.segments())
    tensor_field = wire[wire.index(b"\x22", 2):]  # Envelope.tensors (field 4) is the last field written
    body = tensor_field[1 + len(_varint_bytes(tensor_field[1:])):] + tail
    retyped = wire[: len(wire) - len(tensor_field)] + b"\x22" + varint(len(body)) + body
    got = read([memoryview(retyped)]).tensors[0]
    assert got.dtype == "float32" and not got.finite_checked
    with pytest.raises(BadMessage, match="NaN or inf"):
        decode_tensor(got)
    good = WireEnvelope(pb.Envelope(protocol_version=PROTOCOL_VERSION, kind=pb.ACTIVATION))
    good.add_tensor("x", torch.randn(64))
    received = read([memoryview(b"".join(good.segments()))]).tensors[0]
    assert received.finite_checked
    received.data = x.numpy().tobytes()  # replaced: no longer what was checked
    assert not received.finite_checked
    with pytest.raises(BadMessage, match="NaN or inf"):
        decode_tensor(received)
    sent = WireEnvelope(pb.Envelope(kind=pb.ACTIVATION))
    assert not sent.add_tensor("x", x).finite_checked  # built here, never checked


def _varint_bytes(data: bytes) -> bytes:
    """The varint that starts `data`."""
    end = next(i for i, b in enumerate(data) if not b & 0x80)
    return data[: end + 1]
