"""Leader election and plan epochs over real hivemind DHT processes on loopback."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from hivemind.utils import get_dht_time

from peer.compute.device_probe import DeviceInfo
from peer.swarm.adverts import Advert
from peer.swarm.dht import DHTConfig, start_dht, visible_maddrs
from peer.swarm.election import elect_leader
from peer.swarm.identity import Identity
from peer.swarm.membership import Membership
from peer.swarm.plans import PlanBoard, PlanRecord

HEARTBEAT_S = 0.5
TTL_S = 1.5
FAILOVER_DEADLINE_S = 15.0  # issue #4: a new leader publishes a new plan within 15 s of the old one dying
DEVICE = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)


def advert(peer_id: str, started_at: float, role: str = "worker") -> Advert:
    return Advert(peer_id, "127.0.0.1:5000", DEVICE, started_at, role=role)


def test_elect_leader_is_oldest_worker_ties_by_id():
    adverts = [advert("c", 10.0), advert("b", 5.0), advert("a", 5.0), advert("z", 1.0, role="client")]
    assert elect_leader(adverts) == "a"
    assert elect_leader(reversed(adverts)) == "a"  # order of the view does not matter
    assert elect_leader([advert("c", 10.0)]) == "c"
    assert elect_leader([advert("z", 1.0, role="client")]) is None
    assert elect_leader([]) is None


class Peer:
    """One DHT node with its membership and plan board (ended by the fixture or by the test)."""

    def __init__(self, initial: tuple[str, ...], run_id: str, started_at: float):
        self.identity = Identity.generate()
        self.dht = start_dht(DHTConfig(initial_peers=initial), self.identity)
        self.membership = Membership(
            self.dht, run_id, self.identity, "s", heartbeat_s=HEARTBEAT_S, ttl_s=TTL_S
        )
        self.board = PlanBoard(self.dht, run_id, self.identity, "s", plan_ttl_s=60.0)
        self.advert = Advert(self.identity.peer_id, "127.0.0.1:5000", DEVICE, started_at)
        self.alive = True

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def leader(self) -> str | None:
        return elect_leader(self.membership.live_peers())

    def crash(self) -> None:
        """Die without a word: heartbeat stops and the DHT process goes away."""
        self.membership.stop_heartbeat()
        self.dht.shutdown()
        self.alive = False

    def close(self) -> None:
        if self.alive:
            self.membership.leave()
            self.dht.shutdown()
            self.alive = False


@pytest.fixture
def swarm() -> Iterator[list[Peer]]:
    """Five peers of one run; peer i started i seconds after peer 0, so peer 0 leads, then 1, ..."""
    run_id = f"leader-{uuid.uuid4().hex[:8]}"
    base = get_dht_time() - 100
    peers: list[Peer] = []
    try:
        peers.append(Peer((), run_id, base))
        bootstrap = tuple(visible_maddrs(peers[0].dht))
        for index in range(1, 5):
            peers.append(Peer(bootstrap, run_id, base + index))
        for peer in peers:
            peer.membership.announce(peer.advert)
        yield peers
    finally:
        for peer in peers:
            peer.close()


def wait_for(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.1) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start


def test_all_peers_elect_the_same_leader_and_follow_its_plan(swarm):
    wait_for(lambda: all(len(peer.membership.live_peers()) == 5 for peer in swarm), timeout_s=10)
    assert {peer.leader() for peer in swarm} == {swarm[0].peer_id}
    leader = swarm[0]
    epoch = leader.board.next_epoch()
    assert epoch == 1
    assert leader.board.publish(epoch, leader.peer_id, {"pipelines": [[0, 1], [2, 3]]})
    for peer in swarm:
        assert peer.board.latest() == PlanRecord(1, leader.peer_id, {"pipelines": [[0, 1], [2, 3]]})
    epoch, leader_id, plan = swarm[3].board.latest()  # unpacks as a triple
    assert (epoch, leader_id) == (1, leader.peer_id)
    assert leader.board.republish()


def failover(swarm: list[Peer], kill: Callable[[Peer], None]) -> None:
    wait_for(lambda: all(len(peer.membership.live_peers()) == 5 for peer in swarm), timeout_s=10)
    old = swarm[0]
    assert old.board.publish(old.board.next_epoch(), old.peer_id, {"by": "old"})
    old_epoch = old.board.highest_epoch
    survivors = swarm[1:]
    assert all(peer.board.latest().epoch == old_epoch for peer in survivors)
    kill(old)
    start = time.monotonic()
    # Every survivor runs the daemon's loop: derive the leader; if it is me, publish the next epoch.
    while time.monotonic() - start < FAILOVER_DEADLINE_S:
        for peer in survivors:
            if peer.leader() == peer.peer_id and peer.board.latest().leader_id != peer.peer_id:
                peer.board.publish(peer.board.next_epoch(), peer.peer_id, {"by": peer.peer_id})
        latest = [peer.board.latest() for peer in survivors]
        if all(plan.leader_id == swarm[1].peer_id for plan in latest):
            break
        time.sleep(0.1)
    took = time.monotonic() - start
    assert took < FAILOVER_DEADLINE_S, "no new plan from a new leader within 15 s"
    assert {peer.leader() for peer in survivors} == {swarm[1].peer_id}
    assert all(peer.board.latest().epoch == old_epoch + 1 for peer in survivors)


def test_new_leader_after_the_leader_leaves(swarm):
    failover(swarm, lambda peer: peer.close())


def test_new_leader_after_the_leader_crashes(swarm):
    failover(swarm, lambda peer: peer.crash())


def test_two_leaders_publishing_concurrently_everyone_ends_on_the_highest_epoch(swarm):
    a, b = swarm[0], swarm[1]
    # Both believe they lead and have seen nothing yet: a publishes epoch 3 while b publishes epoch 4.
    assert a.board.publish(3, a.peer_id, {"by": "a"})
    assert b.board.publish(4, b.peer_id, {"by": "b"})
    for peer in swarm:
        assert peer.board.latest() == PlanRecord(4, b.peer_id, {"by": "b"})
    # a has now seen epoch 4: it can no longer publish anything older, and its own plan is not renewed.
    assert a.board.highest_epoch == 4
    with pytest.raises(ValueError, match="older than the highest epoch seen"):
        a.board.publish(3, a.peer_id, {"by": "a"})
    assert not a.board.republish()
    assert a.board.next_epoch() == 5
    # Equal epochs from two leaders: everybody takes the same one (smallest leader id).
    assert a.board.publish(5, a.peer_id, {"by": "a"})
    assert b.board.publish(5, b.peer_id, {"by": "b"})
    expected = min(a.peer_id, b.peer_id)
    assert {peer.board.latest().leader_id for peer in swarm} == {expected}


def test_epochs_never_go_back_on_a_board(swarm):
    a = swarm[0]
    watcher = PlanBoard(swarm[2].dht, a.membership.run_id, None, "s")  # read-only board
    assert a.board.publish(7, a.peer_id, {"n": 7})
    assert watcher.latest().epoch == 7
    with pytest.raises(ValueError, match="read-only"):
        watcher.publish(8, a.peer_id, {})
    # Even if the DHT forgot every plan, the board would remember epoch 7.
    watcher.store.run_id = f"{a.membership.run_id}-elsewhere"
    assert watcher.latest().epoch == 7 and watcher.next_epoch() == 8


def test_forged_and_malformed_plans_are_ignored(swarm):
    honest, forger, reader = swarm[0], swarm[1], swarm[2]
    run_id = honest.membership.run_id
    assert honest.board.publish(2, honest.peer_id, {"ok": True})
    key, tag = f"{run_id}:plans", forger.identity.owner_tag
    now = get_dht_time()
    bad = [
        ({"epoch": 9, "leader": honest.peer_id, "plan": {}, "at": now}, b"|epoch=9"),  # names another leader
        ({"epoch": 8, "leader": forger.peer_id, "plan": {}, "at": now}, b"|epoch=9"),  # epoch != key
        ({"epoch": 9, "leader": forger.peer_id, "plan": [1], "at": now}, b"|epoch=9"),  # plan not a dict
        ({"epoch": 9, "leader": forger.peer_id, "plan": {}}, b"|epoch=9"),  # missing field
        ({"epoch": 9, "leader": forger.peer_id, "plan": {}, "at": now}, b"|nine"),  # bad suffix
    ]
    for index, (payload, suffix) in enumerate(bad):
        mac = forger.board.store.mac("plans", suffix, payload)
        forger.dht.store(key, {"p": payload, "mac": mac}, now + 30 + 0.01 * index, subkey=tag + suffix)
    # Signed by the honest leader's tag but stored by the forger: refused by the signature validator.
    forged = {"epoch": 9, "leader": honest.peer_id, "plan": {}, "at": now}
    forged_mac = forger.board.store.mac("plans", b"|epoch=9", forged)
    honest_subkey = honest.identity.owner_tag + b"|epoch=9"
    forger.dht.store(key, {"p": forged, "mac": forged_mac}, now + 31, subkey=honest_subkey)
    assert reader.board.latest() == PlanRecord(2, honest.peer_id, {"ok": True})
