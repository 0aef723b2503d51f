"""The byte GPT (``peer.compute.model``) as a model family: kind ``"gpt"``, the kind of a model dict without one."""

from __future__ import annotations

from typing import Any

from tasklet.peer.compute.family.base import ModelFamily
from tasklet.peer.compute.model import ModelConfig


class GPTFamily(ModelFamily):
    """The built-in byte-level decoder, shaped by ``[model] n_layers / d_model / n_heads / seq_len``."""

    kind = "gpt"
    spec_type = ModelConfig

    def from_dict(self, data: dict[str, Any]) -> ModelConfig:
        fields = {k: v for k, v in data.items() if k != "kind"}
        return ModelConfig(**fields)  # an unknown field is a TypeError; RunSpec.validate checks the values

    def to_dict(self, spec: Any) -> dict[str, Any]:
        """The fields alone: run records written before families had kinds carry none, and a dict without a kind
        is a byte GPT's."""
        return spec.to_dict()

    def from_config(self, section: Any, seed: int, tie: bool) -> ModelConfig | None:
        del tie  # nothing is tied
        if section.config:
            return None
        return ModelConfig(n_layers=section.n_layers, d_model=section.d_model, n_heads=section.n_heads,
                           seq_len=section.seq_len, seed=seed)

    def numel(self, spec: Any) -> int:
        """The closed form (no stage is built)."""
        return spec.n_layers * spec.params_per_layer() + spec.params_embedding() + spec.params_head()

    def describe(self, spec: Any) -> str:
        return f"byte GPT, {spec.n_layers} layers"
