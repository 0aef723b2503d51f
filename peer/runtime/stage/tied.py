"""Tied embeddings across a pipeline: the first and the last stage sum their gradients of the one weight.

A model that ties its LM head to its token embedding keeps, in a plan of two or more stages, two copies of that
weight: the embedding on the first stage, the head on the last (``peer.compute.hf.tied``). After a stage's
replicas have averaged and verified their summed gradient, the first and the last stage of each pipeline send
each other the tied slice of it (Kind ``TIED_GRAD``, one message each way per step attempt) and both replace
their slice with ``first + last`` before they report the step reduced, so the two-phase apply still holds.
Every replica of a stage holds the same summed gradient, so every replica of both stages ends with the same
tied gradient and takes the same AdamW step from the same state: the copies stay bitwise equal. A one-stage
plan holds the weight once and exchanges nothing.

What arrives is bounded before it is held: only the peer at the other end of this pipeline may send it, its
tensor must be float32 of exactly the tied weight's size and finite, and at most one per step attempt is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tasklet.peer.compute.family import family_of
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.wire import envelope
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.errors import Rejected

ATTEMPT_META = "attempt"


@dataclass(frozen=True)
class TiedEnd:
    """This stage's end of the tie: ``[lo, hi)`` of its flat vector, and the other end of its pipeline."""

    lo: int
    hi: int
    first: bool  # this stage holds the embedding (else the head)
    partner: str  # endpoint of the other end in this pipeline
    partner_stage: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def tied_end(spec: RunSpec, a: Assignment) -> TiedEnd | None:
    """This stage's end of a tied weight, or ``None``: an untied model, a middle stage, one stage holding both."""
    family = family_of(spec.model)
    if not family.keeps_tied(spec.model) or a.n_stages < 2 or not (a.is_first or a.is_last):
        return None
    found = family.tied_slice(spec.model, a.layers[0], a.layers[1])
    if found is None:
        return None
    if len(a.pipeline) != a.n_stages:
        raise Rejected("a tied model's assignment must name its pipeline's endpoints (assignment.pipeline)")
    partner_stage = a.n_stages - 1 if a.is_first else 0
    return TiedEnd(found[0], found[1], a.is_first, a.pipeline[partner_stage], partner_stage)


def tied_envelope(key: pb.Key, attempt: int, grad: torch.Tensor) -> pb.Envelope:
    """The message carrying this end's summed gradient of the tied weight for ``attempt`` of ``key.step``."""
    env = envelope(pb.TIED_GRAD, key, {"grad": grad})
    env.meta[ATTEMPT_META] = str(attempt)
    return env


def combine(end: TiedEnd, summed: torch.Tensor, theirs: torch.Tensor) -> None:
    """Replace the tied slice of ``summed`` by ``first + last`` in place (the same order on both ends)."""
    mine = summed[end.lo:end.hi]
    total = mine + theirs if end.first else theirs + mine
    mine.copy_(total)


def sum_with_other_end(end: TiedEnd, key: pb.Key, attempt: int, summed: torch.Tensor,
                       send: Callable[[pb.Envelope], None], take: Callable[[], torch.Tensor]) -> None:
    """Send this end's tied slice of ``summed`` to the other end, ``take`` the other end's (it waits with a
    deadline), and leave ``first + last`` in ``summed``. The slice sent is a copy: a message is sent from its
    tensor's own storage, possibly after :func:`combine` has rewritten ``summed``."""
    send(tied_envelope(key, attempt, summed[end.lo:end.hi].clone()))
    combine(end, summed, take())
