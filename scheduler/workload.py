"""What is trained: a GPT-shaped transformer, its batch split, and the per-stage figures derived from it.

Per transformer layer of width ``d`` (pre-LN GPT block, untied LM head):
    params  = 12 d^2 + 13 d      (QKV 3d^2+3d, out-proj d^2+d, MLP 8d^2+5d, two LayerNorms 4d)
    forward = 24 b s d^2 + 4 b s^2 d  FLOPs per micro-batch of b sequences of s tokens
              (2 FLOPs per multiply-add over the 12 d^2 weight matrix entries for every token, plus the
              QK^T and attention-times-V products, 2 b s^2 d each).
The stage holding layer 0 also holds the token and position embeddings (V d + s d params; a lookup, so only
the 2 b s d FLOPs of adding them); the stage holding the last layer holds the final LayerNorm and the LM head
(2 d + V d params, 2 b s d V FLOPs). Backward costs twice the forward (weights and inputs gradients).

The runtime emulates compute by making each op last ``stage_forward_flops / (tflops * 1e12)``, and the
``full`` cost model uses the same numbers, so prediction and emulation share one formula.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .errors import PlanningError

# The paper's constants (GPT3-XL, DT-FM code): 1.3e9 fp32 parameters -> G = 1.3e9 * 4 B / S per stage;
# A = 2024 x 2048 x 2 B x (1.25e5 / 2048) / 2^30 "GB" of fp16 activations per micro-batch task. The paper's
# cost formula multiplies these "GB" by 8 and divides by Gbit/s, so in bytes they are x 1e9.
DTFM_GPT3_XL_MODEL_BYTES = 1.3e9 * 4
DTFM_GPT3_XL_ACTIVATION_BYTES = 2024 * 2048 * 2 * (1.25e5 / 2048) / 2**30 * 1e9

ADAM_STATE_BYTES_PER_PARAM = 8  # two fp32 moments


@dataclass
class Workload:
    """Model shape and batch split; ``stages`` / ``replicas`` None lets the planner choose them."""

    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab: int
    micro_batch: int
    n_microbatches: int
    stages: int | None = None
    replicas: int | None = None
    param_bytes: int = 4
    act_bytes: int = 4
    name: str = "gpt"
    # Overrides used only by the ``dtfm`` model, to reproduce the paper's constants exactly.
    dtfm_model_bytes: float | None = None
    dtfm_activation_bytes: float | None = None

    def __post_init__(self) -> None:
        for f in ("n_layers", "d_model", "n_heads", "seq_len", "vocab", "micro_batch", "n_microbatches",
                  "param_bytes", "act_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanningError(f, f"must be a positive integer, got {v!r}")
        if self.d_model % self.n_heads:
            raise PlanningError("n_heads", f"must divide d_model={self.d_model}")
        for f in ("stages", "replicas"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise PlanningError(f, f"must be a positive integer or null, got {v!r}")
        if self.stages is not None and self.stages > self.n_layers:
            raise PlanningError("stages", f"{self.stages} stages for {self.n_layers} layers")
        for f in ("dtfm_model_bytes", "dtfm_activation_bytes"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, (int, float)) or not v > 0):
                raise PlanningError(f, f"must be a positive number or null, got {v!r}")

    # ------------------------------------------------------------- constructors
    @classmethod
    def gpt(cls, n_layers: int, d_model: int, n_heads: int, seq_len: int, vocab: int, micro_batch: int,
            n_microbatches: int, stages: int | None = None, replicas: int | None = None, param_bytes: int = 4,
            act_bytes: int = 4) -> Workload:
        return cls(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq_len=seq_len, vocab=vocab,
                   micro_batch=micro_batch, n_microbatches=n_microbatches, stages=stages, replicas=replicas,
                   param_bytes=param_bytes, act_bytes=act_bytes)

    @classmethod
    def preset(cls, name: str) -> Workload:
        """Named workloads. ``gpt3-xl-dtfm``: the paper's GPT3-XL, 8 stages x 8 replicas, its G and A.

        The shape (24 layers, d 2048, seq 2048) is GPT3-XL's; 128 micro-batches of 4 sequences make the
        0.5 M-token batch of GPT-3 XL for the ``full`` model. ``dtfm`` ignores the shape and uses the paper's
        constants (G = 0.65 GB per stage, A = 0.47125 GB per micro-batch task).
        """
        if name == "gpt3-xl-dtfm":
            return cls(n_layers=24, d_model=2048, n_heads=16, seq_len=2048, vocab=50257, micro_batch=4,
                       n_microbatches=128, stages=8, replicas=8, param_bytes=4, act_bytes=2, name=name,
                       dtfm_model_bytes=DTFM_GPT3_XL_MODEL_BYTES,
                       dtfm_activation_bytes=DTFM_GPT3_XL_ACTIVATION_BYTES)
        if name == "tiny":
            return cls(n_layers=4, d_model=64, n_heads=4, seq_len=64, vocab=256, micro_batch=2,
                       n_microbatches=8, name=name)
        raise PlanningError("workload", f"unknown preset {name!r} (have: gpt3-xl-dtfm, tiny)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        if not isinstance(d, dict):
            raise PlanningError("workload", "must be a JSON object")
        if "preset" in d:
            base = asdict(cls.preset(str(d["preset"])))
            base.update({k: v for k, v in d.items() if k != "preset"})
            d = base
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanningError(unknown[0], "unknown workload field")
        missing = [f for f in ("n_layers", "d_model", "n_heads", "seq_len", "vocab", "micro_batch",
                               "n_microbatches") if f not in d]
        if missing:
            raise PlanningError(missing[0], "missing")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Workload:
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise PlanningError("workload", f"no such file: {path}") from exc
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PlanningError("workload", f"cannot read {path}: {exc}") from exc
        return cls.from_dict(doc)

    @classmethod
    def resolve(cls, spec: str) -> Workload:
        """A preset name or a path to a JSON file."""
        if spec.endswith(".json") or os.path.sep in spec:
            return cls.from_json(spec)
        return cls.preset(spec)

    def with_split(self, stages: int, replicas: int) -> Workload:
        d = asdict(self)
        d.update(stages=stages, replicas=replicas)
        return Workload(**d)

    # ---------------------------------------------------------- per-layer facts
    @property
    def layer_params(self) -> int:
        d = self.d_model
        return 12 * d * d + 13 * d

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.d_model + self.seq_len * self.d_model

    @property
    def head_params(self) -> int:
        return self.vocab * self.d_model + 2 * self.d_model

    @property
    def total_params(self) -> int:
        return self.n_layers * self.layer_params + self.embedding_params + self.head_params

    def _check_range(self, a: int, b: int) -> None:
        if not 0 <= a < b <= self.n_layers:
            raise PlanningError("stages", f"layer range [{a}, {b}) outside 0..{self.n_layers}")

    def stage_params(self, a: int, b: int) -> int:
        self._check_range(a, b)
        p = (b - a) * self.layer_params
        if a == 0:
            p += self.embedding_params
        if b == self.n_layers:
            p += self.head_params
        return p

    def stage_forward_flops(self, a: int, b: int) -> float:
        """Forward FLOPs of layers [a, b) for one micro-batch, with embedding / head where they live."""
        self._check_range(a, b)
        bs, s, d = self.micro_batch, self.seq_len, self.d_model
        f = (b - a) * (24.0 * bs * s * d * d + 4.0 * bs * s * s * d)
        if a == 0:
            f += 2.0 * bs * s * d
        if b == self.n_layers:
            f += 2.0 * bs * s * d * self.vocab + 10.0 * bs * s * d
        return f

    def stage_param_bytes(self, a: int, b: int) -> float:
        """Bytes of the stage's weights, which is also the size of its gradient in data-parallel sync."""
        return float(self.stage_params(a, b) * self.param_bytes)

    def activation_bytes(self) -> float:
        """Bytes crossing a stage boundary per micro-batch: the hidden states, b x s x d values."""
        return float(self.micro_batch * self.seq_len * self.d_model * self.act_bytes)

    def stage_memory_bytes(self, a: int, b: int, in_flight: int) -> float:
        """Weights + gradients + AdamW moments + stashed activations of ``in_flight`` micro-batches.

        Activations are checkpointed per layer (each layer's input kept, the rest recomputed), so a
        micro-batch in flight costs ``(b - a) * activation_bytes``; the last stage also holds the logits.
        """
        p = self.stage_params(a, b)
        mem = p * (2 * self.param_bytes + ADAM_STATE_BYTES_PER_PARAM)
        mem += in_flight * (b - a) * self.activation_bytes()
        if b == self.n_layers:
            mem += self.micro_batch * self.seq_len * self.vocab * self.act_bytes
        return float(mem)

    # ------------------------------------------------------------- dtfm figures
    def dtfm_gradient_bytes(self, stages: int) -> float:
        """G of the paper: the fp32 gradient of one stage, model bytes spread evenly over the stages."""
        total = self.dtfm_model_bytes if self.dtfm_model_bytes is not None else self.total_params * 4.0
        return total / stages

    def dtfm_activation_bytes_per_task(self) -> float:
        """A of the paper: the activation of one micro-batch task."""
        if self.dtfm_activation_bytes is not None:
            return self.dtfm_activation_bytes
        return self.activation_bytes()
