"""Streams waiting for their first chunk: bounded per caller and in total, before any stream slot is theirs.

A server takes a stream slot only once a stream's first chunk has shown what it is and the caller's role
admits it (peer.net.server): a member holding many identities, none with a role here, must not be able to
fill the slots by opening streams and sending nothing. What such a stream holds until its first chunk (or
its idle deadline, peer.net.idle) is a place in a :class:`WaitingRoom` and a server thread, both bounded.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass

from tasklet.peer.net.idle import Cancellable


class RoomFullError(Exception):
    """No place for this stream: its caller holds its quota (``per_caller``) or the room is full of callers
    waiting with as few streams as this one's."""

    def __init__(self, per_caller: bool, message: str) -> None:
        super().__init__(message)
        self.per_caller = per_caller


@dataclass
class _Waiting:
    caller: str
    call: Cancellable
    since: float


class WaitingRoom:
    """At most ``per_caller`` streams of one caller and ``total`` of all wait for their first chunk.

    When the room is full, a newcomer whose caller waits with fewer streams than the caller waiting with the
    most takes the place of that caller's oldest stream, which is cancelled. Why: with a bound in total alone,
    identities without a role would hold every place; with this, a caller waiting with one stream (an honest
    peer's chunk follows its call at once) always gets in. Thread-safe.
    """

    def __init__(self, total: int, per_caller: int) -> None:
        if total < 1 or per_caller < 1:
            raise ValueError(f"bounds must be >= 1, got total={total}, per_caller={per_caller}")
        self.total, self.per_caller = total, per_caller
        self._lock = threading.Lock()
        self._waiting: dict[int, _Waiting] = {}  # _lock: token -> stream, in arrival order
        self._counts: dict[str, int] = {}  # _lock: caller -> its waiting streams
        self._tokens = itertools.count()
        self.evicted = 0
        self.refused = 0

    def enter(self, caller: str, call: Cancellable) -> int:
        """A place for ``call`` of ``caller`` (its token, for ``leave``), or RoomFullError."""
        evict: Cancellable | None = None
        with self._lock:
            held = self._counts.get(caller, 0)
            if held >= self.per_caller:
                self.refused += 1
                raise RoomFullError(True, f"{held} streams of this peer already wait for their first chunk "
                                          f"(its quota is {self.per_caller})")
            if len(self._waiting) >= self.total:
                evict = self._evict_for(held)
                if evict is None:
                    self.refused += 1
                    raise RoomFullError(False, f"busy, {self.total} streams already wait for their first chunk")
            token = next(self._tokens)
            self._waiting[token] = _Waiting(caller, call, time.monotonic())
            self._counts[caller] = held + 1
        if evict is not None:
            self.evicted += 1
            with contextlib.suppress(Exception):  # a call that ended meanwhile: its place is free all the same
                evict.cancel()
        return token

    def leave(self, token: int | None) -> None:
        """Give the place back (its first chunk came, or the call ended); a second call does nothing."""
        if token is None:
            return
        with self._lock:
            self._drop(token)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def waiting_of(self, caller: str) -> int:
        with self._lock:
            return self._counts.get(caller, 0)

    def _evict_for(self, newcomer_held: int) -> Cancellable | None:
        """(with _lock) Remove the oldest stream of the caller waiting with the most, if that is more than the
        newcomer's caller; the call to cancel."""
        top = max(self._counts.values(), default=0)
        if top <= newcomer_held:
            return None
        for token, entry in self._waiting.items():  # dicts keep insertion order: the oldest first
            if self._counts.get(entry.caller, 0) == top:
                self._drop(token)
                return entry.call
        return None  # pragma: no cover - a caller with a count has a stream

    def _drop(self, token: int) -> None:
        entry = self._waiting.pop(token, None)
        if entry is None:
            return
        left = self._counts.get(entry.caller, 0) - 1
        if left > 0:
            self._counts[entry.caller] = left
        else:
            self._counts.pop(entry.caller, None)
