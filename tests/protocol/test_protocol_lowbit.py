"""Low-bit codecs (protocol/lowbit.py): error bounds, unbiased stochastic rounding, top-k with error feedback,
and the refusal of every malformed message through the wire codec."""

from __future__ import annotations

import math

import pytest
import torch

from tasklet.protocol import lowbit
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import COMPRESSIONS, decode_tensor, encode_tensor
from tasklet.protocol.errors import BadMessage


def _blocks_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1)
    n_blocks = math.ceil(flat.numel() / block)
    padded = torch.zeros(n_blocks * block)
    padded[: flat.numel()] = flat.abs()
    return padded.view(n_blocks, block).amax(dim=1).repeat_interleave(block)[: flat.numel()]


@pytest.mark.parametrize("kind", ["int4", "int2"])
@pytest.mark.parametrize("block", [1, 7, 64, 128])
def test_quantisation_error_is_below_one_step_of_its_block(kind: str, block: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 77) * torch.logspace(-3, 3, 77)  # blocks of very different scales
    y = decode_tensor(encode_tensor("h", x, kind, block_size=block))
    step = _blocks_absmax(x, block) / lowbit.LEVELS[kind]
    err = (x.reshape(-1) - y.reshape(-1)).abs()
    assert bool((err <= step * (1 + 1e-6)).all()), float((err / step).max())
    assert y.shape == x.shape and y.dtype == x.dtype


def test_zero_stays_zero_and_extremes_are_exact() -> None:
    x = torch.tensor([0.0, 3.0, -3.0, 0.0, 1.5])
    for kind in ("int4", "int2"):
        y = decode_tensor(encode_tensor("z", x, kind, block_size=5))
        assert y[0] == 0 and y[3] == 0 and y[1] == 3.0 and y[2] == -3.0
    assert bool((decode_tensor(encode_tensor("z", torch.zeros(10), "int2")) == 0).all())


