"""Tensors to and from `tasklet.v1.Tensor` messages, with optional lossy compression and strict validation.

Encodings (`compression=`):

* ``"none"``: the tensor's raw bytes (little-endian, row-major). Exact.
* ``"fp16"``: IEEE half precision, decoded back to the original dtype. Half has p = 11 bits of precision, so
  round-to-nearest moves a value in the normal range [2^-14, 65504] by at most the unit roundoff
  u = 2^-p = 2^-11 relative to it; below 2^-14 the spacing of subnormals is 2^-24 and the error at most half
  of it. Hence, per element,  |x - decode(encode(x))| <= max(2^-11 * |x|, 2^-25).
  Finite values beyond half's range would turn into inf: the encoder refuses them (ValueError).
  (A bfloat16 tensor inside half's normal range round-trips exactly: bfloat16 has only 8 bits of precision.)
* ``"int8"``: blockwise absmax quantisation. The flattened tensor is cut into blocks of `block_size`
  elements; each block stores s = absmax(block) / 127 as float32 and codes q = round(x / s) in [-127, 127].
  Since |x / s| <= 127 the clamp never bites, and rounding to the nearest integer moves x / s by at most 1/2,
  so |x - q * s| <= s / 2 = absmax(block) / 254, plus float32 rounding of the division and the product, at
  most about 2 * 2^-24 * absmax(block). Cost: 1 byte per element + 4 bytes per block (block_size=64: 1.0625
  bytes per element, 3.8x smaller than float32). Non-finite inputs cannot be coded; the encoder refuses them.
* ``"int4"``, ``"int2"``, ``"topk"``: :mod:`protocol.lowbit`; ``"topk2"``, ``"topk4"`` (one entry per block in
  2 or 4 bits, for pseudo-gradients with error feedback): :mod:`protocol.sparse`.

Decoding trusts nothing: dtype, shape, element count, byte sizes, compression parameters and (unless allowed)
finiteness are all checked before a tensor is built, and each failure raises `protocol.errors.BadMessage`
naming the field. Memory used by a decode is bounded by the message size (the byte count must match the
shape) and, with `max_elements`, by the caller.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Protocol

import torch

from tasklet.protocol import lowbit, sparse
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
FLOAT_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})

COMPRESSIONS: dict[str, int] = {"none": pb.NONE, "fp16": pb.FP16, "int8": pb.INT8_BLOCKWISE, **lowbit.WIRE_IDS,
                               **sparse.WIRE_IDS}
DEFAULT_BLOCK_SIZE = 64
MAX_BLOCK_SIZE = 1 << 20
MAX_NDIM = 32
FP16_MAX = 65504.0
INT8_LEVELS = 127

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("tasklet.protocol.codec assumes a little-endian host (the wire format is little-endian)")


def _label(name: str) -> str:
    """A short, printable label for a tensor name that came from the network."""
    shown = name if len(name) <= 64 else name[:61] + "..."
    return f"tensor[{shown!r}]"


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as bytes (one copy). Booleans are one byte each, as in torch."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes | memoryview, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A writable 1-D tensor of `numel` elements of `dtype` holding `data`: a view of it, without a copy, when
    `data` is a writable buffer (a received tensor's own buffer, see protocol.message), else one copy."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    buffer = data if isinstance(data, memoryview) and not data.readonly else bytearray(data)
    if dtype == torch.bool:
        return torch.frombuffer(buffer, dtype=torch.uint8).to(torch.bool)
    return torch.frombuffer(buffer, dtype=dtype)


class WireTensorLike(Protocol):
    """What decode_tensor reads of a tensor message (pb.Tensor and protocol.message.WireTensor both are)."""

    name: str
    dtype: str
    shape: Sequence[int]
    data: bytes
    compression: int
    scales: bytes
    block_size: int


def _data_of(msg: pb.Tensor | WireTensorLike) -> bytes | memoryview:
    """A tensor message's data: a protocol.message.WireTensor's buffer as is (no copy), a pb.Tensor's bytes."""
    payload = getattr(msg, "payload", None)
    return msg.data if payload is None else payload


def encode_payload(
    name: str, t: torch.Tensor, compression: str = "none", *, block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[pb.Tensor, memoryview]:
    """`t` as a Tensor message without its data, and the data as a buffer of its own (checked as by
    encode_tensor). Uncompressed, the buffer is the tensor's own storage when it is a contiguous CPU tensor:
    no copy at all, so the tensor must not change until it has been sent (see protocol.message)."""
    if compression == "none" and t.dtype in DTYPE_NAMES:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        header = pb.Tensor(name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape))
        return header, memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    header = encode_tensor(name, t, compression, block_size=block_size)
    data = memoryview(header.data)  # compressed: the encoder made the bytes; moved out of the message
    header.ClearField("data")
    return header, data


