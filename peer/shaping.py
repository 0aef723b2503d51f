"""Link emulation at the sender: a token bucket for bandwidth plus a one-way delay, per directed link.

`tc netem` is not available here, so each peer shapes what it sends to each destination itself. The model
of a link with rate r (bits/s) and one-way delay d is the textbook one: a message of n bytes handed to the
link at t0 on an idle link is serialised during [t0, t0 + 8n/r] and its last byte arrives at
t0 + d + 8n/r; its first byte never arrives before t0 + d.

How it is emulated (all at the sender, because only the sender knows both ends of the link; the receiver
would need trustworthy send times):

* Delay: a message's chunks are held back until t0 + d, each message on its own clock, in its own thread.
  Several messages in flight therefore wait *concurrently*: a 100 ms link still carries many messages per
  second. Delay is latency, not a per-message lock.
* Bandwidth: one virtual clock per link (`_next_free`, the time the link finishes what it has been given).
  A chunk of c bytes reserves the slot [max(next_free, now), +8c/r] and is released at the *end* of its slot,
  i.e. when a real link would have finished putting it on the wire. Concurrent messages to the same
  destination draw from the same clock, so they share the link's rate instead of each getting all of it.
  Because slots are computed from the virtual clock and not from when a sleeping thread woke up, sleep
  overshoot does not accumulate; a sender that fell behind by at most `slack_s` (a late wake-up, a slow
  consumer) continues from the end of its previous slot and so catches up. An idle link banks nothing:
  after a pause, transmission starts from "now", never earlier.
* Granularity: releasing a 1 MiB chunk at once on a 10 Mbit/s link would make the stream bursty (0.8 s of
  nothing, then a burst at memory speed). `chunk_bytes` suggests chunks of about `quantum_s` worth of the
  link's rate, so the release pattern is smooth at every rate.

Loopback itself adds its own small latency and finite bandwidth; the benchmark (`python -m bench.transport`)
reports what is actually achieved.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

MIN_CHUNK_BYTES = 16 * 1024


def sleep_until(
    deadline: float, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
) -> None:
    """Sleep until `clock()` reaches `deadline` (returns at once if it already has)."""
    while True:
        left = deadline - clock()
        if left <= 0:
            return
        sleep(left)


class LinkShaper:
    """Token bucket + one-way delay for everything one process sends to one destination.

    rate_bps: link bandwidth in bits per second (None or inf: unlimited, delay only).
    delay_s: one-way latency in seconds.
    Thread-safe: share one instance between all senders to the same destination.
    """

    def __init__(
        self,
        rate_bps: float | None,
        delay_s: float = 0.0,
        *,
        quantum_s: float = 0.005,
        slack_s: float = 0.005,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate_bps is not None and not rate_bps > 0:
            raise ValueError(f"rate_bps must be positive (or None for unlimited), got {rate_bps}")
        if not delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.rate_bps = None if rate_bps is None or math.isinf(rate_bps) else float(rate_bps)
        self.delay_s = float(delay_s)
        self.quantum_s = quantum_s
        self.slack_s = slack_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._next_free = -math.inf
        self.bytes_sent = 0

    def __repr__(self) -> str:
        rate = "unlimited" if self.rate_bps is None else f"{self.rate_bps / 1e6:g} Mbit/s"
        return f"LinkShaper({rate}, {self.delay_s * 1e3:g} ms)"

    def chunk_bytes(self, default: int) -> int:
        """Chunk size to use on this link: about `quantum_s` of transmission, at most `default`."""
        if self.rate_bps is None:
            return default
        return max(1, min(default, max(MIN_CHUNK_BYTES, int(self.rate_bps / 8 * self.quantum_s))))

    def reserve(self, n_bytes: int) -> float:
        """Book n_bytes on the link; return the time at which they have been fully transmitted."""
        with self._lock:
            self.bytes_sent += n_bytes
            now = self._clock()
            if self.rate_bps is None:
                return now
            # Busy link (its previous booking ended at most slack_s ago): continue right after it, catching
            # up on a late wake-up. Idle link: start now; idle time is not banked as a burst.
            start = self._next_free if self._next_free >= now - self.slack_s else now
            self._next_free = start + 8.0 * n_bytes / self.rate_bps
            return self._next_free

    def wait_delay(self, sent_at: float) -> None:
        """Block until one-way delay has passed since `sent_at` (a `clock()` time)."""
        if self.delay_s > 0:
            sleep_until(sent_at + self.delay_s, self._clock, self._sleep)

    def transmit(self, n_bytes: int) -> None:
        """Block until n_bytes have passed through the link's bandwidth."""
        sleep_until(self.reserve(n_bytes), self._clock, self._sleep)

    def shape(
        self, items: Iterable[T], size_of: Callable[[T], int], sent_at: float | None = None
    ) -> Iterator[T]:
        """Yield `items` (the pieces of one message) no earlier than the link would deliver them.

        The first piece waits for the delay from `sent_at` (default: now, when iteration starts), then
        every piece waits for its bandwidth slot.
        """
        start = self._clock() if sent_at is None else sent_at
        self.wait_delay(start)
        for item in items:
            self.transmit(size_of(item))
            yield item

    def now(self) -> float:
        return self._clock()


class LinkTable:
    """One LinkShaper per destination of this process, created on first use from `link_of`.

    link_of(destination) returns (rate_bps, delay_s) for the directed link to that destination, or None for
    an unshaped link. Pushes to the same destination from any thread share that destination's shaper.
    """

    def __init__(self, link_of: Callable[[str], tuple[float | None, float] | None]) -> None:
        self._link_of = link_of
        self._lock = threading.Lock()
        self._shapers: dict[str, LinkShaper | None] = {}

    def get(self, destination: str) -> LinkShaper | None:
        with self._lock:
            if destination not in self._shapers:
                link = self._link_of(destination)
                self._shapers[destination] = None if link is None else LinkShaper(*link)
            return self._shapers[destination]
