"""Plain single-process training of the full model: the yardstick of the equivalence invariant.

Deliberately the textbook loop — one ``nn.Module``, ``loss.backward()`` accumulating into ``.grad``,
``torch.optim.AdamW`` — sharing with the stage runtime only what defines the *problem* (model, data order,
loss, which parameters are decayed, the clip formula), never the machinery (flat buffers, the exactly-once
sum, master copies). A bug in that machinery then shows up as a difference.

Each step uses micro-batches ``0..n_microbatches-1`` of :func:`peer.compute.data.microbatch`, and its loss is the mean
of their losses, so the gradient is ``(1/n) sum_m dL_m/dθ`` — what the pipeline computes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from peer.compute.data import Corpus, microbatch
from peer.compute.model import ModelConfig, build_stage, is_weight_decayed, lm_loss
from peer.compute.stage import OptimConfig, clip_coefficient

log = logging.getLogger(__name__)


def train_reference(
    model_cfg: ModelConfig | Any,
    optim_cfg: OptimConfig,
    corpus: Corpus,
    seed: int,
    steps: int,
    n_microbatches: int,
    micro_batch: int,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train the full model for ``steps`` steps on the CPU in fp32; return ``(state_dict, per_step_losses)``.

    The state dict's names are the full model's (``blocks.3.fc.weight``), i.e. the same names a stage uses.
    For a Hugging Face model spec the model is transformers' own ``AutoModelForCausalLM`` (not the stage module),
    started from the same weights, so the comparison also checks the stage split against the library.
    """
    model_cfg.validate()
    optim_cfg.validate()
    if steps < 0 or n_microbatches < 1 or micro_batch < 1:
        raise ValueError(f"need steps >= 0, n_microbatches >= 1, micro_batch >= 1; got {steps}, "
                         f"{n_microbatches}, {micro_batch}")
    model, forward = _full_model(model_cfg)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if is_weight_decayed(n, p)], "weight_decay": optim_cfg.weight_decay},
        {"params": [p for n, p in named if not is_weight_decayed(n, p)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=optim_cfg.lr,
                                  betas=optim_cfg.betas, eps=optim_cfg.eps)
    losses: list[float] = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for mb in range(n_microbatches):
            inputs, targets = microbatch(corpus, seed, step, mb, micro_batch, model_cfg.seq_len)
            loss = lm_loss(forward(inputs), targets)
            (loss / n_microbatches).backward()
            step_loss += float(loss.detach())
        if optim_cfg.grad_clip is not None:
            norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for _, p in named if p.grad is not None))
            coef = clip_coefficient(norm, optim_cfg.grad_clip)
            if coef < 1.0:
                for _, p in named:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        optimizer.step()
        losses.append(step_loss / n_microbatches)
        log.debug("reference step %d loss %.6f", step, losses[-1])
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _full_model(model_cfg: ModelConfig | Any) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The whole model and its ids -> logits function."""
    if isinstance(model_cfg, ModelConfig):
        model = build_stage(model_cfg, 0, model_cfg.n_layers)
        return model, model
    from peer.compute.hf.stage import full_model

    hf_model = full_model(model_cfg)
    hf_model.train()
    return hf_model, lambda ids: hf_model(input_ids=ids).logits
