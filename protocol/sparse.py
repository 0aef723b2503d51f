"""Sparse low-bit codecs for DiLoCo pseudo-gradients: one entry per block, its value in 2 or 4 bits.

``"topk2"`` / ``"topk4"``: the flattened tensor is cut into blocks of ``block_size`` (2..256) elements; each
block keeps its entry of largest magnitude (the first of equal ones), sent as its offset in the block (one
byte) and a code of ``b`` bits (b = 2 or 4). Codes are shared-scale and symmetric without a zero level: with
M = 2^b - 1, code u in [0, M] stands for s (2u - M) / M, where s is the largest kept magnitude of its group of
``GROUP_BLOCKS`` blocks (one float32 per group); the encoder rounds to the nearest level. Hence per kept entry
|v - decode| <= s / M, and the kept entry of largest magnitude of each group is exact. Everything not kept
decodes to zero.

Why these: an outer round's pseudo-gradient is the one tensor a DiLoCo member sends per round, and with error
feedback (the caller keeps ``corrected - decode(encode(corrected))`` and adds it to the next round, see
``peer.runtime.outer.OuterState``) what one round does not send, later rounds do. The cost is (1 + b / 8)
bytes per block + 4 bytes per group: at blocks of 64, 0.0205 bytes per element for topk2 (195x smaller than
float32) and 0.0244 for topk4 (164x). The selection is a per-block maximum, so encoding and decoding are a few
vectorised passes over the tensor (no global sort, unlike ``"topk"`` in :mod:`protocol.lowbit`).

Wire layout (``pb.Tensor``): ``data`` = n_blocks offset bytes, then the codes packed ``8 / b`` a byte, lowest
bits first, padding bits zero; ``scales`` = one little-endian float32 per group; ``block_size``.

Decoding is hostile input: block size, byte counts against the shape, offsets (inside their block, the last
block's included), padding bits, and scales (finite, >= 0) are checked before a tensor is built; each failure
raises :class:`protocol.errors.BadMessage` naming the field. A message of N bytes announces at most
N x block_size elements: callers bound the shape (``max_elements`` / ``expect_shape``) as for any tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import BadMessage
from tasklet.protocol.lowbit import pack_bits, unpack_bits

WIRE_IDS: dict[str, int] = {"topk2": pb.TOPK2, "topk4": pb.TOPK4}
BITS = {"topk2": 2, "topk4": 4}
KIND_OF = {wire: name for name, wire in WIRE_IDS.items()}
MAX_BLOCK_SIZE = 256  # an offset is one byte
GROUP_BLOCKS = 64  # blocks sharing one scale (4,096 elements at blocks of 64)
FP32_BYTES = 4


def bytes_per_element(compression: str, block_size: int = 64) -> float:
    """Wire bytes per element under ``compression`` (offsets, codes and scales; the cost model's figure)."""
    return (1.0 + BITS[compression] / 8) / block_size + FP32_BYTES / (block_size * GROUP_BLOCKS)


def _check_block(block_size: int) -> None:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")


def select(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset of each block's largest-magnitude entry as int64, its value) of a 1-D float32 tensor."""
    numel = flat.numel()
    n_blocks = math.ceil(numel / block_size)
    full = numel // block_size
    offsets = torch.empty(n_blocks, dtype=torch.int64)
    values = torch.empty(n_blocks, dtype=torch.float32)
    if full:
        blocks = flat[: full * block_size].view(full, block_size)
        offsets[:full] = blocks.abs().argmax(dim=1)
        values[:full] = blocks.gather(1, offsets[:full, None]).squeeze(1)
    if n_blocks > full:  # the last, shorter block: no padding to allocate
        tail = flat[full * block_size:]
        offsets[full] = int(tail.abs().argmax())
        values[full] = tail[offsets[full]]
    return offsets, values


def _group_scales(values: torch.Tensor) -> torch.Tensor:
    n = values.numel()
    n_groups = math.ceil(n / GROUP_BLOCKS)
    full = n // GROUP_BLOCKS
    scales = torch.empty(n_groups, dtype=torch.float32)
    if full:
        scales[:full] = values[: full * GROUP_BLOCKS].abs().view(full, GROUP_BLOCKS).amax(dim=1)
    if n_groups > full:
        scales[full] = values[full * GROUP_BLOCKS:].abs().max()
    return scales


def _per_block(scales: torch.Tensor, n_blocks: int) -> torch.Tensor:
    return scales.repeat_interleave(GROUP_BLOCKS)[:n_blocks]


def quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 in [0, 2^bits - 1], one float32 scale per group) of the kept values, nearest level."""
    m = (1 << bits) - 1
    scales = _group_scales(values)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    level = values / _per_block(safe, values.numel())
    codes = torch.round((level * m + m) / 2).clamp_(0, m).to(torch.uint8)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    m = (1 << bits) - 1
    return (codes.to(torch.float32) * 2 - m) / m * _per_block(scales, codes.numel())


def encode_into(msg: pb.Tensor, label: str, x: torch.Tensor, compression: str, block_size: int) -> pb.Tensor:
    """Fill ``msg`` (name, dtype and shape already set by the caller) with ``x`` under topk2 / topk4."""
    _check_block(block_size)
    flat = x.detach().to("cpu", torch.float32).reshape(-1).contiguous()
    bits = BITS[compression]
    offsets, values = select(flat, block_size)
    codes, scales = quantize(values, bits)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"{label}: {compression} compression needs finite values (NaN/inf or overflow)")
    msg.compression = WIRE_IDS[compression]  # type: ignore[assignment]
    msg.block_size = block_size
    msg.data = offsets.to(torch.uint8).numpy().tobytes() + pack_bits(codes, bits)
    msg.scales = scales.numpy().tobytes()
    return msg


def decode_flat(msg: Any, label: str, numel: int, data: bytes | memoryview) -> torch.Tensor:
    """The float32 elements of a topk2 / topk4 message (shape and dtype already checked by the caller)."""
    block_size = msg.block_size
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise BadMessage(f"{label}.block_size", f"{block_size} is not in [1, {MAX_BLOCK_SIZE}]")
    kind = KIND_OF[msg.compression]
    bits = BITS[kind]
    n_blocks = math.ceil(numel / block_size)
    n_groups = math.ceil(n_blocks / GROUP_BLOCKS)
    code_bytes = math.ceil(n_blocks * bits / 8)
    if len(data) != n_blocks + code_bytes:
        raise BadMessage(f"{label}.data", f"{len(data)} bytes, but {n_blocks} blocks of {block_size} as {kind} "
                         f"need {n_blocks + code_bytes}")
    if len(msg.scales) != FP32_BYTES * n_groups:
        raise BadMessage(f"{label}.scales", f"{len(msg.scales)} bytes, but {n_groups} groups need "
                         f"{FP32_BYTES * n_groups}")
    out = torch.zeros(numel, dtype=torch.float32)
    if numel == 0:
        return out
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    offsets = raw[:n_blocks].to(torch.int64)
    room = torch.full((n_blocks,), block_size, dtype=torch.int64)
    room[-1] = numel - (n_blocks - 1) * block_size
    if bool((offsets >= room).any()):
        raise BadMessage(f"{label}.data", "an offset lies outside its block")
    scales = torch.frombuffer(bytearray(msg.scales), dtype=torch.float32)
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise BadMessage(f"{label}.scales", "scales must be finite and non-negative")
    codes = unpack_bits(raw[n_blocks:], n_blocks, bits, label)
    starts = torch.arange(n_blocks, dtype=torch.int64) * block_size
    out[starts + offsets] = dequantize(codes, scales, bits)
    return out