def encode_tensor(
    name: str,
    t: torch.Tensor,
    compression: str = "none",
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    out: pb.Tensor | None = None,
) -> pb.Tensor:
    """Serialise `t` (any device; it is copied to the CPU) into a Tensor message.

    out: a message to fill in place, typically `envelope.tensors.add()`; this saves the copy of the whole
    data that `envelope.tensors.append(encode_tensor(...))` makes (protobuf copies appended messages).

    Raises ValueError for an unsupported dtype, a compression that does not apply to it (only floating
    tensors compress), values that the chosen compression cannot represent, or a bad block size.
    """
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"{_label(name)}.dtype: {t.dtype} is not supported on the wire")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {sorted(COMPRESSIONS)}, got {compression!r}")
    msg = pb.Tensor() if out is None else out
    msg.Clear()
    msg.name = name
    msg.dtype = DTYPE_NAMES[t.dtype]
    msg.shape.extend(t.shape)
    if compression == "none":
        msg.data = _raw_bytes(t)
        return msg
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{_label(name)}: {compression} compression applies to floating tensors, not {t.dtype}"
        )
    x = t.detach().to("cpu")
    if compression == "fp16":
        half = x.to(torch.float16)
        if bool((torch.isinf(half) & torch.isfinite(x)).any()):
            raise ValueError(
                f"{_label(name)}: values beyond float16's range ({FP16_MAX}); use 'none' or 'int8'"
            )
        msg.compression = pb.FP16
        msg.data = _raw_bytes(half)
        return msg
    if compression in lowbit.WIRE_IDS:  # int4 / int2 / topk: see protocol/lowbit.py
        return lowbit.encode_into(msg, name, x, compression, block_size)
    if compression in sparse.WIRE_IDS:  # topk2 / topk4: see protocol/sparse.py
        return sparse.encode_into(msg, _label(name), x, compression, block_size)
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    codes, scales = _quantize_int8(x.to(torch.float32).reshape(-1), block_size)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(
            f"{_label(name)}: int8 compression needs finite values (NaN/inf or float32 overflow)"
        )
    msg.compression = pb.INT8_BLOCKWISE
    msg.block_size = block_size
    msg.data = _raw_bytes(codes)
    msg.scales = _raw_bytes(scales)
    return msg


