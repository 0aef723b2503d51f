"""Idle streams end: a stream whose bytes stopped moving for ``idle_s`` is cancelled, whatever its deadline.

A call's deadline may be up to 600 s (a step), so without this a caller that opens a stream and then sends (or
reads) nothing holds its stream slot and a server thread for that long; a member running many identities could
hold every slot of a worker or the coordinator. :class:`IdleWatch` keeps the time of each watched stream's last
progress (a chunk received, a chunk handed to gRPC to send) and one thread cancels those past ``idle_s``
(``grpc.RpcContext.cancel``: the handler's blocked read or write returns and its slot is released).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class IdleWatch:
    """Streams under watch and the thread that cancels idle ones; ``close()`` stops the thread."""

    def __init__(self, idle_s: float, period_s: float | None = None) -> None:
        if not idle_s > 0:
            raise ValueError(f"idle_s must be positive, got {idle_s}")
        self.idle_s = idle_s
        self.period_s = period_s if period_s is not None else min(1.0, idle_s / 4)
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[Cancellable, float]] = {}  # _lock: token -> (call, last progress)
        self._tokens = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cancelled = 0

    def start(self) -> None:
        """Start (or restart, after ``close``) the thread; ``watch`` does it too (a mounted server never starts)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive() or self._stop.is_set():
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._loop, args=(self._stop,), name="idle-watch",
                                                daemon=True)
                self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def watch(self, call: Cancellable) -> int:
        if self._thread is None or self._stop.is_set():
            self.start()
        token = next(self._tokens)
        with self._lock:
            self._streams[token] = (call, time.monotonic())
        return token

    def touch(self, token: int) -> None:
        with self._lock:
            entry = self._streams.get(token)
            if entry is not None:
                self._streams[token] = (entry[0], time.monotonic())

    def done(self, token: int) -> None:
        with self._lock:
            self._streams.pop(token, None)

    def moving(self, token: int, items: Iterator[T]) -> Iterator[T]:
        """``items`` unchanged, each one counted as progress of stream ``token``; unwatched once exhausted."""
        try:
            for item in items:
                self.touch(token)
                yield item
        finally:
            self.done(token)

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.period_s):
            limit = time.monotonic() - self.idle_s
            with self._lock:
                idle = [(token, call) for token, (call, last) in self._streams.items() if last < limit]
                for token, _ in idle:
                    del self._streams[token]
            for _, call in idle:
                self.cancelled += 1
                try:
                    call.cancel()
                except Exception:  # a call that ended meanwhile
                    log.debug("cancelling an idle stream failed", exc_info=True)
            if idle:
                log.info("cancelled %d stream(s) idle for %.0f s", len(idle), self.idle_s)
