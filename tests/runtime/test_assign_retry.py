"""A refused assignment is sent again while a heartbeat can end the refusal (peer.runtime.lead.coordinator).

After a partition heals, the leader sees a peer's advert before the peer has read the leader's again: the peer's
TLS trust store no longer holds the leader's certificate and its intake does not follow that leader yet, so the
assignment is refused at once. Declared dead on that, the peer was banned for twice ``BAN_S`` and sat out the rest
of the run (seen in tests/swarms/test_partition_heal.py).
"""

from __future__ import annotations

import time

import pytest

from tasklet.peer.runtime.lead import coordinator
from tasklet.protocol.errors import PeerUnreachable, Refused, TransportError

pytestmark = pytest.mark.unit

HANDSHAKE = PeerUnreachable("10.0.0.3:1", "UNAVAILABLE: failed to connect to all addresses; Socket closed")
NOT_FOLLOWING = Refused("PERMISSION_DENIED", "assignments are taken only from the leader this peer elects")


class Worker:
    """A worker whose first ``refusals`` pushes fail with ``error``."""

    def __init__(self, error: TransportError, refusals: int) -> None:
        self.error, self.refusals, self.pushes = error, refusals, 0

    def push(self, envelope: object, timeout_s: float) -> None:
        assert timeout_s >= 1.0
        self.pushes += 1
        if self.pushes <= self.refusals:
            raise self.error


@pytest.mark.parametrize("error", [HANDSHAKE, NOT_FOLLOWING], ids=["tls-handshake", "not-following-yet"])
def test_a_refusal_that_a_heartbeat_ends_is_sent_again_until_taken(error: TransportError) -> None:
    worker = Worker(error, refusals=1)  # the original push failed; the first retry fails too; the second takes
    start = time.monotonic()
    assert coordinator.send_again(worker.push, object(), error, 0.01, time.monotonic() + 10) is None
    assert worker.pushes == 2 and time.monotonic() - start >= 0.02


def test_still_refused_after_the_retries_returns_the_last_error() -> None:
    worker = Worker(HANDSHAKE, refusals=99)
    assert coordinator.send_again(worker.push, object(), HANDSHAKE, 0.01, time.monotonic() + 10) is HANDSHAKE
    assert worker.pushes == coordinator.ASSIGN_RETRY_HEARTBEATS


@pytest.mark.parametrize("error", [
    PeerUnreachable("10.0.0.3:1", "DEADLINE_EXCEEDED: Deadline Exceeded"),  # maybe gone: no second wait
    Refused("INVALID_ARGUMENT", "the assignment names layers the model does not have"),  # a refusal on merit
])
def test_a_timeout_or_a_refusal_on_merit_is_not_sent_again(error: TransportError) -> None:
    worker = Worker(error, refusals=0)
    assert coordinator.send_again(worker.push, object(), error, 0.01, time.monotonic() + 10) is error
    assert worker.pushes == 0


def test_no_retry_past_the_assignments_deadline() -> None:
    worker = Worker(HANDSHAKE, refusals=0)
    assert coordinator.send_again(worker.push, object(), HANDSHAKE, 5.0, time.monotonic() + 1.0) is HANDSHAKE
    assert worker.pushes == 0
