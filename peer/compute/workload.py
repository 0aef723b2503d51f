"""The scheduler's description of a run's model and batch, from its spec: what the planner prices and what a
worker bounds a stage's memory by (``peer.runtime.bounds``), one figure for both so an honest plan always fits."""

from __future__ import annotations

from typing import Any

from tasklet.peer.compute.hf import HFModelSpec
from tasklet.scheduler.model_workload import Workload, from_hf_config


def workload_for(spec: Any, stages: int | None = None, replicas: int | None = None) -> Workload:
    """The scheduler's description of a ``RunSpec``'s model and batch (4-byte params, activations in fp32/bf16);
    a Hugging Face model's figures come from its config (``scheduler.model_workload``)."""
    m = spec.model
    if isinstance(m, HFModelSpec):
        return from_hf_config(m.config, m.seq_len, spec.micro_batch, spec.n_microbatches, spec.precision,
                              stages, replicas, name=m.source)
    act_bytes = 4 if spec.precision == "fp32" else 2
    return Workload.gpt(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, seq_len=m.seq_len,
                        vocab=m.vocab_size, micro_batch=spec.micro_batch, n_microbatches=spec.n_microbatches,
                        stages=stages, replicas=replicas, param_bytes=4, act_bytes=act_bytes)