def _quantize_int8(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8 codes (numel of them) and one float32 scale per block (see module docstring)."""
    numel = flat.numel()
    whole = numel % block_size == 0  # whole blocks: a view, no padded copy
    blocks = flat.contiguous().view(-1, block_size) if whole else lowbit.padded_blocks(flat, block_size)
    # absmax as max(max, -min): the same value as abs().amax() without an |x| copy of the tensor
    scales = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()) / INT8_LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.div(blocks, safe[:, None]).round_().clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return codes.reshape(-1)[:numel], scales


def _dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    numel = codes.numel()
    n_blocks = scales.numel()
    if numel == n_blocks * block_size:
        return codes.view(n_blocks, block_size).to(torch.float32).mul_(scales[:, None]).reshape(-1)
    padded = torch.zeros(n_blocks * block_size, dtype=torch.float32)
    padded[:numel] = codes.to(torch.float32)
    return (padded.view(n_blocks, block_size) * scales[:, None]).reshape(-1)[:numel]


def _check_shape(
    label: str, shape: Sequence[int], expect_shape: Sequence[int | None] | None, max_elements: int | None
) -> int:
    """Validate the announced shape; return its element count."""
    if len(shape) > MAX_NDIM:
        raise BadMessage(f"{label}.shape", f"{len(shape)} dimensions, at most {MAX_NDIM} allowed")
    if any(d < 0 for d in shape):
        raise BadMessage(f"{label}.shape", f"negative dimension in {list(shape)}")
    numel = math.prod(shape)
    if max_elements is not None and numel > max_elements:
        raise BadMessage(
            f"{label}.shape", f"{list(shape)} has {numel} elements, more than the limit {max_elements}"
        )
    if expect_shape is not None:
        ok = len(shape) == len(expect_shape) and all(
            want is None or want == got for want, got in zip(expect_shape, shape, strict=False)
        )
        if not ok:
            want_txt = "[" + ", ".join("*" if w is None else str(w) for w in expect_shape) + "]"
            raise BadMessage(f"{label}.shape", f"expected {want_txt}, got {list(shape)}")
    return numel


def _check_size(label: str, what: str, got: int, want: int, why: str) -> None:
    if got != want:
        raise BadMessage(f"{label}.{what}", f"{got} bytes, but {why} needs {want}")


def decode_tensor(
    msg: pb.Tensor | WireTensorLike,
    *,
    expect_shape: Sequence[int | None] | None = None,
    expect_dtype: torch.dtype | None = None,
    max_elements: int | None = None,
    allow_nonfinite: bool = False,
) -> torch.Tensor:
    """Build a CPU tensor from a Tensor message (pb.Tensor, or a received protocol.message.WireTensor),
    refusing anything malformed. An uncompressed WireTensor decodes without a copy: the result is a view of the
    message's own buffer (decoding it twice gives two views of the same memory).

    expect_shape: the required shape; None entries accept any size in that dimension (e.g. the batch).
    expect_dtype: the required (decoded) dtype. max_elements: refuse larger tensors before allocating.
    allow_nonfinite: accept NaN/inf in floating tensors (refused by default: one NaN activation or gradient
    would silently poison every replica after the next averaging).
    Raises protocol.errors.BadMessage naming the field.
    """
    label = _label(msg.name)
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise BadMessage(f"{label}.dtype", f"unknown dtype {msg.dtype[:32]!r}; known: {', '.join(DTYPES)}")
    if expect_dtype is not None and dtype != expect_dtype:
        raise BadMessage(
            f"{label}.dtype", f"expected {DTYPE_NAMES.get(expect_dtype, expect_dtype)}, got {msg.dtype}"
        )
    shape = list(msg.shape)
    numel = _check_shape(label, shape, expect_shape, max_elements)
    data = _data_of(msg)
    if msg.compression == pb.NONE:
        _check_size(label, "data", len(data), numel * dtype.itemsize, f"shape {shape} of {msg.dtype}")
        flat = _from_bytes(data, dtype, numel)
    elif msg.compression == pb.FP16:
        if dtype not in FLOAT_DTYPES:
            raise BadMessage(f"{label}.compression", f"FP16 compression of a {msg.dtype} tensor")
        _check_size(label, "data", len(data), numel * 2, f"shape {shape} as FP16")
        flat = _from_bytes(data, torch.float16, numel).to(dtype)
    elif msg.compression == pb.INT8_BLOCKWISE:
        if dtype not in FLOAT_DTYPES:
            raise BadMessage(f"{label}.compression", f"INT8_BLOCKWISE compression of a {msg.dtype} tensor")
        block_size = msg.block_size
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise BadMessage(f"{label}.block_size", f"{block_size} is not in [1, {MAX_BLOCK_SIZE}]")
        n_blocks = math.ceil(numel / block_size)
        _check_size(label, "data", len(data), numel, f"shape {shape} as INT8_BLOCKWISE")
        _check_size(label, "scales", len(msg.scales), 4 * n_blocks, f"{n_blocks} blocks of {block_size}")
        scales = _from_bytes(msg.scales, torch.float32, n_blocks)
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise BadMessage(f"{label}.scales", "scales must be finite and non-negative")
        flat = _dequantize_int8(_from_bytes(data, torch.int8, numel), scales, block_size).to(dtype)
    elif msg.compression in lowbit.WIRE_IDS.values():
        if dtype not in FLOAT_DTYPES:
            raise BadMessage(f"{label}.compression", f"low-bit compression of a {msg.dtype} tensor")
        flat = lowbit.decode_flat(msg, label, numel, data).to(dtype)
    elif msg.compression in sparse.KIND_OF:
        if dtype not in FLOAT_DTYPES:
            raise BadMessage(f"{label}.compression", f"sparse compression of a {msg.dtype} tensor")
        flat = sparse.decode_flat(msg, label, numel, data).to(dtype)
    else:
        raise BadMessage(f"{label}.compression", f"unknown compression {msg.compression}")
    if not allow_nonfinite and dtype in FLOAT_DTYPES and numel and not _proven_finite(msg):
        _check_finite(label, flat)
    return flat.reshape(shape)


def _proven_finite(msg: pb.Tensor | WireTensorLike) -> bool:
    """Whether the receiver already proved this uncompressed data finite as it arrived (a received
    protocol.message.WireTensor, see StreamReader), so that decode need not read it again."""
    return msg.compression == pb.NONE and getattr(msg, "finite_checked", False) is True


def _check_finite(label: str, flat: torch.Tensor) -> None:
    """Refuse NaN/inf. Fast path: one NaN or inf anywhere makes the sum NaN or inf (inf - inf = NaN), so a
    finite sum proves every element finite, in one allocation-free pass. A non-finite sum may also be a
    mere overflow of finite values; only then is each element checked."""
    if bool(torch.isfinite(flat.sum())):
        return
    bad = int((~torch.isfinite(flat)).sum())
    if bad:
        raise BadMessage(f"{label}.data", f"{bad} of {flat.numel()} values are NaN or inf")
