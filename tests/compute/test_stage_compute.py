"""StageCompute: an exactly-once gradient sum, bad input, state hand-over, reduced precision, devices."""

from __future__ import annotations

import blake3
import pytest
import torch

from tasklet.peer.compute import device_choice as devices
from tasklet.peer.compute.data import Corpus, microbatch
from tasklet.peer.compute.device_choice import DeviceError, check_precision, resolve_device, resolve_dtype
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.compute.stage import (
    GradientError,
    OptimConfig,
    StageCompute,
    StageComputeConfig,
    StageConfigError,
    UnknownMicrobatchError,
    shard_bounds,
)

MODEL = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=32, seed=1)
MB, SEQ = 2, 32


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.from_stdlib(max_bytes=1 << 18)


def make(first: int, last: int, **kw: object) -> StageCompute:
    return StageCompute(StageComputeConfig(MODEL, first, last, **kw))  # type: ignore[arg-type]


def batch(corpus: Corpus, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    return microbatch(corpus, 0, step, mb, MB, SEQ)


def run_mb(s0: StageCompute, s1: StageCompute, corpus: Corpus, step: int, mb: int) -> float:
    x, y = batch(corpus, step, mb)
    loss, grad = s1.forward_loss(mb, s0.forward(mb, x), y)
    assert s0.backward(mb, grad) is None
    return loss


def test_duplicate_microbatch_is_accumulated_once(corpus: Corpus) -> None:
    s0, s1 = make(0, 2), make(2, 4)
    run_mb(s0, s1, corpus, 0, 0)
    assert s0.accumulated() == {0} and s1.accumulated() == {0}
    once = s0.accumulated_grad()
    assert float(once.abs().sum()) > 0
    run_mb(s0, s1, corpus, 0, 0)  # the same micro-batch re-done (its lease was thought lost)
    assert torch.equal(s0.accumulated_grad(), once), "a duplicate must not change the sum"
    assert s0.accumulated() == {0}
    run_mb(s0, s1, corpus, 0, 1)
    assert s0.accumulated() == {0, 1}
    assert not torch.equal(s0.accumulated_grad(), once)


def test_backward_needs_its_forward_and_reset_forgets_the_step(corpus: Corpus) -> None:
    s0, s1 = make(0, 2), make(2, 4)
    with pytest.raises(UnknownMicrobatchError, match="3"):
        s0.backward(3, torch.zeros(MB, SEQ, 32))
    run_mb(s0, s1, corpus, 0, 4)
    summed = s0.accumulated_grad()
    with pytest.raises(UnknownMicrobatchError, match="4"):  # its stash was used up by the first backward
        s0.backward(4, torch.zeros(MB, SEQ, 32))
    assert torch.equal(s0.accumulated_grad(), summed)
    x, _ = batch(corpus, 0, 5)
    s0.forward(5, x)
    s0.reset_step()  # the pipeline was dropped from the step
    assert s0.accumulated() == set() and float(s0.accumulated_grad().abs().sum()) == 0
    with pytest.raises(UnknownMicrobatchError, match="5"):
        s0.backward(5, torch.zeros(MB, SEQ, 32))


def test_interleaved_micro_batches_give_the_same_gradients(corpus: Corpus) -> None:
    """1F1B interleaves forwards and backwards; each micro-batch's gradient must not depend on that."""
    seq0, seq1 = make(0, 2), make(2, 4)
    for mb in (0, 1):
        run_mb(seq0, seq1, corpus, 0, mb)
    il0, il1 = make(0, 2), make(2, 4)
    (x0, y0), (x1, y1) = batch(corpus, 0, 0), batch(corpus, 0, 1)
    h0, h1 = il0.forward(0, x0), il0.forward(1, x1)
    _, g1 = il1.forward_loss(1, h1, y1)
    _, g0 = il1.forward_loss(0, h0, y0)
    il0.backward(1, g1)
    il0.backward(0, g0)
    for a, b in ((seq0, il0), (seq1, il1)):
        assert torch.equal(a.accumulated_grad(), b.accumulated_grad())


def test_bad_gradients_are_refused_and_state_is_untouched(corpus: Corpus) -> None:
    s0, s1 = make(0, 2), make(2, 4)
    run_mb(s0, s1, corpus, 0, 0)
    before = s1.flat_params()
    acc = s1.accumulated_grad()
    good = acc.clone()
    nan = good.clone()
    nan[7] = float("nan")
    cases = [(good[:-1], "flat vector"), (good.view(-1, 1)[:10], "flat vector"), (good.double(), "float32"),
             (nan, "NaN"), (torch.full_like(good, float("inf")), "NaN or inf")]
    for bad, msg in cases:
        with pytest.raises(GradientError, match=msg):
            s1.apply_update(bad, 1)
    with pytest.raises(GradientError, match="n_microbatches"):
        s1.apply_update(good, 0)
    assert torch.equal(s1.flat_params(), before) and s1.step == 0
    assert torch.equal(s1.accumulated_grad(), acc) and s1.accumulated() == {0}
    # wrong-shaped activation gradient: refused, and the stash survives for a correct retry
    x, _ = batch(corpus, 0, 1)
    s0.forward(1, x)
    with pytest.raises(ValueError, match="shape"):
        s0.backward(1, torch.zeros(MB, SEQ, 16))
    assert s0.backward(1, torch.zeros(MB, SEQ, 32)) is None
    with pytest.raises(RuntimeError, match="not the last"):
        s0.forward_loss(2, x, x)
    with pytest.raises(ValueError, match="int64 token ids"):
        s0.forward(2, x.float())


def test_update_clears_the_step_and_replicas_stay_identical(corpus: Corpus) -> None:
    a, b = make(0, 4), make(0, 4)
    for rep, mb in ((a, 0), (b, 1)):
        x, y = batch(corpus, 0, mb)
        rep.forward_loss(mb, x, y)
    summed = a.accumulated_grad() + b.accumulated_grad()
    before = a.flat_params()
    for rep in (a, b):
        rep.apply_update(summed, 2)
        assert rep.step == 1 and rep.accumulated() == set() and float(rep.accumulated_grad().abs().sum()) == 0
    assert torch.equal(a.flat_params(), b.flat_params())
    assert not torch.equal(a.flat_params(), before)
    # a micro-batch id accumulated last step is accumulated again in the new step
    x, y = batch(corpus, 1, 0)
    a.forward_loss(0, x, y)
    assert a.accumulated() == {0} and float(a.accumulated_grad().abs().sum()) > 0


def test_grad_clip_needs_the_global_norm_on_a_partial_stage(corpus: Corpus) -> None:
    s0, s1 = make(0, 2, optim=OptimConfig(grad_clip=1.0)), make(2, 4, optim=OptimConfig(grad_clip=1.0))
    run_mb(s0, s1, corpus, 0, 0)
    with pytest.raises(GradientError, match="global_grad_norm"):
        s0.apply_update(s0.accumulated_grad(), 1)
    s0.apply_update(s0.accumulated_grad(), 1, global_grad_norm=2.0)
    assert s0.step == 1


def train_steps(stage: StageCompute, corpus: Corpus, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(corpus, step, 0)
        losses.append(stage.forward_loss(0, x, y)[0])
        stage.apply_update(stage.accumulated_grad(), 1)
    return losses


def test_state_dict_hand_over_resumes_bit_identically(corpus: Corpus) -> None:
    optim = OptimConfig(lr=3e-3)
    original = make(0, 4, optim=optim)
    train_steps(original, corpus, range(2))
    state = original.state_dict()
    assert state["step"] == 2 and state["params"].dtype == torch.float32 and state["adam_step"] == 2
    joiner = make(0, 4, optim=optim)
    assert not torch.equal(joiner.flat_params(), original.flat_params())
    joiner.load_state_dict(state)
    assert joiner.step == 2
    train_steps(original, corpus, range(2, 4))
    train_steps(joiner, corpus, range(2, 4))
    assert torch.equal(joiner.flat_params(), original.flat_params())
    other_layers = make(0, 2)
    with pytest.raises(StageConfigError, match="layers"):
        other_layers.load_state_dict(state)
    broken = dict(state, params=state["params"][:-3])
    with pytest.raises(GradientError, match="params"):
        joiner.load_state_dict(broken)
    with pytest.raises(StageConfigError, match="model config"):
        joiner.load_state_dict(dict(state, model={**MODEL.to_dict(), "seed": 9}))


def test_the_parameters_digest_is_cached_until_the_parameters_change(corpus: Corpus) -> None:
    def fresh(c: StageCompute) -> str:  # the digest written out: BLAKE3 of the prefixed label and the bytes
        label = b"tasklet/params"
        return blake3.blake3(len(label).to_bytes(2, "big") + label + c.flat_params().numpy().tobytes()).hexdigest()[:32]

    c = make(0, 4)
    assert c.known_digest is None, "never computed unasked (a Status reply reads it)"
    first = c.params_digest()
    assert first == fresh(c) and c.known_digest == first
    train_steps(c, corpus, range(1))  # apply_update
    assert c.known_digest is None and c.params_digest() == fresh(c) != first
    c.set_params(c.flat_params() * 2)
    assert c.known_digest is None and c.params_digest() == fresh(c)
    c.load_state_dict(make(0, 4).state_dict())
    assert c.known_digest is None and c.params_digest() == first


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_keeps_an_fp32_master(corpus: Corpus, precision: str) -> None:
    """The CPU runs bf16/fp16 too (slowly), which exercises the master-copy and loss-scale logic here."""
    ref0, ref1 = make(0, 2), make(2, 4)
    low0, low1 = make(0, 2, precision=precision), make(2, 4, precision=precision)
    assert torch.equal(low0.flat_params(), ref0.flat_params()), "same fp32 master at start"
    dtype = resolve_dtype(precision)
    x, y = batch(corpus, 0, 0)
    h = low0.forward(0, x)
    assert h.dtype == dtype and h.device.type == "cpu"
    loss_low, grad = low1.forward_loss(0, h, y)
    assert grad is not None and grad.dtype == dtype
    low0.backward(0, grad)
    loss_ref = run_mb(ref0, ref1, corpus, 0, 0)
    assert loss_low == pytest.approx(loss_ref, rel=2e-2)
    for low, ref in ((low0, ref0), (low1, ref1)):
        g_low, g_ref = low.accumulated_grad(), ref.accumulated_grad()
        assert g_low.dtype == torch.float32
        # the loss scale (1024 for fp16) was divided back out: same gradient up to half-precision error
        assert float((g_low - g_ref).norm() / g_ref.norm()) < 0.1
        low.apply_update(g_low, 1)
        master = low.flat_params()
        assert master.dtype == torch.float32
        compute = torch.cat([p.detach().reshape(-1) for p in low.module.parameters()])
        assert compute.dtype == dtype
        assert torch.equal(compute, master.to(dtype)), "compute weights are the master, rounded"


def test_shard_bounds_cover_evenly() -> None:
    for numel, n in [(10, 3), (7, 7), (5, 8), (0, 2), (1_000_003, 4)]:
        bounds = shard_bounds(numel, n)
        assert len(bounds) == n and bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        sizes = [e - s for s, e in bounds]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="n_shards"):
        shard_bounds(10, 0)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(StageConfigError, match="optim.lr"):
        make(0, 4, optim=OptimConfig(lr=-1.0))
    with pytest.raises(StageConfigError, match="optim.betas"):
        make(0, 4, optim=OptimConfig(betas=(0.9, 1.0)))
    with pytest.raises(DeviceError, match="--precision"):
        make(0, 4, precision="fp8")
    with pytest.raises(StageConfigError, match="loss_scale"):
        make(0, 4, precision="fp16", loss_scale=0.0)


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="--device"):
        resolve_device("tpu")
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        resolve_device("cuda")
    # a mocked GPU (the only mock allowed): auto picks it, and an out-of-range index is refused
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices.torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("CUDA:0") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="only 1"):
        resolve_device("cuda:1")
    monkeypatch.setattr(devices.torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(devices.torch.cuda, "get_device_name", lambda _d=None: "Old GPU")
    with pytest.raises(DeviceError, match="bf16"):
        check_precision("bf16", torch.device("cuda", 0))
    assert devices.default_precision(torch.device("cuda", 0)) == "fp32"
    assert devices.default_precision(torch.device("cpu")) == "fp32"


def test_update_uses_the_mean_of_the_micro_batch_gradients(corpus: Corpus) -> None:
    """Adam's step direction is blind to the gradient's scale, so check the moments it stored instead."""
    optim = OptimConfig(betas=(0.9, 0.95))
    stage = make(0, 4, optim=optim)
    for mb in range(3):
        x, y = batch(corpus, 0, mb)
        stage.forward_loss(mb, x, y)
    summed = stage.accumulated_grad()
    stage.apply_update(summed, 3)
    state = stage.state_dict()
    mean = summed / 3
    torch.testing.assert_close(state["exp_avg"], (1 - 0.9) * mean, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(state["exp_avg_sq"], (1 - 0.95) * mean * mean, rtol=1e-5, atol=1e-16)


def test_a_digest_is_blake3_of_the_prefixed_label_and_the_bytes_and_differs_when_one_byte_does() -> None:
    """A large input hashed on threads gives what one thread gives over the same bytes; a moved byte another."""
    from tasklet.peer.compute.stage import bytes_digest

    data = bytearray(torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes())
    assert bytes_digest(memoryview(data), b"x") == blake3.blake3(b"\x00\x01x" + bytes(data)).hexdigest()
    assert bytes_digest(memoryview(data), b"xy") != bytes_digest(memoryview(data), b"x")
    before = bytes_digest(memoryview(data), b"x")
    data[(1 << 20) + 1] ^= 1
    assert bytes_digest(memoryview(data), b"x") != before


def test_a_digest_streamed_in_chunks_equals_the_whole_vectors() -> None:
    """A device stage's parameters are hashed a chunk at a time (peer.compute.stage.streamed_digest): the digest is
    the one of the whole vector, for chunks that divide it or not, and of its fp32 bytes whatever its dtype."""
    from tasklet.peer.compute.stage import bytes_digest, flat_digest, streamed_digest

    x = torch.randn(10_007, generator=torch.Generator().manual_seed(1))
    whole = bytes_digest(memoryview(x.numpy()).cast("B"), b"tasklet/params")
    for chunk_bytes in (4, 4 * 1_000, 4 * 10_007, 1 << 20, 6):
        assert streamed_digest(x, b"tasklet/params", chunk_bytes) == whole, chunk_bytes
    assert streamed_digest(x, b"tasklet/param", 4_000) != whole
    assert flat_digest(x) == whole[:32]
    half = x.to(torch.bfloat16)
    assert streamed_digest(half, b"tasklet/params", 4_000)[:32] == flat_digest(half) == flat_digest(half.float())
    assert streamed_digest(torch.empty(0), b"l") == bytes_digest(memoryview(b""), b"l")


def test_a_steps_sum_starts_from_nothing_though_the_last_steps_values_are_overwritten_not_zeroed(
        corpus: Corpus) -> None:
    """The ended step's sum is left in place and the next gradient copied over it: what a step sums is still
    exactly its own micro-batches, and a step that adds nothing reads as zeros."""
    a, b = make(0, 4), make(0, 4)
    x, y = batch(corpus, 0, 0)
    for stage in (a, b):
        stage.forward_loss(0, x, y)
        stage.forward_loss(1, *batch(corpus, 0, 1))
    a.apply_update(a.accumulated_view(), 2)
    b.apply_update(b.accumulated_grad(), 2)
    assert torch.equal(a.flat_params(), b.flat_params())
    assert torch.count_nonzero(a.accumulated_grad()) == 0, "nothing added since the step ended"
    fresh = make(0, 4)
    fresh.set_params(a.flat_params())
    for stage in (a, fresh):
        stage.forward_loss(2, *batch(corpus, 1, 2))
        stage.forward_loss(3, *batch(corpus, 1, 3))
    assert torch.equal(a.accumulated_grad(), fresh.accumulated_grad())
    b.forward_loss(2, *batch(corpus, 1, 2))  # b's stale sum was never read: overwritten by the copy
    b.forward_loss(3, *batch(corpus, 1, 3))
    assert torch.equal(b.accumulated_view(), fresh.accumulated_grad())


def test_a_one_micro_batch_step_applies_its_own_sum_in_place_of_a_copy_and_trains_the_same(corpus: Corpus) -> None:
    """Applying the stage's own sum of one micro-batch swaps it in as the optimizer's gradient (no copy): the
    parameters are bitwise those of applying a copy, step after step; a sum holding NaN is refused first."""
    a, b = make(0, 4), make(0, 4)
    for step in range(3):
        x, y = batch(corpus, step, 0)
        for stage in (a, b):
            stage.forward_loss(0, x, y)
        a.apply_update(a.accumulated_view(), 1)  # its own sum: swapped in
        b.apply_update(b.accumulated_grad(), 1)  # a copy: divided into the optimizer's buffer
        assert torch.equal(a.flat_params(), b.flat_params()), f"step {step}"
    a.forward_loss(0, *batch(corpus, 3, 0))
    a.accumulated_view()[5] = float("nan")
    before, state = a.flat_params(), a.state_dict()
    with pytest.raises(GradientError, match="NaN"):
        a.apply_update(a.accumulated_view(), 1)
    assert torch.equal(a.flat_params(), before) and a.step == 3
    assert torch.equal(a.state_dict()["exp_avg"], state["exp_avg"])
