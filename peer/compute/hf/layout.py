"""Where the parts of a transformers causal LM live, found by looking at the model instead of a table of families.

Nearly every decoder-only ``*ForCausalLM`` in transformers has one layout: a base model (``base_model_prefix``:
``model``, ``transformer``) holding a token embedding, one ``nn.ModuleList`` of decoder layers, a final norm and
often a rotary embedding, and an LM head on the outer model; the families differ *inside* the decoder layer,
which a stage runs as transformers' own module. :func:`find_layout` finds those parts on a model built on the
``meta`` device (no memory), plus the few operations the base model and the head apply *around* the layers
(Granite's embedding multiplier and logit scaling, Gemma-2's logit soft-capping, Cohere's logit scale), which a
stage has to repeat because it does not call the base model's ``forward``.

A model whose layout cannot be cut safely is refused with one line naming what was not found or what is not
supported (encoder-decoder, a vision tower, mixture-of-experts layers). What this module cannot see — an
operation hidden in an unknown ``forward`` — the load-time self-check (``peer.compute.hf.selfcheck``) catches.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

from torch import nn


class ModelSourceError(ValueError):
    """A model config, checkpoint or tokenizer cannot be used; the message names the file and the field."""


# The operations a base model or an LM head applies around the decoder layers that a stage repeats, by the
# config attribute that holds their constant (seen in the source of the model's forward).
EMBEDDING_OPS = ("embedding_multiplier",)  # h = embed(ids) * m             (Granite)
LOGIT_OPS = ("logits_scaling", "final_logit_softcapping", "logit_scale")  # / s; c * tanh(l / c); * s
_SCALING_NAME = re.compile(r"(?:config|self)\.(\w*(?:multiplier|scal|softcap)\w*)")
_NORM_NAME = re.compile(r"norm|ln_f", re.IGNORECASE)
_MOE_NAME = re.compile(r"experts|router|sparse|moeblock|gating", re.IGNORECASE)


@dataclass(frozen=True)
class Layout:
    """Attribute names of a causal LM's parts (``None``: the model has no such part) and its outer operations."""

    architecture: str  # the *ForCausalLM class name
    base: str  # attribute of the causal LM holding the decoder
    token_embedding: str  # attribute of the base model
    position_embedding: str | None  # learned absolute positions (GPT-2's ``wpe``)
    layers: str  # attribute of the base model: the ModuleList of decoder layers
    final_norm: str  # attribute of the base model
    rotary: str | None  # attribute of the base model computing (cos, sin) for every layer
    rotary_per_layer_type: bool  # Gemma-3: one (cos, sin) per entry of ``config.layer_types``
    lm_head: str  # attribute of the causal LM
    embedding_ops: tuple[str, ...]  # config attributes of EMBEDDING_OPS the base model applies
    logit_ops: tuple[str, ...]  # config attributes of LOGIT_OPS the head applies

    def describe(self) -> str:
        extra = [*self.embedding_ops, *self.logit_ops]
        b = self.base
        parts = [f"{b}.{self.token_embedding}", f"{b}.{self.layers}[]", f"{b}.{self.final_norm}", self.lm_head]
        return f"{self.architecture}: {', '.join(parts)}" + (f" ({', '.join(extra)})" if extra else "")


def _child_name(parent: nn.Module, child: nn.Module | None) -> str | None:
    for name, module in parent.named_children():
        if module is child:
            return name
    return None


def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def _refuse(where: str, arch: str, what: str) -> ModelSourceError:
    return ModelSourceError(f"{where}: {arch} cannot be cut into pipeline stages: {what}")


