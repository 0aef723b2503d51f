"""The gradient exchange's defences as one ordered list, :data:`GRADIENT_CHECKS`, that the exchange runs in order.

A defence is a :class:`GradientCheck`: a name, the phase of the attempt it inspects and ``inspect``, which looks
at an :class:`AttemptView` and raises a refusal (it never changes the mail). The exchange
(:class:`~peer.runtime.stage.exchange.GradientExchange`) runs the ``SUM`` checks once every contribution to
its shard has arrived, before it sums them (``shard_sum``), and the ``VERIFY`` checks once every participant's
digests have arrived after the all-gather (``verify``). The first refusal ends the attempt; the worker reports
the replicas it names to the coordinator (peer.runtime.stage.sync).

The checks, in order (this list is checked against :data:`GRADIENT_CHECKS` by tests/runtime/test_gradient_checks.py):

1. ``norm`` (SUM, :class:`NormCheck`): a contribution whose norm per micro-batch is above k
   (``outlier_factor``, 1000 unless the run says) x the larger of the others' median and this replica's whole
   gradient's, or not finite.
2. ``direction`` (SUM, :class:`DirectionCheck`): a contribution of enough tokens unrelated to the others' sum
   (``direction_z``; ``checks.unrelatedness``).
3. ``exactly_once`` (SUM, :class:`ExactlyOnceCheck`): the contributions' micro-batches are not each of
   ``0..n_microbatches-1`` exactly once.
4. ``digest`` (VERIFY, :class:`DigestCheck`): a summed shard that is not the sum of the contributions, or a
   contributor's digest that is not of what it sent (``checks.shard_digest``).

A new defence is one class here and one entry in :data:`GRADIENT_CHECKS` (docs/extending.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

import torch

from tasklet.peer.runtime.choices import GRAD_OUTLIER_FACTOR
from tasklet.peer.runtime.stage import checks
from tasklet.protocol.errors import BadMessage

Tag = tuple[int, int]  # (step, attempt)
Digest = tuple[list[str], list[tuple[list[float], list[float]]]]  # per participant: seed; (projections, scales)


class ExchangeAbortedError(RuntimeError):
    """The attempt was abandoned (a participant died and the coordinator started a new attempt)."""


class OutlierContributionError(ExchangeAbortedError):
    """Contributions refused before the sum (``replicas``): a norm per micro-batch above k x the median of the
    others', or a direction unrelated to the others' sum."""

    def __init__(self, tag: Tag, replicas: list[int], why: str) -> None:
        self.replicas = replicas
        super().__init__(f"attempt {tag}: gradient of replica(s) {replicas} {why}")


class DigestMismatchError(ExchangeAbortedError):
    """The all-gather failed its digest check: ``replicas`` sent a summed shard that is not the sum of the
    contributions, or a digest that is not of what they contributed."""

    def __init__(self, tag: Tag, replicas: list[int], why: str) -> None:
        self.replicas = replicas
        super().__init__(f"attempt {tag}: replica(s) {replicas}: {why}")


class Phase(Enum):
    """When the exchange runs a check."""

    SUM = "sum"  # every contribution to this replica's shard arrived, before the sum (shard_sum)
    VERIFY = "verify"  # every participant's digests arrived, after the all-gather (verify)


@dataclass(frozen=True)
class CheckSettings:
    """A run's settings of the checks (``RunSpec.grad_outlier_factor``, ``direction_z``)."""

    outlier_factor: float = GRAD_OUTLIER_FACTOR  # k of the norm check; 0: no check
    direction_z: float = 0.0  # z of the direction test; 0: no test
    tokens_per_microbatch: int = 0  # a contribution under checks.MIN_DIRECTION_TOKENS is not direction-tested


@dataclass(frozen=True)
class AttemptView:
    """What a check sees of one attempt at this replica: what has arrived so far (at its phase, all of it)."""

    tag: Tag
    replica: int  # this replica: the owner of the shard the contributions are to
    participants: tuple[int, ...]
    contributions: Mapping[int, tuple[torch.Tensor, list[int]]]  # sender -> (its part of my shard, micro-batches)
    own_scale: float  # this replica's whole-gradient norm per micro-batch (the norm check's floor)
    n_microbatches: int | None  # the step's micro-batches; None: DiLoCo pseudo-gradients, which cover none
    reduced: Mapping[int, torch.Tensor]  # owner -> its summed shard as received
    digests: Mapping[int, Digest]  # sender -> its digests of its contributions to every shard
    settings: CheckSettings


@runtime_checkable
class GradientCheck(Protocol):
    """One defence of the exchange: ``inspect`` raises a refusal naming the culprits, or returns None."""

    name: str
    phase: Phase

    def inspect(self, view: AttemptView) -> None: ...


