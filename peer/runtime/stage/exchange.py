"""Data-parallel gradient averaging inside one stage's group: reduce-scatter, then all-gather.

The group of a step attempt's synchronisation is its list of *participants* (replica ids, ascending): the pipelines
still intact when the step's micro-batches were all committed. Participant at position ``i`` owns shard ``i``
of the stage's flat gradient (``shard_bounds(numel, len(participants))``). In the reduce-scatter every
participant sends shard ``j`` of its accumulated gradient to participant ``j``; the owner sums the
contributions *in participant order* (so the result does not depend on arrival order) and checks that the
micro-batches they cover are each present exactly once. In the all-gather the owner sends its summed shard to
every other participant. Every participant then holds bitwise the same summed gradient and applies the same
AdamW step, so replicas never drift apart and any one of them can hand its state to a newcomer.

Traffic per replica and phase: ``(D - 1)`` shards of ``G / D`` bytes — the pattern the scheduler's cost
models assume. Messages are keyed by a *tag* ``(step, attempt)``: an attempt that failed (a participant died) is
simply abandoned and the next attempt starts clean. Every message states the participants it was computed
for, so a shard can be checked against its expected size the moment it arrives, even before this replica has
itself been told to synchronise. This class only holds what arrives (server threads put, the compute thread
waits); sending is the worker's job.

Plausible but wrong gradients: before summing, the owner compares each contribution's norm per micro-batch
with the median of the other participants' (``outlier_factor``, k), floored by the norm per micro-batch of its own
whole gradient (a shard of token-embedding rows is sparse: honest replicas' parts of it can differ by far more than
their whole gradients do). One more than k times that is refused
(:class:`OutlierContributionError`, the worker reports its sender to the coordinator, which excludes it and
starts a new attempt of the step). This stops a member from blowing up the model with a huge gradient;
it does not stop a small, plausible poisoning (see docs/security.md). With ``direction_z`` above 0 the owner also
refuses a contribution of enough tokens that is unrelated to the others' sum (noise of any norm;
``checks.unrelatedness``).

A lying owner: after the all-gather, every participant sends every other the digests of its own contributions
(``checks.shard_digest``, seeded by each summed shard as received) and checks each summed shard against them
(:meth:`GradientExchange.verify`) before it reports the step reduced; the owner checks the contributors' digests
against what they sent it. Nobody applies a shard that fails (:class:`DigestMismatchError` names the culprit).

These defences are the entries of ``gradient_checks.GRADIENT_CHECKS``, which the exchange runs in order: the
``SUM`` ones in :meth:`GradientExchange.shard_sum`, the ``VERIFY`` ones in :meth:`GradientExchange.verify`.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tasklet.peer.compute.stage import shard_bounds
from tasklet.peer.runtime.choices import GRAD_OUTLIER_FACTOR
from tasklet.peer.runtime.stage import checks, gradient_checks
from tasklet.peer.runtime.stage.gradient_checks import (
    AttemptView,
    CheckSettings,
    Digest,
    ExchangeAbortedError,
    GradientCheck,
    Phase,
    Tag,
)
from tasklet.peer.runtime.stage.tied import TiedEnd
from tasklet.protocol.errors import BadMessage


class ExchangeTimeoutError(TimeoutError):
    """Not every participant's message arrived in time (a peer died or is partitioned)."""


DIGEST_META = "digest"  # a PARAM_SHARD with this meta carries all-gather digests, no tensor
MAX_DIGEST_CHARS = 65_536  # of the meta text that carries a digest (a group of a few dozen replicas fits)


def digest_text(digest: Digest) -> str:
    """The wire form of a digest (``meta.digest``): JSON floats round-trip exactly."""
    seeds, parts = digest
    return json.dumps({"seeds": seeds, "proj": [p for p, _ in parts], "mag": [m for _, m in parts]})


def parse_digest(text: str, n: int) -> Digest:
    """A digest of ``n`` shards from its wire form; BadMessage for anything else (size, types, non-finite)."""
    if len(text) > MAX_DIGEST_CHARS:
        raise BadMessage("meta.digest", f"{len(text)} characters, more than {MAX_DIGEST_CHARS}")
    try:
        d = json.loads(text)
        seeds, proj, mag = d["seeds"], d["proj"], d["mag"]
        ok = (isinstance(seeds, list) and isinstance(proj, list) and isinstance(mag, list)
              and len(seeds) == len(proj) == len(mag) == n
              and all(isinstance(x, str) and len(x) == 16 and all(c in "0123456789abcdef" for c in x)
                      for x in seeds))
        rows = [list(row) for row in (*proj, *mag)] if ok else []
        ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for row in rows for v in row)
        rows = [[float(v) for v in row] for row in rows] if ok else []
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, RecursionError):
        ok, rows = False, []
    k = checks.DIGEST_K
    if not ok or any(len(row) != k or not all(math.isfinite(v) for v in row) for row in rows) or any(
            v < 0 for row in rows[n:] for v in row):
        raise BadMessage("meta.digest", f"expected {n} hex seeds and {n} x {k} finite projections and scales")
    return list(seeds), [(rows[i], rows[n + i]) for i in range(n)]


