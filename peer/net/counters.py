"""Process-wide traffic counters of the transport: bytes per message kind and direction, refusals by reason.

The server and the client add to :data:`TRAFFIC` as messages pass; whoever wants the figures (the daemon's
Prometheus endpoint, ``peer.observe.metrics``) reads :meth:`TrafficCounters.snapshot`. The transport thus
needs no monitoring library and imports nothing above it. Labels are bounded: kinds are the protocol's
``Kind`` names (plus ``PROBE``), reasons are gRPC status code names, so a hostile peer cannot grow the maps.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

MAX_LABELS = 64  # more distinct kinds or reasons than the protocol has: fold the rest into "UNLISTED"


@dataclass
class TrafficSnapshot:
    """Totals since the process started: ``sent[kind]`` and ``received[kind]`` in bytes, ``refused[reason]``."""

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    messages_sent: dict[str, int] = field(default_factory=dict)
    messages_received: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)


class TrafficCounters:
    """Thread-safe monotonic counters; cheap enough to call on every message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = TrafficSnapshot()

    @staticmethod
    def _add(table: dict[str, int], label: str, n: int) -> None:
        if label not in table and len(table) >= MAX_LABELS:
            label = "UNLISTED"
        table[label] = table.get(label, 0) + n

    def sent(self, kind: str, n_bytes: int) -> None:
        """One message of ``kind`` sent (pushed by us, or a fetch reply served by us)."""
        with self._lock:
            self._add(self._data.sent, kind, n_bytes)
            self._add(self._data.messages_sent, kind, 1)

    def received(self, kind: str, n_bytes: int) -> None:
        """One message of ``kind`` received (pushed to us, or a fetch reply we read)."""
        with self._lock:
            self._add(self._data.received, kind, n_bytes)
            self._add(self._data.messages_received, kind, 1)

    def refused(self, reason: str) -> None:
        """This process's server refused a call (``reason``: the gRPC status code name it answered)."""
        with self._lock:
            self._add(self._data.refused, reason, 1)

    def snapshot(self) -> TrafficSnapshot:
        with self._lock:
            d = self._data
            return TrafficSnapshot(
                dict(d.sent), dict(d.received), dict(d.messages_sent), dict(d.messages_received), dict(d.refused)
            )


TRAFFIC = TrafficCounters()
