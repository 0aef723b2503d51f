"""The equivalence run: a small GPT as 2 stages x 2 replicas against single-process training of the same model on
the same batches (``tests/swarms/test_equivalence.py``, and the outsider's attack on the same run in
``tests/net/test_outsider.py``)."""

from __future__ import annotations

import pytest
import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import ModelConfig, unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig
from tasklet.peer.emulation.local import RunResult
from tasklet.peer.runtime.spec import RunSpec

STEPS = 10
SPEC = RunSpec(run_id="equivalence", model=ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=32, seed=5),
               optim=OptimConfig(lr=3e-3, eps=1e-3), seed=11, micro_batch=2, n_microbatches=4)
STAGES = [(0, 2), (2, 4)]
PIPELINES = [[0, 1], [2, 3]]  # pipelines[r][s] = device


@pytest.fixture(scope="module", name="reference")
def reference_fixture() -> tuple[dict[str, torch.Tensor], list[float]]:
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
