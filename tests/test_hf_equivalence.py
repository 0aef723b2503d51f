"""Equivalence invariant for Hugging Face families: a tiny Llama (grouped-query attention, SwiGLU) and a tiny
GPT-2 (tied embeddings, untied at load), each trained by 4 worker processes (2 stages x 2 replicas, gRPC on
loopback) for 5 steps, against single-process training of transformers' own ``AutoModelForCausalLM``."""

from __future__ import annotations

import pytest
import torch

from peer.compute.data import Corpus
from peer.compute.hf import resolve_model
from peer.compute.model import unflatten_stage
from peer.compute.reference import train_reference
from peer.compute.stage import OptimConfig
from peer.emulation.local import train_plan
from peer.runtime.spec import RunSpec

STEPS = 5
STAGES = [(0, 2), (2, 4)]
PIPELINES = [[0, 1], [2, 3]]


def spec_for(preset: str) -> RunSpec:
    return RunSpec(run_id=f"hf-{preset}", model=resolve_model(preset, seq_len=32, seed=5),
                   optim=OptimConfig(lr=3e-3, eps=1e-3), seed=11, micro_batch=2, n_microbatches=4)


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_hf_family_two_stages_two_replicas_match_transformers(preset: str) -> None:
    torch.set_num_threads(1)
    spec = RunSpec.from_dict(spec_for(preset).to_dict())  # as the workers receive it: through JSON
    assert spec == spec_for(preset)
    ref_params, ref_losses = train_reference(spec.model, spec.optim, Corpus.load(spec.corpus), spec.seed, STEPS,
                                             spec.n_microbatches, spec.micro_batch)
    result = train_plan(spec, STAGES, PIPELINES, STEPS)
    seen: set[str] = set()
    for s, (a, b) in enumerate(STAGES):
        replicas = [result.states[(s, r)] for r in range(len(PIPELINES))]
        assert torch.equal(replicas[0]["params"], replicas[1]["params"]), f"stage {s}: replicas differ"
        for name, value in unflatten_stage(spec.model, a, b, replicas[0]["params"]).items():
            ref = ref_params[name]
            err = float((value - ref).abs().max())
            assert err < 1e-5, f"{preset} {name}: differs from transformers' training by {err:.2e}"
            seen.add(name)
    assert seen == set(ref_params)
    for got, want in zip(result.losses, ref_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]
