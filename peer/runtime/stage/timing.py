"""Where a worker's step goes: device compute, waiting for the network, host work, control round trips.

A donated device should spend its step computing; every second the peer's host spends on parameters and
gradients (copies, sums, checks, the optimizer step, the parameters hash) or waiting (for shards, for a lease)
is a second the device idles. :class:`StepTimes` sums those per step, so a peer can log the breakdown of each
step (``bench.overhead`` reads it) and report the share of its step its device computed (``peer status``, the
dashboard, ``/metrics``).

The parts are timed where they happen, on whatever thread: compute ops by the compute loop (the
:class:`DeviceClock`'s busy time), the averaging's phases by :class:`GradientSync` (its waits in the exchange
are network, the rest host), lease and commit round trips by the feeder and committer. Round trips off the
compute thread can overlap compute, so the parts may add up to more than the step; ``idle`` is what the step
has left after compute, the optimizer, network and host work. ``optimizer`` is AdamW's step, which any
training loop does; ``host`` is what the peer adds to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PARTS = ("compute", "optimizer", "network", "host", "control")


@dataclass
class StepBreakdown:
    """One finished step: its seconds from ``start_step`` to the end of its apply, and each part's seconds."""

    step: int
    step_s: float
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def compute_share(self) -> float:
        """The share of the step the device spent computing: forwards, backwards and the optimizer (0 for a step of
        no time)."""
        busy = self.parts.get("compute", 0.0) + self.parts.get("optimizer", 0.0)
        return min(1.0, busy / self.step_s) if self.step_s > 0 else 0.0

    @property
    def idle_s(self) -> float:
        busy = sum(self.parts.get(p, 0.0) for p in ("compute", "optimizer", "network", "host"))
        return max(0.0, self.step_s - busy)

    def line(self) -> str:
        """``step 3 times: wall 1.234 s, compute 1.100 s, network ..., compute_share 0.89`` (what the log says)."""
        parts = ", ".join(f"{p} {self.parts.get(p, 0.0):.4f} s" for p in PARTS)
        return (f"step {self.step} times: wall {self.step_s:.4f} s, {parts}, idle {self.idle_s:.4f} s, "
                f"compute_share {self.compute_share:.3f}")

    def as_dict(self) -> dict[str, float]:
        return {"step": self.step, "step_s": round(self.step_s, 4),
                **{f"{p}_s": round(self.parts.get(p, 0.0), 4) for p in PARTS},
                "idle_s": round(self.idle_s, 4), "compute_share": round(self.compute_share, 4)}


class StepTimes:
    """The current step's sums (thread-safe) and the last finished step's breakdown."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._step: int | None = None
        self._started = 0.0
        self._parts: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.last: StepBreakdown | None = None

    def begin(self, step: int) -> None:
        """``start_step`` of ``step`` (a new attempt of the same step keeps counting from its first start)."""
        with self._lock:
            if self._step != step:
                self._step, self._started = step, self._now()
                self._parts = dict.fromkeys(PARTS, 0.0)

    def add(self, part: str, seconds: float) -> None:
        with self._lock:
            self._parts[part] = self._parts.get(part, 0.0) + max(0.0, seconds)

    def move(self, source: str, target: str, seconds: float) -> None:
        """Count ``seconds`` timed as ``source`` as ``target`` instead."""
        with self._lock:
            seconds = max(0.0, min(seconds, self._parts.get(source, 0.0)))
            self._parts[source] -= seconds
            self._parts[target] = self._parts.get(target, 0.0) + seconds

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        t0 = self._now()
        try:
            yield
        finally:
            self.add(part, self._now() - t0)

    def finish(self, step: int) -> StepBreakdown | None:
        """The step's apply is done: its breakdown (None when the step never started here, e.g. a repeated
        apply); the sums start again at the next ``begin``."""
        with self._lock:
            if self._step != step:
                return None
            done = StepBreakdown(step, self._now() - self._started, dict(self._parts))
            self._step = None
            self.last = done
            return done