def _check_supported(model: nn.Module, config: Any, where: str, arch: str) -> None:
    """Refuse the layouts a stage cannot hold, before looking for parts."""
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(where, arch, "encoder-decoder models are not supported (only decoder-only *ForCausalLM)")
    if getattr(config, "vision_config", None) is not None or any("vision" in n.lower() or "visual" in n.lower()
                                                                  for n, _ in model.named_children()):
        raise _refuse(where, arch, "a vision tower (vision_config) is not supported; use the text-only model")
    n_experts = max(int(getattr(config, k, 0) or 0) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    from transformers import PreTrainedModel

    moe = next((type(m).__name__ for m in model.modules()  # a block inside the model, not the model's own class
                if not isinstance(m, PreTrainedModel) and not type(m).__name__.endswith("DecoderLayer")
                and _MOE_NAME.search(type(m).__name__)), None)
    if n_experts > 1 or moe:
        raise _refuse(where, arch, f"mixture-of-experts layers ({moe or f'{n_experts} experts'}) are not supported "
                                   "yet (the router's auxiliary loss is not carried between stages)")


def find_layout(model: nn.Module, config: Any, where: str) -> Layout:
    """The layout of ``model`` (a causal LM, usually on the meta device), or a one-line :class:`ModelSourceError`
    naming the first part not found or the feature not supported."""
    arch = type(model).__name__
    _check_supported(model, config, where, arch)
    base_name = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, base_name, None) if base_name else None
    if not isinstance(base, nn.Module):
        raise _refuse(where, arch, f"no base model (base_model_prefix {base_name!r} names no submodule)")
    embedding = model.get_input_embeddings()
    token_embedding = _child_name(base, embedding)
    if token_embedding is None:
        raise _refuse(where, arch, f"no token embedding directly under {base_name}")
    head = model.get_output_embeddings()
    lm_head = _child_name(model, head) if isinstance(head, nn.Linear) else None
    if lm_head is None:
        raise _refuse(where, arch, "no LM head (a Linear returned by get_output_embeddings)")
    n_layers = getattr(config, "num_hidden_layers", None)
    lists = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(lists) != 1:
        raise _refuse(where, arch, f"no single list of {n_layers} decoder layers under {base_name} "
                                   f"(found {len(lists)})")
    others = [(n, m) for n, m in base.named_children() if n not in (token_embedding, lists[0])]
    norms = [n for n, m in others if _NORM_NAME.search(type(m).__name__) or _NORM_NAME.search(n)]
    if len(norms) != 1:
        raise _refuse(where, arch, f"no single final norm under {base_name} (found {norms or 'none'})")
    rotary = [n for n, m in others if hasattr(m, "inv_freq") or "rotary" in type(m).__name__.lower()]
    positions = [n for n, m in others if type(m) is nn.Embedding]
    known = set(norms) | set(rotary) | set(positions)
    unknown = [n for n, m in others if n not in known and any(True for _ in m.parameters())]
    if unknown or len(rotary) > 1 or len(positions) > 1:
        what = unknown or (rotary if len(rotary) > 1 else positions)
        raise _refuse(where, arch, f"{base_name}.{what[0]} ({type(getattr(base, what[0])).__name__}) is a part "
                                   "the stage cut does not know")
    per_type = bool(rotary) and "layer_type" in inspect.signature(getattr(base, rotary[0]).forward).parameters
    base_src, head_src = _forward_source(type(base)), _forward_source(type(model))
    seen = set(_SCALING_NAME.findall(base_src)) | set(_SCALING_NAME.findall(head_src))
    strange = sorted(seen - set(EMBEDDING_OPS) - set(LOGIT_OPS))
    if strange:
        raise _refuse(where, arch, f"its forward applies {strange[0]} around the decoder layers, which the stage "
                                   "cut does not reproduce")
    return Layout(
        architecture=arch, base=base_name, token_embedding=token_embedding,
        position_embedding=positions[0] if positions else None, layers=lists[0], final_norm=norms[0],
        rotary=rotary[0] if rotary else None, rotary_per_layer_type=per_type, lm_head=lm_head,
        embedding_ops=tuple(k for k in EMBEDDING_OPS if k in base_src and getattr(config, k, None) is not None),
        logit_ops=tuple(k for k in LOGIT_OPS if k in head_src and getattr(config, k, None) is not None),
    )


def build_meta_model(config_obj: Any, where: str) -> Any:
    """transformers' causal LM for ``config_obj`` on the meta device (no memory), or a one-line refusal."""
    import torch

    if getattr(config_obj, "is_encoder_decoder", False):
        raise ModelSourceError(f"{where}: model_type: {config_obj.model_type!r} is an encoder-decoder model; only "
                               "decoder-only *ForCausalLM models are supported")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config_obj), None)
    if model_cls is None:
        raise ModelSourceError(f"{where}: model_type: {config_obj.model_type!r} has no *ForCausalLM class in "
                               "transformers (not a decoder-only language model)")
    try:
        with torch.device("meta"):
            return model_cls(config_obj)
    except (ValueError, TypeError, AttributeError) as exc:
        raise ModelSourceError(f"{where}: transformers cannot build {model_cls.__name__} from this config "
                               f"({str(exc).splitlines()[0][:160]})") from None
