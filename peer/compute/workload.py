"""The scheduler's description of a run's model and batch, from its spec: what the planner prices and what a
worker bounds a stage's memory by (``peer.runtime.bounds``), one figure for both so an honest plan always fits."""

from __future__ import annotations

from typing import Any

from tasklet.peer.compute.family import family_of
from tasklet.scheduler.model_workload import Workload


def workload_for(spec: Any, stages: int | None = None, replicas: int | None = None) -> Workload:
    """The scheduler's description of a ``RunSpec``'s model and batch (4-byte params, activations in fp32/bf16),
    as the model's family gives it (a Hugging Face model's figures come from its config,
    ``scheduler.model_workload``)."""
    return family_of(spec.model).workload(spec, stages, replicas)
