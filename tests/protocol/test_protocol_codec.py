"""Tensor codec: exact round trips, the documented fp16 and int8 error bounds, and refusal of bad messages."""

from __future__ import annotations

import math

import pytest
import torch

from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import DTYPES, decode_tensor, encode_tensor
from tasklet.protocol.errors import BadMessage


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5, 2)])
def test_uncompressed_round_trip_is_exact(dtype_name: str, shape: tuple[int, ...]) -> None:
    t = _sample(DTYPES[dtype_name], shape)
    msg = pb.Tensor.FromString(encode_tensor("w", t).SerializeToString())
    out = decode_tensor(msg, expect_shape=shape, expect_dtype=t.dtype)
    assert out.dtype == t.dtype and tuple(out.shape) == shape
    assert torch.equal(out, t)
    out.add_(1) if out.dtype != torch.bool else out.logical_not_()  # decoded tensors are writable


def test_non_contiguous_input_is_encoded_in_logical_order() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(decode_tensor(encode_tensor("t", t)), t)


def test_fp16_error_bound() -> None:
    # Values spanning subnormal, normal and large magnitudes of half precision.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20_000, generator=gen, dtype=torch.float64) * torch.logspace(
        -9, 4.5, 20_000, dtype=torch.float64
    )
    x = x.clamp(-60000, 60000).to(torch.float32)
    msg = encode_tensor("x", x, "fp16")
    assert msg.compression == pb.FP16 and len(msg.data) == 2 * x.numel()
    out = decode_tensor(msg)
    assert out.dtype == torch.float32
    err = (out.double() - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2.0**-11, torch.full_like(err, 2.0**-25))
    assert bool((err <= bound).all())
    # and the bound is tight: some element uses at least half of it
    assert float((err / bound).max()) > 0.5


def test_fp16_refuses_values_beyond_half_range() -> None:
    with pytest.raises(ValueError, match="float16"):
        encode_tensor("big", torch.tensor([1.0, 70000.0]), "fp16")


def test_bfloat16_round_trips_exactly_through_fp16_in_half_normal_range() -> None:
    x = (torch.randn(1000) * 100).to(torch.bfloat16)
    x = x[x.float().abs() > 2.0**-14]
    assert torch.equal(decode_tensor(encode_tensor("b", x, "fp16")), x)


@pytest.mark.parametrize("block_size", [1, 7, 64, 1000])
def test_int8_error_bound_per_block(block_size: int) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5003, generator=gen) * torch.logspace(-3, 3, 5003)  # blocks of very different scales
    msg = encode_tensor("g", x, "int8", block_size=block_size)
    n_blocks = math.ceil(x.numel() / block_size)
    assert len(msg.data) == x.numel() and len(msg.scales) == 4 * n_blocks and msg.block_size == block_size
    out = decode_tensor(msg)
    padded = torch.zeros(n_blocks * block_size)
    padded[: x.numel()] = x
    absmax = padded.view(n_blocks, block_size).abs().amax(dim=1)
    per_elem_absmax = absmax.repeat_interleave(block_size)[: x.numel()].double()
    bound = per_elem_absmax / 254 + per_elem_absmax * 2.0**-22  # absmax/127/2 plus float32 rounding
    err = (out.double() - x.double()).abs()
    assert bool((err <= bound).all())
    if block_size > 1:
        assert float((err / (per_elem_absmax / 254)).max()) > 0.5  # the bound is not vacuous


def test_int8_keeps_zero_blocks_and_dtype() -> None:
    x = torch.zeros(130, dtype=torch.float64)
    x[100] = -3.5
    out = decode_tensor(encode_tensor("z", x, "int8", block_size=64))
    assert out.dtype == torch.float64
    assert torch.equal(out[:64], torch.zeros(64, dtype=torch.float64))
    assert float(out[100]) == pytest.approx(-3.5, rel=1e-6)


def test_encoder_refuses_what_it_cannot_represent() -> None:
    with pytest.raises(ValueError, match="finite"):
        encode_tensor("n", torch.tensor([1.0, float("nan")]), "int8")
    with pytest.raises(ValueError, match="floating"):
        encode_tensor("i", torch.arange(4), "fp16")
    with pytest.raises(ValueError, match="compression"):
        encode_tensor("x", torch.ones(2), "zstd")
    with pytest.raises(ValueError, match="block_size"):
        encode_tensor("x", torch.ones(2), "int8", block_size=0)
    with pytest.raises(ValueError, match="not supported"):
        encode_tensor("c", torch.ones(2, dtype=torch.complex64))


