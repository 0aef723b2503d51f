"""Workloads of real decoder families from their Hugging Face config: Llama/Mistral (grouped-query attention,
SwiGLU, RMSNorm, rotary positions) and GPT-2 (learned positions, biases, LayerNorm, GELU MLP).

:class:`DecoderWorkload` is a :class:`~scheduler.workload.Workload` whose per-layer figures come from the config
instead of the GPT formula ``12 d^2``; the search and the cost models only call its methods. Pure: it reads a
config *dict* (the JSON of ``config.json``) and imports nothing but the scheduler.

Per layer of width ``d``, ``h`` query heads of ``d/h`` dims, ``k`` key/value heads, MLP width ``f``:
    params  = d(d + 2 k d/h) (Q, K, V) + d^2 (O) + (3 if gated else 2) d f (MLP) + norms (+ biases for GPT-2)
    forward = 2 b s (matrix params) + 4 b s^2 d FLOPs per micro-batch (QK^T and AV, 2 b s^2 d each)
Memory per stage, as the runtime holds it (``peer.compute.stage``): fp32 master, its gradient, the step's
accumulated gradient and two AdamW moments (20 B per parameter), plus a bf16/fp16 compute copy (2 B) when the
run is not fp32; for every micro-batch in flight, the tensors autograd keeps (no recomputation), about
``6 d + 2 k d/h + (4 if gated else 2) f`` values per token per layer; the last stage also the logits (compute
dtype) and their fp32 copy for the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .errors import PlanningError
from .workload import Workload

MASTER_BYTES_PER_PARAM = 4 + 4 + 4 + 8  # fp32 master, its gradient, accumulated gradient, AdamW moments

# Shapes (Hugging Face config dicts) of models people train, for planning and benchmarks.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
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
# (seq_len, micro_batch, n_microbatches) a preset is planned with: 0.5 M tokens per step, as GPT-3 XL; smaller
# micro-batches for the larger models, whose stashed activations would not fit 32 GB devices otherwise
PRESET_BATCH = {"llama-3.2-1b": (2048, 2, 128), "llama-3-8b": (2048, 1, 256), "gpt3-xl": (2048, 4, 64)}
PRECISION_ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class DecoderWorkload(Workload):
    """A Workload whose layer figures follow a decoder family's config (see the module docstring)."""

    n_kv_heads: int = 0  # 0: as many as query heads
    ffn_dim: int = 0  # 0: 4 d
    gated_mlp: bool = False  # SwiGLU: gate, up and down projections
    biases: bool = False  # GPT-2: every linear has a bias
    learned_positions: int = 0  # GPT-2: rows of the position embedding (0: rotary, no parameters)
    norm_params: int = 0  # per layer (RMSNorm: 2 d; LayerNorm: 4 d)
    compute_copy_bytes: int = 0  # bf16/fp16 compute weights besides the fp32 master

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim == 0:
            self.ffn_dim = 4 * self.d_model
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise PlanningError("n_kv_heads", f"{self.n_kv_heads} must divide n_heads={self.n_heads}")

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * (self.d_model // self.n_heads)

    def _matrix_params(self) -> int:
        d, f = self.d_model, self.ffn_dim
        return d * (d + 2 * self.kv_dim) + d * d + (3 if self.gated_mlp else 2) * d * f

    @property
    def layer_params(self) -> int:
        d, f = self.d_model, self.ffn_dim
        bias = (d + 2 * self.kv_dim + d + f + d) if self.biases else 0
        return self._matrix_params() + self.norm_params + bias

    @property
    def embedding_params(self) -> int:
        return (self.vocab + self.learned_positions) * self.d_model

    @property
    def head_params(self) -> int:  # final norm + untied LM head (tied models are untied for training)
        return self.vocab * self.d_model + self.norm_params // 2

    def stage_forward_flops(self, a: int, b: int) -> float:
        self._check_range(a, b)
        tokens, s, d = self.micro_batch * self.seq_len, self.seq_len, self.d_model
        f = (b - a) * (2.0 * tokens * self._matrix_params() + 4.0 * tokens * s * d)
        if b == self.n_layers:
            f += 2.0 * tokens * d * self.vocab
        return f

    def stage_memory_bytes(self, a: int, b: int, in_flight: int) -> float:
        p = self.stage_params(a, b)
        mem = p * (MASTER_BYTES_PER_PARAM + self.compute_copy_bytes)
        per_token = 6 * self.d_model + 2 * self.kv_dim + (4 if self.gated_mlp else 2) * self.ffn_dim
        tokens = self.micro_batch * self.seq_len
        mem += in_flight * (b - a) * tokens * per_token * self.act_bytes
        if b == self.n_layers:
            mem += tokens * self.vocab * (self.act_bytes + 4)
        return float(mem)

    def with_split(self, stages: int, replicas: int) -> DecoderWorkload:
        return replace(self, stages=stages, replicas=replicas)


def _int(config: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = config.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanningError(key, f"must be a positive integer, got {value!r}")
            return value
    if default is None:
        raise PlanningError(keys[0], "missing from the model config")
    return default


def from_hf_config(config: dict[str, Any], seq_len: int, micro_batch: int, n_microbatches: int,
                   precision: str = "fp32", stages: int | None = None, replicas: int | None = None,
                   name: str = "") -> DecoderWorkload:
    """The workload of a Hugging Face config dict (llama, mistral, gpt2) trained at ``precision``."""
    if precision not in PRECISION_ACT_BYTES:
        raise PlanningError("precision", f"must be one of {', '.join(PRECISION_ACT_BYTES)}, got {precision!r}")
    act = PRECISION_ACT_BYTES[precision]
    kind = config.get("model_type")
    common = {"seq_len": seq_len, "micro_batch": micro_batch, "n_microbatches": n_microbatches, "stages": stages,
              "replicas": replicas, "param_bytes": 4, "act_bytes": act, "name": name or str(kind),
              "compute_copy_bytes": 0 if precision == "fp32" else 2}
    if kind in ("llama", "mistral"):
        d = _int(config, "hidden_size")
        return DecoderWorkload(
            n_layers=_int(config, "num_hidden_layers"), d_model=d, n_heads=_int(config, "num_attention_heads"),
            vocab=_int(config, "vocab_size"), n_kv_heads=_int(config, "num_key_value_heads", default=0) or 0,
            ffn_dim=_int(config, "intermediate_size"), gated_mlp=True, norm_params=2 * d, **common)
    if kind == "gpt2":
        d = _int(config, "n_embd", "hidden_size")
        return DecoderWorkload(
            n_layers=_int(config, "n_layer", "num_hidden_layers"), d_model=d,
            n_heads=_int(config, "n_head", "num_attention_heads"), vocab=_int(config, "vocab_size"),
            ffn_dim=_int(config, "n_inner", default=4 * d), biases=True,
            learned_positions=_int(config, "n_positions", "max_position_embeddings"), norm_params=4 * d, **common)
    raise PlanningError("model_type", f"{kind!r} is not a supported decoder family (llama, mistral, gpt2)")


def model_preset(name: str, precision: str = "bf16", stages: int | None = None,
                 replicas: int | None = None) -> DecoderWorkload:
    """A named shape (``MODEL_SHAPES``) with its planning batch (``PRESET_BATCH``)."""
    if name not in MODEL_SHAPES:
        raise PlanningError("workload", f"unknown model preset {name!r} (have: {', '.join(MODEL_SHAPES)})")
    seq_len, micro_batch, n_mb = PRESET_BATCH[name]
    return from_hf_config(MODEL_SHAPES[name], seq_len, micro_batch, n_mb, precision, stages, replicas, name)
