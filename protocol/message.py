"""Envelopes whose tensor bytes live outside protobuf: sent from the tensors' own storage, received into buffers
of their own, decoded without a copy.

Why: a protobuf Envelope holds its tensors' bytes inside the message, so a tensor was copied into the message,
again when serialized, again into each chunk, and on the receiver again into the reassembly buffer, into the
parsed message, out of it as `bytes` and into a writable buffer: about ten copies of every byte, which capped
the transport at a fraction of what gRPC itself carries. A `WireEnvelope` is a protobuf Envelope without
tensors (key, meta, ...) plus a list of `WireTensor`: each a Tensor message without its data, and the data as a
buffer of its own.

The wire format does not change: `segments()` are the pieces of a valid serialized Envelope (its fields, then
each tensor as a length-delimited Tensor whose `data` field holds the buffer as is; protobuf accepts fields in
any order), so the sender copies each byte once, into the gRPC message of its chunk. The receiver keeps the
received chunks as they are (its memory grows with the bytes that arrive, never with what was announced),
then walks the protobuf wire format to find each tensor's `data` field and copies it into a buffer of exactly
that size: one copy; `protocol.codec.decode_tensor` views it as a tensor without another. Everything else of
the message (small) is parsed by protobuf as before. Anything the walk does not expect (a repeated `data`
field, groups, a very large number of fields) falls back to protobuf's own parser of the whole message, so
every valid Envelope is accepted exactly as before, and every invalid one refused.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from google.protobuf.message import DecodeError

from protocol import tasklet_pb2 as pb
from protocol.codec import DEFAULT_BLOCK_SIZE, encode_payload
from protocol.errors import BadMessage

# Wire tags: Envelope.tensors and Tensor.data are both field 4, length-delimited: (4 << 3) | 2.
_TAG_BYTES_4 = 0x22
# A message with more fields than this is parsed by protobuf (in C) instead of walked (in Python): a hostile
# peer's millions of tiny fields must not cost a Python loop each.
MAX_WALKED_FIELDS = 1 << 16
_MAX_VARINT = 10


def varint(value: int) -> bytes:
    """The protobuf varint encoding of a non-negative int."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


class WireTensor:
    """One tensor of a WireEnvelope: ``header``, a Tensor message without data, and ``payload``, its data.

    Reads like a pb.Tensor (name, dtype, shape, compression, scales, block_size; ``data`` makes a bytes copy
    of the payload for readers that want bytes). A received payload is a writable buffer of its own;
    protocol.codec.decode_tensor views it without a copy.
    """

    __slots__ = ("header", "payload")

    def __init__(self, header: pb.Tensor, payload: memoryview) -> None:
        self.header = header
        self.payload = payload

    name = property(lambda self: self.header.name)
    dtype = property(lambda self: self.header.dtype)
    shape = property(lambda self: self.header.shape)
    compression = property(lambda self: self.header.compression)
    scales = property(lambda self: self.header.scales)
    block_size = property(lambda self: self.header.block_size)

    @property
    def data(self) -> bytes:
        return bytes(self.payload)

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes

    def to_pb(self) -> pb.Tensor:
        msg = pb.Tensor()
        msg.CopyFrom(self.header)
        msg.data = bytes(self.payload)
        return msg


class WireEnvelope:
    """An Envelope (``header``: every field but ``tensors``) and its tensors with their data out of protobuf.

    Reads and stamps like a pb.Envelope (kind, key, meta, microbatches, sender, protocol_version, tensors), so
    handlers written for pb.Envelope take it as is. Build one with ``add_tensor`` (no copy of an uncompressed
    contiguous CPU tensor: it must not change until sent), or convert with ``from_pb`` / ``to_pb``.
    """

    __slots__ = ("header", "tensors")

    def __init__(self, header: pb.Envelope | None = None, tensors: Sequence[WireTensor] = ()) -> None:
        self.header = pb.Envelope() if header is None else header
        if len(self.header.tensors):
            raise ValueError("a WireEnvelope's header carries no tensors; pass them as WireTensors")
        self.tensors: list[WireTensor] = list(tensors)

    @classmethod
    def from_pb(cls, env: pb.Envelope) -> WireEnvelope:
        header = pb.Envelope()
        header.CopyFrom(env)
        del header.tensors[:]
        tensors = []
        for t in env.tensors:
            head = pb.Tensor()
            head.CopyFrom(t)
            head.ClearField("data")
            tensors.append(WireTensor(head, memoryview(t.data)))
        return cls(header, tensors)

    def to_pb(self) -> pb.Envelope:
        env = pb.Envelope()
        env.CopyFrom(self.header)
        for t in self.tensors:
            env.tensors.append(t.to_pb())
        return env

    def add_tensor(
        self, name: str, t: torch.Tensor, compression: str = "none", *, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> WireTensor:
        """Append `t` (see protocol.codec.encode_payload for what is checked, and when nothing is copied)."""
        header, payload = encode_payload(name, t, compression, block_size=block_size)
        wire = WireTensor(header, payload)
        self.tensors.append(wire)
        return wire

    # --- pb.Envelope's fields -----------------------------------------------------------------------------
    kind = property(lambda self: self.header.kind, lambda self, v: setattr(self.header, "kind", v))
    sender = property(lambda self: self.header.sender, lambda self, v: setattr(self.header, "sender", v))
    protocol_version = property(
        lambda self: self.header.protocol_version, lambda self, v: setattr(self.header, "protocol_version", v)
    )
    key = property(lambda self: self.header.key)
    meta = property(lambda self: self.header.meta)
    microbatches = property(lambda self: self.header.microbatches)

    def HasField(self, name: str) -> bool:  # noqa: N802 - pb.Envelope's name
        return self.header.HasField(name)

    # --- wire form ----------------------------------------------------------------------------------------
    def segments(self) -> list[bytes | memoryview]:
        """The serialized Envelope as pieces whose concatenation protobuf parses as this message (tensors'
        data as the buffers themselves: nothing large is copied)."""
        parts: list[bytes | memoryview] = [self.header.SerializeToString()]
        for t in self.tensors:
            head = t.header.SerializeToString()
            n = t.payload.nbytes
            data_field = bytes((_TAG_BYTES_4,)) + varint(n) if n else b""
            parts += [bytes((_TAG_BYTES_4,)), varint(len(head) + len(data_field) + n), head]
            if n:
                parts += [data_field, t.payload]
        return parts

    @property
    def nbytes(self) -> int:
        """The size of the serialized Envelope."""
        return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in self.segments())


