"""A GPT-style decoder that splits into pipeline stages by layer range.

Why the model is written this way:

* **Stages are slices of one model.** ``build_stage(cfg, a, b)`` holds transformer blocks ``a..b-1``. The
  stage that holds block 0 also owns the token and position embeddings; the stage that holds the last block
  also owns the final LayerNorm and the LM head. ``build_stage(cfg, 0, cfg.n_layers)`` is the full model.
* **Initialisation is a pure function of (seed, component).** Every parameter is drawn from its own
  ``torch.Generator`` whose seed is ``sha256(f"{cfg.seed}/{name}")``, where ``name`` carries the *global*
  layer index (``blocks.3.attn.qkv.weight``). A stage built in any process therefore has bit-for-bit the
  parameters of the same slice of the full model, without anyone shipping weights around, and regardless of
  how the layers are split.
* **No weight tying** between the embedding and the LM head: they live on different stages (different
  processes), and tying them would need a gradient exchange between the first and last stage every step.
* **No dropout**, so a forward pass is a deterministic function of parameters and input; the equivalence
  invariant (pipeline training == single-process training) depends on it.
* **Parameter names use the global layer index** (``blocks`` is a ``ModuleDict`` keyed by ``str(i)``), so the
  state dict of a stage is literally a subset of the full model's state dict.

Pre-LN blocks (GPT-2): ``h = h + attn(ln1(h)); h = h + mlp(ln2(h))``. Residual output projections are
initialised with std ``0.02 / sqrt(2 * n_layers)`` because each block adds two residual branches; with
``2 n_layers`` independent contributions, the residual stream's variance would otherwise grow linearly with
depth.

Linear layers have **no biases** (as in PaLM / LLaMA); LayerNorms keep theirs. Besides saving parameters,
this matters for reproducibility: the attention *key* bias adds the same ``q . b_k`` to every score of a
query, which softmax ignores, so its true gradient is identically zero and what it receives is rounding noise,
which Adam normalises into full-size ``±lr`` updates. Such a parameter would differ between any two
summation orders (pipeline vs single process), breaking the equivalence invariant for no benefit.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

INIT_STD = 0.02


class ModelConfigError(ValueError):
    """A model configuration field is invalid; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. ``vocab_size`` is 256 because the tokenizer is byte-level."""

    n_layers: int = 4
    d_model: int = 64
    n_heads: int = 4
    seq_len: int = 32
    vocab_size: int = 256
    seed: int = 0
    mlp_ratio: int = 4

    def validate(self) -> ModelConfig:
        """Raise :class:`ModelConfigError` naming the first bad field; return ``self`` for chaining."""
        for name in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ModelConfigError(f"model.seed must be a non-negative integer, got {self.seed!r}")
        if self.d_model % self.n_heads != 0:
            raise ModelConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
            )
        return self

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelConfig:
        """Build from a dict (a published run config); unknown keys are an error, not silently dropped."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**data).validate()  # type: ignore[arg-type]

    def build_stage(self, first_layer: int, last_layer: int) -> StageModule:
        """The stage module of layers ``[first_layer, last_layer)`` (the interface HF model specs share)."""
        return build_stage(self, first_layer, last_layer)

    def stage_shapes(self, first_layer: int, last_layer: int) -> list[tuple[str, torch.Size]]:
        """Parameter names and shapes of a stage, in the flat order the runtime uses."""
        return [(n, p.shape) for n, p in build_stage(self, first_layer, last_layer).named_parameters()]

    def params_per_layer(self) -> int:
        """Parameters of one block: 2 LayerNorms (gain + bias), qkv, attention projection, 2-layer MLP."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        return 2 * 2 * d + 3 * d * d + d * d + 2 * d * h

    def params_embedding(self) -> int:
        """Token + position embeddings (first stage)."""
        return (self.vocab_size + self.seq_len) * self.d_model

    def params_head(self) -> int:
        """Final LayerNorm + LM head (last stage)."""
        return 2 * self.d_model + self.d_model * self.vocab_size


def component_seed(seed: int, name: str) -> int:
    """Seed of one named parameter: the first 8 bytes of ``sha256(f"{seed}/{name}")`` (63 bits).

    A cryptographic hash, rather than e.g. ``seed * 1000 + layer``, keeps nearby components' generators
    unrelated and does not depend on Python's per-process string hash randomisation.
    """
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # [B, T, D] -> [B, H, T, D/H]
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Embedding(nn.Module):
    """Token + learned position embeddings (first stage only)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(positions)[None]


