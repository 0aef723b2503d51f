"""A worker's DHT reads per heartbeat do not grow with the swarm (issue #17), over real hivemind DHT nodes.

Each peer here is what a daemon's control loop runs (``peer.swarm.view.SwarmView`` over its membership, plan
board and progress board), ticked by the test instead of a thread. Peer 0 leads: it publishes a plan and beats
every tick. Once the workers follow it, each reads one record a heartbeat (the leader's beat) whether the swarm
has 4 peers or 8, and no advert at all; when the leader dies they read every advert again and elect the next
peer, whose plan they then follow.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.dht import DHTConfig, ops_delta, start_dht, visible_maddrs
from tasklet.peer.swarm.membership import Membership
from tasklet.peer.swarm.plans import PlanBoard
from tasklet.peer.swarm.progress import ProgressBoard
from tasklet.peer.swarm.view import SwarmView
from tasklet.peer.timing import now
from tests.support.waits import wait_until

pytestmark = pytest.mark.usefixtures("processes")

HEARTBEAT_S = 1.0
TTL_S = 4.0  # generous: on a loaded machine one tick round of eight peers can take a second
TICKS = 2  # ticks per heartbeat, as the daemon
DEVICE = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)


class Peer:
    def __init__(self, initial: tuple[str, ...], run_id: str) -> None:
        self.identity = Identity.generate()
        self.dht = start_dht(DHTConfig(initial_peers=initial), self.identity)
        self.membership = Membership(self.dht, run_id, self.identity, "s", heartbeat_s=HEARTBEAT_S, ttl_s=TTL_S)
        self.plans = PlanBoard(self.dht, run_id, self.identity, "s", plan_ttl_s=60.0, elector=self.elected)
        self.progress = ProgressBoard(self.dht, run_id, self.identity, "s")
        self.view = SwarmView(self.membership, self.plans, self.progress, ticks_per_heartbeat=TICKS)
        self.leading = False
        self.alive = True

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def elected(self) -> str | None:
        return self.view.elected()

    def ops(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for store in (self.membership.store, self.plans.store, self.progress.store):
            for key, n in store.ops.snapshot().items():
                total[key] = total.get(key, 0) + n
        return total

    def tick(self) -> None:
        """What the daemon's loop does with the view: lead when confirmed, beat while leading."""
        tick = self.view.tick(self.leading)
        if tick.leader == self.peer_id and not self.leading:
            self.leading = True
            live = [e.advert.peer_id for e in (tick.entries or [])]
            assert self.plans.publish(self.plans.next_epoch(), self.peer_id, {"by": self.peer_id}, live)
        if self.leading:
            epoch = self.plans.highest_epoch
            self.progress.publish({"epoch": epoch, "step": 0, "state": "training", "history": {"loss": [1.0] * 50}})

    def crash(self) -> None:
        self.membership.stop_heartbeat()
        self.dht.shutdown()
        self.alive = False

    def close(self) -> None:
        if self.alive:
            self.membership.leave()
            self.dht.shutdown()
            self.alive = False


def make_swarm(n: int) -> list[Peer]:
    """``n`` peers joined in order (each found the ones before it), so peer 0 leads, then peer 1."""
    run_id = f"load-{uuid.uuid4().hex[:8]}"
    peers = [Peer((), run_id)]
    bootstrap = tuple(visible_maddrs(peers[0].dht))
    for index in range(n):
        if index:
            peers.append(Peer(bootstrap, run_id))
        peers[-1].membership.announce(Advert(peers[-1].peer_id, f"127.0.0.1:{5000 + index}", DEVICE, now()))
    return peers


@pytest.fixture
def swarms() -> Iterator[Callable[[int], list[Peer]]]:
    made: list[Peer] = []

    def make(n: int) -> list[Peer]:
        made.extend(make_swarm(n))
        return made[-n:]

    try:
        yield make
    finally:
        for peer in made:
            peer.close()


def run_ticks(peers: list[Peer], heartbeats: float) -> None:
    for _ in range(round(heartbeats * TICKS)):
        started = time.monotonic()
        for peer in peers:
            if peer.alive:
                peer.tick()
        time.sleep(max(0.0, HEARTBEAT_S / TICKS - (time.monotonic() - started)))