@pytest.mark.parametrize("kind", ["int4", "int2"])
def test_stochastic_rounding_is_unbiased(kind: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(256)
    x[0] = 4.0  # pins the block's scale so every round uses the same grid
    rounds = 2000
    acc = torch.zeros_like(x)
    for seed in range(rounds):
        acc += decode_tensor(encode_tensor("g", x, kind, block_size=256) if seed == 0 else _enc(x, kind, seed))
    mean = acc / rounds
    step = 4.0 / lowbit.LEVELS[kind]
    # each decode is x plus a zero-mean error bounded by one step: the mean's error shrinks like step / sqrt(n)
    tol = 5 * step / math.sqrt(rounds)
    assert float((mean - x).abs().max()) < tol
    # and deterministic rounding would not pass: its error for most entries stays a fixed fraction of a step
    assert float((torch.round(x / step) * step - x).abs().mean()) > 4 * tol / 5


def _enc(x: torch.Tensor, kind: str, seed: int) -> pb.Tensor:
    msg = pb.Tensor(name="g", dtype="float32", shape=list(x.shape))
    return lowbit.encode_into(msg, "g", x, kind, 256, seed=seed)


def test_seeded_rounding_is_deterministic() -> None:
    x = torch.randn(1000)
    a = _enc(x, "int2", 7).SerializeToString()
    assert a == _enc(x, "int2", 7).SerializeToString()
    assert a != _enc(x, "int2", 8).SerializeToString()
    # without a seed the rounding is a function of the tensor's bytes
    assert encode_tensor("g", x, "int4").SerializeToString() == encode_tensor("g", x, "int4").SerializeToString()


def test_bytes_per_element_match_the_wire() -> None:
    x = torch.randn(64 * 1000)
    for kind in ("int4", "int2", "topk", "int8", "fp16", "none"):
        msg = encode_tensor("a", x, kind, block_size=64)
        got = (len(msg.data) + len(msg.scales)) / x.numel()
        assert got == pytest.approx(lowbit.bytes_per_element(kind, 64)), kind
    assert 4.0 / lowbit.bytes_per_element("int2", 64) >= 8.0  # at least 8x fewer bytes than fp32, scales included
    assert 4.0 / lowbit.bytes_per_element("topk", 64) >= 8.0
    assert 4.0 / lowbit.bytes_per_element("int4", 256) > 7.7


def test_registered_names() -> None:
    for name, code in lowbit.WIRE_IDS.items():
        assert COMPRESSIONS[name] == code
    assert len(set(COMPRESSIONS.values())) == len(COMPRESSIONS)


def test_nonfinite_and_integer_inputs_are_refused_by_the_encoder() -> None:
    for kind in ("int4", "int2", "topk"):
        with pytest.raises(ValueError):
            encode_tensor("n", torch.tensor([1.0, float("nan")]), kind)
        with pytest.raises(ValueError):
            encode_tensor("n", torch.tensor([1, 2]), kind)


def test_bfloat16_and_empty_round_trip() -> None:
    x = torch.randn(33).to(torch.bfloat16)
    y = decode_tensor(encode_tensor("b", x, "int4", block_size=8))
    assert y.dtype == torch.bfloat16
    for kind in ("int4", "int2", "topk"):
        assert decode_tensor(encode_tensor("e", torch.zeros(0, 3), kind)).shape == (0, 3)


# ---------------------------------------------------------------------------------------------- top-k
def test_topk_keeps_the_largest_entries_exactly() -> None:
    torch.manual_seed(2)
    x = torch.randn(1000)
    y = decode_tensor(encode_tensor("t", x, "topk", block_size=50))
    kept = y != 0
    assert int(kept.sum()) == 20
    assert torch.equal(y[kept], x[kept])
    assert float(x[~kept].abs().max()) <= float(x[kept].abs().min())


@pytest.mark.parametrize(("n", "k", "nonzeros"), [(1000, 20, 20), (1000, 20, 7), (1000, 20, 0), (30, 30, 30),
                                                  (64, 9, 9)])
def test_topk_of_a_tensor_sparser_than_k_sends_it_exactly(n: int, k: int, nonzeros: int) -> None:
    """An all-gather's summed shard holds at most k non-zeros: all of them go, zeros fill the count."""
    torch.manual_seed(n + nonzeros)
    x = torch.zeros(n)
    x[torch.randperm(n)[:nonzeros]] = torch.randn(nonzeros)
    idx, vals = lowbit.topk_encode(x, k)
    assert idx.numel() == k and bool((idx[1:] > idx[:-1]).all())
    assert torch.equal(lowbit.topk_decode(idx, vals, n), x)
    msg = encode_tensor("s", x, "topk", block_size=n // k)  # keeps ceil(n / (n // k)) >= k entries
    assert torch.equal(decode_tensor(msg), x)


def _feedback(x: torch.Tensor, residual: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k with error feedback as a DiLoCo member runs it: (what the wire carries, the new residual)."""
    corrected = x + residual
    sent = decode_tensor(encode_tensor("w", corrected, "topk", block_size=block)).view_as(x)
    return sent, corrected - sent


def test_error_feedback_residual_carries_what_was_not_sent() -> None:
    torch.manual_seed(3)
    g = torch.randn(4, 64)
    sent, residual = _feedback(g, torch.zeros_like(g), 16)
    assert int((sent != 0).sum()) == 16
    assert torch.allclose(sent + residual, g)
    g2 = torch.randn(4, 64)
    sent2, residual2 = _feedback(g2, residual, 16)
    assert torch.allclose(sent2 + residual2, g2 + residual, atol=1e-6)


def test_error_feedback_sum_over_rounds_converges() -> None:
    """Sending a constant tensor through top-k + EF: the running mean of what was sent converges to it, while
    top-k alone keeps missing the same small entries forever."""
    torch.manual_seed(4)
    g = torch.randn(512)
    residual, total = torch.zeros_like(g), torch.zeros_like(g)
    errs = []
    for n in range(1, 401):
        sent, residual = _feedback(g, residual, 32)
        total += sent
        errs.append(float((total / n - g).abs().max()))
    assert errs[-1] < 0.02 * float(g.abs().max())
    assert errs[-1] < errs[9] / 10
    alone = decode_tensor(encode_tensor("p", g, "topk", block_size=32))
    assert float((alone - g).abs().max()) > 10 * errs[-1]


# ------------------------------------------------------------------------------------ malformed input
def _good(kind: str, n: int = 100, block: int = 32) -> pb.Tensor:
    torch.manual_seed(5)
    return encode_tensor("m", torch.randn(n), kind, block_size=block)


def _refused(msg: pb.Tensor, field: str) -> None:
    raw = msg.SerializeToString()  # what a peer would send
    with pytest.raises(BadMessage) as exc:
        decode_tensor(pb.Tensor.FromString(raw))
    assert exc.value.field.endswith(field), str(exc.value)


@pytest.mark.parametrize("kind", ["int4", "int2"])
def test_quantised_malformed_refused(kind: str) -> None:
    m = _good(kind)
    m.data = m.data[:-1]
    _refused(m, "data")
    m = _good(kind)
    m.data = m.data + b"\x00"
    _refused(m, "data")
    m = _good(kind)
    m.scales = m.scales[:-4]  # a block short
    _refused(m, "scales")
    m = _good(kind)
    m.scales = m.scales + b"\x00\x00\x80\x3f"  # a block too many
    _refused(m, "scales")
    for bad in (float("nan"), float("inf"), -1.0):
        m = _good(kind)
        m.scales = torch.tensor([bad] + [1.0] * 3).numpy().tobytes()
        _refused(m, "scales")
    for bs in (0, -3, lowbit.MAX_BLOCK_SIZE + 1):
        m = _good(kind)
        m.block_size = bs
        _refused(m, "block_size")
    m = _good(kind)
    m.block_size = 64  # valid size, but then 2 blocks, not 4: the scales no longer match
    _refused(m, "scales")
    m = _good(kind)
    m.data = b"\xff" + m.data[1:]  # nibble 15 / two-bit code 3 are never written
    _refused(m, "data")
    m = _good(kind, n=99)  # the last byte has padding bits
    m.data = m.data[:-1] + bytes([m.data[-1] | 0x80])
    _refused(m, "data")
    m = _good(kind)
    m.dtype = "int32"
    _refused(m, "compression")
    if kind == "int4":
        m = _good(kind)
        m.scales = torch.full((4,), 3e38).numpy().tobytes()  # finite scales, but -7 x scale overflows to -inf
        m.data = bytes([0] * len(m.data))
        _refused(m, "data")


def test_topk_malformed_refused() -> None:
    def parts(m: pb.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = len(m.data) // 8
        idx = torch.frombuffer(bytearray(m.data[: 4 * k]), dtype=torch.int32).clone()
        return idx, torch.frombuffer(bytearray(m.data[4 * k:]), dtype=torch.float32).clone()

    def with_parts(idx: torch.Tensor, vals: torch.Tensor) -> pb.Tensor:
        m = _good("topk")
        m.data = idx.numpy().tobytes() + vals.numpy().tobytes()
        return m

    m = _good("topk")
    m.data = m.data[:-3]
    _refused(m, "data")
    idx, vals = parts(_good("topk"))
    for bad_index in (-1, 100, 2**31 - 1):
        i2 = idx.clone()
        i2[-1] = bad_index
        _refused(with_parts(i2, vals), "data")
    i2 = idx.clone()
    i2[1] = i2[0]  # duplicate
    _refused(with_parts(i2, vals), "data")
    _refused(with_parts(idx.flip(0), vals), "data")  # not increasing
    for bad in (float("nan"), float("inf")):
        v2 = vals.clone()
        v2[0] = bad
        _refused(with_parts(idx, v2), "data")
    many = torch.arange(101, dtype=torch.int32)
    _refused(with_parts(many, torch.ones(101)), "data")  # more entries than elements
    m = _good("topk")
    m.scales = b"\x00" * 4
    _refused(m, "scales")
    m = _good("topk")
    m.block_size = 0
    _refused(m, "block_size")
    m = _good("topk")
    m.data = b""  # zero entries for a non-empty shape: the encoder keeps ceil(numel / block_size), never none
    _refused(m, "data")
    m = _good("topk")
    del m.shape[:]
    m.shape.append(0)
    m.data = b""  # an empty tensor keeps nothing
    assert decode_tensor(m).numel() == 0


def test_unknown_compression_id_still_refused() -> None:
    m = _good("int4")
    m.compression = 99  # type: ignore[assignment]
    _refused(m, "compression")


def test_received_payload_buffer_is_decoded_without_reading_data() -> None:
    """A received WireTensor keeps its bytes in ``payload`` (a buffer); the low-bit decoder reads that."""

    class Received:
        def __init__(self, msg: pb.Tensor) -> None:
            self.name, self.dtype, self.shape = msg.name, msg.dtype, list(msg.shape)
            self.compression, self.scales, self.block_size = msg.compression, msg.scales, msg.block_size
            self.payload = memoryview(bytearray(msg.data))

        @property
        def data(self) -> bytes:
            raise AssertionError("the payload buffer should be used")

    x = torch.randn(4, 50)
    for kind in ("int4", "int2", "topk", "topk2", "topk4"):  # topk2 / topk4: protocol/sparse.py
        msg = encode_tensor("r", x, kind, block_size=16)
        assert torch.equal(decode_tensor(Received(msg)), decode_tensor(msg))  # type: ignore[arg-type]