class Head(nn.Module):
    """Final LayerNorm + untied LM head (last stage only)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


class StageModule(nn.Module):
    """Blocks ``first_layer..last_layer-1`` of the decoder, plus embeddings / head at the ends.

    ``forward`` takes int64 token ids ``[B, T]`` on the first stage and hidden states ``[B, T, d_model]``
    elsewhere; it returns hidden states, or logits ``[B, T, vocab_size]`` on the last stage.
    """

    def __init__(self, cfg: ModelConfig, first_layer: int, last_layer: int) -> None:
        super().__init__()
        cfg.validate()
        if not (isinstance(first_layer, int) and isinstance(last_layer, int)):
            raise ModelConfigError("stage layer range must be two integers")
        if not 0 <= first_layer < last_layer <= cfg.n_layers:
            raise ModelConfigError(
                f"stage layers [{first_layer}, {last_layer}) must satisfy 0 <= first < last <= "
                f"n_layers ({cfg.n_layers})"
            )
        self.cfg = cfg
        self.first_layer = first_layer
        self.last_layer = last_layer
        self.embed = Embedding(cfg) if self.is_first else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(first_layer, last_layer)})
        self.head = Head(cfg) if self.is_last else None
        reset_parameters(self)

    @property
    def is_first(self) -> bool:
        return self.first_layer == 0

    @property
    def is_last(self) -> bool:
        return self.last_layer == self.cfg.n_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            if x.dim() != 2 or x.dtype != torch.int64:
                raise ValueError(f"first stage expects int64 token ids [B, T], got {x.dtype} "
                                 f"{tuple(x.shape)}")
            if x.shape[1] > self.cfg.seq_len:
                raise ValueError(f"sequence length {x.shape[1]} exceeds model.seq_len {self.cfg.seq_len}")
            h = self.embed(x)
        else:
            if x.dim() != 3 or x.shape[2] != self.cfg.d_model or not x.is_floating_point():
                raise ValueError(
                    f"stage {self.first_layer}..{self.last_layer} expects float hidden states "
                    f"[B, T, {self.cfg.d_model}], got {x.dtype} {tuple(x.shape)}"
                )
            h = x
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


def reset_parameters(module: StageModule) -> None:
    """(Re)initialise every parameter from its own name-seeded generator (see the module docstring).

    Draws happen on the CPU in fp32 and are then copied into the parameter (whatever its device and dtype), so
    the values do not depend on the device's RNG implementation.
    """
    cfg = module.cfg
    residual_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, param in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if ".ln" in f".{name}" and leaf == "weight":
                values = torch.ones(param.shape)
            elif leaf == "bias":
                values = torch.zeros(param.shape)
            else:
                std = residual_std if name.endswith(("attn.proj.weight", ".out.weight")) else INIT_STD
                gen = torch.Generator().manual_seed(component_seed(cfg.seed, name))
                values = torch.randn(param.shape, generator=gen) * std
            param.copy_(values)


def build_stage(cfg: ModelConfig, first_layer: int, last_layer: int) -> StageModule:
    """Blocks ``[first_layer, last_layer)``, seeded per component; ``(0, n_layers)`` is the full model."""
    return StageModule(cfg, first_layer, last_layer)


def unflatten_stage(cfg: Any, first_layer: int, last_layer: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stage's parameters by (full-model) name from the flat vector the runtime moves around.

    The flat layout is the stage module's ``named_parameters()`` order, the order ``StageCompute`` flattens in;
    a vector of the wrong length is an error rather than a silent truncation. ``cfg`` is a ``ModelConfig`` or
    any model spec with ``stage_shapes`` (a Hugging Face one).
    """
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in cfg.stage_shapes(first_layer, last_layer):
        numel = math.prod(shape)
        out[name] = flat[offset : offset + numel].view(shape)
        offset += numel
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, stage [{first_layer}, {last_layer}) has {offset}")
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all ``B * T`` positions, computed in fp32.

    Casting to fp32 first matters in bf16/fp16: the log-sum-exp over 256 logits loses several bits in half
    precision, and the loss is what every gradient is derived from.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}")
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def is_weight_decayed(name: str, param: torch.Tensor) -> bool:
    """AdamW decays matrices (linear weights, embeddings) but not biases or LayerNorm gains.

    Decaying a LayerNorm gain pulls it towards 0, i.e. towards switching the layer off, and a bias has no
    scale to regularise; this is the usual GPT-2 / nanoGPT convention. Shared by the stage runtime and the
    single-process reference so both optimise the same objective.
    """
    del name  # the rule depends on the shape only; the name stays in the signature for the call sites
    return param.dim() >= 2
