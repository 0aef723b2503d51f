"""Named model shapes (Hugging Face config dicts), so a run can say ``--model tiny-llama`` with no files.

The large ones are *shapes* for planning and benchmarks (Llama-3.2-1B, Llama-3-8B, the paper's GPT-3 XL);
training them from a preset starts from seeded random weights, like any config.
"""

from __future__ import annotations

from typing import Any

from scheduler.model_workload import MODEL_SHAPES

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
    **MODEL_SHAPES,  # llama-3.2-1b, llama-3-8b, gpt3-xl: the scheduler plans with the same shapes
}
