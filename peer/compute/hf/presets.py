"""Named model shapes (Hugging Face config dicts), so a run can say ``--model tiny-llama`` with no files.

The tiny ones (4 layers, hidden 64-128) are one per family the tests train: Llama, Mistral (sliding window),
GPT-2 (learned positions, tied), Gemma-2 (scaled embedding, alternating sliding/full attention, logit
soft-capping, tied), OLMo-2 (norms after attention and MLP, QK-norm), Granite (embedding, residual, attention
and logit multipliers) and Qwen-3 (QK-norm). The large ones are *shapes* for planning and benchmarks
(Llama-3.2-1B, OLMo-2-1B, Llama-3-8B, the paper's GPT-3 XL); training them from a preset starts from seeded
random weights, like any config.
"""

from __future__ import annotations

from typing import Any

from tasklet.scheduler.model_workload import MODEL_SHAPES

_ROTARY: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": None,
    },
    "tiny-gpt2": {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 512, "n_embd": 64, "n_layer": 4,
        "n_head": 4, "n_positions": 512, "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None,
    },
    "tiny-mistral": {**_ROTARY, "model_type": "mistral", "sliding_window": 8},
    "tiny-gemma2": {**_ROTARY, "model_type": "gemma2", "head_dim": 16, "sliding_window": 8,
                    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "tie_word_embeddings": True},
    "tiny-olmo2": {**_ROTARY, "model_type": "olmo2"},
    "tiny-granite": {**_ROTARY, "model_type": "granite", "embedding_multiplier": 12.0, "logits_scaling": 8.0,
                     "residual_multiplier": 0.22, "attention_multiplier": 0.0625, "tie_word_embeddings": True},
    "tiny-qwen3": {**_ROTARY, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    **MODEL_SHAPES,  # llama-3.2-1b, olmo-2-1b, llama-3-8b, gpt3-xl: the scheduler plans with the same shapes
}
