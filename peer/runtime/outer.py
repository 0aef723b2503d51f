"""DiLoCo-style data-parallel sync: the outer round every ``sync_period`` inner steps, for one stage replica.

With ``RunSpec.sync_period = H > 1`` a step is an *inner* step: the task pool still hands out every micro-batch
exactly once (first commit wins), but a pipeline's stages step their own AdamW on their own accumulated
gradient divided by the number of micro-batches *their pipeline* committed — nothing is averaged across
pipelines (a pipeline that committed none skips the step: :meth:`StageCompute.skip_update`). After inner step
``k`` with ``(k + 1) % H == 0`` comes the outer round:

1. every replica of a stage computes its pseudo-gradient ``anchor - params`` (``anchor``: the parameters at
   the round's start, identical on every replica), compressed as ``pseudo_grad_compression`` says;
2. the stage's participants sum them through the same reduce-scatter + all-gather as exact training
   (:mod:`peer.runtime.stage.exchange`; the summed shards travel compressed too, :func:`allgather_codec`) and
   divide by the number of participants;
3. only when every stage holds its average (the coordinator's two-phase apply) does every replica take the
   identical Nesterov step from the anchor — ``m = mu m + g; params = anchor - lr (g + mu m)``, i.e.
   ``torch.optim.SGD(nesterov=True)`` — and the result becomes the next round's anchor. Inner AdamW state
   stays local to each replica.

Compression of a contribution (the reduce-scatter's shards): ``"int8"`` sends each shard of the
pseudo-gradient int8-blockwise (deterministic, so the owner's own shard is the same encode/decode round trip);
``"topk"`` adds this replica's error-feedback residual, keeps the k largest entries of each shard
(k = ceil(shard / block)), and keeps what it did not send as the new residual — committed only when the outer
step is applied, so an outer round restarted after a death starts again from the same residual. ``"topk2"`` /
``"topk4"`` do the same with one entry per block of 64 in 2 or 4 bits (:mod:`protocol.sparse`: 195x / 164x
smaller than fp32); what rounding loses goes to the residual too. The all-gather of a sparse codec's summed
shard is exact (:func:`allgather_codec`).

Deaths (see also docs/architecture.md, "One step"): a pipeline that loses a member during an inner step is
dropped from that step as in exact training (its micro-batches of that step go back to the pool and are redone
by the others) *and from the rest of the round*: it takes no further inner steps and does not join the outer
round. The micro-batches it committed in *earlier* inner steps of the round were each accounted exactly once
(the commit records of those steps say so) but their effect lives only in that pipeline's local parameters,
which are discarded: they do not reach the outer update and are not recomputed. The driver re-plans at the
next round boundary, where every live replica holds the same parameters. A death during the outer averaging
restarts it without that pipeline; when no pipeline is left whole (or the round fails otherwise) the inner step
still counts (``OuterRoundFailedError``): the survivors keep their local parameters and the anchor, and the next
outer round covers both rounds' inner steps. A tasklet that fetches its state from a replica whose parameters
are not its anchor (mid-round) starts from the anchor: the source's own inner progress reaches the average once.

Overlap (``RunSpec.outer_overlap``; docs/architecture.md, "The outer round behind compute"): the outer round of
step ``s`` (a round's last inner step) starts as above, but step ``s`` ends as soon as the reduce went out; each
replica takes its contribution from its parameters at the round's end (kept as ``round_end`` until the round
lands, so a restart after a death sends the same) and averages on a thread of its own while step ``s + 1``
computes. After step ``s + 1``'s inner apply the outer step lands: the anchor takes it as before, and each replica
goes on from ``new anchor + (params - round_end)``, its own progress of step ``s + 1`` on top (Streaming DiLoCo's
overlap with tau = 1). ``bench.overlap`` measured what that costs in loss (docs/benchmarks/outer-round.md).
A round in flight is *finished*, never replayed: a death while it travels restarts its averaging without that
pipeline, as in step; before a re-plan, a checkpoint or the run's end the leader lands it at once (the replicas
are then at the anchor, as after a round in step); a round that cannot land (no pipeline left whole, an error)
fails as a round in step does, and the next round covers its inner steps. A new plan, a roll-back or a new leader
drops a round in flight (every worker's new assignment forgets it). With overlap the replicas' parameters are
compared only where a round lands in step (before a re-plan or checkpoint, at the run's end): after a late
landing each replica holds its own progress.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tasklet.peer.runtime.choices import ERROR_FEEDBACK_COMPRESSIONS
from tasklet.protocol.codec import DEFAULT_BLOCK_SIZE, decode_tensor, encode_tensor

BLOCK_SIZE = DEFAULT_BLOCK_SIZE  # of int8 blocks and of top-k density (1 / BLOCK_SIZE)


def is_round_end(step: int, sync_period: int) -> bool:
    """Whether inner step ``step`` is the last of its round (an outer round follows it)."""
    return sync_period > 1 and (step + 1) % sync_period == 0


def roundtrip(x: torch.Tensor, compression: str, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """What a receiver decodes when ``x`` is sent under ``compression``: the sender's own copy of it."""
    if compression == "none":
        return x.clone()
    return decode_tensor(encode_tensor("pg", x, compression, block_size=block_size), expect_dtype=torch.float32)


