"""Equivalence invariant, in process: pipeline (stages x replicas of StageCompute) == single-process training.

Four StageCompute objects stand in for the stage processes; activations and gradients are handed over by
function calls. Replica ``r`` of ``R`` takes micro-batches ``r, r + R, ...``; the replicas of a stage sum
their accumulated gradients in a fixed order (replica 0 first) and each applies the same update. The result
must match :func:`peer.compute.reference.train_reference` on the same batches: every parameter within 1e-5 relative,
and the same loss curve. Only float summation order differs between the two.
"""

from __future__ import annotations

import math

import pytest
import torch

from tasklet.peer.compute.data import Corpus, microbatch
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig, StageCompute, StageComputeConfig

SEED = 7
STEPS = 10
N_MICROBATCHES = 4
MICRO_BATCH = 2
MODEL = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=32, seed=3)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.from_stdlib(max_bytes=1 << 20)


def train_pipeline(
    model: ModelConfig, optim: OptimConfig, corpus: Corpus, splits: list[tuple[int, int]], n_replicas: int,
    steps: int = STEPS,
) -> tuple[list[list[StageCompute]], list[float]]:
    """Run ``steps`` steps of pipeline x data-parallel training in process; return the stages and losses."""
    stages = [[StageCompute(StageComputeConfig(model, a, b, optim)) for _ in range(n_replicas)]
              for a, b in splits]
    losses: list[float] = []
    for step in range(steps):
        mb_losses: dict[int, float] = {}
        for r in range(n_replicas):
            for mb in range(r, N_MICROBATCHES, n_replicas):
                inputs, targets = microbatch(corpus, SEED, step, mb, MICRO_BATCH, model.seq_len)
                h = inputs
                for s in range(len(splits) - 1):
                    h = stages[s][r].forward(mb, h)
                loss, grad = stages[-1][r].forward_loss(mb, h, targets)
                mb_losses[mb] = loss
                for s in range(len(splits) - 2, -1, -1):
                    grad = stages[s][r].backward(mb, grad)
                assert grad is None  # the first stage has no input gradient
                for s in range(len(splits)):
                    assert mb in stages[s][r].accumulated()
        summed = []
        for replicas in stages:
            total = replicas[0].accumulated_grad()
            for rep in replicas[1:]:
                total = total + rep.accumulated_grad()
            summed.append(total)
        norm = None
        if optim.grad_clip is not None:
            sq = [reps[0].grad_sq_norm(g, N_MICROBATCHES) for reps, g in zip(stages, summed, strict=True)]
            norm = math.sqrt(sum(sq))
        for replicas, g in zip(stages, summed, strict=True):
            for rep in replicas:
                rep.apply_update(g, N_MICROBATCHES, global_grad_norm=norm)
        losses.append(sum(mb_losses[m] for m in range(N_MICROBATCHES)) / N_MICROBATCHES)
    return stages, losses


def assert_equivalent(stages: list[list[StageCompute]], losses: list[float],
                      reference: dict[str, torch.Tensor], ref_losses: list[float]) -> None:
    """Per parameter tensor: ``max|a - b| <= 1e-5 * max|b|``, replicas bit-identical, losses within 1e-5.

    Relative to the tensor's scale rather than elementwise: an entry whose summed gradient nearly cancels sits
    near 0, and Adam normalises its rounding noise up to a few ulps of the *tensor's* scale.
    """
    seen: set[str] = set()
    for replicas in stages:
        first = replicas[0].named_params()
        for rep in replicas[1:]:  # replicas of a stage stay bit-identical: same summed gradient, same update
            other = rep.named_params()
            assert all(torch.equal(first[n], other[n]) for n in first)
        for name, value in first.items():
            ref = reference[name]
            assert value.shape == ref.shape, name
            err = float((value - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
            assert err < 1e-5, f"{name}: max difference {err:.2e} of the tensor's largest entry"
            seen.add(name)
    assert seen == set(reference), "the stages together must hold exactly the full model's parameters"
    assert len(losses) == len(ref_losses) == STEPS
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: loss {a} vs reference {b}"
    assert ref_losses[-1] < ref_losses[0], "training should reduce the loss"
    # parameters must actually have moved, or equality would be trivial
    initial = StageCompute(StageComputeConfig(MODEL, 0, MODEL.n_layers, OptimConfig())).named_params()
    assert max(float((reference[n] - initial[n]).abs().max()) for n in initial) > 1e-3


@pytest.mark.parametrize(
    ("splits", "eps"),
    # eps=1e-3 is comparable to sqrt(v): the update then depends on the gradient's scale (plain Adam is
    # scale-invariant), so a wrong 1/n or a replica counted twice shows up as a difference.
    [([(0, 2), (2, 4)], 1e-8), ([(0, 1), (1, 4)], 1e-8), ([(0, 2), (2, 4)], 1e-3)],
    ids=["2+2 layers", "1+3 layers", "2+2 layers, scale-sensitive eps"],
)
def test_two_stages_two_replicas_match_single_process(
    corpus: Corpus, splits: list[tuple[int, int]], eps: float
) -> None:
    optim = OptimConfig(lr=3e-3, weight_decay=0.1, eps=eps)
    reference, ref_losses = train_reference(MODEL, optim, corpus, SEED, STEPS, N_MICROBATCHES, MICRO_BATCH)
    stages, losses = train_pipeline(MODEL, optim, corpus, splits, n_replicas=2)
    assert_equivalent(stages, losses, reference, ref_losses)


def test_equivalence_with_global_grad_clipping(corpus: Corpus) -> None:
    """A clip small enough to be active every step: clipping must use the norm over *all* stages."""
    optim = OptimConfig(lr=3e-3, grad_clip=0.05)
    reference, ref_losses = train_reference(MODEL, optim, corpus, SEED, STEPS, N_MICROBATCHES, MICRO_BATCH)
    stages, losses = train_pipeline(MODEL, optim, corpus, [(0, 2), (2, 4)], n_replicas=2)
    assert_equivalent(stages, losses, reference, ref_losses)
