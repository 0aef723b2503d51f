"""Cutting a serialized Envelope into Chunks and putting it back together, with every check done on the way.

Why chunks: gRPC refuses single messages above a configured size (4 MiB by default), and one activation or
stage-state message can be hundreds of MiB. Streaming pieces of at most `chunk_bytes` keeps every gRPC
message small and lets the receiver refuse an oversized or malformed stream early: the first chunk announces
the total size, so a message above the receiver's limit is refused before any of it is buffered. The buffer
grows with the bytes that actually arrive, never with what the first chunk announces: a sender that announces
a large message and stalls makes the receiver hold only what it sent.

Copies: the sender builds each chunk from pieces (`iter_segment_chunks`: a tensor's storage as is, see
protocol.message), copying each byte once into its gRPC message; the receiver reads each chunk as it arrives,
a tensor's data straight into a buffer of its own (protocol.message.StreamReader), and lets the chunk go.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

from google.protobuf.message import DecodeError

from tasklet.protocol import PROTOCOL_VERSION
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage
from tasklet.protocol.message import StreamReader, WireEnvelope

DEFAULT_CHUNK_BYTES = 1 << 20


def check_version(field: str, version: int) -> None:
    """Refuse a message whose protocol version differs from ours."""
    if version != PROTOCOL_VERSION:
        raise BadMessage(
            field, f"message speaks protocol version {version}, this peer speaks version {PROTOCOL_VERSION}"
        )


class ChunkView(NamedTuple):
    """A received Chunk whose payload is a view into the received bytes (no copy)."""

    protocol_version: int
    total_bytes: int
    seq: int
    payload: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated varint")


# Wire tags of Chunk's fields: (field number << 3) | wire type (0 varint, 2 length-delimited).
_TAG_VERSION, _TAG_TOTAL, _TAG_SEQ, _TAG_PAYLOAD = 0x08, 0x10, 0x18, 0x22


def encode_chunk(
    total_bytes: int,
    seq: int,
    payload: bytes | memoryview | Sequence[bytes | memoryview],
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """The serialized form of Chunk(version, total_bytes, seq, payload), copying the payload once.

    payload: bytes, or pieces whose concatenation is the payload (joined into the chunk, not before).
    Building a pb.Chunk and serializing it would copy a 1 MiB payload three times (into the message, into
    the serialized bytes, ...); at memory speeds of a few GB/s that alone caps a stream near 1 GB/s. The
    output is byte-identical to pb.Chunk(...).SerializeToString() (fields in number order, proto3 defaults
    omitted); tests check that.
    """
    pieces = [payload] if isinstance(payload, bytes | bytearray | memoryview) else list(payload)
    size = sum(_nbytes(p) for p in pieces)
    parts: list[bytes | memoryview] = []
    if version:
        parts += [bytes((_TAG_VERSION,)), _varint(version)]
    if total_bytes:
        parts += [bytes((_TAG_TOTAL,)), _varint(total_bytes)]
    if seq:
        parts += [bytes((_TAG_SEQ,)), _varint(seq)]
    if size:
        parts += [bytes((_TAG_PAYLOAD,)), _varint(size), *pieces]
    return b"".join(parts)


def _nbytes(piece: bytes | bytearray | memoryview) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else len(piece)


def decode_chunk(data: bytes) -> ChunkView:
    """Parse a serialized Chunk without copying its payload.

    Fast path for the canonical layout every protobuf serializer writes (known fields in number order);
    anything else (unknown fields, repeated or reordered fields) goes through the real protobuf parser, so
    any valid Chunk is accepted. Raises BadMessage for bytes that are not a Chunk.
    """
    view = memoryview(data)
    try:
        pos, fields = 0, {}
        for tag in (_TAG_VERSION, _TAG_TOTAL, _TAG_SEQ):
            if pos < len(view) and view[pos] == tag:
                fields[tag], pos = _read_varint(view, pos + 1)
        payload = view[0:0]
        if pos < len(view) and view[pos] == _TAG_PAYLOAD:
            size, pos = _read_varint(view, pos + 1)
            payload, pos = view[pos : pos + size], pos + size
        if pos == len(view) and fields.get(_TAG_VERSION, 0) < 1 << 32 and fields.get(_TAG_SEQ, 0) < 1 << 32:
            return ChunkView(fields.get(_TAG_VERSION, 0), fields.get(_TAG_TOTAL, 0), fields.get(_TAG_SEQ, 0), payload)
    except ValueError:
        pass
    try:
        msg = pb.Chunk.FromString(data)
    except DecodeError:
        raise BadMessage("chunk", "not a valid Chunk message") from None
    return ChunkView(msg.protocol_version, msg.total_bytes, msg.seq, memoryview(msg.payload))


def iter_chunk_wire(data: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Serialized Chunks of at most `chunk_bytes` payload covering `data` (one Chunk when data is empty)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    total = len(data)
    view = memoryview(data)
    for seq, start in enumerate(range(0, max(total, 1), chunk_bytes)):
        yield encode_chunk(total, seq, view[start : start + chunk_bytes])


def iter_segment_chunks(
    segments: Sequence[bytes | memoryview], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[bytes]:
    """Serialized Chunks covering the concatenation of `segments` (as iter_chunk_wire of the joined bytes,
    byte for byte), each chunk copying its share of the segments once and nothing joined beforehand."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    views = [memoryview(s) for s in segments if _nbytes(s)]
    total = sum(v.nbytes for v in views)
    if total == 0:
        yield encode_chunk(0, 0, b"")
        return
    seq, pending, pending_bytes = 0, [], 0
    for view in views:
        offset = 0
        while offset < view.nbytes:
            take = min(chunk_bytes - pending_bytes, view.nbytes - offset)
            pending.append(view[offset : offset + take])
            pending_bytes += take
            offset += take
            if pending_bytes == chunk_bytes:
                yield encode_chunk(total, seq, pending)
                seq, pending, pending_bytes = seq + 1, [], 0
    if pending:
        yield encode_chunk(total, seq, pending)