def _good() -> pb.Tensor:
    return encode_tensor("act", torch.ones(2, 3))


def _refused(msg: pb.Tensor, field: str, match: str, **kwargs: object) -> None:
    with pytest.raises(BadMessage, match=match) as info:
        decode_tensor(msg, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == f"tensor['{msg.name}'].{field}"
    assert "\n" not in str(info.value)


def test_decoder_refuses_malformed_messages() -> None:
    msg = _good()
    msg.dtype = "float128"
    _refused(msg, "dtype", "unknown dtype")
    _refused(_good(), "dtype", "expected float16, got float32", expect_dtype=torch.float16)
    _refused(_good(), "shape", r"expected \[2, 4\], got \[2, 3\]", expect_shape=(2, 4))
    _refused(_good(), "shape", r"expected \[\*, 3, 1\]", expect_shape=(None, 3, 1))
    assert decode_tensor(_good(), expect_shape=(None, 3)).shape == (2, 3)
    _refused(_good(), "shape", "more than the limit 5", max_elements=5)
    msg = _good()
    msg.shape[:] = [2, -3]
    _refused(msg, "shape", "negative")
    msg = _good()
    msg.shape[:] = [1] * 40
    _refused(msg, "shape", "dimensions")
    msg = _good()
    msg.data = msg.data[:-1]
    _refused(msg, "data", "23 bytes, but shape")
    msg = _good()
    msg.shape[:] = [1 << 40, 1 << 40]  # a huge claim is refused by the size check, nothing is allocated
    _refused(msg, "data", "bytes, but shape")
    msg = _good()
    msg.compression = 9  # an enum value this peer does not know
    _refused(msg, "compression", "unknown compression 9")


def test_decoder_refuses_bad_compression_parameters() -> None:
    msg = encode_tensor("q", torch.randn(100), "int8", block_size=32)
    msg.block_size = 0
    _refused(msg, "block_size", "not in")
    msg = encode_tensor("q", torch.randn(100), "int8", block_size=32)
    msg.scales = msg.scales[:-4]
    _refused(msg, "scales", "blocks of 32")
    msg = encode_tensor("q", torch.randn(100), "int8", block_size=32)
    msg.scales = torch.tensor([1.0, float("inf"), 1.0, 1.0]).numpy().tobytes()
    _refused(msg, "scales", "finite")
    msg = encode_tensor("q", torch.randn(100), "int8", block_size=32)
    msg.scales = torch.tensor([1.0, -1.0, 1.0, 1.0]).numpy().tobytes()
    _refused(msg, "scales", "non-negative")
    msg = encode_tensor("ids", torch.arange(6, dtype=torch.int16))
    msg.compression = pb.FP16
    _refused(msg, "compression", "FP16 compression of a int16")
    msg = encode_tensor("h", torch.randn(6), "fp16")
    msg.data = msg.data + b"\0\0"
    _refused(msg, "data", "as FP16")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_decoder_refuses_non_finite_values_unless_allowed(bad: float, compression: str) -> None:
    x = torch.randn(50)
    x[17] = bad
    msg = encode_tensor("grad", x, compression)
    _refused(msg, "data", "1 of 50 values are NaN or inf")
    out = decode_tensor(msg, allow_nonfinite=True)
    assert not bool(torch.isfinite(out[17]))


def test_finite_values_whose_sum_overflows_are_accepted() -> None:
    # The fast finiteness check sums the tensor; an overflowing sum of finite values must not be refused.
    x = torch.full((8,), 3e38, dtype=torch.float32)
    assert torch.equal(decode_tensor(encode_tensor("big", x)), x)
    h = torch.full((100,), 60000.0, dtype=torch.float16)
    assert torch.equal(decode_tensor(encode_tensor("bigh", h)), h)


def test_encode_in_place_into_an_envelope() -> None:
    env = pb.Envelope()
    t = torch.randn(4, 5)
    msg = encode_tensor("a", t, "fp16", out=env.tensors.add())
    assert msg is env.tensors[0]
    encode_tensor("a", t, out=msg)  # refilling clears the previous encoding (compression, shape, ...)
    assert msg.compression == pb.NONE and list(msg.shape) == [4, 5]
    assert torch.equal(decode_tensor(env.tensors[0]), t)
