"""A follower whose coordinator does not answer for COORDINATOR_LOST_HEARTBEATS deposes its leader and elects
without it (peer.node.watch, peer.swarm.view); one that answers, or a leader it no longer elects, is left alone."""

from __future__ import annotations

import threading
import time

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.node.watch import CoordinatorWatch
from tasklet.peer.runtime.spec import Assignment
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.membership import PeerEntry
from tasklet.peer.swarm.view import SwarmView
from tasklet.peer.timing import COORDINATOR_LOST_HEARTBEATS, DEPOSE_HEARTBEATS
from tasklet.protocol.errors import TransportError

HEARTBEAT_S = 0.01
A = Assignment(epoch=3, stage=1, replica=0, n_stages=2, n_replicas=1, layers=(2, 4), group=("w",),
               coordinator="127.0.0.1:1/coordinator", leader="lead")


def _watch(answers: bool, elected: str = "lead", leading: bool = False) -> tuple[CoordinatorWatch, list]:
    deposed: list[tuple[str, float, str]] = []

    def ping(a: Assignment) -> None:
        if not answers:
            raise TransportError("unreachable")

    watch = CoordinatorWatch(HEARTBEAT_S, None, "me", lambda: A, lambda: leading, lambda: elected,  # type: ignore[arg-type]
                             lambda pid, for_s, why: deposed.append((pid, for_s, why)), threading.Event(), ping)
    return watch, deposed


def _run_checks(watch: CoordinatorWatch, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watch.check()
        time.sleep(HEARTBEAT_S / 2)


def test_an_unreachable_coordinator_deposes_its_leader_after_the_bound():
    watch, deposed = _watch(answers=False)
    watch.check()
    assert deposed == []  # one miss is no verdict
    _run_checks(watch, HEARTBEAT_S * COORDINATOR_LOST_HEARTBEATS * 1.5)
    assert deposed and deposed[0][0] == "lead"
    assert abs(deposed[0][1] - HEARTBEAT_S * DEPOSE_HEARTBEATS) < 1e-9
    assert "127.0.0.1:1/coordinator" in deposed[0][2]
    # while it stays unreachable the deposition is renewed (quietly), even once the follower elects another
    watch.elected = lambda: "other"
    n = len(deposed)
    watch.check()
    assert len(deposed) == n + 1 and deposed[-1][:2] == ("lead", HEARTBEAT_S * DEPOSE_HEARTBEATS)
    watch.ping = lambda a: None  # it answers again: let go at once (a deposition of 0 s)
    watch.check()
    watch.check()
    assert len(deposed) == n + 2 and deposed[-1][:2] == ("lead", 0.0) and watch.deposed == {}


def test_a_reachable_coordinator_or_another_leader_is_left_alone():
    for watch, deposed in (_watch(answers=True), _watch(answers=False, elected="other"),
                           _watch(answers=False, leading=True)):
        _run_checks(watch, HEARTBEAT_S * COORDINATOR_LOST_HEARTBEATS * 1.5)
        assert deposed == []


def _entry(peer_id: str, found: set[str]) -> PeerEntry:
    device = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)
    return PeerEntry(Advert(peer_id, "127.0.0.1:5000", device, 0.0), 0.0, 0.0, frozenset(found))


class _Membership:
    peer_id = "c"
    ttl_s = 3.0

    def use_endpoint_hints(self, hints: object) -> None:
        pass

    def live_entries(self) -> list[PeerEntry]:
        return [_entry("a", set()), _entry("b", {"a"}), _entry("c", {"a", "b"})]


class _Plans:
    def followed(self) -> None:
        return None

    def plans(self) -> list:
        return []


def test_a_deposed_leader_is_left_out_of_the_election_until_the_time_is_up():
    view = SwarmView(_Membership(), _Plans(), None, confirm_ticks=1, ticks_per_heartbeat=10**6)  # type: ignore[arg-type]
    view._elect(_Membership().live_entries())
    assert view.elected() == "a"
    view.depose("a", 0.2, "its coordinator has not answered")
    assert view.suspect and view.is_deposed("a")
    view._elect(_Membership().live_entries())
    assert view.elected() == "b"  # the next in line
    time.sleep(0.25)
    view._elect(_Membership().live_entries())
    assert view.elected() == "a" and not view.is_deposed("a")


def test_a_leader_whose_signed_progress_moves_is_not_deposed_for_one_followers_lost_pings():
    watch, deposed = _watch(answers=False)
    steps = iter(range(10**6))
    watch.progress_step = lambda leader: next(steps) if leader == "lead" else None
    _run_checks(watch, HEARTBEAT_S * COORDINATOR_LOST_HEARTBEATS * 3)
    assert deposed == [], "the leader trains with its other workers: the fault is between it and this follower"
    watch.progress_step = lambda leader: 7  # its progress stops too: now it is deposed
    _run_checks(watch, HEARTBEAT_S * COORDINATOR_LOST_HEARTBEATS * 2)
    assert deposed and deposed[0][0] == "lead"


def test_the_ping_reuses_one_open_channel_to_the_coordinator():
    from tasklet.peer.net.config import TransportConfig
    from tasklet.peer.net.server import PeerServer
    from tasklet.peer.net.tls import process_tls

    server = PeerServer(TransportConfig())
    server.start()
    try:
        a = Assignment(epoch=3, stage=1, replica=0, n_stages=2, n_replicas=1, layers=(2, 4), group=("w",),
                       coordinator=f"127.0.0.1:{server.port}", leader="")
        watch = CoordinatorWatch(HEARTBEAT_S, process_tls(), "me", lambda: a, lambda: False, lambda: "",
                                 lambda *args: None, threading.Event())
        watch._ping(a)
        first = watch._client
        watch._ping(a)
        assert first is not None and watch._client is first, "a new channel per ping"
        watch.close()
        assert watch._client is None
    finally:
        server.stop()
