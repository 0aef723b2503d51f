"""Equivalence invariant over real processes: 2 stages x 2 replicas as 4 worker processes on loopback, gRPC
between them, against plain single-process training of the same model on the same batches.

Every parameter must match within 1e-5 (relative to the tensor's largest entry: an entry whose summed
gradient nearly cancels sits near zero, and Adam scales its rounding noise to the tensor's scale), the
replicas of a stage must be bit-identical, and the loss curves must agree. Then the same with link emulation
(bandwidth and delay per directed pair) switched on: shaping changes timing, never results.
"""

from __future__ import annotations

import pytest
import torch

from peer.compute.data import Corpus
from peer.compute.model import ModelConfig, unflatten_stage
from peer.compute.reference import train_reference
from peer.compute.stage import OptimConfig
from peer.emulation.local import LinkModel, RunResult, train_plan
from peer.runtime.spec import RunSpec

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

STEPS = 10
SPEC = RunSpec(run_id="equivalence", model=ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=32, seed=5),
               optim=OptimConfig(lr=3e-3, eps=1e-3), seed=11, micro_batch=2, n_microbatches=4)
STAGES = [(0, 2), (2, 4)]
PIPELINES = [[0, 1], [2, 3]]  # pipelines[r][s] = device


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.set_num_threads(1)
    corpus = Corpus.load(SPEC.corpus)
    return train_reference(SPEC.model, SPEC.optim, corpus, SPEC.seed, STEPS, SPEC.n_microbatches, SPEC.micro_batch)


def check_equivalent(result: RunResult, reference: tuple[dict[str, torch.Tensor], list[float]]) -> None:
    ref_params, ref_losses = reference
    seen: set[str] = set()
    for s, (a, b) in enumerate(STAGES):
        replicas = [result.states[(s, r)] for r in range(len(PIPELINES))]
        for other in replicas[1:]:
            assert torch.equal(replicas[0]["params"], other["params"]), f"stage {s}: replicas differ"
        assert replicas[0]["step"] == STEPS
        for name, value in unflatten_stage(SPEC.model, a, b, replicas[0]["params"]).items():
            ref = ref_params[name]
            err = float((value - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
            assert err < 1e-5, f"{name}: differs by {err:.2e} of the tensor's largest entry"
            seen.add(name)
    assert seen == set(ref_params)
    assert len(result.losses) == STEPS
    for step, (got, want) in enumerate(zip(result.losses, ref_losses, strict=True)):
        assert got == pytest.approx(want, rel=1e-5), f"step {step}: loss {got} vs reference {want}"
    assert ref_losses[-1] < ref_losses[0]
    # both pipelines did work: a plan that silently ran everything on one pipeline would be a weaker test
    assert all(len(r.microbatches_per_pipeline) == 2 for r in result.reports)


def test_two_stages_two_replicas_over_grpc_match_single_process(reference) -> None:
    result = train_plan(SPEC, STAGES, PIPELINES, STEPS)
    check_equivalent(result, reference)


def test_equivalence_holds_with_link_emulation(reference) -> None:
    n = 4
    # 200 Mbit/s and 5 ms between pipeline neighbours' machines, 50 Mbit/s and 20 ms elsewhere
    bw = [[200e6 if abs(i - j) == 1 else 50e6 for j in range(n)] for i in range(n)]
    delay = [[0.005 if abs(i - j) == 1 else 0.020 for j in range(n)] for i in range(n)]
    result = train_plan(SPEC, STAGES, PIPELINES, STEPS, links=LinkModel(bw, delay))
    check_equivalent(result, reference)
    # the shaping really applied: a step cannot beat its critical path of delays (2 hops x 2 ways)
    assert min(result.step_seconds) > 2 * 0.005
