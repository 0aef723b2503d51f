"""Low-bit codecs for the wire: 4-bit and 2-bit blockwise quantisation with stochastic rounding (activations
and activation gradients at stage boundaries) and top-k sparsification with error feedback (pseudo-gradients).

Why these: over a home uplink the bytes of every micro-batch's boundary tensors and of every replica sync
dominate a step. fp16 halves them and int8 (in :mod:`protocol.codec`) quarters them; these go further.

* ``"int4"``: the flattened tensor is cut into blocks of ``block_size``; each block stores one float32 scale
  s = absmax(block) / 7 and codes q in [-7, 7] (stored as q + 7 in a nibble, two per byte, low nibble first;
  the nibble 15 is never written and is refused). q = floor(x / s + u) with u uniform in [0, 1): *stochastic
  rounding*, so E[q s] = x exactly (unbiased; gradients averaged over many micro-batches do not drift), and
  |x - q s| < s = absmax(block) / 7 per element. Zero stays exactly zero. Cost: 0.5 byte per element + 4 bytes
  per block: block 64 -> 0.5625 B (7.1x smaller than float32), block 128 -> 7.5x, block 256 -> 7.8x.
* ``"int2"``: as int4 with s = absmax(block) and q in [-1, 1] (stored as q + 1 in two bits, four per byte;
  the code 3 is refused): |x - q s| < s = absmax(block). Cost: 0.25 byte per element + 4 per block: block
  64 -> 0.3125 B (12.8x smaller than float32), block 128 -> 14.2x.
* ``"topk"``: the k = ceil(numel / block_size) entries of largest magnitude (density 1 / block_size), sent as
  k strictly increasing int32 indices followed by their k float32 values; everything else decodes to zero.
  Cost: 8 bytes per kept entry (block 64 -> 0.125 B per element, 32x smaller). Lossy alone; with error
  feedback the caller keeps what was not sent (``x - decode(encode(x))``) and adds it to the next round's
  tensor, so over rounds everything is sent eventually (``peer.runtime.outer.OuterState`` does).

Stochastic rounding is deterministic given a seed: ``seed=None`` derives it from the tensor's bytes (CRC32),
so the same tensor always encodes the same way while different tensors get independent rounding noise.

Decoding is hostile input: byte counts against the shape, block counts, scales (finite, >= 0), code ranges,
padding bits, the top-k entry count (exactly what the encoder keeps for the shape, so a shape the data does
not pay for is refused), indices (in range, strictly increasing so no duplicates) and values (finite) are
checked before a tensor is built; each failure raises :class:`protocol.errors.BadMessage` naming the field.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage

WIRE_IDS: dict[str, int] = {"int4": pb.INT4_BLOCKWISE, "int2": pb.INT2_BLOCKWISE, "topk": pb.TOPK}
LEVELS = {"int4": 7, "int2": 1}  # symmetric levels -L..L around an exact zero
BITS = {"int4": 4, "int2": 2}
MAX_BLOCK_SIZE = 1 << 20
FP32_BYTES = 4


def bytes_per_element(compression: str, block_size: int = 64) -> float:
    """Wire bytes per element of a float tensor under ``compression`` (the cost model's figure)."""
    if compression in ("none", "fp32"):
        return 4.0
    if compression == "fp16":
        return 2.0
    if compression == "int8":
        return 1.0 + FP32_BYTES / block_size
    if compression in BITS:
        return BITS[compression] / 8 + FP32_BYTES / block_size
    if compression == "topk":
        return 8.0 / block_size
    raise ValueError(f"unknown compression {compression!r}")


def _label(name: str) -> str:
    shown = name if len(name) <= 64 else name[:61] + "..."
    return f"tensor[{shown!r}]"


def _seed_of(flat: torch.Tensor) -> int:
    return zlib.crc32(flat.numpy().tobytes())


# ----------------------------------------------------------------------------------------- quantisation

def padded_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` (float32) zero-padded to whole blocks, as an (n_blocks, block_size) view: the layout every
    blockwise codec (int8 in ``codec``, int4/int2 here) quantizes, one scale per row."""
    numel = flat.numel()
    n_blocks = math.ceil(numel / block_size)
    padded = torch.zeros(n_blocks * block_size, dtype=torch.float32)
    padded[:numel] = flat
    return padded.view(n_blocks, block_size)

def quantize(flat: torch.Tensor, kind: str, block_size: int, seed: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed codes int8 in [-L, L], one float32 scale per block) of a 1-D float32 tensor, rounded stochastically.

    Raises ValueError for non-finite values (they have no code) or a bad block size.
    """
    if kind not in LEVELS:
        raise ValueError(f"kind must be one of {sorted(LEVELS)}, got {kind!r}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    flat = flat.detach().to("cpu", torch.float32).reshape(-1).contiguous()
    levels = LEVELS[kind]
    blocks = padded_blocks(flat, block_size)
    scales = blocks.abs().amax(dim=1) / levels
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"{kind} compression needs finite values (NaN/inf or float32 overflow)")
    gen = torch.Generator().manual_seed(_seed_of(flat) if seed is None else int(seed))
    noise = torch.rand(blocks.shape, generator=gen, dtype=torch.float32)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.floor(blocks / safe[:, None] + noise).clamp_(-levels, levels).to(torch.int8)
    return codes.reshape(-1)[: flat.numel()], scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    numel, n_blocks = codes.numel(), scales.numel()
    padded = torch.zeros(n_blocks * block_size, dtype=torch.float32)
    padded[:numel] = codes.to(torch.float32)
    return (padded.view(n_blocks, block_size) * scales[:, None]).reshape(-1)[:numel]


def pack_bits(u: torch.Tensor, bits: int) -> bytes:
    """Unsigned codes (uint8, each below 2^bits) packed ``8 / bits`` per byte, lowest bits first; padding bits
    are zero. The layout of every sub-byte codec (int4 / int2 here, topk2 / topk4 in ``protocol.sparse``)."""
    per = 8 // bits
    n = u.numel()
    padded = torch.zeros(math.ceil(n / per) * per, dtype=torch.uint8)
    padded[:n] = u
    lanes = padded.view(-1, per)
    out = torch.zeros(lanes.shape[0], dtype=torch.uint8)
    for i in range(per):
        out |= lanes[:, i] << (bits * i)
    return out.numpy().tobytes()


def unpack_bits(raw: torch.Tensor, n: int, bits: int, label: str) -> torch.Tensor:
    """The first ``n`` codes (uint8) of packed bytes ``raw``; refuses non-zero padding bits."""
    per = 8 // bits
    mask = (1 << bits) - 1
    lanes = torch.stack([(raw >> (bits * i)) & mask for i in range(per)], dim=1).reshape(-1)
    if bool((lanes[n:] != 0).any()):
        raise BadMessage(f"{label}.data", "padding bits after the last code are not zero")
    return lanes[:n]


def pack(codes: torch.Tensor, kind: str) -> bytes:
    """Offset codes (q + L) packed ``8 / bits`` per byte (:func:`pack_bits`)."""
    return pack_bits((codes.to(torch.int16) + LEVELS[kind]).to(torch.uint8), BITS[kind])


def unpack(data: bytes, numel: int, kind: str, label: str) -> torch.Tensor:
    """Signed codes from packed bytes; refuses codes above 2 L and non-zero padding bits."""
    levels = LEVELS[kind]
    if numel == 0:
        return torch.empty(0, dtype=torch.int8)
    u = unpack_bits(torch.frombuffer(bytearray(data), dtype=torch.uint8), numel, BITS[kind], label)
    if bool((u > 2 * levels).any()):
        raise BadMessage(f"{label}.data", f"{kind} code out of range (stored codes are 0..{2 * levels})")
    return (u.to(torch.int16) - levels).to(torch.int8)


# ------------------------------------------------------------------------------------------------ top-k
def topk_count(numel: int, block_size: int) -> int:
    """Entries kept by ``"topk"`` with density 1 / block_size (at least one of a non-empty tensor)."""
    return min(numel, math.ceil(numel / block_size))


def topk_encode(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending int32 indices, float32 values) of the k entries of largest magnitude.

    A tensor with at most k non-zeros (a sum of sparse pseudo-gradients in an all-gather) takes them all and
    the first zeros to make k, in a few linear passes instead of a selection over the whole tensor.
    """
    flat = flat.detach().to("cpu", torch.float32).reshape(-1)
    if not bool(torch.isfinite(flat.sum())) and not bool(torch.isfinite(flat).all()):  # a finite sum proves it
        raise ValueError("topk compression needs finite values")
    k = max(0, min(int(k), flat.numel()))
    keep = flat != 0
    count = int(torch.count_nonzero(keep))
    if count <= k:  # the first k positions hold at most `count` non-zeros, so at least k - count zeros
        keep[torch.nonzero(~keep[:k]).flatten()[: k - count]] = True
        idx = torch.nonzero(keep).flatten()
        return idx.to(torch.int32), flat[idx].contiguous()
    idx = torch.topk(flat.abs(), k, sorted=False).indices if k else torch.empty(0, dtype=torch.long)
    idx = torch.sort(idx).values
    return idx.to(torch.int32), flat[idx].contiguous()


def topk_decode(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=torch.float32)
    out[indices.to(torch.long)] = values
    return out


# --------------------------------------------------------------------------------------- the wire hooks
def encode_into(msg: pb.Tensor, name: str, x: torch.Tensor, compression: str, block_size: int,
                seed: int | None = None) -> pb.Tensor:
    """Fill ``msg`` (name, dtype and shape already set by the caller) with ``x`` under a low-bit codec."""
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    flat = x.detach().to("cpu", torch.float32).reshape(-1).contiguous()
    msg.compression = WIRE_IDS[compression]  # type: ignore[assignment]
    msg.block_size = block_size
    try:
        if compression == "topk":
            idx, vals = topk_encode(flat, topk_count(flat.numel(), block_size))
            msg.data = idx.numpy().tobytes() + vals.numpy().tobytes()
            return msg
        codes, scales = quantize(flat, compression, block_size, seed)
    except ValueError as exc:
        raise ValueError(f"{_label(name)}: {exc}") from exc
    msg.data = pack(codes, compression)
    msg.scales = scales.numpy().tobytes()
    return msg


def decode_flat(msg: Any, label: str, numel: int, data: bytes | memoryview | None = None) -> torch.Tensor:
    """The float32 elements of a low-bit message (shape and dtype already validated by the caller).

    ``msg``: a ``pb.Tensor`` or a received ``protocol.message.WireTensor``; ``data``: its payload when the
    caller has it already (saves the copy that ``msg.data`` makes of a WireTensor's buffer).
    """
    block_size = msg.block_size
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise BadMessage(f"{label}.block_size", f"{block_size} is not in [1, {MAX_BLOCK_SIZE}]")
    data = msg.data if data is None else data
    if msg.compression == pb.TOPK:
        if msg.scales:
            raise BadMessage(f"{label}.scales", "TOPK carries no scales")
        if len(data) % 8:
            raise BadMessage(f"{label}.data", f"{len(data)} bytes is not a whole number of (index, value) pairs")
        k = len(data) // 8
        if k != topk_count(numel, block_size):  # what the encoder keeps, exactly: numel is bounded by the data
            raise BadMessage(f"{label}.data", f"{k} entries, but top-k of {numel} elements in blocks of "
                             f"{block_size} keeps {topk_count(numel, block_size)}")
        if k == 0:
            return torch.zeros(numel, dtype=torch.float32)
        idx = torch.frombuffer(bytearray(data[: 4 * k]), dtype=torch.int32).to(torch.long)
        vals = torch.frombuffer(bytearray(data[4 * k:]), dtype=torch.float32)
        if int(idx.min()) < 0 or int(idx.max()) >= numel:
            raise BadMessage(f"{label}.data", f"top-k index outside [0, {numel})")
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise BadMessage(f"{label}.data", "top-k indices must be strictly increasing (no duplicates)")
        if not bool(torch.isfinite(vals).all()):
            raise BadMessage(f"{label}.data", "top-k values must be finite")
        return topk_decode(idx, vals, numel)
    kind = "int4" if msg.compression == pb.INT4_BLOCKWISE else "int2"
    per = 8 // BITS[kind]
    n_blocks = math.ceil(numel / block_size)
    want = math.ceil(numel / per)
    if len(data) != want:
        raise BadMessage(f"{label}.data", f"{len(data)} bytes, but {numel} {kind} codes need {want}")
    if len(msg.scales) != FP32_BYTES * n_blocks:
        raise BadMessage(f"{label}.scales", f"{len(msg.scales)} bytes, but {n_blocks} blocks of {block_size} "
                         f"need {FP32_BYTES * n_blocks}")
    if numel == 0:
        return torch.zeros(0, dtype=torch.float32)
    scales = torch.frombuffer(bytearray(msg.scales), dtype=torch.float32)
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise BadMessage(f"{label}.scales", "scales must be finite and non-negative")
    return dequantize(unpack(data, numel, kind, label), scales, block_size)
