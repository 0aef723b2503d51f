"""How far a saved run is from single-process training: the check behind every daemon-level equivalence test.

A run saved with ``--save`` holds ``run.json`` (its configuration and losses) and one ``stage-*.pt`` per stage.
Training the same model on the same micro-batches in one process (``peer.compute.reference``) must give the
same parameters up to float summation order (docs/architecture.md, "Invariants"). Where the run's record holds
every step, the one process sums each step's micro-batches as the run's pipelines did
(``train_grouped_reference``), so the comparison does not hang on which pipeline happened to take which
micro-batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.reference import groupings_of, train_grouped_reference, train_reference
from tasklet.peer.config import RunConfig


@dataclass
class ReferenceGap:
    """``max_abs``: the largest absolute difference of any parameter; ``max_rel``: the largest difference of a
    tensor relative to that tensor's scale (misleading for a tensor still near zero, such as a young bias);
    ``loss_rel``: of the last loss; ``run``: the saved run.json; ``grouped``: whether the reference summed each
    step's micro-batches as the run's record says its pipelines did (else in micro-batch order)."""

    max_abs: float
    max_rel: float
    loss_rel: float
    run: dict[str, Any]
    grouped: bool = False


def gap_to_reference(save: Path, steps: int) -> ReferenceGap:
    """Train the saved run's model for ``steps`` steps in one process and compare with the saved stages."""
    torch.set_num_threads(1)
    run = json.loads((save / "run.json").read_text())
    spec = RunConfig.from_dict(run["config"]).spec()
    corpus = Corpus.load(spec.corpus)
    groupings = groupings_of(run.get("record") or [], steps, spec.n_microbatches)
    if groupings is not None:
        ref, ref_losses = train_grouped_reference(spec.model, spec.optim, corpus, spec.seed, groupings,
                                                  spec.micro_batch)
    else:
        ref, ref_losses = train_reference(spec.model, spec.optim, corpus, spec.seed, steps, spec.n_microbatches,
                                          spec.micro_batch)
    got: dict[str, torch.Tensor] = {}
    for f in sorted(save.glob("stage-*.pt")):
        got.update(torch.load(f, weights_only=True))
    if set(got) != set(ref):
        raise AssertionError(f"saved tensors {sorted(got)[:4]}... differ from the model's {sorted(ref)[:4]}...")
    max_abs = max(float((v - ref[k]).abs().max()) for k, v in got.items())
    max_rel = max(float((v - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k, v in got.items())
    last = run["loss"][-1] if run.get("loss") else None
    last = float("nan") if last is None else last  # a step whose loss reports were all refused has none
    loss_rel = abs(last - ref_losses[-1]) / max(abs(ref_losses[-1]), 1e-12)
    return ReferenceGap(max_abs=max_abs, max_rel=max_rel, loss_rel=loss_rel, run=run,
                        grouped=groupings is not None)
