"""Workloads of Hugging Face decoder models, measured from the parameter shapes of the model transformers builds.

No per-family formula: :func:`shapes_of` builds the config's ``*ForCausalLM`` on the ``meta`` device (no memory,
whatever its size) and reads, from its parameters, what the scheduler needs per decoder layer — its parameters,
the parameters of its matrices (2 FLOPs each per token forward), the width of its attention (``4 b s^2 a``
FLOPs for QK^T and AV) and the outputs of its linear layers (what autograd keeps) — plus the embeddings (token
and learned positions) and the head (final norm and LM head, counted as its own tensor: a tied head is a second
copy of the embedding on the last stage, as the runtime holds it).
:class:`DecoderWorkload` is a :class:`~scheduler.workload.Workload` with those figures; the search and the cost
models only call its methods. The module imports nothing at load time; torch and transformers are imported by
:func:`shapes_of`, once per config (cached).

Memory per stage, as the runtime holds it (``peer.compute.stage``): fp32 master, its gradient, the step's
accumulated gradient and two AdamW moments (20 B per parameter), plus a bf16/fp16 compute copy (2 B) when the
run is not fp32; for every micro-batch in flight, the tensors autograd keeps (no recomputation), estimated per
token per layer as twice the outputs of the layer's linear maps plus two hidden-state-sized norm outputs; the
last stage also the logits (compute dtype) and their fp32 copy for the loss.
"""

from __future__ import annotations

import functools
import json
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
    "olmo-2-1b": {  # OLMo-2-0425-1B's shape: QK-norm, norms after attention and MLP, untied
        "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "vocab_size": 100352, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": 100257, "pad_token_id": 100277,
    },
    "gpt3-xl": {  # the paper's GPT-3 XL shape (1.3B): 24 layers, d 2048, 2048 positions; GPT-2 layout
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257, "n_embd": 2048,
        "n_layer": 24, "n_head": 16, "n_positions": 2048, "tie_word_embeddings": True,
        "bos_token_id": 50256, "eos_token_id": 50256,
    },
}
# (seq_len, micro_batch, n_microbatches) a preset is planned with: 0.5 M tokens per step, as GPT-3 XL; smaller
# micro-batches for the larger models, whose stashed activations would not fit 32 GB devices otherwise
PRESET_BATCH = {"llama-3.2-1b": (2048, 2, 128), "olmo-2-1b": (2048, 2, 128), "llama-3-8b": (2048, 1, 256),
                "gpt3-xl": (2048, 4, 64)}