def chunk_payload_sizes(total: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[int]:
    """Payload sizes of the chunks iter_chunk_wire(data of length total, chunk_bytes) yields, in order."""
    for start in range(0, max(total, 1), chunk_bytes):
        yield min(chunk_bytes, total - start)


def split_bytes(data: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.Chunk]:
    """Chunk messages covering `data` (the message form of iter_chunk_wire, for tests and tools)."""
    for wire in iter_chunk_wire(data, chunk_bytes):
        yield pb.Chunk.FromString(wire)


def split_envelope(envelope: pb.Envelope, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Serialize `envelope` once and yield its Chunks in serialized form."""
    return iter_chunk_wire(envelope.SerializeToString(), chunk_bytes)


class ChunkLike(Protocol):
    protocol_version: int
    total_bytes: int
    seq: int
    payload: bytes | memoryview


class Reassembler:
    """Collects the Chunks of one message and checks them as they arrive.

    `add` raises BadMessage on a wrong protocol version, out-of-order sequence number, a total size above
    `max_total_bytes`, a total that changes between chunks, more bytes than announced, or an empty chunk
    after the first. `message()` (and `envelope()`, its pb.Envelope form) raises BadMessage if the stream
    ended early or does not parse as an Envelope of our protocol version.

    What it holds is what arrived: a protocol.message.StreamReader reads each payload as it comes, the tensors'
    data straight into their own buffers, and lets the chunk go.
    """

    def __init__(self, max_total_bytes: int, what: str = "") -> None:
        self.max_total_bytes = max_total_bytes
        self.what = what
        self._reader: StreamReader | None = None
        self._total = 0
        self._received = 0
        self._next_seq = 0

    @property
    def received(self) -> int:
        return self._received

    @property
    def total(self) -> int:
        return self._total

    def add(self, chunk: ChunkLike) -> None:
        check_version("chunk.protocol_version", chunk.protocol_version)
        if chunk.seq != self._next_seq:
            raise BadMessage("chunk.seq", f"expected chunk {self._next_seq}, got {chunk.seq}")
        payload = chunk.payload
        if self._reader is None:
            if chunk.total_bytes > self.max_total_bytes:
                raise BadMessage(
                    "chunk.total_bytes",
                    f"message of {chunk.total_bytes} bytes exceeds this peer's limit of {self.max_total_bytes}"
                    + (f" for {self.what}" if self.what else ""),
                )
            self._total = chunk.total_bytes
            self._reader = StreamReader(self._total)  # holds what arrives (see the module docstring)
        elif chunk.total_bytes != self._total:
            raise BadMessage("chunk.total_bytes", f"changed from {self._total} to {chunk.total_bytes} mid-stream")
        elif not payload:
            raise BadMessage("chunk.payload", f"empty chunk {chunk.seq}")
        end = self._received + len(payload)
        if end > self._total:
            raise BadMessage("chunk.payload", f"stream carries more than the announced {self._total} bytes")
        self._reader.feed(payload if isinstance(payload, memoryview) else memoryview(payload))
        self._received = end
        self._next_seq += 1

    def message(self) -> WireEnvelope:
        """The received Envelope, its tensors' data each in a buffer of its own (see protocol.message)."""
        if self._reader is None:
            raise BadMessage("chunk", "stream ended before its first chunk")
        if self._received != self._total:
            raise BadMessage("chunk.total_bytes", f"stream ended after {self._received} of {self._total} bytes")
        reader, self._reader = self._reader, StreamReader(0)
        env = reader.finish()
        check_version("envelope.protocol_version", env.protocol_version)
        return env

    def envelope(self) -> pb.Envelope:
        """The received Envelope as a protobuf message (its tensors' data copied into it)."""
        return self.message().to_pb()


def envelope_kind_prefix(payload: bytes | memoryview) -> int:
    """The Kind of a serialized Envelope from its first bytes (our encoder writes fields in number order:
    protocol_version, then kind), so a receiver can pick the Kind's size limit from the first chunk. Returns
    KIND_UNSPECIFIED when the prefix does not start that way; the receiver checks the parsed kind matches."""
    data = bytes(payload[:16])
    pos = 0

    def varint() -> int | None:
        nonlocal pos
        value, shift = 0, 0
        while pos < len(data) and shift < 35:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
        return None

    if pos < len(data) and data[pos] == 0x08:  # field 1 (protocol_version), varint
        pos += 1
        if varint() is None:
            return pb.KIND_UNSPECIFIED
    if pos < len(data) and data[pos] == 0x10:  # field 2 (kind), varint
        pos += 1
        kind = varint()
        return pb.KIND_UNSPECIFIED if kind is None else kind
    return pb.KIND_UNSPECIFIED


def join_chunks(chunks: Iterable[ChunkLike], max_total_bytes: int) -> pb.Envelope:
    """Reassemble and check a whole chunk stream (see Reassembler)."""
    asm = Reassembler(max_total_bytes)
    for chunk in chunks:
        asm.add(chunk)
    return asm.envelope()
