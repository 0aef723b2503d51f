"""The loopback fault runs' common ground: one small run (spec, stages, emulated compute) and its comparison with
single-process training, shared by the fault-tolerance, spot-check, poisoning and roll-back tests.

Real worker processes (``tasklet.peer.emulation.local.LocalSwarm``) train ``SPEC``; a run whose every micro-batch
counted exactly once ends with the parameters of plain single-process training on the same data, up to float
summation order (1e-5 of each tensor's scale): a micro-batch lost or counted twice shows far above that.
"""

from __future__ import annotations

import pytest
import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import ModelConfig, unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig
from tasklet.peer.emulation.local import LinkModel, RunResult
from tasklet.peer.runtime.spec import RunSpec

Reference = tuple[dict[str, torch.Tensor], list[float]]  # single-process parameters, and the loss of each step

STEPS = 5
SPEC = RunSpec(run_id="faults", model=ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=32, seed=2),
               optim=OptimConfig(lr=3e-3, eps=1e-3), seed=4, micro_batch=2, n_microbatches=8)
STAGES = [(0, 2), (2, 4)]
FULL = (STAGES, [[0, 1], [2, 3]])
# ~2.4 MFLOP per stage forward at 1e-4 TFLOP/s: ~25 ms forward, ~50 ms backward
SLOW = LinkModel(tflops=[1e-4] * 8)
TOLERANCE = 1e-5  # of each tensor's scale


def flops(a: int, b: int) -> float:
    """The emulated forward cost of layers ``a``..``b`` (every stage alike)."""
    return 2.4e6


def reference_run(steps: int, spec: RunSpec = SPEC) -> Reference:
    """``steps`` of single-process training of ``spec`` on its corpus."""
    torch.set_num_threads(1)
    corpus = Corpus.load(spec.corpus)
    return train_reference(spec.model, spec.optim, corpus, spec.seed, steps, spec.n_microbatches, spec.micro_batch)


def _stage_states(result: RunResult, steps: int) -> dict[int, dict]:
    """Stage -> its saved state; every replica of a stage must be equal and at step ``steps``."""
    by_stage: dict[int, dict] = {}
    for (stage, _), state in result.states.items():
        assert state["step"] == steps
        if stage in by_stage:
            assert torch.equal(by_stage[stage]["params"], state["params"]), "replicas of a stage differ"
        by_stage[stage] = state
    assert sorted(by_stage) == list(range(len(STAGES)))
    return by_stage


def _errors(result: RunResult, reference: Reference, steps: int) -> dict[str, float]:
    """Parameter name -> its error relative to the tensor's scale."""
    by_stage, ref_params = _stage_states(result, steps), reference[0]
    errors = {}
    for s, (a, b) in enumerate(STAGES):
        for name, got in unflatten_stage(SPEC.model, a, b, by_stage[s]["params"]).items():
            ref = ref_params[name]
            errors[name] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
    return errors


def worst_error(result: RunResult, reference: Reference, steps: int) -> float:
    """The largest error, relative to each tensor's scale, of the saved parameters against the reference; every
    stage's replicas must be equal and at step ``steps``."""
    return max(_errors(result, reference, steps).values())


def assert_matches_reference(result: RunResult, reference: Reference, steps: int = STEPS) -> None:
    """The run trained ``steps`` steps to the reference's parameters and losses within ``TOLERANCE``."""
    ref_losses = reference[1]
    assert len(result.reports) == steps
    for name, err in _errors(result, reference, steps).items():
        assert err < TOLERANCE, f"{name}: {err:.2e} of the tensor's scale off the undisturbed run"
    for step, (got, want) in enumerate(zip(result.losses, ref_losses, strict=True)):
        assert got == pytest.approx(want, rel=TOLERANCE), f"step {step}: loss {got} vs {want}"
