"""Named model shapes (Hugging Face config dicts), so a run can say ``--model tiny-llama`` with no files.

The large ones are *shapes* for planning and benchmarks (Llama-3.2-1B, Llama-3-8B, the paper's GPT-3 XL);
training them from a preset starts from seeded random weights, like any config.
"""

from __future__ import annotations

from typing import Any

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
    "llama-3.2-1b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama-3-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "gpt3-xl": {  # the paper's GPT-3 XL shape (1.3B): 24 layers, d 2048, 2048 positions; GPT-2 layout
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257, "n_embd": 2048,
        "n_layer": 24, "n_head": 16, "n_positions": 2048, "tie_word_embeddings": True,
        "bos_token_id": 50256, "eos_token_id": 50256,
    },
}