PRECISION_ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShapes:
    """What the parameter shapes of a causal LM say, per decoder layer (the largest layer when they differ)."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab: int
    layer_params: int
    layer_matrix_params: int  # parameters of the layer's 2-D weights
    attention_width: int  # query heads x head dim
    linear_outputs: int  # sum of the out_features of the layer's linear maps
    embedding_params: int  # token (+ learned position) embeddings
    head_params: int  # final norm + LM head (untied)
    architecture: str


def _count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


@functools.lru_cache(maxsize=32)
def _shapes_cached(config_json: str) -> ModelShapes:
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_json)
    cfg = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(raw.get("model_type"), **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (TypeError, ValueError, KeyError) as exc:
        raise PlanningError("model_type", f"{raw.get('model_type')!r}: transformers cannot build a causal LM "
                                          f"({str(exc).splitlines()[0][:120]})") from None
    base = model.base_model
    n_layers = int(config.num_hidden_layers)
    lists = [m for m in base.children() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(lists) != 1:
        raise PlanningError("model_type", f"{type(model).__name__}: no single list of {n_layers} decoder layers")
    layers = lists[0]
    biggest = max(layers, key=_count)
    d = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or d // heads)
    embedding = model.get_input_embeddings()
    positions = [m for m in base.children() if type(m) is nn.Embedding and m is not embedding]
    head = model.get_output_embeddings()
    rest = [m for m in base.children() if m is not layers and m is not embedding and m not in positions]
    return ModelShapes(
        n_layers=n_layers, d_model=d, n_heads=heads, vocab=int(config.vocab_size),
        layer_params=_count(biggest),
        layer_matrix_params=max(sum(p.numel() for p in layer.parameters() if p.dim() >= 2) for layer in layers),
        attention_width=heads * head_dim,
        linear_outputs=max(sum(m.out_features if isinstance(m, nn.Linear) else m.weight.shape[-1]
                               for m in layer.modules()
                               if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D") for layer in layers),
        embedding_params=_count(embedding) + sum(_count(m) for m in positions),
        head_params=head.weight.numel() + (head.bias.numel() if head.bias is not None else 0)
        + sum(_count(m) for m in rest),
        architecture=type(model).__name__,
    )


def shapes_of(config: dict[str, Any]) -> ModelShapes:
    """The :class:`ModelShapes` of a Hugging Face config dict (the JSON of ``config.json``)."""
    return _shapes_cached(json.dumps(config, sort_keys=True, default=str))


@dataclass
class DecoderWorkload(Workload):
    """A Workload whose layer figures are measured from a model's parameter shapes (see the module docstring)."""

    measured_layer_params: int = 0
    layer_matrix_params: int = 0
    attention_width: int = 0
    linear_outputs: int = 0
    measured_embedding_params: int = 0
    measured_head_params: int = 0
    compute_copy_bytes: int = 0  # bf16/fp16 compute weights besides the fp32 master

    @property
    def layer_params(self) -> int:
        return self.measured_layer_params

    @property
    def embedding_params(self) -> int:
        return self.measured_embedding_params

    @property
    def head_params(self) -> int:
        return self.measured_head_params

    def stage_forward_flops(self, a: int, b: int) -> float:
        self._check_range(a, b)
        tokens, s = self.micro_batch * self.seq_len, self.seq_len
        f = (b - a) * (2.0 * tokens * self.layer_matrix_params + 4.0 * tokens * s * self.attention_width)
        if b == self.n_layers:
            f += 2.0 * tokens * self.d_model * self.vocab
        return f

    def stage_memory_bytes(self, a: int, b: int, in_flight: int) -> float:
        p = self.stage_params(a, b)
        mem = p * (MASTER_BYTES_PER_PARAM + self.compute_copy_bytes)
        per_token = 2 * self.linear_outputs + 2 * self.d_model
        tokens = self.micro_batch * self.seq_len
        mem += in_flight * (b - a) * tokens * per_token * self.act_bytes
        if b == self.n_layers:
            mem += tokens * self.vocab * (self.act_bytes + 4)
        return float(mem)

    def with_split(self, stages: int, replicas: int) -> DecoderWorkload:
        return replace(self, stages=stages, replicas=replicas)


def from_hf_config(config: dict[str, Any], seq_len: int, micro_batch: int, n_microbatches: int,
                   precision: str = "fp32", stages: int | None = None, replicas: int | None = None,
                   name: str = "") -> DecoderWorkload:
    """The workload of any decoder-only Hugging Face config dict trained at ``precision``."""
    if precision not in PRECISION_ACT_BYTES:
        raise PlanningError("precision", f"must be one of {', '.join(PRECISION_ACT_BYTES)}, got {precision!r}")
    shapes = shapes_of(config)
    return DecoderWorkload(
        n_layers=shapes.n_layers, d_model=shapes.d_model, n_heads=shapes.n_heads, vocab=shapes.vocab,
        seq_len=seq_len, micro_batch=micro_batch, n_microbatches=n_microbatches, stages=stages, replicas=replicas,
        param_bytes=4, act_bytes=PRECISION_ACT_BYTES[precision], name=name or str(config.get("model_type")),
        measured_layer_params=shapes.layer_params, layer_matrix_params=shapes.layer_matrix_params,
        attention_width=shapes.attention_width, linear_outputs=shapes.linear_outputs,
        measured_embedding_params=shapes.embedding_params, measured_head_params=shapes.head_params,
        compute_copy_bytes=0 if precision == "fp32" else 2)


def model_preset(name: str, precision: str = "bf16", stages: int | None = None,
                 replicas: int | None = None) -> DecoderWorkload:
    """A named shape (``MODEL_SHAPES``) with its planning batch (``PRESET_BATCH``)."""
    if name not in MODEL_SHAPES:
        raise PlanningError("workload", f"unknown model preset {name!r} (have: {', '.join(MODEL_SHAPES)})")
    seq_len, micro_batch, n_mb = PRESET_BATCH[name]
    return from_hf_config(MODEL_SHAPES[name], seq_len, micro_batch, n_mb, precision, stages, replicas, name)
