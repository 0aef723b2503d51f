"""Data-parallel gradient averaging inside one stage's group: reduce-scatter, then all-gather.

Replica ``r`` of a group of ``D`` owns shard ``r`` of the stage's flat gradient (``shard_bounds``). In the
reduce-scatter every replica sends shard ``j`` of its accumulated gradient to replica ``j``; the owner sums
the ``D`` contributions *in replica order* (so the result does not depend on arrival order) and checks that
the micro-batches they cover are each present exactly once. In the all-gather the owner sends its summed
shard to every other replica. Every replica then holds bitwise the same summed gradient and applies the same
AdamW step, so replicas never drift apart and any one of them can hand its state to a newcomer.

Traffic per replica and phase: ``(D - 1)`` shards of ``G / D`` bytes — the communication pattern the
scheduler's cost models assume. This class only holds what arrives (server threads put, the compute thread
waits); sending is the worker's job.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from protocol.errors import BadMessage


class ExchangeTimeoutError(TimeoutError):
    """Not every replica's contribution arrived in time (a peer died or is partitioned)."""


@dataclass
class _StepSlots:
    contributions: dict[int, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)


class GradientExchange:
    """Mailbox for one stage replica's reduce-scatter and all-gather messages, keyed by step."""

    def __init__(self, replica: int, n_replicas: int, bounds: list[tuple[int, int]]) -> None:
        self.replica = replica
        self.n_replicas = n_replicas
        self.bounds = bounds
        self._cond = threading.Condition()
        self._steps: dict[int, _StepSlots] = {}

    def _slots(self, step: int) -> _StepSlots:
        return self._steps.setdefault(step, _StepSlots())

    def put_contribution(self, step: int, sender: int, shard: torch.Tensor, microbatches: list[int]) -> None:
        """Replica ``sender``'s part of *my* shard (validated: size, sender, no second copy)."""
        lo, hi = self.bounds[self.replica]
        if not 0 <= sender < self.n_replicas:
            raise BadMessage("key.replica", f"sender replica {sender} not in [0, {self.n_replicas})")
        if shard.dim() != 1 or shard.numel() != hi - lo or shard.dtype != torch.float32:
            raise BadMessage("tensors.grad", f"expected float32[{hi - lo}], got {shard.dtype}{list(shard.shape)}")
        with self._cond:
            slots = self._slots(step)
            if sender in slots.contributions:
                raise BadMessage("key.replica", f"replica {sender} already sent its shard for step {step}")
            slots.contributions[sender] = (shard, list(microbatches))
            self._cond.notify_all()

    def put_reduced(self, step: int, owner: int, shard: torch.Tensor) -> None:
        """The summed shard ``owner`` is responsible for."""
        if not 0 <= owner < self.n_replicas:
            raise BadMessage("key.replica", f"owner replica {owner} not in [0, {self.n_replicas})")
        lo, hi = self.bounds[owner]
        if shard.dim() != 1 or shard.numel() != hi - lo or shard.dtype != torch.float32:
            raise BadMessage("tensors.grad", f"expected float32[{hi - lo}], got {shard.dtype}{list(shard.shape)}")
        with self._cond:
            self._slots(step).reduced[owner] = shard
            self._cond.notify_all()

    def _wait(self, ready: callable, timeout_s: float, what: str) -> None:  # type: ignore[valid-type]
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExchangeTimeoutError(what)
                self._cond.wait(left)

    def reduce(self, step: int, n_microbatches: int, timeout_s: float) -> torch.Tensor:
        """Wait for all ``D`` contributions to my shard; return their sum (replica order).

        Raises BadMessage when the union of the contributions' micro-batches is not exactly
        ``0..n_microbatches-1`` with each once: the exactly-once invariant, checked where the sum happens.
        """
        slots = self._slots(step)
        self._wait(lambda: len(slots.contributions) == self.n_replicas, timeout_s,
                   f"step {step}: {len(slots.contributions)}/{self.n_replicas} gradient shards arrived")
        seen: list[int] = []
        total = None
        for r in range(self.n_replicas):
            shard, mbs = slots.contributions[r]
            seen += mbs
            total = shard.clone() if total is None else total.add_(shard)
        if sorted(seen) != list(range(n_microbatches)):
            raise BadMessage("microbatches", f"step {step}: contributions cover {sorted(seen)}, expected each "
                             f"of 0..{n_microbatches - 1} exactly once")
        assert total is not None
        return total

    def gather(self, step: int, timeout_s: float) -> torch.Tensor:
        """Wait for every owner's summed shard; return the whole summed gradient and forget the step."""
        slots = self._slots(step)
        self._wait(lambda: len(slots.reduced) == self.n_replicas, timeout_s,
                   f"step {step}: {len(slots.reduced)}/{self.n_replicas} summed shards arrived")
        full = torch.cat([slots.reduced[r] for r in range(self.n_replicas)])
        with self._cond:
            for s in [s for s in self._steps if s <= step]:
                del self._steps[s]
        return full

    def forget_before(self, step: int) -> None:
        """Drop mail of steps older than ``step`` (after a re-plan)."""
        with self._cond:
            for s in [s for s in self._steps if s < step]:
                del self._steps[s]
