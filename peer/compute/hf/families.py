"""Which ``transformers`` model families a stage can hold, and where their parts live.

A family is described by *names*, never by copies of its layers: the attribute that holds the base model
(``model`` for Llama/Mistral, ``transformer`` for GPT-2), the names of its embeddings, its list of decoder
layers, its final norm, and how a decoder layer is called. The layers themselves are transformers' own
modules, so a stage computes exactly what ``AutoModelForCausalLM`` computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ModelSourceError(ValueError):
    """A model config, checkpoint or tokenizer cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Family:
    """Layout of one decoder family inside its ``*ForCausalLM`` class."""

    name: str
    base: str  # attribute of the *ForCausalLM model holding the decoder ("model" / "transformer")
    token_embedding: str  # attribute of the base model
    position_embedding: str | None  # learned absolute positions (GPT-2), or None (rotary)
    layers: str  # attribute of the base model: the ModuleList of decoder layers
    final_norm: str  # attribute of the base model
    rotary: bool  # the base model has a ``rotary_emb`` whose (cos, sin) every layer takes
    sliding_window: bool  # Mistral: the mask may be a sliding window
    # config keys of the shape (transformers' attribute_map spells GPT-2's differently)
    n_layers_key: str
    hidden_key: str
    heads_key: str
    positions_key: str
    dropout_keys: tuple[str, ...]


LLAMA = Family("llama", "model", "embed_tokens", None, "layers", "norm", True, False,
               "num_hidden_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
               ("attention_dropout",))
MISTRAL = Family("mistral", "model", "embed_tokens", None, "layers", "norm", True, True,
                 "num_hidden_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                 ("attention_dropout",))
GPT2 = Family("gpt2", "transformer", "wte", "wpe", "h", "ln_f", False, False,
              "n_layer", "n_embd", "n_head", "n_positions",
              ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"))

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, GPT2)}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel"}


def family_of(config: dict[str, Any], where: str = "config") -> Family:
    """The family of a config dict; an unsupported ``model_type`` or architecture is a one-line error."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ModelSourceError(
            f"{where}: model_type: {model_type!r} is not supported (supported: {', '.join(FAMILIES)})"
        )
    archs = config.get("architectures") or []
    expected = ARCHITECTURES[model_type]
    wrong = [a for a in archs if a != expected]
    if wrong:
        raise ModelSourceError(f"{where}: architectures: {wrong[0]!r} is not supported (expected {expected})")
    return FAMILIES[model_type]


def shape_value(config: dict[str, Any], key: str, where: str) -> int:
    """A positive integer field of the config, or a one-line error naming it."""
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelSourceError(f"{where}: {key}: must be a positive integer, got {value!r}")
    return value