def envelope_segments(envelope: pb.Envelope | WireEnvelope) -> list[bytes | memoryview]:
    """The serialized form of either kind of envelope, as pieces (a pb.Envelope serializes in one piece)."""
    if isinstance(envelope, WireEnvelope):
        return envelope.segments()
    return [envelope.SerializeToString()]


class Segments:
    """Bytes received as a list of buffers, read as one sequence without joining them."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views: list[memoryview | None] = list(views)
        self.starts: list[int] = []
        total = 0
        for v in views:
            self.starts.append(total)
            total += v.nbytes
        self.total = total

    def read(self, pos: int, n: int) -> bytes:
        """Bytes [pos, pos + n) (clipped at the end), copied: for small reads."""
        out = bytearray()
        end = min(pos + n, self.total)
        i = bisect.bisect_right(self.starts, pos) - 1
        while pos < end:
            view = self.views[i]
            assert view is not None, "read of released bytes"
            offset = pos - self.starts[i]
            piece = view[offset : offset + end - pos]
            out += piece
            pos += piece.nbytes
            i += 1
        return bytes(out)

    def copy_into(self, dest: np.ndarray, pos: int, n: int) -> None:
        """Copy bytes [pos, pos + n) into the uint8 array `dest` (exactly n long)."""
        i = bisect.bisect_right(self.starts, pos) - 1
        done = 0
        while done < n:
            view = self.views[i]
            assert view is not None, "read of released bytes"
            offset = pos + done - self.starts[i]
            piece = view[offset : offset + n - done]
            dest[done : done + piece.nbytes] = np.frombuffer(piece, dtype=np.uint8)
            done += piece.nbytes
            i += 1

    def release_before(self, pos: int) -> None:
        """Drop the buffers that end at or before `pos` (their bytes are copied out): memory falls as it moves."""
        for i, start in enumerate(self.starts):
            view = self.views[i]
            if view is None:
                continue
            if start + view.nbytes > pos:
                return
            self.views[i] = None

    def joined(self) -> bytes:
        return b"".join(v for v in self.views if v is not None)

    def varint(self, pos: int) -> tuple[int, int]:
        """The varint at pos and the position after it; ValueError when truncated or too long."""
        data = self.read(pos, _MAX_VARINT)
        value = 0
        for i, byte in enumerate(data):
            value |= (byte & 0x7F) << (7 * i)
            if not byte & 0x80:
                return value, pos + i + 1
        raise ValueError("truncated or overlong varint")


class BufferPool:
    """Receive buffers reused once nothing refers to them any more.

    Why: a fresh buffer of many MiB is new memory for the kernel to fault in page by page, which costs more
    than copying into it (measured here: 2-4 GB/s against 8-11 GB/s into memory already in use). A buffer is
    handed out as a numpy view of a pooled array; it is free again when that view is gone, i.e. when nothing
    made from it (its memoryview, tensors decoded from it) is alive any more: CPython frees them by reference
    counting, so a handler that keeps a decoded tensor keeps its buffer. The pool holds at most `max_bytes`,
    buffers of at most `max_buffer_bytes` each, and lets go of buffers idle for `idle_s`.
    """

    def __init__(self, max_bytes: int = 256 << 20, max_buffer_bytes: int = 64 << 20, idle_s: float = 30.0) -> None:
        self.max_bytes = max_bytes
        self.max_buffer_bytes = max_buffer_bytes
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._entries: list[_PoolEntry] = []

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(e.array.nbytes for e in self._entries)

    def take(self, n: int) -> np.ndarray:
        """A writable uint8 array of exactly n bytes (contents undefined)."""
        if n > self.max_buffer_bytes or n == 0:
            return torch.empty(n, dtype=torch.uint8).numpy()
        now = time.monotonic()
        with self._lock:
            self._entries = [e for e in self._entries if e.busy() or now - e.used_at < self.idle_s]
            fits = [e for e in self._entries if n <= e.array.nbytes <= 2 * n and not e.busy()]
            if fits:
                entry = min(fits, key=lambda e: e.array.nbytes)
            elif sum(e.array.nbytes for e in self._entries) + n <= self.max_bytes:
                entry = _PoolEntry(torch.empty(n, dtype=torch.uint8).numpy())
                self._entries.append(entry)
            else:
                return torch.empty(n, dtype=torch.uint8).numpy()
            view = entry.array[:n]
            entry.lent = weakref.ref(view)
            entry.used_at = now
            return view


class _PoolEntry:
    __slots__ = ("array", "lent", "used_at")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.lent: weakref.ref[np.ndarray] | None = None
        self.used_at = time.monotonic()

    def busy(self) -> bool:
        return self.lent is not None and self.lent() is not None


RECEIVE_BUFFERS = BufferPool()
"""Where received tensors' data lands (protocol.chunking.Reassembler.message)."""


