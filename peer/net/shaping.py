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
  After its delay, a message of n bytes books the slot [max(next_free, now), +8n/r]; each chunk is released
  when the bytes up to its end have been transmitted, i.e. when a real link would have finished putting it
  on the wire. Messages to the same destination share the one clock, so concurrent messages share the
  link's rate instead of each getting all of it, and leave in FIFO order like packets through a bottleneck
  queue (a message handed over first arrives first). Because slots are computed from the virtual clock and
  not from when a sleeping thread woke up, sleep overshoot does not accumulate; a sender that fell behind
  by at most `slack_s` (a late wake-up, a slow consumer) continues from the end of its previous slot and so
  catches up. An idle link banks nothing: after a pause, transmission starts from "now", never earlier.
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
from typing import Any, TypeVar

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
    base_delay_s: the one-way latency the real transport adds by itself (gRPC on loopback: about 2 ms on a
        loaded 2-core machine), subtracted from the hold time so that the end-to-end latency of a message,
        not just the shaper's hold, equals delay_s. 0 by default: then the first byte is never delivered
        before delay_s, and the end-to-end latency is delay_s plus the transport's own.
    Thread-safe: share one instance between all senders to the same destination.
    """

    def __init__(
        self,
        rate_bps: float | None,
        delay_s: float = 0.0,
        *,
        base_delay_s: float = 0.0,
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
        self.base_delay_s = float(base_delay_s)
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

    def book(self, n_bytes: int) -> tuple[float, float]:
        """Book n_bytes on the link; return (start, end) of their transmission slot."""
        with self._lock:
            self.bytes_sent += n_bytes
            now = self._clock()
            if self.rate_bps is None:
                return now, now
            # Busy link (its previous booking ended at most slack_s ago): continue right after it, catching
            # up on a late wake-up. Idle link: start now; idle time is not banked as a burst.
            start = self._next_free if self._next_free >= now - self.slack_s else now
            self._next_free = start + 8.0 * n_bytes / self.rate_bps
            return start, self._next_free

    def reserve(self, n_bytes: int) -> float:
        """Book n_bytes on the link; return the time at which they have been fully transmitted."""
        return self.book(n_bytes)[1]

    @property
    def hold_s(self) -> float:
        """How long a message is held back before transmission: the delay less the transport's own."""
        return max(0.0, self.delay_s - self.base_delay_s)

    def wait_delay(self, sent_at: float) -> None:
        """Block until the one-way delay (less base_delay_s) has passed since `sent_at` (a `clock()` time)."""
        if self.hold_s > 0:
            sleep_until(sent_at + self.hold_s, self._clock, self._sleep)

    def transmit(self, n_bytes: int) -> None:
        """Block until n_bytes have passed through the link's bandwidth."""
        sleep_until(self.reserve(n_bytes), self._clock, self._sleep)

    def shape(
        self,
        items: Iterable[T],
        size_of: Callable[[T], int],
        sent_at: float | None = None,
        total_bytes: int | None = None,
    ) -> Iterator[T]:
        """Yield `items` (the pieces of one message) no earlier than the link would deliver them.

        The first piece waits for the delay from `sent_at` (default: now, when iteration starts). With
        `total_bytes`, the whole message is then booked at once, so messages to one destination leave in the
        order they were handed over, like packets through a FIFO bottleneck, and each piece is released when
        the bytes up to its end have been transmitted. total_bytes should be the sum of size_of over the
        pieces; bytes beyond it are accounted on the link (later messages wait for them) but not waited for.
        Without it, every piece is booked on its own (concurrent messages then interleave).
        """
        self.wait_delay(self._clock() if sent_at is None else sent_at)
        if total_bytes is None or self.rate_bps is None:
            for item in items:
                self.transmit(size_of(item))
                yield item
            return
        start, _ = self.book(total_bytes)
        done = 0
        for item in items:
            size = size_of(item)
            within = max(0, min(size, total_bytes - done))
            done += size
            if size > within:
                # The caller under-announced: account for the excess (it delays later messages) but do not
                # send this message's tail to the back of the queue.
                self.book(size - within)
            sleep_until(start + 8.0 * min(done, total_bytes) / self.rate_bps, self._clock, self._sleep)
            yield item

    def now(self) -> float:
        return self._clock()


