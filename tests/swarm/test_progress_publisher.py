"""The leader's progress records are stored off the driver's thread (peer.swarm.progress.ProgressPublisher): a step
never waits for the DHT, a newer payload replaces one not yet stored, and a flush waits for what was submitted."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tasklet.peer.swarm.progress import ProgressPublisher

pytestmark = pytest.mark.unit


class SlowBoard:
    """A progress board whose stores take as long as the test lets them (``release``), or fail (``ok``)."""

    def __init__(self) -> None:
        self.stored: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.ok = True

    def publish(self, payload: dict[str, Any]) -> bool:
        self.entered.set()
        assert self.release.wait(10)
        if payload.get("boom"):
            raise RuntimeError("store exploded")
        self.stored.append(dict(payload))
        return self.ok


@pytest.fixture
def board() -> SlowBoard:
    return SlowBoard()


def publisher_of(board: SlowBoard, timeout_s: float = 5.0) -> ProgressPublisher:
    return ProgressPublisher(board, timeout_s=timeout_s).start()  # type: ignore[arg-type]


def test_submit_returns_at_once_and_the_newest_waiting_payload_wins(board: SlowBoard) -> None:
    pub = publisher_of(board)
    t0 = time.monotonic()
    pub.submit({"step": 1})
    assert board.entered.wait(5)  # step 1's store is in flight and stalls
    for step in (2, 3, 4):
        pub.submit({"step": step})
    assert time.monotonic() - t0 < 1.0, "submitting never waits for a store"
    board.release.set()
    assert pub.flush(5)
    assert [p["step"] for p in board.stored] == [1, 4], "steps 2 and 3 were replaced before their turn"
    pub.close()


def test_flush_waits_for_the_store_in_flight_and_times_out_without_it(board: SlowBoard) -> None:
    pub = publisher_of(board)
    pub.submit({"step": 7})
    assert board.entered.wait(5)
    t0 = time.monotonic()
    assert not pub.flush(0.3), "the store has not ended"
    assert 0.25 < time.monotonic() - t0 < 2.0
    threading.Timer(0.2, board.release.set).start()
    assert pub.flush(5) and board.stored == [{"step": 7}]
    pub.close()


def test_a_failed_or_raising_store_ends_the_flush_and_the_thread_goes_on(board: SlowBoard) -> None:
    pub = publisher_of(board)
    board.release.set()
    board.ok = False
    pub.submit({"step": 1})
    assert pub.flush(5) and pub.failures == 1
    pub.submit({"step": 2, "boom": True})
    assert pub.flush(5) and pub.failures == 2
    board.ok = True
    pub.submit({"step": 3})
    assert pub.flush(5) and board.stored[-1] == {"step": 3} and pub.failures == 2
    pub.close()


def test_renew_stores_the_last_payload_again_and_close_stops_everything(board: SlowBoard) -> None:
    pub = publisher_of(board)
    board.release.set()
    pub.renew({"step": 0, "state": "forming"})  # a leader beats before its first step too
    deadline = time.monotonic() + 5
    while len(board.stored) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    pub.submit({"step": 5})
    assert pub.flush(5)
    pub.renew({"step": 5})
    while len(board.stored) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert board.stored == [{"step": 0, "state": "forming"}, {"step": 5}, {"step": 5}]
    board.release.clear()
    board.entered.clear()
    pub.submit({"step": 6})
    assert board.entered.wait(5)  # in flight, stalled
    pub.submit({"step": 7})  # waiting
    pub.close()
    board.release.set()
    assert not pub.flush(0.3), "the waiting payload is dropped at close"
    pub.submit({"step": 8})
    pub.renew({"step": 8})
    pub._thread.join(2)
    assert not pub._thread.is_alive()
    assert [p["step"] for p in board.stored] == [0, 5, 5, 6], "the store in flight ends; nothing after close"