class _NotWalkableError(Exception):
    """The bytes are not in a form the walk handles; protobuf's parser decides."""


def _walk_fields(segs: Segments, start: int, end: int, budget: list[int]) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, start of the field, start of its value, end of the field) of each field in
    [start, end); a length-delimited field's value starts after its length. Raises _NotWalkableError."""
    pos = start
    while pos < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise _NotWalkableError
        try:
            tag, value_at = segs.varint(pos)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                after = segs.varint(value_at)[1]
            elif wire == 1:
                after = value_at + 8
            elif wire == 5:
                after = value_at + 4
            elif wire == 2:
                length, value_at = segs.varint(value_at)
                after = value_at + length
            else:  # groups: never written by our encoder
                raise _NotWalkableError
        except ValueError:
            raise _NotWalkableError from None
        if after > end:
            raise _NotWalkableError
        yield field, wire, pos, value_at, after
        pos = after


def parse_segments(segs: Segments, pool: BufferPool = RECEIVE_BUFFERS) -> WireEnvelope:
    """The WireEnvelope of a received serialized Envelope (see the module docstring). Raises BadMessage.

    Each tensor's data is copied into a buffer from `pool`; the buffers of `segs` are released as their bytes
    are copied out."""
    try:
        header_parts, tensors = _walk(segs)
    except _NotWalkableError:
        return _parse_whole(segs)
    try:
        header = pb.Envelope.FromString(b"".join(header_parts))
        heads = [pb.Tensor.FromString(b"".join(parts)) for parts, _ in tensors]
    except DecodeError as exc:
        raise BadMessage("envelope", f"payload is not a valid Envelope ({exc})") from None
    if len(header.tensors):  # a tensor in a form the walk passed on (e.g. with a wire type protobuf tolerates)
        return _parse_whole(segs)
    out = []
    for head, (_, span) in zip(heads, tensors, strict=True):
        if span is None:
            out.append(WireTensor(head, memoryview(b"")))
            continue
        start, n = span
        array = pool.take(n)  # exactly the bytes that arrived for it
        segs.copy_into(array, start, n)
        segs.release_before(start + n)
        out.append(WireTensor(head, memoryview(array)))
    return WireEnvelope(header, out)


def _walk(segs: Segments) -> tuple[list[bytes], list[tuple[list[bytes], tuple[int, int] | None]]]:
    """Split a serialized Envelope into its non-tensor fields and, per tensor, its non-data fields and the
    span (start, length) of its data."""
    budget = [MAX_WALKED_FIELDS]
    header: list[bytes] = []
    tensors: list[tuple[list[bytes], tuple[int, int] | None]] = []
    for field, wire, at, value_at, end in _walk_fields(segs, 0, segs.total, budget):
        if field != 4 or wire != 2:
            header.append(segs.read(at, end - at))
            continue
        kept: list[bytes] = []
        span: tuple[int, int] | None = None
        for t_field, t_wire, t_at, t_value_at, t_end in _walk_fields(segs, value_at, end, budget):
            if t_field == 4 and t_wire == 2:
                if span is not None:
                    raise _NotWalkableError  # protobuf keeps the last one; rare enough to leave to it
                span = (t_value_at, t_end - t_value_at)
            else:
                kept.append(segs.read(t_at, t_end - t_at))
        tensors.append((kept, span))
    return header, tensors


def _parse_whole(segs: Segments) -> WireEnvelope:
    env = pb.Envelope()
    try:
        env.ParseFromString(segs.joined())
    except DecodeError as exc:
        raise BadMessage("envelope", f"payload is not a valid Envelope ({exc})") from None
    return WireEnvelope.from_pb(env)
