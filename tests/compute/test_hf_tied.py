"""Tied embeddings kept tied: two stages (embedding on the first, head on the last) driven by hand, the tied
slice's gradient summed between them (``peer.compute.hf.tied``), against transformers' own tied model trained in
one process; with and without global gradient clipping (the tied weight counted once in the norm)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tasklet.peer.compute.data import microbatch
from tasklet.peer.compute.hf import resolve_model
from tasklet.peer.compute.hf.export import export, write_result
from tasklet.peer.compute.hf.stage import full_model
from tasklet.peer.compute.hf.tied import sum_tied, tied_slice, tied_sq_norm
from tasklet.peer.compute.model import unflatten_stage
from tasklet.peer.compute.reference import train_reference
from tasklet.peer.compute.stage import OptimConfig, StageCompute, StageComputeConfig
from tasklet.peer.compute.textdata import load_corpus

SPLIT = [(0, 2), (2, 4)]
STEPS, N_MB, MB = 5, 2, 2


def train_tied(model, optim: OptimConfig, corpus) -> tuple[list[StageCompute], list[float]]:
    norms: list[float] = []
    stages = [StageCompute(StageComputeConfig(model, a, b, optim)) for a, b in SPLIT]
    slices = [tied_slice(model, a, b) for a, b in SPLIT]
    for step in range(STEPS):
        for mb in range(N_MB):
            x, y = microbatch(corpus, 3, step, mb, MB, model.seq_len)
            _, g = stages[1].forward_loss(mb, stages[0].forward(mb, x), y)
            stages[0].backward(mb, g)
        grads = [s.accumulated_grad() for s in stages]
        sum_tied(grads[0], grads[1], slices[0], slices[1])
        sq = sum(s.grad_sq_norm(g, N_MB) for s, g in zip(stages, grads, strict=True))
        norm = math.sqrt(sq - tied_sq_norm(grads[0], slices[0], N_MB))
        norms.append(norm)
        for s, g in zip(stages, grads, strict=True):
            s.apply_update(g, N_MB, norm)
    return stages, norms


@pytest.mark.parametrize(("preset", "clip"), [("tiny-gpt2", None), ("tiny-gemma2", None), ("tiny-granite", 0.1)])
def test_tied_embeddings_train_like_transformers_tied_model(preset: str, clip: float | None, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = resolve_model(preset, seq_len=32, seed=2, tie=True)
    assert model.keep_tied and model.config["tie_word_embeddings"] is True
    reference = full_model(model)
    emb, head = reference.get_input_embeddings().weight, reference.get_output_embeddings().weight
    assert emb is head, "the reference must be transformers' tied model"
    emb_name = f"{model.layout.base}.{model.layout.token_embedding}.weight"
    optim = OptimConfig(lr=3e-3, eps=1e-3, grad_clip=clip)
    corpus = load_corpus(None)
    ref, losses = train_reference(model, optim, corpus, 3, STEPS, N_MB, MB)
    assert "lm_head.weight" not in ref and losses[-1] < losses[0]
    stages, norms = train_tied(model, optim, corpus)
    assert clip is None or max(norms) > clip, "the clipped variant must actually clip"
    got = [unflatten_stage(model, a, b, s.flat_params()) for s, (a, b) in zip(stages, SPLIT, strict=True)]
    assert torch.equal(got[0][emb_name], got[1]["lm_head.weight"]), "the tied copies drifted apart"
    worst = 0.0
    for part in got:
        for name, value in part.items():
            err = float((value - ref[emb_name if name == "lm_head.weight" else name]).abs().max())
            assert err < 1e-5, f"{preset} {name}: differs from transformers' tied training by {err:.2e}"
            worst = max(worst, err)
    out = export(write_result(tmp_path / "result", {"model": model.to_dict()}, dict(enumerate(got))), tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert loaded.get_input_embeddings().weight is loaded.get_output_embeddings().weight  # exported tied
    ids = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = stages[1].module(stages[0].module(ids))
        export_err = float((loaded(input_ids=ids).logits - x).abs().max())
    assert export_err < 1e-5, f"exported logits differ from the stages' by {export_err:.2e}"
    print(f"{preset} tied: max parameter difference {worst:.2e}")


def test_without_the_sum_the_tied_copies_part() -> None:
    """The sum is what keeps them equal: without it the embedding and the head leave each other at once."""
    model = resolve_model("tiny-gpt2", seq_len=16, seed=2, tie=True)
    stages = [StageCompute(StageComputeConfig(model, a, b, OptimConfig(lr=1e-2))) for a, b in SPLIT]
    x, y = microbatch(load_corpus(None), 3, 0, 0, 2, 16)
    _, g = stages[1].forward_loss(0, stages[0].forward(0, x), y)
    stages[0].backward(0, g)
    for s in stages:
        s.apply_update(s.accumulated_grad(), 1)
    first = unflatten_stage(model, 0, 2, stages[0].flat_params())["transformer.wte.weight"]
    assert not torch.equal(first, unflatten_stage(model, 2, 4, stages[1].flat_params())["lm_head.weight"])


def test_one_stage_holds_the_tied_weight_once_and_trains_like_transformers() -> None:
    """A one-stage plan exchanges nothing: the stage keeps the embedding and the head one parameter (as the model
    does), so autograd sums both uses' gradients itself."""
    torch.set_num_threads(1)
    model = resolve_model("tiny-gemma2", seq_len=32, seed=2, tie=True)
    optim, corpus = OptimConfig(lr=3e-3, eps=1e-3), load_corpus(None)
    stage = StageCompute(StageComputeConfig(model, 0, model.n_layers, optim))
    assert "lm_head.weight" not in stage.names and tied_slice(model, 0, model.n_layers) is None
    for step in range(STEPS):
        for mb in range(N_MB):
            x, y = microbatch(corpus, 3, step, mb, MB, model.seq_len)
            stage.forward_loss(mb, x, y)
        stage.apply_update(stage.accumulated_grad(), N_MB)
    ref, _ = train_reference(model, optim, corpus, 3, STEPS, N_MB, MB)
    got = unflatten_stage(model, 0, model.n_layers, stage.flat_params())
    assert set(got) == set(ref)
    for name, value in got.items():
        assert float((value - ref[name]).abs().max()) < 1e-5, name