class NormCheck:
    """Refuse a contribution whose norm per micro-batch is above k x the larger of the others' median and this
    replica's whole gradient's, or is not finite. This replica's own is never refused.

    The floor: a shard of sparse rows (token embeddings) can be near zero in one honest replica and not in
    another. k is large because honest gradients spike: one micro-batch's gradient was up to 174 x the larger scale
    in tiny Hugging Face models (64- and 256-token micro-batches, ``bench.gradient_tails``), so the check refuses
    only a size no honest gradient came near; a scaled gradient under k is AdamW's to absorb (docs/security.md)."""

    name = "norm"
    phase = Phase.SUM

    @staticmethod
    def ratios(view: AttemptView) -> dict[int, float]:
        """Each other sender's norm per micro-batch over its scale (inf: not finite; empty: fewer than two)."""
        if len(view.contributions) < 2:
            return {}
        norms = {r: float(shard.norm()) / max(1, len(mbs)) for r, (shard, mbs) in view.contributions.items()}
        out = {}
        for r, norm in norms.items():
            if r == view.replica:
                continue
            scale = max(statistics.median(v for q, v in norms.items() if q != r), view.own_scale)
            out[r] = math.inf if not math.isfinite(norm) else norm / scale if scale > 0 else 0.0
        return out

    def inspect(self, view: AttemptView) -> None:
        k = view.settings.outlier_factor
        if not k:
            return
        bad = sorted(r for r, ratio in self.ratios(view).items() if ratio > k)
        if bad:
            norms = {r: float(shard.norm()) / max(1, len(mbs)) for r, (shard, mbs) in view.contributions.items()}
            shown = ", ".join(f"{r}: {v:.3g}" for r, v in sorted(norms.items()))
            raise OutlierContributionError(
                view.tag, bad, f"exceeds {k:g} x the larger of the others' median norm per micro-batch and "
                               f"this replica's whole gradient's ({view.own_scale:.3g}) (norms {shown})")


class DirectionCheck:
    """Refuse a contribution of enough tokens unrelated to the others' sum (``checks.unrelatedness``). Never this
    replica's own: it computed it (with two participants the test is symmetric, so the owner names the other)."""

    name = "direction"
    phase = Phase.SUM

    def inspect(self, view: AttemptView) -> None:
        z = view.settings.direction_z
        if not z:
            return
        shards = {r: shard for r, (shard, _) in view.contributions.items()}
        total: torch.Tensor | None = None
        if len(shards) > 2:  # with two, the others' sum of one is the other's shard itself
            first, *rest = shards.values()
            total = first.clone()
            for shard in rest:
                total.add_(shard)
        scores: dict[int, tuple[float, float]] = {}  # replica -> (score, least score it needs)
        for r, (shard, mbs) in view.contributions.items():
            if r == view.replica or len(mbs) * view.settings.tokens_per_microbatch < checks.MIN_DIRECTION_TOKENS:
                continue
            others = total - shard if total is not None else next(s for q, s in shards.items() if q != r)
            found = checks.unrelatedness(shard, others)
            if found is not None:
                scores[r] = (found[0], checks.direction_threshold(z, found[1]))
        bad = sorted(r for r, (v, floor) in scores.items() if v < floor)
        if bad:
            shown = ", ".join(f"{r}: {v:.2f} of {floor:.2f}" for r, (v, floor) in sorted(scores.items()))
            raise OutlierContributionError(view.tag, bad, f"is unrelated to the others' sum (mean scaled cosine "
                                                          f"per block, of the least needed: {shown})")


class ExactlyOnceCheck:
    """Refuse (BadMessage) contributions whose micro-batches are not ``0..n_microbatches-1`` each exactly once:
    the exactly-once invariant, checked where the sum happens. DiLoCo's pseudo-gradients carry none (each inner
    step's accounting was checked when it was applied)."""

    name = "exactly_once"
    phase = Phase.SUM

    def inspect(self, view: AttemptView) -> None:
        n = view.n_microbatches
        if n is None:
            return
        seen = sorted(mb for r in view.participants for mb in view.contributions[r][1])
        if seen != list(range(n)):
            raise BadMessage("microbatches", f"attempt {view.tag}: contributions cover {seen}, expected each "
                                             f"of 0..{n - 1} exactly once")


class DigestCheck:
    """Check each summed shard against the contributors' digests (``checks.sum_mismatch``); where this replica
    owns the shard, each contributor's digest against the contribution it sent. Raises
    :class:`DigestMismatchError` naming the owner of a shard that is not the sum (or reached participants as
    different bytes) and a contributor whose digest is not of what it sent. An owner does not name a contributor
    whose digest is seeded by other bytes than it holds: the other receivers can tell which owner sent what."""

    name = "digest"
    phase = Phase.VERIFY

    def inspect(self, view: AttemptView) -> None:
        parts, me, digests = view.participants, view.replica, view.digests
        bad: dict[int, str] = {}
        failed = False
        for j, owner in enumerate(parts):
            seed = digests[me][0][j]
            if owner == me:
                for r in parts:
                    if r == owner:
                        continue
                    if digests[r][0][j] != seed:
                        failed = True  # a contributor that saw other bytes: the receivers name whoever sent them
                    elif not checks.digest_matches(view.contributions[r][0], seed, digests[r][1][j]):
                        bad[r] = f"its digest of shard {j} is not of the contribution it sent"
                continue
            if any(digests[r][0][j] != seed for r in parts):
                bad[owner] = f"summed shard {j} reached the participants as different bytes"
                continue
            off = checks.sum_mismatch(view.reduced[owner], seed, [digests[r][1][j] for r in parts], j)
            if not off <= 1.0:
                bad[owner] = f"summed shard {j} is not the sum of the contributions ({off:.3g} x the tolerance)"
        if bad or failed:
            why = "; ".join(f"{r}: {w}" for r, w in sorted(bad.items())) or "a contributor saw other bytes of my shard"
            raise DigestMismatchError(view.tag, sorted(bad), why)


# The exchange's defences, in the order it runs them (per phase). A new defence: one class above, one entry here.
GRADIENT_CHECKS: tuple[GradientCheck, ...] = (
    NormCheck(),
    DirectionCheck(),
    ExactlyOnceCheck(),
    DigestCheck(),
)