def settle(peers: list[Peer], leader: Peer, timeout_s: float = 40.0) -> None:
    """Tick until every live worker follows ``leader``'s plan and no longer suspects it."""
    def workers() -> list[Peer]:
        return [p for p in peers if p.alive and p is not leader]

    def plan_leaders() -> set[str | None]:
        return {p.view.followed_plan().leader_id if p.view.followed_plan() else None for p in workers()}

    def settled() -> bool:
        if plan_leaders() == {leader.peer_id} and not any(p.view.suspect for p in workers()):
            return True
        run_ticks(peers, 1)
        return False

    wait_until(settled, timeout_s, f"workers settle on {leader.peer_id}", 0.0, detail=lambda: str(plan_leaders()))


def reads_per_heartbeat(peers: list[Peer], heartbeats: int) -> list[dict[str, float]]:
    """Each worker's DHT gets per heartbeat by record over ``heartbeats`` heartbeats of following."""
    workers = [p for p in peers if not p.leading]
    before = [p.ops() for p in workers]
    run_ticks(peers, heartbeats)
    return [
        {k[4:]: n / heartbeats for k, n in ops_delta(b, p.ops()).items() if k.startswith("get:")}
        for b, p in zip(before, workers, strict=True)
    ]


def test_a_workers_reads_per_heartbeat_do_not_grow_with_the_swarm(swarms):
    measured = {}
    for n in (4, 8):
        peers = swarms(n)
        for p in peers:
            p.view.holding_plan = True  # as a daemon whose worker took its assignment
        settle(peers, peers[0])
        rates = reads_per_heartbeat(peers, heartbeats=6)
        measured[n] = rates
        for rate in rates:
            # one small record a heartbeat: the leader's beat; never the adverts, the plan or the full progress
            assert rate == {"beat": 1.0}, f"N={n}: a worker read {rate} per heartbeat"
        assert peers[0].view.full_reads > 0  # the leader reads every advert (it plans from them)
    assert measured[4][0] == measured[8][0]


def test_workers_read_everything_again_when_the_leader_dies_and_follow_the_next(swarms):
    peers = swarms(4)
    for p in peers:
        p.view.holding_plan = True
    settle(peers, peers[0])
    followers = peers[2:]
    reads_before = [p.view.full_reads for p in followers]
    peers[0].crash()
    settle(peers, peers[1], timeout_s=30)
    assert peers[1].leading and all(p.elected() == peers[1].peer_id for p in followers)
    assert all(p.view.full_reads > before for p, before in zip(followers, reads_before, strict=True))
    assert {p.view.followed_plan().epoch for p in followers} == {2}  # the new leader's plan, one epoch up
    rates = reads_per_heartbeat(peers, heartbeats=4)
    assert all(rate == {"beat": 1.0} for rate in rates), rates  # and back to one read a heartbeat


def test_a_peer_without_an_assignment_reads_the_adverts_once_a_heartbeat(swarms):
    peers = swarms(4)
    settle(peers, peers[0])
    rates = reads_per_heartbeat(peers, heartbeats=4)
    assert all(rate.get("peers") == 1.0 and rate.get("beat") == 1.0 for rate in rates), rates


def test_an_assignment_from_another_peer_makes_a_worker_look_again(swarms):
    peers = swarms(3)
    for p in peers:
        p.view.holding_plan = True
    settle(peers, peers[0])
    worker = peers[2]
    before = worker.view.full_reads
    worker.view.suspect_leader("test: an assignment from a peer it did not elect")
    run_ticks(peers, 1)
    assert worker.view.full_reads > before and worker.elected() == peers[0].peer_id
    settle(peers, peers[0])  # the leader beats: suspicion clears, reads drop back


def test_a_leader_that_resigns_is_looked_past_at_the_next_beat(swarms):
    peers = swarms(3)
    for p in peers:
        p.view.holding_plan = True
    settle(peers, peers[0])
    followers = peers[1:]
    before = [p.view.full_reads for p in followers]
    peers[0].leading = False  # it steps down (the daemon does so when the election moves away from it)
    assert peers[0].progress.resign()
    for _ in range(TICKS):  # one heartbeat of the followers only: each reads the beat once and sees "resigned"
        for p in followers:
            p.tick()
    assert all(p.view.suspect for p in followers)
    for _ in range(TICKS):
        for p in followers:
            p.tick()
    assert all(p.view.full_reads > b for p, b in zip(followers, before, strict=True))
