"""File descriptors of this process and connection caps on its listening ports.

A peer listens on several ports (gRPC, the bulk lane, the relay, the dashboard, the metrics endpoint), and
every connection a stranger opens costs a descriptor before anything else is checked; at the common soft
limit of 1,024 a flood of ~50 connections a second reaches it within seconds, and then the peer cannot open
its own files, sockets or DHT connections. So :func:`raise_nofile` lifts the soft limit to the hard one at
start (where the system allows it), :func:`descriptor_budget` is what the caps of the listeners are derived
from, and :class:`ConnectionCap` is the per-source and total admission each listener takes a connection
through before it reads a byte.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

NOFILE_TARGET = 65536  # what raise_nofile asks for (capped by the hard limit)
RESERVED_DESCRIPTORS = 256  # never handed to listeners: the process's own files, DHT, clients, CUDA


def _rlimit() -> tuple[int, int]:
    try:
        import resource
    except ImportError:  # not on this platform
        return 1024, 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def raise_nofile(target: int = NOFILE_TARGET) -> int:
    """Raise the soft RLIMIT_NOFILE towards ``target`` (at most the hard limit); return the soft limit now."""
    soft, hard = _rlimit()
    want = target if hard < 0 else min(target, hard)  # RLIM_INFINITY is -1
    if want > soft:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ImportError, ValueError, OSError) as exc:
            log.info("cannot raise the open-file limit from %d to %d: %s", soft, want, exc)
    return soft


def descriptor_budget() -> int:
    """Descriptors this process may let its listeners hold, all together: the soft limit less a reserve."""
    soft, _ = _rlimit()
    return max(64, soft - RESERVED_DESCRIPTORS)


class ConnectionCap:
    """Admission of connections to one listening port: at most ``per_source`` at once from one address and
    ``total`` from all. ``admit(address)`` returns False for one over a cap (the listener closes it at once,
    before reading); each admitted one is given back with ``release(address)``. Thread-safe."""

    def __init__(self, total: int, per_source: int) -> None:
        if total < 1 or per_source < 1:
            raise ValueError(f"caps must be >= 1, got total={total}, per_source={per_source}")
        self.total, self.per_source = total, per_source
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # _lock
        self._count = 0  # _lock
        self.refused = 0

    def admit(self, address: str) -> bool:
        with self._lock:
            held = self._held.get(address, 0)
            if self._count >= self.total or held >= self.per_source:
                self.refused += 1
                return False
            self._held[address] = held + 1
            self._count += 1
            return True

    def release(self, address: str) -> None:
        with self._lock:
            held = self._held.get(address, 0) - 1
            if held > 0:
                self._held[address] = held
            else:
                self._held.pop(address, None)
            self._count = max(0, self._count - 1)

    @property
    def held(self) -> int:
        with self._lock:
            return self._count
