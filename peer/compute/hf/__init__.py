"""Hugging Face model families through ``transformers``: specs, stage modules, checkpoints, export."""

from tasklet.peer.compute.hf.layout import ModelSourceError
from tasklet.peer.compute.hf.resolve import resolve_model
from tasklet.peer.compute.hf.spec import HFModelSpec

__all__ = ["HFModelSpec", "ModelSourceError", "resolve_model"]