def allgather_codec(compression: str, shard_numel: int, n_participants: int) -> tuple[str, int]:
    """(compression, block size) of a summed shard in the all-gather.

    int8 stays int8. A sum of sparse contributions (topk, topk2, topk4: at most one kept entry per
    ``BLOCK_SIZE``) holds at most ``n_participants x ceil(shard / BLOCK_SIZE)`` non-zeros, so it goes as top-k
    with a block small enough to keep them all (exact); when that block would be below 2 (8 bytes per kept
    entry, more than fp32) it goes uncompressed.
    """
    if compression not in ERROR_FEEDBACK_COMPRESSIONS:
        return compression, BLOCK_SIZE
    kept = n_participants * math.ceil(shard_numel / BLOCK_SIZE) if shard_numel else 1
    block = shard_numel // max(1, kept)
    return ("topk", block) if block >= 2 else ("none", BLOCK_SIZE)


@dataclass
class OuterState:
    """One stage replica's outer-loop state: the round's anchor, the Nesterov buffer, the top-k residual."""

    anchor: torch.Tensor  # flat fp32 parameters at the start of the round (identical on every replica)
    momentum: torch.Tensor  # Nesterov buffer (identical on every replica)
    residual: torch.Tensor  # error feedback of top-k (this replica's own)
    # overlap: this replica's parameters at the end of the round in flight, and that round's last inner step
    round_end: torch.Tensor | None = None
    round_end_step: int = -1

    @classmethod
    def start(cls, params: torch.Tensor, momentum: torch.Tensor | None = None) -> OuterState:
        return cls(params.detach().clone(), torch.zeros_like(params) if momentum is None else momentum.clone(),
                   torch.zeros_like(params))

    def contribution(
        self, params: torch.Tensor, shards: list[tuple[int, int]], compression: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(what to send, shard by shard, under ``compression``; the residual after sending it).

        For none/int8 that is the pseudo-gradient itself (the wire quantizes int8); for top-k it is the dense
        tensor of the kept entries (which top-k encodes exactly), the rest going to the new residual; topk2 /
        topk4 send the decoded round trip of each shard, its rounding going to the residual too.
        """
        pseudo = self.anchor - params
        if compression not in ERROR_FEEDBACK_COMPRESSIONS:
            return pseudo, self.residual
        corrected = pseudo + self.residual
        sent = torch.zeros_like(corrected)
        for lo, hi in shards:
            sent[lo:hi] = roundtrip(corrected[lo:hi], compression)
        return sent, corrected - sent

    def apply(self, average: torch.Tensor, lr: float, momentum: float, residual: torch.Tensor) -> torch.Tensor:
        """The outer Nesterov step from the anchor with the averaged pseudo-gradient; it becomes the anchor."""
        if momentum > 0:
            self.momentum.mul_(momentum).add_(average)
            update = average.add(self.momentum, alpha=momentum)
        else:
            update = average
        new = self.anchor.clone()
        new.add_(update, alpha=-lr)
        self.anchor = new.clone()
        self.residual = residual.clone()
        return new

    def keep_round_end(self, params: torch.Tensor, step: int) -> None:
        """Overlap: keep this replica's parameters at the end of the round of ``step`` until it lands."""
        self.round_end, self.round_end_step = params, step

    def forget_round(self) -> None:
        """Drop a round in flight (a new plan): its work stays in the parameters, the next round covers it."""
        self.round_end, self.round_end_step = None, -1

    def keeps_round_end(self, step: int) -> bool:
        """Whether the snapshot of the round that ``step`` ended is held (overlap)."""
        return self.round_end is not None and self.round_end_step == step

    def land(self, step: int, average: torch.Tensor, lr: float, momentum: float, residual: torch.Tensor,
             params: torch.Tensor | None) -> torch.Tensor:
        """Overlap: the outer step lands after inner steps of the next round; this replica goes on from the new
        anchor plus its own progress since the round's end (``params - round_end``). Without progress (the round
        landed in step, the snapshot is gone, or ``params`` is None) that is the new anchor itself, bit for bit."""
        new = self.apply(average, lr, momentum, residual)
        end = self.round_end if self.keeps_round_end(step) else None  # ``step``: the round's last inner step
        self.forget_round()
        if end is None or params is None or torch.equal(end, params):
            return new
        return new.add_(params - end)

    def resume(self, other: OuterState) -> None:
        """Take a replica's round after a resync: its anchor and Nesterov buffer (the residual stays our own; a
        round in flight is abandoned)."""
        self.anchor, self.momentum = other.anchor, other.momentum
        self.forget_round()


def assignment_record(reports: Sequence[Any]) -> list[dict[str, Any]]:
    """The replayable record of a run's inner and outer steps from its StepReports (JSON-able):
    ``[{"step", "commits": {micro-batch: pipeline}, "applied": [pipelines], "outer": [participants] | None,
    "outer_of": step | None}]``, what :func:`peer.compute.reference.train_diloco_reference` replays
    (``reports``: StepReports). ``outer_of``: with overlap, the earlier step whose round landed after this one."""
    return [
        {"step": r.step, "commits": dict(r.commits), "applied": list(r.applied),
         "outer": None if r.outer is None else list(r.outer), "outer_of": r.outer_of}
        for r in reports
    ]
