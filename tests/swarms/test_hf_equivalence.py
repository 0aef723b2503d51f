"""Equivalence invariant for Hugging Face families: a tiny model of each family — Llama (grouped-query attention,
SwiGLU), Mistral (sliding window), GPT-2 (learned positions, tied embeddings), Gemma-2 (scaled embedding,
alternating sliding/full attention, logit soft-capping, tied), OLMo-2 (post-norms, QK-norm) and Granite
(embedding/residual/attention/logit multipliers, tied) — trained by 4 worker processes (2 stages x 2 replicas,
gRPC on loopback) for 5 steps, against single-process training of transformers' own ``AutoModelForCausalLM``;
then exported, loaded with ``from_pretrained``, whose logits must equal the trained stages' forward.

Gemma-2 and Granite keep their embeddings tied (the first and the last stage of each pipeline sum their
gradients of the one weight, peer.runtime.stage.tied), against transformers' tied model: both copies must equal
its one weight, and each other bitwise. GPT-2 is trained untied (its head starts as a copy of the embedding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.hf import resolve_model
from tasklet.peer.compute.hf.export import export, generate, write_result
from tasklet.peer.compute.model import unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig
from tasklet.peer.emulation.local import train_plan
from tasklet.peer.runtime.spec import RunSpec

pytestmark = pytest.mark.exact_processes  # every check is an equality with transformers: lane 1 (tests/conftest.py)

STEPS = 5
STAGES = [(0, 2), (2, 4)]
PIPELINES = [[0, 1], [2, 3]]
FAMILIES = ["tiny-llama", "tiny-gpt2", "tiny-mistral", "tiny-gemma2", "tiny-olmo2", "tiny-granite"]
TIED = {"tiny-gemma2", "tiny-granite"}  # kept tied in the swarm; the others (GPT-2 too) untied




def spec_for(preset: str) -> RunSpec:
    return RunSpec(run_id=f"hf-{preset}", model=resolve_model(preset, seq_len=32, seed=5, tie=preset in TIED),
                   optim=OptimConfig(lr=3e-3, eps=1e-3), seed=11, micro_batch=2, n_microbatches=4)


def check_export(spec: RunSpec, params: dict[int, dict[str, torch.Tensor]], folder: Path) -> float:
    """Export the trained stages; the folder's model (``from_pretrained``) must compute the stages' logits."""
    from transformers import AutoModelForCausalLM

    out = export(write_result(folder / "result", spec.to_dict(), params), folder / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(loaded).__name__ == spec.model.config["architectures"][0]
    ids = torch.randint(0, spec.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    x = ids
    with torch.no_grad():
        for s, (a, b) in enumerate(STAGES):
            stage = spec.model.build_stage(a, b).eval()
            stage.load_state_dict(params[s], strict=False)
            x = stage(x)
        err = float((loaded(input_ids=ids).logits - x).abs().max())
    assert generate(out, "Doc", max_new_tokens=3).startswith("Doc")  # byte tokenizer: any 3 tokens decode
    return err


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("preset", FAMILIES)
def test_hf_family_two_stages_two_replicas_match_transformers(preset: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    spec = RunSpec.from_dict(spec_for(preset).to_dict())  # as the workers receive it: through JSON
    assert spec == spec_for(preset)
    model = spec.model
    emb = f"{model.layout.base}.{model.layout.token_embedding}.weight"
    assert model.keep_tied == (preset in TIED) and model.config["tie_word_embeddings"] == (preset in TIED)
    ref_params, ref_losses = train_reference(spec.model, spec.optim, Corpus.load(spec.corpus), spec.seed, STEPS,
                                             spec.n_microbatches, spec.micro_batch)
    result = train_plan(spec, STAGES, PIPELINES, STEPS)
    seen: set[str] = set()
    trained: dict[int, dict[str, torch.Tensor]] = {}
    worst = 0.0
    for s, (a, b) in enumerate(STAGES):
        replicas = [result.states[(s, r)] for r in range(len(PIPELINES))]
        assert torch.equal(replicas[0]["params"], replicas[1]["params"]), f"stage {s}: replicas differ"
        trained[s] = unflatten_stage(spec.model, a, b, replicas[0]["params"])
        for name, value in trained[s].items():
            ref = ref_params[emb if model.keep_tied and name == "lm_head.weight" else name]
            err = float((value - ref).abs().max())
            assert err < 1e-5, f"{preset} {name}: differs from transformers' training by {err:.2e}"
            worst = max(worst, err)
            seen.add(name)
    assert seen == set(ref_params) | ({"lm_head.weight"} if model.keep_tied else set())
    if model.keep_tied:  # transformers' tied model has one weight; the swarm's two copies stayed bitwise equal
        assert "lm_head.weight" not in ref_params
        assert torch.equal(trained[0][emb], trained[1]["lm_head.weight"]), f"{preset}: the tied copies differ"
    for got, want in zip(result.losses, ref_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]
    export_err = check_export(spec, trained, tmp_path)
    assert export_err < 1e-5, f"{preset}: exported logits differ from the stages' by {export_err:.2e}"
    print(f"{preset}: max parameter difference {worst:.2e}, exported logits {export_err:.2e}")