@dataclass
class _Attempt:
    """One attempt's mail at this replica; the exchange changes it only through these methods, under its lock."""

    participants: tuple[int, ...]
    contributions: dict[int, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)
    digests: dict[int, Digest] = field(default_factory=dict)
    own_scale: float = 0.0  # this replica's whole-gradient norm per micro-batch (the norm check's floor)
    whole: torch.Tensor | None = None  # the summed shards joined, once all arrived (gather is asked twice)

    def add_contribution(self, sender: int, shard: torch.Tensor, microbatches: list[int],
                         own_whole_norm: float | None = None) -> None:
        """``own_whole_norm``: with this replica's own part, its whole gradient's norm (the norm check's floor)."""
        self.contributions[sender] = (shard, microbatches)
        if own_whole_norm is not None and math.isfinite(own_whole_norm):
            self.own_scale = own_whole_norm / max(1, len(microbatches))

    def add_reduced(self, owner: int, shard: torch.Tensor) -> None:
        self.reduced[owner] = shard

    def add_digest(self, sender: int, digest: Digest) -> None:
        self.digests[sender] = digest

    def whole_gradient(self, lock: threading.Condition) -> torch.Tensor:
        """The summed shards joined into the whole gradient, once: copied out under ``lock``, joined outside it."""
        if self.whole is None:
            with lock:
                shards = [self.reduced[r] for r in self.participants]
            self.whole = shards[0] if len(shards) == 1 else torch.cat(shards)
        return self.whole

    def view(self, tag: Tag, replica: int, settings: CheckSettings, n_microbatches: int | None) -> AttemptView:
        return AttemptView(tag, replica, self.participants, self.contributions, self.own_scale, n_microbatches,
                           self.reduced, self.digests, settings)


