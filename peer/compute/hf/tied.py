"""Tied input and output embeddings across pipeline stages: one weight, two copies, one summed gradient.

Most small models tie the LM head to the token embedding. With two or more stages the embedding lives on the
first stage and the head on the last, so each holds a copy of the weight. The model's gradient of that weight is
the *sum* of both uses', so after the replicas of each stage have summed their gradients, the first and the last
stage exchange the tied slice and both add the other's; both then take the same AdamW step on the same
gradient from the same state, and the copies stay identical (bitwise: same arithmetic in the same order). For
gradient clipping the tied weight counts once in the global norm, not once per copy.

This module is the compute side: which slice of each stage's flat vector is tied, the sum, the norm correction.
Moving the slice between the first and the last stage is the runtime's (``peer.runtime.stage.tied``: one
message each way per step). The swarm does not clip gradients yet, so ``tied_sq_norm`` serves the one-process
path only.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def tied_names(spec: Any) -> tuple[str, str] | None:
    """(embedding name, head name) of a spec that keeps its embeddings tied, else ``None``."""
    if not getattr(spec, "keep_tied", False):
        return None
    lay = spec.layout
    return f"{lay.base}.{lay.token_embedding}.weight", f"{lay.lm_head}.weight"


def tied_slice(spec: Any, first_layer: int, last_layer: int) -> tuple[int, int] | None:
    """``(start, end)`` of the tied weight in the flat vector of stage ``[first_layer, last_layer)``: the
    embedding on the first stage, the head on the last; ``None`` on other stages, on a stage holding both (one
    parameter there: nothing to sum) and for an untied model."""
    names = tied_names(spec)
    if names is None or (first_layer == 0 and last_layer == spec.n_layers):
        return None
    offset = 0
    found: list[tuple[int, int]] = []
    for name, shape in spec.stage_shapes(first_layer, last_layer):
        numel = math.prod(shape)
        if name in names:
            found.append((offset, offset + numel))
        offset += numel
    return found[0] if len(found) == 1 else None


def sum_tied(first: torch.Tensor, last: torch.Tensor, first_slice: tuple[int, int],
             last_slice: tuple[int, int]) -> None:
    """Add each stage's gradient of the tied weight to the other's, in place (the first stage's summed gradient
    and the last stage's); both slices then hold ``first + last`` computed in that order."""
    a, b = first[first_slice[0]:first_slice[1]], last[last_slice[0]:last_slice[1]]
    total = a + b
    a.copy_(total)
    b.copy_(total)


def tied_sq_norm(summed: torch.Tensor, tied: tuple[int, int], n_microbatches: int) -> float:
    """``||slice / n||^2`` of the tied weight, to subtract once from the sum of the stages' squared norms (each of
    the two stages counted it)."""
    return float(((summed[tied[0]:tied[1]].double() / n_microbatches) ** 2).sum())
