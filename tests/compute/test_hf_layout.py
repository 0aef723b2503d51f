"""Stage cutting by introspection: the parts every family's model is found to have, the one-line refusals of
layouts a stage cannot hold, and the load-time self-check (a stage-split forward equals transformers')."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tasklet.peer.compute.hf import ModelSourceError, resolve_model
from tasklet.peer.compute.hf import spec as spec_module
from tasklet.peer.compute.hf.selfcheck import self_check, tiny_copy

LAYOUTS = {
    "tiny-llama": "LlamaForCausalLM: model.embed_tokens, model.layers[], model.norm, lm_head",
    "tiny-gpt2": "GPT2LMHeadModel: transformer.wte, transformer.h[], transformer.ln_f, lm_head",
    "tiny-gemma2": "Gemma2ForCausalLM: model.embed_tokens, model.layers[], model.norm, lm_head "
                   "(final_logit_softcapping)",
    "tiny-granite": "GraniteForCausalLM: model.embed_tokens, model.layers[], model.norm, lm_head "
                    "(embedding_multiplier, logits_scaling)",
}


@pytest.mark.parametrize("preset", sorted(LAYOUTS))
def test_layout_is_found_by_looking_at_the_model(preset: str) -> None:
    spec = resolve_model(preset, seq_len=16)
    assert spec.layout.describe() == LAYOUTS[preset]
    assert spec.layout.rotary == (None if preset == "tiny-gpt2" else "rotary_emb")
    assert spec.layout.position_embedding == ("wpe" if preset == "tiny-gpt2" else None)


def write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


SMALL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2}
REFUSED = {
    "t5": ({"model_type": "t5", "d_model": 32, "num_layers": 2},
           "model_type: 't5' is an encoder-decoder model; only decoder-only *ForCausalLM models are supported"),
    "mixtral": ({"model_type": "mixtral", **SMALL, "num_local_experts": 4},
                "MixtralForCausalLM cannot be cut into pipeline stages: mixture-of-experts layers "
                "(MixtralSparseMoeBlock) are not supported yet (the router's auxiliary loss is not carried "
                "between stages)"),
    "qwen3_moe": ({"model_type": "qwen3_moe", **SMALL, "num_experts": 4, "num_experts_per_tok": 2},
                  "Qwen3MoeForCausalLM cannot be cut into pipeline stages: mixture-of-experts layers "
                  "(Qwen3MoeSparseMoeBlock) are not supported yet (the router's auxiliary loss is not carried "
                  "between stages)"),
    # ALiBi is computed outside Falcon's layers; the self-check refuses the cut. How it shows depends on the
    # transformers release (5.24: the layer demands the alibi tensor; 5.25: it runs without it, logits are off).
    "falcon": ({"model_type": "falcon", **SMALL, "alibi": True}, "self-check: FalconForCausalLM "),
    "gemma3": ({"model_type": "gemma3"},
               "Gemma3ForConditionalGeneration cannot be cut into pipeline stages: a vision tower (vision_config) is "
               "not supported; use the text-only model"),
    "bert": ({"model_type": "bert", **SMALL},
             "BertLMHeadModel cannot be cut into pipeline stages: no token embedding directly under bert"),
    "vit": ({"model_type": "vit"},
            "model_type: 'vit' has no *ForCausalLM class in transformers (not a decoder-only language model)"),
    "made-up": ({"model_type": "made-up"}, "model_type: 'made-up' is not a transformers model"),
    "wrong head": ({"model_type": "llama", **SMALL, "architectures": ["LlamaForTokenClassification"]},
                   "architectures: 'LlamaForTokenClassification' is not supported (expected LlamaForCausalLM, the "
                   "causal LM of model_type 'llama')"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_layout_that_cannot_be_cut_is_refused_in_one_line(case: str, tmp_path: Path) -> None:
    config, message = REFUSED[case]
    path = write(tmp_path, config)
    with pytest.raises(ModelSourceError) as info:
        resolve_model(path, seq_len=16)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path}: {message}"), text


def test_the_self_check_refuses_a_cut_that_misses_an_operation(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """Blind the layout to Granite's logit scaling (as for a family whose forward it cannot read): the stages then
    compute other logits than transformers' model, and the self-check refuses the model before any training."""
    real = spec_module.find_layout

    def blind(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), logit_ops=())

    monkeypatch.setattr(spec_module, "find_layout", blind)
    spec_module._layout_cached.cache_clear()
    path = write(tmp_path, {**resolve_model("tiny-granite", 16).config, "vocab_size": 300})
    try:
        with pytest.raises(ModelSourceError, match=rf"^{path}: self-check: GraniteForCausalLM cut into stages "
                                                   r"\[\(0, 2\), \(2, 4\)\] computes logits [\d.e+-]+ \(relative\) "
                                                   "away from transformers' forward"):
            resolve_model(path, seq_len=16)
    finally:
        spec_module._layout_cached.cache_clear()


def test_a_large_model_is_checked_on_a_tiny_copy_of_its_architecture() -> None:
    config = resolve_model("llama-3.2-1b", seq_len=64).config  # passed its self-check at resolve time
    tiny = tiny_copy(config)
    assert (tiny["num_hidden_layers"], tiny["hidden_size"], tiny["vocab_size"], tiny["num_key_value_heads"]) == \
        (2, 64, 256, 2)
    assert tiny["bos_token_id"] is None and tiny["rope_parameters"] == config["rope_parameters"]
    assert self_check(config, "llama-3.2-1b", 64) <= 1e-5


def test_a_half_precision_cast_recomputes_buffers_and_keeps_weights() -> None:
    """Gemma's embedding scale and the rotary frequencies are buffers recomputed in fp32 after a cast; the
    weights of the same modules must come through the cast untouched."""
    import torch

    stage = resolve_model("tiny-gemma2", seq_len=16).build_stage(0, 2)
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    stage.to(torch.bfloat16)
    emb = stage.model.embed_tokens
    assert emb.embed_scale.dtype == torch.float32 and float(emb.embed_scale) == pytest.approx(64 ** 0.5)
    assert stage.rotary_emb.inv_freq.dtype == torch.float32
    for n, p in stage.named_parameters():
        assert torch.equal(p, before[n].to(torch.bfloat16)), n
