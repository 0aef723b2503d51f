"""A peer's calls to itself, kept in the process: no socket, no TLS, no HTTP/2.

Why: a lone peer's leader and its worker are one process, and each step they exchange several control messages
(start, lease, commit, reduce, apply, report); over mutual-TLS gRPC on loopback each cost 2-3 ms of a 2-core
machine, a third of a small model's step (docs/benchmarks/overhead.md). What does not change: the envelope is
serialised and reassembled with the same limits, the server admits its Kind from the caller and takes a stream
slot of the caller's quota, the handlers run their own checks on threads that are not the caller's, and a
refusal comes back as the same Refused or PeerUnreachable. The caller is this process's own identity, which is
what mutual TLS would have authenticated.

Only endpoints a daemon :func:`publish` es for its own server are served this way (its published address, and a
route mounted on it, such as the leader's ``/coordinator``). A client of any other endpoint, one whose link is
emulated (a shaper), or one with another TLS identity goes through the network as before, and so do in-process
tests of the transport, which publish nothing.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from tasklet.peer.net.server import PeerServer
from tasklet.peer.net.tls import TlsContext

_lock = threading.Lock()
_published: dict[str, PeerServer] = {}  # endpoint (without a route) -> this process's server behind it


def publish(endpoint: str, server: PeerServer) -> None:
    """Serve this process's calls to ``endpoint`` (and routes under it) from ``server`` directly."""
    base = endpoint.partition("/")[0]
    if not base:
        raise ValueError("an endpoint to publish is needed")
    with _lock:
        _published[base] = server


def withdraw(server: PeerServer) -> None:
    """Stop serving any endpoint from ``server`` in process (it is stopping)."""
    with _lock:
        for endpoint in [e for e, s in _published.items() if s is server]:
            del _published[endpoint]


def local_server(endpoint: str, tls: TlsContext | None) -> PeerServer | None:
    """The server of this process that answers ``endpoint`` for a client with ``tls``, or None (the network)."""
    base, _, route = endpoint.partition("/")
    with _lock:
        server = _published.get(base)
    if server is None or server.config.tls is not tls:
        return None
    return server.mounted_at(route) if route else server


def caller_id(tls: TlsContext | None) -> str:
    """The peer id the server sees for this process's own calls: its certificate's, as mutual TLS gives it."""
    if tls is None:
        return ""
    return tls.trust.peer_of(tls.certificate) or tls.peer_id


MAX_WATCHED = 4096  # entries before the settled ones are swept out (each settled one would leave at its deadline)


class Deadlines:
    """One thread that fails a local call's Future when its handler outlives the call's deadline, as gRPC ends a
    call at its deadline: a caller that only waits on a done-callback (the worker's outbox) then hears of it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Future[Any], Callable[[], BaseException]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, future: Future[Any], deadline: float, failure: Callable[[], BaseException]) -> None:
        """Fail ``future`` with ``failure()`` at ``deadline`` (monotonic seconds) unless it is settled by then."""
        with self._cond:
            if len(self._heap) >= MAX_WATCHED:
                self._heap = [entry for entry in self._heap if not entry[2].done()]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (deadline, next(self._order), future, failure))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="local-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][2] is future:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                deadline, _, future, failure = self._heap[0]
                wait_s = deadline - time.monotonic()
                if not future.done() and wait_s > 0:
                    self._cond.wait(wait_s)
                    continue
                heapq.heappop(self._heap)
            if not future.done():
                with contextlib.suppress(InvalidStateError):  # settled by its handler meanwhile
                    future.set_exception(failure())


DEADLINES = Deadlines()


def settle_from(source: Future[Any], target: Future[Any]) -> None:
    """Give ``target`` the outcome of ``source`` unless a deadline settled it first."""
    try:
        error = source.exception()
        if error is None:
            target.set_result(source.result())
        else:
            target.set_exception(error)
    except InvalidStateError:
        pass
