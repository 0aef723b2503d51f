"""A pipeline stage of a transformers causal LM: a contiguous range of its decoder layers.

The stage is cut out of the real model: ``AutoModelForCausalLM.from_config`` builds the whole model on the
``meta`` device (no memory, whatever its size), the stage keeps its layers — plus the embeddings on the first
stage, the final norm and the LM head on the last — and only those are materialised. Parameter names are the
full model's (``model.layers.7.mlp.up_proj.weight``), so a stage's state dict is a subset of the model's and the
export is a plain merge.

Initial weights, when no checkpoint is given, are a pure function of (seed, parameter name) — each matrix drawn
from its own ``sha256(seed/name)``-seeded generator with transformers' ``initializer_range`` (GPT-2's residual
projections scaled by ``1/sqrt(2 n_layers)`` as transformers does), norms at 1, biases at 0 — so they do not
depend on the stage split. With a checkpoint, each stage reads only its own tensors.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from tasklet.peer.compute.hf.checkpoint import Checkpoint, model_fingerprint
from tasklet.peer.compute.hf.layout import ModelSourceError, build_meta_model
from tasklet.peer.compute.model import component_seed

log = logging.getLogger(__name__)


class HFStageModule(nn.Module):
    """Layers ``[first_layer, last_layer)`` of a transformers model; ``forward`` like the byte GPT's stage:
    int64 ids ``[B, T]`` in on the first stage, hidden states ``[B, T, d]`` elsewhere; logits out of the last."""

    def __init__(self, spec: Any, first_layer: int, last_layer: int, materialise: bool = True) -> None:
        # spec: a peer.compute.hf.spec.HFModelSpec (not imported here: spec.py builds stages, one direction)
        super().__init__()
        spec.validate()
        if not 0 <= first_layer < last_layer <= spec.n_layers:
            raise ModelSourceError(f"stage layers [{first_layer}, {last_layer}) outside 0..{spec.n_layers}")
        self.spec, self.layout = spec, spec.layout
        self.first_layer, self.last_layer = first_layer, last_layer
        self.config = spec.hf_config()
        lay = self.layout
        full = build_meta_model(self.config, spec.source or "model")
        base_full = getattr(full, lay.base)
        base = nn.Module()
        setattr(self, lay.base, base)  # parameter names start with "model." / "transformer." as in the model
        if self.is_first:
            setattr(base, lay.token_embedding, getattr(base_full, lay.token_embedding))
            if lay.position_embedding:
                setattr(base, lay.position_embedding, getattr(base_full, lay.position_embedding))
        layers = getattr(base_full, lay.layers)
        setattr(base, lay.layers, nn.ModuleDict({str(i): layers[i] for i in range(first_layer, last_layer)}))
        if self.is_last:
            setattr(base, lay.final_norm, getattr(base_full, lay.final_norm))
            setattr(self, lay.lm_head, getattr(full, lay.lm_head))
        if lay.rotary:  # no parameters; its frequencies are buffers, recomputed below
            self.rotary_emb = getattr(base_full, lay.rotary)
        self._init_buffers = type(full)._init_weights.__get__(full)  # transformers' own (buffers: rotary, scales)
        self.loaded_from: Checkpoint | None = None
        if not materialise:  # names and shapes only (parameters stay on the meta device)
            return
        self.to_empty(device="cpu")
        self._recompute_buffers()
        if spec.checkpoint is None:
            self._init_seeded()
        else:
            self._load(Checkpoint(spec.checkpoint))
        self.train()

    def _recompute_buffers(self) -> None:
        """Buffers are not weights (rotary frequencies, Gemma's embedding scale): ``to_empty`` leaves garbage in
        them, so they are recomputed from the config by transformers' own initialiser, in fp32, leaving the
        parameters of the same modules (an embedding holding a scale) as they are."""
        for module in self.modules():
            names = [name for name, _ in module.named_buffers(recurse=False)]
            if names:
                for name in names:
                    setattr(module, name, getattr(module, name).float())
                params = list(module.parameters(recurse=False))
                for p in params:  # transformers' init skips tensors flagged initialised: the weights stay
                    p._is_hf_initialized = True
                try:
                    self._init_buffers(module)
                finally:
                    for p in params:
                        del p._is_hf_initialized
    @property
    def is_first(self) -> bool:
        return self.first_layer == 0

    @property
    def is_last(self) -> bool:
        return self.last_layer == self.spec.n_layers

    def _base(self) -> nn.Module:
        return getattr(self, self.layout.base)

    # ------------------------------------------------------------------------------------------ parameters
    def _source_name(self, name: str) -> str:
        """The tensor a parameter starts from: the embedding for an untied head of a tied model."""
        if name == f"{self.layout.lm_head}.weight" and self.spec.tied:
            return f"{self.layout.base}.{self.layout.token_embedding}.weight"
        return name

    def _init_seeded(self) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        residual_std = std / math.sqrt(2 * self.spec.n_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if param.dim() == 1:
                    values = torch.ones(param.shape) if leaf == "weight" else torch.zeros(param.shape)
                else:
                    source = self._source_name(name)
                    scaled = source.endswith("c_proj.weight")  # GPT-2 style residual projections
                    gen = torch.Generator().manual_seed(component_seed(self.spec.seed, source))
                    values = torch.randn(param.shape, generator=gen) * (residual_std if scaled else std)
                param.copy_(values)

    def _load(self, ckpt: Checkpoint) -> None:
        mine = model_fingerprint(self.spec.config, ckpt)
        if self.spec.fingerprint and mine != self.spec.fingerprint:
            raise ModelSourceError(f"{ckpt.folder}: this peer's checkpoint (fingerprint {mine[:12]}) differs from "
                                   f"the run's ({self.spec.fingerprint[:12]})")
        wanted: dict[str, str] = {}
        for name, _ in self.named_parameters():
            found = ckpt.resolve(self._source_name(name), self.layout.base) or ckpt.resolve(name, self.layout.base)
            if found is None:
                raise ModelSourceError(f"{ckpt.folder}: tensor {name} is missing from the checkpoint")
            wanted[name] = found
        tensors = ckpt.read(wanted)
        with torch.no_grad():
            for name, param in self.named_parameters():
                t = tensors[name]
                if tuple(t.shape) != tuple(param.shape):
                    raise ModelSourceError(f"{ckpt.folder}: tensor {wanted[name]} has shape {tuple(t.shape)}, "
                                           f"the config says {tuple(param.shape)}")
                param.copy_(t.float())
        self.loaded_from = ckpt

    def _apply(self, fn: Any, recurse: bool = True) -> HFStageModule:
        """Keep buffers in fp32 when the stage is cast to bf16/fp16 (as transformers computes rotary frequencies):
        rounding ``inv_freq`` to 8 bits of mantissa would shift every position's angle."""
        super()._apply(fn, recurse)
        self._tie()
        if self.__dict__.get("_init_buffers") is not None and any(
                b.is_floating_point() and b.dtype != torch.float32 for b in self.buffers()):
            device = next(self.buffers()).device
            for module in self.modules():
                for name, b in list(module.named_buffers(recurse=False)):
                    setattr(module, name, b.to(torch.float32))
            with torch.device(device):
                self._recompute_buffers()
        return self

    def _tie(self) -> None:
        """A stage holding both ends of tied embeddings (a one-stage plan) keeps them one parameter, as the model
        does: moving the modules (``to_empty`` off the meta device) gives each module a parameter of its own, and
        two copies trained apart would part."""
        if getattr(self.spec, "keep_tied", False) and self.is_first and self.is_last:
            embedding = getattr(self._base(), self.layout.token_embedding)
            getattr(self, self.layout.lm_head).register_parameter("weight", embedding.weight)

    # --------------------------------------------------------------------------------------------- forward
    def _masks(self, h: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
        """The attention mask of each layer type, as the base model builds them (causal; sliding window where the
        config asks for one)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = {"config": self.config, "inputs_embeds": h, "attention_mask": None, "cache": None,
                  "position_ids": positions}
        types = set(getattr(self.config, "layer_types", None) or ())
        if not types:
            sliding = getattr(self.config, "sliding_window", None) is not None
            return {"": (create_sliding_window_causal_mask if sliding else create_causal_mask)(**kwargs)}
        makers = {"sliding_attention": create_sliding_window_causal_mask}
        return {t: makers.get(t, create_causal_mask)(**kwargs) for t in types}

    def _layer_type(self, index: int) -> str:
        types = getattr(self.config, "layer_types", None)
        return types[index] if types else ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lay, base = self.layout, self._base()
        if self.is_first:
            if x.dim() != 2 or x.dtype != torch.int64:
                raise ValueError(f"first stage expects int64 token ids [B, T], got {x.dtype} {tuple(x.shape)}")
            if x.shape[1] > self.spec.seq_len:
                raise ValueError(f"sequence length {x.shape[1]} exceeds the run's seq_len {self.spec.seq_len}")
            h = getattr(base, lay.token_embedding)(x)
            for key in lay.embedding_ops:  # embedding_multiplier
                h = h * getattr(self.config, key)
        else:
            if x.dim() != 3 or x.shape[2] != self.spec.d_model or not x.is_floating_point():
                raise ValueError(f"stage {self.first_layer}..{self.last_layer} expects float hidden states "
                                 f"[B, T, {self.spec.d_model}], got {x.dtype} {tuple(x.shape)}")
            h = x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if self.is_first and lay.position_embedding:
            h = h + getattr(base, lay.position_embedding)(positions)
        masks = self._masks(h, positions)
        rotary: dict[str, Any] = {}
        if lay.rotary:
            types = set(getattr(self.config, "layer_types", None) or ()) if lay.rotary_per_layer_type else set()
            rotary = ({t: self.rotary_emb(h, positions, t) for t in types} if types
                      else {"": self.rotary_emb(h, positions)})
        for index, layer in getattr(base, lay.layers).items():
            kind = self._layer_type(int(index))
            extra = {"position_embeddings": rotary[kind if kind in rotary else ""]} if rotary else {}
            out = layer(h, attention_mask=masks[kind if kind in masks else ""], position_ids=positions, **extra)
            h = out[0] if isinstance(out, tuple) else out
        if self.is_last:
            h = getattr(self, lay.lm_head)(getattr(base, lay.final_norm)(h))
            h = apply_logit_ops(h, lay.logit_ops, self.config)
        return h


def apply_logit_ops(logits: torch.Tensor, ops: tuple[str, ...], config: Any) -> torch.Tensor:
    """What the causal LM's forward does to the head's output, for the ops :mod:`layout` found."""
    for key in ops:
        value = getattr(config, key)
        if key == "logits_scaling":
            logits = logits / value
        elif key == "final_logit_softcapping":
            logits = torch.tanh(logits / value) * value
        elif key == "logit_scale":
            logits = logits * value
    return logits


def full_model(spec: Any) -> nn.Module:
    """The whole transformers model with the weights a one-stage split of ``spec`` starts from (the reference)."""
    from transformers import AutoModelForCausalLM

    stage = HFStageModule(spec, 0, spec.n_layers)
    model = AutoModelForCausalLM.from_config(spec.hf_config())
    missing, unexpected = model.load_state_dict(stage.state_dict(), strict=False)
    params = {n for n, _ in model.named_parameters()}
    if params & set(missing) or unexpected:
        raise RuntimeError(f"stage and model names differ: missing {sorted(params & set(missing))[:3]}, "
                           f"unexpected {unexpected[:3]}")
    return model