class GradientExchange:
    """Mailbox for one stage replica's reduce-scatter and all-gather messages. ``checks``: the defences it runs,
    in order (None: :data:`~peer.runtime.stage.gradient_checks.GRADIENT_CHECKS` as it is when the exchange is
    built)."""

    def __init__(self, replica: int, numel: int, outlier_factor: float = GRAD_OUTLIER_FACTOR, direction_z: float = 0.0,
                 tokens_per_microbatch: int = 0, tied: TiedEnd | None = None,
                 checks: Sequence[GradientCheck] | None = None) -> None:
        self.replica = replica
        self.numel = numel
        self.tied = tied  # this stage's end of a tied weight (peer.runtime.stage.tied), None: nothing to sum
        self._tied_mail: dict[Tag, torch.Tensor] = {}  # the other end's tied gradient, per attempt
        self.settings = CheckSettings(outlier_factor, direction_z, tokens_per_microbatch)
        self.gradient_checks = tuple(gradient_checks.GRADIENT_CHECKS if checks is None else checks)
        self._cond = threading.Condition()
        self._attempts: dict[Tag, _Attempt] = {}
        self._aborted_through: Tag = (-1, -1)
        self.waited_s = 0.0  # seconds the compute thread waited here for messages (peer.runtime.stage.timing)

    def _run_checks(self, phase: Phase, view: AttemptView) -> None:
        """Run the checks of ``phase`` in their order; the first refusal propagates to the caller."""
        for check in self.gradient_checks:
            if check.phase is phase:
                check.inspect(view)

    def _attempt(self, tag: Tag, participants: Sequence[int]) -> _Attempt:
        parts = tuple(participants)
        if list(parts) != sorted(set(parts)) or not parts:
            raise BadMessage("meta.participants", f"must be distinct ascending replica ids, got {list(parts)}")
        if self.replica not in parts:
            raise BadMessage("meta.participants", f"replica {self.replica} is not among {list(parts)}")
        attempt = self._attempts.setdefault(tag, _Attempt(parts))
        if attempt.participants != parts:
            raise BadMessage(
                "meta.participants",
                f"attempt {tag} has participants {list(attempt.participants)}, message says {list(parts)}",
            )
        return attempt

    def _check_shard(self, attempt: _Attempt, owner: int, shard: torch.Tensor) -> None:
        lo, hi = shard_bounds(self.numel, len(attempt.participants))[attempt.participants.index(owner)]
        if shard.dim() != 1 or shard.numel() != hi - lo or shard.dtype != torch.float32:
            raise BadMessage("tensors.grad", f"expected float32[{hi - lo}], got {shard.dtype}{list(shard.shape)}")

    def shard_of(self, participants: Sequence[int], owner: int) -> tuple[int, int]:
        """The ``[lo, hi)`` range of the flat gradient that participant ``owner`` reduces."""
        return shard_bounds(self.numel, len(participants))[list(participants).index(owner)]

    def put_contribution(
        self, tag: Tag, participants: Sequence[int], sender: int, shard: torch.Tensor, microbatches: list[int],
        whole_norm: float = 0.0,
    ) -> None:
        """Participant ``sender``'s part of *my* shard. ``whole_norm``: with this replica's own part, the norm of
        its whole gradient (the outlier check's floor; never taken from another sender)."""
        with self._cond:
            attempt = self._attempt(tag, participants)
            if sender not in attempt.participants:
                raise BadMessage("key.replica", f"sender replica {sender} is not a participant")
            self._check_shard(attempt, self.replica, shard)
            if sender in attempt.contributions:
                raise BadMessage("key.replica", f"replica {sender} already sent its shard for attempt {tag}")
            attempt.add_contribution(sender, shard, list(microbatches),
                                     whole_norm if sender == self.replica else None)
            self._cond.notify_all()

    def put_reduced(self, tag: Tag, participants: Sequence[int], owner: int, shard: torch.Tensor) -> None:
        """The summed shard that participant ``owner`` is responsible for."""
        with self._cond:
            attempt = self._attempt(tag, participants)
            if owner not in attempt.participants:
                raise BadMessage("key.replica", f"owner replica {owner} is not a participant")
            self._check_shard(attempt, owner, shard)
            attempt.add_reduced(owner, shard)
            self._cond.notify_all()

    def _wait(self, tag: Tag, ready: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with self._cond:
            try:
                while not ready():
                    if tag <= self._aborted_through:
                        raise ExchangeAbortedError(f"attempt {tag} was abandoned")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ExchangeTimeoutError(what())
                    self._cond.wait(left)
            finally:
                self.waited_s += time.monotonic() - t0

    def shard_sum(
        self, tag: Tag, participants: Sequence[int], n_microbatches: int | None, timeout_s: float
    ) -> torch.Tensor:
        """Wait for every participant's contribution to my shard, run the ``SUM`` checks on them in order
        (peer.runtime.stage.gradient_checks: norm, direction, exactly-once; the first refusal propagates), and
        return their sum (participant order).

        ``n_microbatches=None``: the contributions are DiLoCo pseudo-gradients (peer.runtime.outer), which carry
        no micro-batches — each inner step's accounting was checked when it was applied.
        """
        with self._cond:
            attempt = self._attempt(tag, participants)
        n = len(attempt.participants)
        self._wait(tag, lambda: len(attempt.contributions) == n, timeout_s,
                   lambda: f"attempt {tag}: {len(attempt.contributions)}/{n} gradient shards arrived")
        self._run_checks(Phase.SUM, attempt.view(tag, self.replica, self.settings, n_microbatches))
        total: torch.Tensor | None = None
        for r in attempt.participants:
            shard = attempt.contributions[r][0]
            if total is None:  # a group of one: its own shard is the sum (nothing is added to it in place)
                total = shard if n == 1 else shard.clone()
            else:
                total.add_(shard)
        assert total is not None
        return total

    def gather(self, tag: Tag, participants: Sequence[int], timeout_s: float) -> torch.Tensor:
        """Wait for every owner's summed shard; return the whole summed gradient. The attempt's mail is kept
        for :meth:`verify` (or dropped by :meth:`forget_through`)."""
        with self._cond:
            attempt = self._attempt(tag, participants)
        n = len(attempt.participants)
        self._wait(tag, lambda: len(attempt.reduced) == n, timeout_s,
                   lambda: f"attempt {tag}: {len(attempt.reduced)}/{n} summed shards arrived")
        return attempt.whole_gradient(self._cond)

    def my_digest(self, tag: Tag, participants: Sequence[int], flat: torch.Tensor) -> Digest:
        """This replica's digest of its own contribution ``flat`` (its whole accumulated gradient) to each
        shard, seeded by each summed shard as it arrived here (call after :meth:`gather`)."""
        with self._cond:
            attempt = self._attempt(tag, participants)
            reduced = dict(attempt.reduced)
        seeds, digests = [], []
        for r in attempt.participants:
            lo, hi = self.shard_of(attempt.participants, r)
            seed = checks.digest_seed(tag, r, reduced[r])
            seeds.append(seed)
            digests.append(checks.shard_digest(flat[lo:hi], seed))
        return seeds, digests

    def put_digest(self, tag: Tag, participants: Sequence[int], sender: int, digest: Digest) -> None:
        """Participant ``sender``'s digests of its contributions to every shard."""
        with self._cond:
            attempt = self._attempt(tag, participants)
            if sender not in attempt.participants:
                raise BadMessage("key.replica", f"sender replica {sender} is not a participant")
            seeds, digests = digest
            n = len(attempt.participants)
            if len(seeds) != n or len(digests) != n or not all(
                    len(p) == checks.DIGEST_K and len(m) == checks.DIGEST_K for p, m in digests):
                raise BadMessage("meta.digest", f"expected {n} seeds and {n} x {checks.DIGEST_K} projections")
            if sender in attempt.digests:
                raise BadMessage("key.replica", f"replica {sender} already sent its digest for attempt {tag}")
            attempt.add_digest(sender, digest)
            self._cond.notify_all()

    def verify(self, tag: Tag, participants: Sequence[int], timeout_s: float) -> None:
        """Wait for every participant's digest (this replica's own included, via :meth:`put_digest`), run the
        ``VERIFY`` checks in order (``gradient_checks.DigestCheck``: each summed shard against the contributors'
        digests; :class:`DigestMismatchError` names the culprits), then forget the attempt, refused or not."""
        with self._cond:
            attempt = self._attempt(tag, participants)
        n = len(attempt.participants)
        self._wait(tag, lambda: len(attempt.digests) == n, timeout_s,
                   lambda: f"attempt {tag}: {len(attempt.digests)}/{n} all-gather digests arrived")
        try:
            self._run_checks(Phase.VERIFY, attempt.view(tag, self.replica, self.settings, None))
        finally:
            self.forget_through(tag)

    def put_tied(self, tag: Tag, grad: torch.Tensor) -> None:
        """The other end's summed gradient of the tied weight for ``tag``: float32 of exactly the tied weight's
        size, finite, one per attempt; mail of earlier steps is dropped (at most one step's attempts held)."""
        end = self.tied
        if end is None:
            raise BadMessage("kind", "this stage holds no tied weight")
        if grad.dim() != 1 or grad.numel() != end.numel or grad.dtype != torch.float32:
            raise BadMessage("tensors.grad", f"expected float32[{end.numel}] (the tied weight), got "
                                             f"{grad.dtype}{list(grad.shape)}")
        if not bool(torch.isfinite(grad).all()):
            raise BadMessage("tensors.grad", "the tied gradient holds NaN or inf values")
        with self._cond:
            if tag <= self._aborted_through:
                raise BadMessage("meta.attempt", f"attempt {tag} was abandoned")
            if tag in self._tied_mail:
                raise BadMessage("meta.attempt", f"the tied gradient of attempt {tag} already arrived")
            for old in [t for t in self._tied_mail if t[0] < tag[0]]:
                del self._tied_mail[old]
            self._tied_mail[tag] = grad
            self._cond.notify_all()

    def take_tied(self, tag: Tag, timeout_s: float) -> torch.Tensor:
        """Wait for the other end's tied gradient of ``tag``; take it and drop the mail of earlier attempts."""
        self._wait(tag, lambda: tag in self._tied_mail, timeout_s,
                   lambda: f"attempt {tag}: the tied gradient from the other end of the pipeline did not arrive")
        with self._cond:
            grad = self._tied_mail[tag]
            for t in [t for t in self._tied_mail if t <= tag]:
                del self._tied_mail[t]
            return grad

    def abort_before(self, tag: Tag) -> None:
        """Abandon every attempt before ``tag``: waiters raise ExchangeAbortedError, their mail is dropped."""
        with self._cond:
            for t in [t for t in self._attempts if t < tag]:
                del self._attempts[t]
            for t in [t for t in self._tied_mail if t < tag]:
                del self._tied_mail[t]
            self._aborted_through = max(self._aborted_through, (tag[0], tag[1] - 1))
            self._cond.notify_all()

    def forget_through(self, tag: Tag) -> None:
        """Drop the mail of ``tag`` and every earlier attempt."""
        with self._cond:
            for t in [t for t in self._attempts if t <= tag]:
                del self._attempts[t]
