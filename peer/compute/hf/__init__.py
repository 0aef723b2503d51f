"""Hugging Face model families through ``transformers``: specs, stage modules, checkpoints, export."""

from peer.compute.hf.layout import ModelSourceError
from peer.compute.hf.resolve import resolve_model
from peer.compute.hf.spec import HFModelSpec

__all__ = ["HFModelSpec", "ModelSourceError", "resolve_model"]
