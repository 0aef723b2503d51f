"""LinkShaper's token bucket and delay, on a simulated clock (deterministic: sleeping advances the clock)."""

from __future__ import annotations

import pytest

from tasklet.peer.net.shaping import MIN_CHUNK_BYTES, LinkShaper, LinkTable


class SimClock:
    """time.monotonic + time.sleep stand-ins: sleep(s) moves the clock by s and logs nothing else."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def _shaper(rate_bps: float | None, delay_s: float, clock: SimClock, **kw: float) -> LinkShaper:
    return LinkShaper(rate_bps, delay_s, clock=clock, sleep=clock.sleep, **kw)


def test_single_message_arrives_after_delay_plus_transmission() -> None:
    clock = SimClock()
    link = _shaper(8e6, 0.05, clock)  # 1 MB/s, 50 ms
    sent = clock.now
    times = []
    for chunk in link.shape([b"x" * 100_000] * 10, len):  # 1 MB
        times.append(clock.now - sent)
        assert chunk
    # first chunk: 50 ms delay + 100 ms on the wire; last: 50 ms + 1 s
    assert times[0] == pytest.approx(0.15)
    assert times[-1] == pytest.approx(1.05)
    assert all(b - a == pytest.approx(0.1) for a, b in zip(times, times[1:], strict=False))


def test_first_byte_never_before_delay_even_for_tiny_messages() -> None:
    clock = SimClock()
    link = _shaper(None, 0.2, clock)
    sent = clock.now
    list(link.shape([b"p"], len))
    assert clock.now - sent == pytest.approx(0.2)


def test_delay_does_not_serialise_pipelined_messages() -> None:
    """Two messages sent at the same moment on a 100 ms link: both wait the same 100 ms concurrently; the
    second does not wait for the first one's delay."""
    clock = SimClock()
    link = _shaper(8e9, 0.1, clock)  # fast link, so only the delay matters
    sent = clock.now
    first = link.shape([b"a" * 1000], len, sent_at=sent)
    second = link.shape([b"b" * 1000], len, sent_at=sent)
    next(first)
    t_first = clock.now - sent
    next(second)
    t_second = clock.now - sent
    assert t_first == pytest.approx(0.1, abs=1e-5)
    assert t_second == pytest.approx(0.1, abs=1e-5)  # not 0.2


def test_concurrent_messages_share_the_link_rate() -> None:
    clock = SimClock()
    link = _shaper(8e6, 0.0, clock, slack_s=0.0)
    a = link.shape([b"a" * 50_000] * 10, len)
    b = link.shape([b"b" * 50_000] * 10, len)
    start = clock.now
    for _ in range(10):  # interleave, as two sending threads would
        next(a)
        next(b)
    # 1 MB in total through 1 MB/s, not 0.5 s as two independent buckets would allow
    assert clock.now - start == pytest.approx(1.0)
    assert link.bytes_sent == 1_000_000


def test_idle_link_banks_nothing_but_a_late_sender_catches_up() -> None:
    clock = SimClock()
    link = _shaper(8e6, 0.0, clock, slack_s=0.005)
    link.transmit(1000)
    clock.now += 10.0  # a long idle period: no burst allowance afterwards
    start = clock.now
    link.transmit(1_000_000)
    assert clock.now - start == pytest.approx(1.0)
    clock.now += 0.004  # woke up 4 ms late (within slack): the next slot starts where the last one ended
    start = clock.now
    link.transmit(10_000)
    assert clock.now - start == pytest.approx(0.01 - 0.004)


def test_chunk_size_follows_rate() -> None:
    assert _shaper(10e6, 0, SimClock()).chunk_bytes(1 << 20) == MIN_CHUNK_BYTES
    assert _shaper(1e9, 0, SimClock()).chunk_bytes(1 << 20) == 625_000  # 5 ms at 1 Gbit/s
    assert _shaper(100e9, 0, SimClock()).chunk_bytes(1 << 20) == 1 << 20
    assert _shaper(None, 0, SimClock()).chunk_bytes(1 << 20) == 1 << 20


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        LinkShaper(0, 0.0)
    with pytest.raises(ValueError):
        LinkShaper(1e6, -1.0)


def test_link_table_keeps_one_shaper_per_destination() -> None:
    asked: list[str] = []

    def link_of(dest: str) -> tuple[float | None, float] | None:
        asked.append(dest)
        return None if dest == "local" else (1e8, 0.01)

    table = LinkTable(link_of)
    first = table.get("127.0.0.2:5000")
    assert first is not None and first.rate_bps == 1e8 and first.delay_s == 0.01
    assert table.get("127.0.0.2:5000") is first
    assert table.get("local") is None and table.get("local") is None
    assert asked == ["127.0.0.2:5000", "local"]


def test_whole_message_booking_is_fifo_and_paced() -> None:
    clock = SimClock()
    link = _shaper(8e6, 0.0, clock)  # 1 MB/s
    a = link.shape([b"a" * 100_000] * 5, len, total_bytes=500_000)
    b = link.shape([b"b" * 100_000] * 5, len, total_bytes=500_000)
    start = clock.now
    next(a)
    next(b)  # b was handed over second: it is booked after all of a
    assert clock.now - start == pytest.approx(0.6)  # b's first piece ends at 0.5 + 0.1
    rest_a = list(a)  # a's remaining pieces were due long ago: released at once
    assert len(rest_a) == 4 and clock.now - start == pytest.approx(0.6)
    list(b)
    assert clock.now - start == pytest.approx(1.0)


def test_bytes_beyond_the_announced_total_delay_later_messages_only() -> None:
    clock = SimClock()
    link = _shaper(8e6, 0.0, clock)
    start = clock.now
    list(link.shape([b"x" * 100_000, b"y" * 110_000], len, total_bytes=200_000))
    assert clock.now - start == pytest.approx(0.2)  # not sent to the back of the queue
    assert link.bytes_sent == 210_000
    link.transmit(10_000)
    assert clock.now - start == pytest.approx(0.22)  # the excess was accounted on the link


def test_base_delay_is_subtracted_from_the_hold() -> None:
    clock = SimClock()
    link = _shaper(None, 0.010, clock, base_delay_s=0.002)
    start = clock.now
    list(link.shape([b"p"], len))
    assert clock.now - start == pytest.approx(0.008)
    assert _shaper(None, 0.001, clock, base_delay_s=0.002).hold_s == 0.0
