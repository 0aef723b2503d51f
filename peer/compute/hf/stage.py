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

from peer.compute.hf.checkpoint import Checkpoint, model_fingerprint
from peer.compute.hf.families import ModelSourceError
from peer.compute.model import component_seed

log = logging.getLogger(__name__)


class HFStageModule(nn.Module):
    """Layers ``[first_layer, last_layer)`` of a transformers model; ``forward`` like the byte GPT's stage:
    int64 ids ``[B, T]`` in on the first stage, hidden states ``[B, T, d]`` elsewhere; logits out of the last."""

    def __init__(self, spec: Any, first_layer: int, last_layer: int, materialise: bool = True) -> None:
        # spec: a peer.compute.hf.spec.HFModelSpec (not imported here: spec.py builds stages, one direction)
        super().__init__()
        from transformers import AutoModelForCausalLM

        spec.validate()
        if not 0 <= first_layer < last_layer <= spec.n_layers:
            raise ModelSourceError(f"stage layers [{first_layer}, {last_layer}) outside 0..{spec.n_layers}")
        self.spec, self.family = spec, spec.family
        self.first_layer, self.last_layer = first_layer, last_layer
        self.config = spec.hf_config()
        fam = self.family
        with torch.device("meta"):
            full = AutoModelForCausalLM.from_config(self.config)
        base_full = getattr(full, fam.base)
        base = nn.Module()
        setattr(self, fam.base, base)  # parameter names start with "model." / "transformer." as in the model
        if self.is_first:
            setattr(base, fam.token_embedding, getattr(base_full, fam.token_embedding))
            if fam.position_embedding:
                setattr(base, fam.position_embedding, getattr(base_full, fam.position_embedding))
        layers = getattr(base_full, fam.layers)
        setattr(base, fam.layers, nn.ModuleDict({str(i): layers[i] for i in range(first_layer, last_layer)}))
        if self.is_last:
            setattr(base, fam.final_norm, getattr(base_full, fam.final_norm))
            self.lm_head = full.lm_head
        rotary_cls = type(base_full.rotary_emb) if fam.rotary else None
        del full, base_full
        self.loaded_from: Checkpoint | None = None
        if not materialise:  # names and shapes only (parameters stay on the meta device)
            self.rotary_emb = None
            return
        self.to_empty(device="cpu")
        # rotary frequencies are buffers computed from the config, rebuilt on the CPU (to_empty leaves garbage)
        self.rotary_emb = rotary_cls(config=self.config) if rotary_cls is not None else None
        if spec.checkpoint is None:
            self._init_seeded()
        else:
            self._load(Checkpoint(spec.checkpoint))
        self.train()

    @property
    def is_first(self) -> bool:
        return self.first_layer == 0

    @property
    def is_last(self) -> bool:
        return self.last_layer == self.spec.n_layers

    def _base(self) -> nn.Module:
        return getattr(self, self.family.base)

    # ------------------------------------------------------------------------------------------ parameters
    def _source_name(self, name: str) -> str:
        """The tensor a parameter starts from: the embedding for an untied head of a tied model."""
        if name == "lm_head.weight" and self.spec.tied:
            return f"{self.family.base}.{self.family.token_embedding}.weight"
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
                    scaled = self.family.name == "gpt2" and source.endswith("c_proj.weight")
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
            found = ckpt.resolve(self._source_name(name), self.family.base) or ckpt.resolve(name, self.family.base)
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
        """Keep the rotary frequencies in fp32 when the stage is cast to bf16/fp16 (as transformers computes
        them): rounding ``inv_freq`` to 8 bits of mantissa would shift every position's angle."""
        super()._apply(fn, recurse)
        rotary = self.__dict__.get("_modules", {}).get("rotary_emb")
        if rotary is not None and hasattr(rotary, "original_inv_freq"):
            fresh = type(rotary)(config=self.config)
            device = rotary.inv_freq.device
            rotary.inv_freq = fresh.inv_freq.to(device)
            rotary.original_inv_freq = fresh.original_inv_freq.to(device)
        return self

    # --------------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        fam, base = self.family, self._base()
        if self.is_first:
            if x.dim() != 2 or x.dtype != torch.int64:
                raise ValueError(f"first stage expects int64 token ids [B, T], got {x.dtype} {tuple(x.shape)}")
            if x.shape[1] > self.spec.seq_len:
                raise ValueError(f"sequence length {x.shape[1]} exceeds the run's seq_len {self.spec.seq_len}")
            h = getattr(base, fam.token_embedding)(x)
        else:
            if x.dim() != 3 or x.shape[2] != self.spec.d_model or not x.is_floating_point():
                raise ValueError(f"stage {self.first_layer}..{self.last_layer} expects float hidden states "
                                 f"[B, T, {self.spec.d_model}], got {x.dtype} {tuple(x.shape)}")
            h = x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if self.is_first and fam.position_embedding:
            h = h + getattr(base, fam.position_embedding)(positions)
        sliding = fam.sliding_window and getattr(self.config, "sliding_window", None) is not None
        make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
        mask = make_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                         position_ids=positions)
        rotary = self.rotary_emb(h, positions) if self.rotary_emb is not None else None
        for layer in getattr(base, fam.layers).values():
            if fam.rotary:
                h = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            else:
                h = layer(h, None, mask, position_ids=positions)
        if self.is_last:
            h = self.lm_head(getattr(base, fam.final_norm)(h))
        return h


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
