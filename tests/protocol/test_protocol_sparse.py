"""Sparse low-bit codecs (protocol/sparse.py): what each block keeps, the rounding bound, the wire size, error
feedback through them, and the refusal of every malformed message through the wire codec."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from tasklet.protocol import sparse
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import COMPRESSIONS, decode_tensor, encode_tensor
from tasklet.protocol.errors import BadMessage
from tasklet.scheduler.compression import bytes_per_element as scheduler_bytes

pytestmark = pytest.mark.unit
KINDS = ("topk2", "topk4")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "block"), [(1, 64), (64, 64), (65, 64), (4096 * 3 + 7, 64), (1000, 7), (300, 256)])
def test_each_block_keeps_its_largest_entry_within_one_level(kind: str, n: int, block: int) -> None:
    torch.manual_seed(n + block)
    x = torch.randn(n)
    y = decode_tensor(encode_tensor("x", x, kind, block_size=block))
    m = (1 << sparse.BITS[kind]) - 1
    n_blocks = math.ceil(n / block)
    starts = torch.arange(n_blocks) * block
    kept = torch.nonzero(y).flatten()
    assert kept.numel() == n_blocks and torch.equal(kept // block, torch.arange(n_blocks)), "one entry per block"
    for b in range(n_blocks):
        seg = x[starts[b]: starts[b] + block]
        assert int(kept[b]) - int(starts[b]) == int(seg.abs().argmax()), f"block {b} kept another entry"
    groups = torch.arange(n_blocks) // sparse.GROUP_BLOCKS
    kept_x = x[kept]
    for g in range(int(groups.max()) + 1):
        sel = groups == g
        s = float(kept_x[sel].abs().max())
        err = (y[kept][sel] - kept_x[sel]).abs()
        assert float(err.max()) <= s / m * (1 + 1e-6), f"group {g}: an error above one level"
        top = int(kept_x[sel].abs().argmax())
        assert float(err[top]) <= s * 1e-6, "the group's largest entry is exact"


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_per_element_match_the_wire(kind: str) -> None:
    n = 64 * sparse.GROUP_BLOCKS * 10
    msg = encode_tensor("x", torch.randn(n), kind)
    assert len(msg.data) + len(msg.scales) == pytest.approx(sparse.bytes_per_element(kind) * n)
    assert 4 / sparse.bytes_per_element(kind) > 150, "over 150x smaller than float32"
    assert COMPRESSIONS[kind] == sparse.WIRE_IDS[kind]
    assert scheduler_bytes(kind, 4) == pytest.approx(sparse.bytes_per_element(kind)), "the scheduler's figure"


def test_zeros_bfloat16_and_empty_round_trip() -> None:
    for kind in KINDS:
        assert torch.equal(decode_tensor(encode_tensor("z", torch.zeros(300), kind)), torch.zeros(300))
        b = torch.randn(3, 70).to(torch.bfloat16)
        out = decode_tensor(encode_tensor("b", b, kind))
        assert out.dtype == torch.bfloat16 and out.shape == b.shape
        assert decode_tensor(encode_tensor("e", torch.zeros(0, 5), kind)).shape == (0, 5)


def test_nonfinite_and_integer_inputs_are_refused_by_the_encoder() -> None:
    for kind in KINDS:
        for bad in (float("nan"), float("inf")):
            x = torch.randn(200)
            x[150] = bad
            with pytest.raises(ValueError, match="finite"):
                encode_tensor("x", x, kind)
        with pytest.raises(ValueError, match="floating"):
            encode_tensor("i", torch.arange(10), kind)
        with pytest.raises(ValueError, match="block_size"):
            encode_tensor("x", torch.randn(10), kind, block_size=sparse.MAX_BLOCK_SIZE + 1)


def test_error_feedback_through_topk2_sends_everything_over_rounds() -> None:
    """The caller's residual (corrected minus what was decoded) makes the sum of what was sent track the sum of
    the inputs: the gap is the residual, which stays bounded (each entry waits at most its block's turn), so the
    average of what was sent converges to the input."""
    torch.manual_seed(3)
    target = torch.randn(4096)
    bound = 2 * 64 * float(target.abs().max())
    residual = torch.zeros_like(target)
    sent_total = torch.zeros_like(target)
    rounds, worst = 1000, 0.0
    for _ in range(rounds):
        corrected = target + residual
        sent = decode_tensor(encode_tensor("p", corrected, "topk2"))
        residual = corrected - sent
        sent_total += sent
        worst = max(worst, float(residual.abs().max()))
    assert torch.allclose(sent_total + residual, target * rounds, atol=0.05)
    assert worst < bound, f"the residual grew to {worst}"
    gap = float((sent_total / rounds - target).abs().max())
    assert gap < bound / rounds, f"average of what was sent is {gap} from the input"


def _good(kind: str, n: int = 1000, block: int = 64) -> pb.Tensor:
    torch.manual_seed(7)
    return encode_tensor("m", torch.randn(n), kind, block_size=block)


def _refused(msg: pb.Tensor, field: str) -> None:
    with pytest.raises(BadMessage) as exc:
        decode_tensor(pb.Tensor.FromString(msg.SerializeToString()))
    assert exc.value.field.endswith(field), str(exc.value)


def _last_offset(m: pb.Tensor, offset: int) -> None:
    n_blocks = math.ceil(1000 / 64)
    m.data = m.data[: n_blocks - 1] + bytes([offset]) + m.data[n_blocks:]


def _huge(m: pb.Tensor) -> None:
    del m.shape[:]
    m.shape.append(1 << 40)  # far more elements than the bytes pay for


# (field the refusal names, what is done to a good message of 1,000 elements in blocks of 64)
MALFORMED: list[tuple[str, Callable[[pb.Tensor], None]]] = [
    ("data", lambda m: setattr(m, "data", m.data[:-1])),
    ("data", lambda m: setattr(m, "data", m.data + b"\x00")),
    ("data", lambda m: setattr(m, "data", b"")),
    ("scales", lambda m: setattr(m, "scales", b"")),
    ("scales", lambda m: setattr(m, "scales", m.scales + b"\x00\x00\x80\x3f")),
    *[("scales", lambda m, v=v: setattr(m, "scales", torch.tensor([v]).numpy().tobytes()))
      for v in (float("nan"), float("inf"), -1.0)],
    *[("block_size", lambda m, b=b: setattr(m, "block_size", b)) for b in (0, -3, sparse.MAX_BLOCK_SIZE + 1)],
    ("data", lambda m: setattr(m, "data", bytes([64]) + m.data[1:])),  # offset 64 in a block of 64
    ("data", lambda m: _last_offset(m, 40)),  # the last block holds 1000 - 15 x 64 = 40 elements
    ("compression", lambda m: setattr(m, "dtype", "int32")),
    ("data", _huge),
]


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_refused(kind: str) -> None:
    for field, spoil in MALFORMED:
        m = _good(kind)
        spoil(m)
        _refused(m, field)
    m = _good(kind, n=64 * 3)  # 3 codes: the last code byte has padding bits
    m.data = m.data[:-1] + bytes([m.data[-1] | 0x80])
    _refused(m, "data")
    good = _good(kind)
    _last_offset(good, 39)  # the last element of the last block is a fine offset
    assert decode_tensor(good).numel() == 1000
