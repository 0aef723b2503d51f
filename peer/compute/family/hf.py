"""Hugging Face causal LMs (``peer.compute.hf``) as a model family: kind ``"hf"``.

Which architectures a stage can cut is not a table here: ``peer.compute.hf.layout`` finds the parts of any
decoder-only ``*ForCausalLM`` by looking at the model, and refuses the ones it cannot cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from tasklet.peer.compute.family.base import ModelFamily, check_same_model
from tasklet.peer.compute.hf.spec import HFModelSpec
from tasklet.scheduler.model_workload import Workload, from_hf_config


class HFFamily(ModelFamily):
    """A transformers config (preset, config.json or model folder), seeded or loaded from a local checkpoint."""

    kind = "hf"
    spec_type = HFModelSpec

    def from_dict(self, data: dict[str, Any]) -> HFModelSpec:
        return HFModelSpec.from_dict(data)

    def to_dict(self, spec: Any) -> dict[str, Any]:
        return spec.to_dict()  # carries its kind already

    def from_config(self, section: Any, seed: int, tie: bool) -> HFModelSpec | None:
        if not section.config:
            return None
        from tasklet.peer.compute.hf.resolve import resolve_model_cached

        return resolve_model_cached(section.config, section.seq_len, seed, tie=tie)

    def workload(self, run: Any, stages: int | None, replicas: int | None) -> Workload:
        """Figures measured from the config's own model on the meta device (``scheduler.model_workload``)."""
        m = run.model
        return from_hf_config(m.config, m.seq_len, run.micro_batch, run.n_microbatches, run.precision, stages,
                              replicas, name=m.source)

    def full_model(self, spec: Any) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
        """transformers' own model (not the stage module) from the same weights, so the reference also checks the
        stage cut against the library."""
        from tasklet.peer.compute.hf.stage import full_model

        hf_model = full_model(spec)
        hf_model.train()
        return hf_model, lambda ids: hf_model(input_ids=ids).logits

    def keeps_tied(self, spec: Any) -> bool:
        return bool(spec.keep_tied)

    def tied_slice(self, spec: Any, first_layer: int, last_layer: int) -> tuple[int, int] | None:
        from tasklet.peer.compute.hf.tied import tied_slice

        return tied_slice(spec, first_layer, last_layer)

    def describe(self, spec: Any) -> str:
        return spec.source or f"Hugging Face {spec.config.get('model_type')}"

    def fingerprint(self, spec: Any) -> str:
        return spec.fingerprint

    def with_local_files(self, sent: Any, local: Any) -> Any:
        """This peer's checkpoint folder and source name (the same config and weights: same fingerprint)."""
        check_same_model(self, sent, local)
        return replace(sent, checkpoint=local.checkpoint, source=local.source)
