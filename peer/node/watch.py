"""A follower's watch on its coordinator: a leader that beats but does not coordinate is replaced like a dead one.

The leader's beat (``peer.swarm.progress``) tells a dead leader from a live one, but not a leader whose
coordinator is gone (it failed while taking over, its role crashed, its port is cut off while the DHT still
reaches it). Once a heartbeat, a follower holding an assignment from the leader it elects pings the
assignment's coordinator; unreachable for ``COORDINATOR_LOST_HEARTBEATS`` heartbeats, the follower deposes that
leader (``SwarmView.depose``: elected without it for ``DEPOSE_HEARTBEATS``, renewed while that coordinator stays
unreachable, lifted as soon as it answers) and takes part in a new election, instead of its feeder retrying
the dead coordinator for as long as the leader's advert lives.

The ping goes over one channel kept open to the coordinator, so strangers holding the coordinator's port (its
connection caps full) do not cut a follower that is already connected; and a coordinator that does not answer
while the leader's signed progress still moves (it reaches its workers, just not this one) is not deposed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.runtime.spec import Assignment
from tasklet.peer.swarm.view import SwarmView
from tasklet.peer.timing import COORDINATOR_LOST_HEARTBEATS, DEPOSE_HEARTBEATS, STATUS_TIMEOUT_S


class CoordinatorWatch:
    """The loop of the module docstring; ``run`` until ``stop`` is set."""

    def __init__(self, heartbeat_s: float, tls: TlsContext, me: str, assignment: Callable[[], Assignment | None],
                 leading: Callable[[], bool], elected: Callable[[], str | None],
                 depose: Callable[[str, float, str], None], stop: threading.Event,
                 ping: Callable[[Assignment], None] | None = None,
                 progress_step: Callable[[str], int | None] | None = None) -> None:
        """``ping(assignment)`` raises when the assignment's coordinator does not answer (default: a gRPC ping
        over mutual TLS on a channel kept open, expecting the leader's certificate); ``progress_step(leader)`` is
        the step of that leader's newest signed progress (None: none read)."""
        self.heartbeat_s, self.tls, self.me = heartbeat_s, tls, me
        self.assignment, self.leading, self.elected, self.depose, self.stop = assignment, leading, elected, depose, stop
        self.ping = ping or self._ping
        self.progress_step = progress_step or (lambda _leader: None)
        self.lost_since: float | None = None
        self.step_when_lost: int | None = None  # the leader's signed step when its coordinator stopped answering
        self.deposed: dict[str, Assignment] = {}  # leaders deposed, with the assignment whose coordinator is gone
        self._client: PeerClient | None = None
        self._client_for: tuple[str, str] = ("", "")

    def _ping(self, a: Assignment) -> None:
        if self._client is None or self._client_for != (a.coordinator, a.leader):
            self.close()
            self._client = PeerClient(a.coordinator, TransportConfig(tls=self.tls), sender=self.me,
                                      expect_peer=a.leader)
            self._client_for = (a.coordinator, a.leader)
        self._client.ping(timeout_s=min(STATUS_TIMEOUT_S, self.heartbeat_s * COORDINATOR_LOST_HEARTBEATS))

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def run(self) -> None:
        try:
            while not self.stop.wait(self.heartbeat_s):
                self.check()
        finally:
            self.close()

    def check(self) -> None:
        self._renew()
        a = self.assignment()
        if self.leading() or a is None or not a.leader or a.leader != self.elected():
            self.lost_since = None
            return
        lost_after = self.heartbeat_s * COORDINATOR_LOST_HEARTBEATS
        try:
            self.ping(a)
            self.lost_since = None
        except Exception as exc:  # any failure to reach it counts
            now = time.monotonic()
            step = self.progress_step(a.leader)
            if self.lost_since is None:
                self.lost_since, self.step_when_lost = now, step
            elif step is not None and self.step_when_lost is not None and step > self.step_when_lost:
                # the leader still trains with its workers: the fault is between it and this peer, not in it
                self.lost_since, self.step_when_lost = now, step
                return
            if now - self.lost_since >= lost_after:
                self.depose(a.leader, self.heartbeat_s * DEPOSE_HEARTBEATS,
                            f"its coordinator {a.coordinator} has not answered for {now - self.lost_since:.0f} s "
                            f"({str(exc)[:120]})")
                self.deposed[a.leader] = a
                self.lost_since = None

    def _renew(self) -> None:
        """A deposed leader stays out of the election while its coordinator stays unreachable (else, once the
        deposition lapsed, the followers would elect it again and wait on it anew); one that answers again is
        let go at once."""
        for leader, a in list(self.deposed.items()):
            try:
                self.ping(a)
            except Exception:
                self.depose(leader, self.heartbeat_s * DEPOSE_HEARTBEATS, "")
                continue
            del self.deposed[leader]
            self.depose(leader, 0.0, f"the coordinator of {leader} answers again")  # e.g. a healed partition


def signed_step(view: SwarmView) -> Callable[[str], int | None]:
    """``progress_step`` for a CoordinatorWatch: the step of the newest beat the view read of the leader it
    elects (the beat is the leader's signed record), None for any other leader or before a beat."""

    def step(leader: str) -> int | None:
        beat = view.elected_beat
        if isinstance(beat, dict) and beat.get("leader") == leader and type(beat.get("step")) is int:
            return beat["step"]
        return None

    return step