class CappedLink(LinkShaper):
    """A link (rate and delay as :class:`LinkShaper`; rate None: unshaped) whose bytes also pass through a
    ``cap`` shared by every destination: the owner's upload limit (``peer join --max-upload``).

    Each message is booked on both clocks; a piece is released when both would have carried the bytes up to
    its end, so the process's total upload never exceeds the cap's rate, however many links send at once.
    """

    def __init__(self, rate_bps: float | None, delay_s: float = 0.0, *, cap: LinkShaper, **kwargs: Any) -> None:
        super().__init__(rate_bps, delay_s, **kwargs)
        if cap.rate_bps is None:
            raise ValueError("the cap of a CappedLink must have a rate")
        self.cap = cap

    def __repr__(self) -> str:
        return f"CappedLink({super().__repr__()}, cap {self.cap.rate_bps / 1e6:g} Mbit/s)"  # type: ignore[operator]

    def chunk_bytes(self, default: int) -> int:
        return min(super().chunk_bytes(default), self.cap.chunk_bytes(default))

    def book(self, n_bytes: int) -> tuple[float, float]:
        start, end = super().book(n_bytes)
        cap_start, cap_end = self.cap.book(n_bytes)
        return min(start, cap_start), max(end, cap_end)

    def shape(
        self,
        items: Iterable[T],
        size_of: Callable[[T], int],
        sent_at: float | None = None,
        total_bytes: int | None = None,
    ) -> Iterator[T]:
        self.wait_delay(self._clock() if sent_at is None else sent_at)
        if total_bytes is None:
            for item in items:
                self.transmit(size_of(item))
                yield item
            return
        link_start, _ = LinkShaper.book(self, total_bytes)
        cap_start, _ = self.cap.book(total_bytes)
        cap_rate = self.cap.rate_bps
        assert cap_rate is not None
        done = 0
        for item in items:
            size = size_of(item)
            within = max(0, min(size, total_bytes - done))
            done += size
            if size > within:  # under-announced: accounted on both clocks, not waited for (as LinkShaper.shape)
                self.book(size - within)
            sent = min(done, total_bytes)
            release = cap_start + 8.0 * sent / cap_rate
            if self.rate_bps is not None:
                release = max(release, link_start + 8.0 * sent / self.rate_bps)
            sleep_until(release, self._clock, self._sleep)
            yield item


_upload_cap: LinkShaper | None = None  # this process's upload limit, shared by every destination
_download_cap: LinkShaper | None = None  # this process's download limit, shared by every source


def set_upload_cap(rate_bps: float | None) -> None:
    """Limit everything this process sends through shaped clients to ``rate_bps`` in total (None: no limit).
    Set before the transport starts: links created earlier keep what they had."""
    global _upload_cap
    if rate_bps is not None and not (rate_bps > 0 and math.isfinite(rate_bps)):
        raise ValueError(f"the upload cap must be a positive number of bit/s, got {rate_bps!r}")
    _upload_cap = None if rate_bps is None else LinkShaper(rate_bps)


def upload_cap() -> LinkShaper | None:
    return _upload_cap


def set_download_cap(rate_bps: float | None) -> None:
    """Limit what this process takes in (pushes, fetch replies and probes it receives) to ``rate_bps`` in total
    (None: no limit): a receiver reads the next chunk only when the cap has carried the previous ones, so
    HTTP/2's flow control (and the bulk lane's TCP window) holds the senders back to the cap, a window's worth
    of bytes ahead at most."""
    global _download_cap
    if rate_bps is not None and not (rate_bps > 0 and math.isfinite(rate_bps)):
        raise ValueError(f"the download cap must be a positive number of bit/s, got {rate_bps!r}")
    _download_cap = None if rate_bps is None else LinkShaper(rate_bps)


def download_cap() -> LinkShaper | None:
    return _download_cap


def take_in(n_bytes: int) -> None:
    """Account ``n_bytes`` received by this process on its download cap (block until the cap carried them)."""
    cap = _download_cap
    if cap is not None:
        cap.transmit(n_bytes)


def with_upload_cap(link: tuple[float | None, float] | None) -> LinkShaper | None:
    """The shaper for a link ((rate_bps, delay_s), or None: unshaped) under this process's upload cap."""
    cap = _upload_cap
    if cap is None:
        return None if link is None else LinkShaper(*link)
    rate, delay = link if link is not None else (None, 0.0)
    return CappedLink(rate, delay, cap=cap)


class LinkTable:
    """One LinkShaper per destination of this process, created on first use from `link_of`.

    link_of(destination) returns (rate_bps, delay_s) for the directed link to that destination, or None for
    an unshaped link. Pushes to the same destination from any thread share that destination's shaper. Under
    an upload cap (:func:`set_upload_cap`) every destination's shaper also passes through the cap.
    """

    def __init__(self, link_of: Callable[[str], tuple[float | None, float] | None]) -> None:
        self._link_of = link_of
        self._lock = threading.Lock()
        self._shapers: dict[str, LinkShaper | None] = {}

    def get(self, destination: str) -> LinkShaper | None:
        with self._lock:
            if destination not in self._shapers:
                self._shapers[destination] = with_upload_cap(self._link_of(destination))
            return self._shapers[destination]
