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
with the median of the other participants' (``outlier_factor``, k). One more than k times that median is
refused (:class:`OutlierContributionError`, the worker reports its sender to the coordinator, which excludes
it and starts a new attempt of the step). This stops a member from blowing up the model with a huge gradient;
it does not stop a small, plausible poisoning (see docs/security.md).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from peer.compute.stage import shard_bounds
from protocol.errors import BadMessage

Tag = tuple[int, int]  # (step, attempt)


class ExchangeTimeoutError(TimeoutError):
    """Not every participant's message arrived in time (a peer died or is partitioned)."""


class ExchangeAbortedError(RuntimeError):
    """The attempt was abandoned (a participant died and the coordinator started a new attempt)."""


class OutlierContributionError(ExchangeAbortedError):
    """Contributions whose norm per micro-batch exceeds k x the median of the others' (``replicas``)."""

    def __init__(self, tag: Tag, replicas: list[int], norms: dict[int, float], factor: float) -> None:
        self.replicas = replicas
        shown = ", ".join(f"{r}: {v:.3g}" for r, v in sorted(norms.items()))
        super().__init__(
            f"attempt {tag}: gradient of replica(s) {replicas} exceeds {factor:g} x the median norm per "
            f"micro-batch of the others (norms {shown})"
        )


@dataclass
class _Attempt:
    participants: tuple[int, ...]
    contributions: dict[int, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)


class GradientExchange:
    """Mailbox for one stage replica's reduce-scatter and all-gather messages."""

    def __init__(self, replica: int, numel: int, outlier_factor: float = 10.0) -> None:
        self.replica = replica
        self.numel = numel
        self.outlier_factor = outlier_factor  # 0: no check
        self._cond = threading.Condition()
        self._attempts: dict[Tag, _Attempt] = {}
        self._aborted_through: Tag = (-1, -1)

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
        self, tag: Tag, participants: Sequence[int], sender: int, shard: torch.Tensor, microbatches: list[int]
    ) -> None:
        """Participant ``sender``'s part of *my* shard."""
        with self._cond:
            attempt = self._attempt(tag, participants)
            if sender not in attempt.participants:
                raise BadMessage("key.replica", f"sender replica {sender} is not a participant")
            self._check_shard(attempt, self.replica, shard)
            if sender in attempt.contributions:
                raise BadMessage("key.replica", f"replica {sender} already sent its shard for attempt {tag}")
            attempt.contributions[sender] = (shard, list(microbatches))
            self._cond.notify_all()

    def put_reduced(self, tag: Tag, participants: Sequence[int], owner: int, shard: torch.Tensor) -> None:
        """The summed shard that participant ``owner`` is responsible for."""
        with self._cond:
            attempt = self._attempt(tag, participants)
            if owner not in attempt.participants:
                raise BadMessage("key.replica", f"owner replica {owner} is not a participant")
            self._check_shard(attempt, owner, shard)
            attempt.reduced[owner] = shard
            self._cond.notify_all()

    def _wait(self, tag: Tag, ready: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not ready():
                if tag <= self._aborted_through:
                    raise ExchangeAbortedError(f"attempt {tag} was abandoned")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExchangeTimeoutError(what())
                self._cond.wait(left)

    def reduce(
        self, tag: Tag, participants: Sequence[int], n_microbatches: int | None, timeout_s: float
    ) -> torch.Tensor:
        """Wait for every participant's contribution to my shard; return their sum (participant order).

        Raises BadMessage when the union of the contributions' micro-batches is not exactly
        ``0..n_microbatches-1`` with each once: the exactly-once invariant, checked where the sum happens.
        ``n_microbatches=None``: the contributions are DiLoCo pseudo-gradients (peer.runtime.outer), which carry
        no micro-batches — each inner step's accounting was checked when it was applied.
        """
        with self._cond:
            attempt = self._attempt(tag, participants)
        n = len(attempt.participants)
        self._wait(tag, lambda: len(attempt.contributions) == n, timeout_s,
                   lambda: f"attempt {tag}: {len(attempt.contributions)}/{n} gradient shards arrived")
        self._check_outliers(tag, attempt)
        seen: list[int] = []
        total: torch.Tensor | None = None
        for r in attempt.participants:
            shard, mbs = attempt.contributions[r]
            seen += mbs
            total = shard.clone() if total is None else total.add_(shard)
        if n_microbatches is not None and sorted(seen) != list(range(n_microbatches)):
            raise BadMessage(
                "microbatches",
                f"attempt {tag}: contributions cover {sorted(seen)}, expected each "
                f"of 0..{n_microbatches - 1} exactly once",
            )
        assert total is not None
        return total

    def _check_outliers(self, tag: Tag, attempt: _Attempt) -> None:
        k = self.outlier_factor
        if not k or len(attempt.contributions) < 2:
            return
        norms = {r: float(shard.norm()) / max(1, len(mbs)) for r, (shard, mbs) in attempt.contributions.items()}
        bad = []
        for r, norm in norms.items():
            median = statistics.median(v for q, v in norms.items() if q != r)
            if median > 0 and norm > k * median:
                bad.append(r)
        if bad:
            raise OutlierContributionError(tag, sorted(bad), norms, k)

    def gather(self, tag: Tag, participants: Sequence[int], timeout_s: float) -> torch.Tensor:
        """Wait for every owner's summed shard; return the whole summed gradient and forget the attempt."""
        with self._cond:
            attempt = self._attempt(tag, participants)
        n = len(attempt.participants)
        self._wait(tag, lambda: len(attempt.reduced) == n, timeout_s,
                   lambda: f"attempt {tag}: {len(attempt.reduced)}/{n} summed shards arrived")
        full = torch.cat([attempt.reduced[r] for r in attempt.participants])
        self.forget_through(tag)
        return full

    def abort_before(self, tag: Tag) -> None:
        """Abandon every attempt before ``tag``: waiters raise ExchangeAbortedError, their mail is dropped."""
        with self._cond:
            for t in [t for t in self._attempts if t < tag]:
                del self._attempts[t]
            self._aborted_through = max(self._aborted_through, (tag[0], tag[1] - 1))
            self._cond.notify_all()

    def forget_through(self, tag: Tag) -> None:
        """Drop the mail of ``tag`` and every earlier attempt."""
        with self._cond:
            for t in [t for t in self._attempts if t <= tag]:
                del self._attempts[t]
