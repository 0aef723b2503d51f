"""Poll the swarm, keep the latest snapshot, and derive events from how successive snapshots differ.

The swarm keeps no event log in the DHT, so the events a dashboard lists are what *this* watcher saw change
between two reads: a peer's advert appearing (joined) or disappearing (left or died: a departure record and an
expired advert look alike to a reader), a higher plan epoch (re-plan, with the leader's stated reason), a new
leader, the step going back (a rollback to a checkpoint), and the run's state (forming, training, done). A
watcher started late sees only what happened since; the loss curve, in contrast, is complete because the
leader carries the whole history in its progress record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_EVENTS = 200


def diff_events(before: dict[str, Any] | None, after: dict[str, Any]) -> list[dict[str, Any]]:
    """The events that explain going from snapshot ``before`` to ``after`` (first snapshot: one summary)."""
    now = after.get("time", time.time())

    def event(kind: str, text: str) -> dict[str, Any]:
        return {"time": now, "kind": kind, "text": text}

    peers_after = {p["peer_id"] for p in after["peers"]}
    plan = after["plan"]
    if before is None:
        return [
            event(
                "watch",
                f"watching run {after['run']}: {len(peers_after)} peer(s), plan epoch {plan['epoch']}, "
                f"step {after['step']}, {after['state']}",
            )
        ]
    out = []
    peers_before = {p["peer_id"] for p in before["peers"]}
    for pid in sorted(peers_after - peers_before):
        out.append(event("join", f"peer {pid[:12]} joined"))
    for pid in sorted(peers_before - peers_after):
        out.append(event("leave", f"peer {pid[:12]} left or died"))
    old_plan = before["plan"]
    if plan["epoch"] is not None and plan["epoch"] != old_plan["epoch"]:
        shape = f"{len(plan['pipelines'])} pipeline(s) x {len(plan['stages'])} stage(s)"
        reason = f": {plan['reason']}" if plan["reason"] else ""
        out.append(event("replan", f"plan epoch {plan['epoch']} at step {plan['step']}, {shape}{reason}"))
        if plan["leader"] != old_plan["leader"] and old_plan["leader"] is not None:
            out.append(event("leader", f"new leader {str(plan['leader'])[:12]} (was {old_plan['leader'][:12]})"))
    step_before, step_after = before["step"], after["step"]
    if isinstance(step_before, int) and isinstance(step_after, int) and step_after < step_before:
        out.append(event("rollback", f"rolled back from step {step_before} to step {step_after}"))
    if after["state"] != before["state"]:
        out.append(event("state", f"run {after['state']} (step {step_after})"))
    return out


class SwarmWatcher:
    """Reads ``read()`` every ``interval_s`` in a thread; serves the latest snapshot (with events) as JSON.

    A read that fails keeps the previous snapshot and records the error, so a slow DHT round shows as a
    stale page rather than an empty one.
    """

    def __init__(self, read: Callable[[], dict[str, Any]], interval_s: float = 2.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._read = read
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] | None = None
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._error: str | None = None
        self._read_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="swarm-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30.0)

    def poll(self) -> dict[str, Any]:
        """Read the swarm once now, append the events, and return the new snapshot."""
        try:
            snap = self._read()
        except Exception as exc:  # a DHT that times out or shuts down must not kill the page
            log.info("swarm read failed: %s", exc)
            with self._lock:
                self._error = f"{type(exc).__name__}: {exc}"[:300]
            raise
        with self._lock:
            self._events.extend(diff_events(self._snapshot, snap))
            self._snapshot, self._error, self._read_at = snap, None, time.monotonic()
        return snap

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a failed read is recorded by poll(); try again next round
                self.poll()
            self._stop.wait(self.interval_s)

    def current(self) -> dict[str, Any]:
        """The latest snapshot with the events (newest first) and how old it is; ``{}`` parts before a read."""
        with self._lock:
            snap = dict(self._snapshot or {})
            snap["events"] = list(reversed(self._events))
            snap["error"] = self._error
            snap["age_s"] = round(time.monotonic() - self._read_at, 2) if self._read_at else None
        return snap

    def json_bytes(self) -> bytes:
        return json.dumps(self.current(), allow_nan=False, separators=(",", ":")).encode()
