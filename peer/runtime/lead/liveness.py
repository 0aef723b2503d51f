"""Liveness: which workers of the plan are alive, as the leader sees it (peer.timing, "The coordinator's view").

A worker is declared dead when ``PING_MISSES`` liveness checks in a row (a Ping every ``interval_s``, at most
one outstanding per worker) fail, or when a failed send to it (a neighbour's report, a broadcast) is confirmed
by one ping. A ping's deadline adapts to the worker: its measured round-trip time times a factor plus its
largest message on its slowest known link (a ping queued behind that transfer is late, not lost).

Liveness owns its state under a lock of its own (a leaf: it calls nobody while holding it, so the coordinator
may ask it under its own lock). It records a death when told to (``mark``) and announces one it finds through
``declare`` (the coordinator's ``declare_dead``, which marks it and tells the running step and the observer).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.runtime.spec import Assignment
from tasklet.peer.timing import PING_MISSES, PING_RTT_FACTOR, PING_TIMEOUT_MAX_S, PING_TIMEOUT_S
from tasklet.protocol.errors import TransportError

log = logging.getLogger(__name__)


class Liveness:
    """Pings, misses, round-trip times and the dead set of one plan at a time (module docstring).

    ``ping(endpoint, timeout_s)`` returns a round-trip time or raises TransportError; ``declare(endpoint,
    reason)`` is called for a death; ``model`` and ``micro_batch`` size the largest message of a worker."""

    def __init__(self, interval_s: float, ping: Callable[[str, float], float],
                 declare: Callable[[str, str], None], model: ModelConfig, micro_batch: int) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._ping, self._declare = ping, declare
        self._model, self._micro_batch = model, micro_batch
        self._assignments: dict[str, Assignment] = {}  # the plan's workers; replaced whole (reset)
        self._dead: set[str] = set()  # _lock
        self._refusing: set[str] = set()  # workers that refused the last plan's assignment as not ours (kept by reset)
        self._reasons: dict[str, str] = {}  # _lock
        self.rtt: dict[str, float] = {}  # moving average per worker
        # endpoint -> the slowest link (bit/s) known from that worker: measured (a leader's link reports),
        # emulated (a local swarm), or None (unknown)
        self._link_bps: Callable[[str], float | None] = lambda endpoint: None
        self._misses: dict[str, int] = {}
        self._pings: dict[str, Future[None]] = {}
        self._pinger = ThreadPoolExecutor(max_workers=16, thread_name_prefix="ping")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="liveness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._pinger.shutdown(wait=False, cancel_futures=True)

    def use_link_speeds(self, link_bps: Callable[[str], float | None]) -> None:
        """Size ping deadlines with ``link_bps(endpoint)``: the slowest link (bit/s) known from that worker."""
        self._link_bps = link_bps

    def is_dead(self, endpoint: str) -> bool:
        with self._lock:
            return endpoint in self._dead

    def dead_now(self) -> frozenset[str]:
        """The workers of the plan declared dead (a snapshot)."""
        with self._lock:
            return frozenset(self._dead)

    def reasons(self) -> dict[str, str]:
        """Why each dead worker of the plan was declared dead (a snapshot)."""
        with self._lock:
            return dict(self._reasons)

    def refused_again(self, endpoint: str, not_ours: bool) -> bool:
        """Record whether ``endpoint`` refused its assignment as not its leader's (PERMISSION_DENIED); True when it
        did so for the previous plan too: it follows another leader for good, whereas a peer back from a partition
        follows us within a plan or two (it must read our advert first)."""
        again = not_ours and endpoint in self._refusing
        if not_ours and len(self._refusing) < 4096:
            self._refusing.add(endpoint)
        elif not not_ours:
            self._refusing.discard(endpoint)
        return again

    def reset(self, assignments: dict[str, Assignment]) -> None:
        """A new plan: nobody is dead (the driver left the dead out of it)."""
        with self._lock:
            self._assignments = assignments
            self._dead.clear()
            self._reasons.clear()
            self._misses.clear()

    def mark(self, endpoint: str, reason: str) -> bool:
        """Record a death; False when it is no live worker of the plan."""
        with self._lock:
            if endpoint in self._dead or endpoint not in self._assignments:
                return False
            self._dead.add(endpoint)
            self._reasons[endpoint] = reason
        log.warning("worker %s declared dead: %s", endpoint, reason)
        return True

    def declare(self, endpoint: str, reason: str) -> None:
        """Declare ``endpoint`` dead without a ping (the owner tells the running step and the observer)."""
        self._declare(endpoint, reason)

    def alive(self, endpoint: str) -> bool:
        """One ping within the worker's deadline (it updates the worker's round-trip time)."""
        try:
            rtt = self._ping(endpoint, self.ping_timeout_s(endpoint))
        except TransportError:
            return False
        old = self.rtt.get(endpoint)
        self.rtt[endpoint] = rtt if old is None else 0.8 * old + 0.2 * rtt
        return True

    def confirm(self, endpoint: str, reason: str) -> None:
        """Declare ``endpoint`` dead if it is a live worker of the plan and does not answer a ping."""
        with self._lock:
            candidate = endpoint in self._assignments and endpoint not in self._dead
        if candidate and not self.alive(endpoint):
            self._declare(endpoint, reason)

    def ping_timeout_s(self, endpoint: str) -> float:
        """A ping's deadline for ``endpoint``: its measured RTT times a factor, plus its largest message on its
        slowest known link (a ping queued behind that transfer is late, not lost); see peer.timing."""
        a = self._assignments.get(endpoint)
        transfer = 0.0
        slowest = self._link_bps(endpoint)
        if a is not None and slowest:
            transfer = 8.0 * self._largest_message_bytes(a) / slowest
        rtt = self.rtt.get(endpoint, 0.0)
        return min(PING_TIMEOUT_MAX_S, max(PING_TIMEOUT_S, PING_RTT_FACTOR * rtt + transfer))

    def _largest_message_bytes(self, a: Assignment) -> float:
        """An activation, or a gradient shard of the stage (about 12 d^2 parameters a layer, fp32)."""
        m = self._model
        hidden = self._micro_batch * m.seq_len * m.d_model * 4
        shard = 12 * m.d_model * m.d_model * (a.layers[1] - a.layers[0]) * 4 / max(1, a.n_replicas)
        return max(hidden, shard)

    def _loop(self) -> None:
        """Ping every live worker each ``interval_s``; ``PING_MISSES`` misses in a row: dead."""
        while not self._stop.wait(self.interval_s):
            with self._lock:
                workers = [ep for ep in self._assignments if ep not in self._dead]
            for ep in workers:  # concurrently, one ping outstanding per worker (a slow one delays no other)
                pending = self._pings.get(ep)
                if pending is not None and not pending.done():
                    continue
                try:
                    self._pings[ep] = self._pinger.submit(self._check, ep)
                except RuntimeError:  # closed
                    return

    def _check(self, endpoint: str) -> None:
        """One ping; ``PING_MISSES`` misses in a row: dead (only this worker's one outstanding check writes its
        count)."""
        if self.alive(endpoint):
            self._misses[endpoint] = 0
            return
        self._misses[endpoint] = self._misses.get(endpoint, 0) + 1
        if self._misses[endpoint] >= PING_MISSES:
            self._declare(endpoint, f"missed {self._misses[endpoint]} liveness checks")
