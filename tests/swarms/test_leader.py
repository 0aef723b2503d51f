"""Leader election (from the others' testimony) and plan epochs over real hivemind DHT processes on loopback."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator

import pytest
from hivemind.utils import get_dht_time

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.dht import DHTConfig, start_dht, visible_maddrs
from tasklet.peer.swarm.election import elect_leader
from tasklet.peer.swarm.membership import Membership, PeerEntry
from tasklet.peer.swarm.plans import MAX_EPOCH_STEP, NoQuorumError, PlanBoard, PlanRecord, has_quorum
from tests.support.waits import wait_until

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

HEARTBEAT_S = 0.5
TTL_S = 1.5
FAILOVER_DEADLINE_S = 15.0  # issue #4: a new leader publishes a new plan within 15 s of the old one dying
PORTS = itertools.count(5000)  # an endpoint is its first advertiser's (peer.swarm.membership)
DEVICE = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)


def advert(peer_id: str, started_at: float, role: str = "worker") -> Advert:
    return Advert(peer_id, "127.0.0.1:5000", DEVICE, started_at, role=role)


def entry(peer_id: str, found: set[str], started_at: float = 100.0, role: str = "worker") -> PeerEntry:
    return PeerEntry(advert(peer_id, started_at, role), 0.0, 0.0, frozenset(found))


def test_elect_leader_is_the_peer_most_others_found_ties_by_id():
    # b joined first; c found b; d found b and c; a claims the earliest start time but nobody found it.
    view = [entry("b", set(), 50.0), entry("c", {"b"}, 60.0), entry("d", {"b", "c"}, 70.0), entry("a", set(), 0.0)]
    assert elect_leader(view) == "b"
    assert elect_leader(reversed(view)) == "b"  # order of the view does not matter
    # a forged leader claim: testifying for oneself is refused at parse time; here it simply does not count
    assert elect_leader([*view[:3], entry("a", {"a", "b", "c", "d"}, 0.0)]) == "b"
    # testimony of a client (or of a dead peer, absent from the view) does not count
    assert elect_leader([entry("x", set()), entry("y", set()), entry("z", {"y"}, role="client")]) == "x"
    assert elect_leader([entry("c", set())]) == "c"
    assert elect_leader([entry("z", set(), role="client")]) is None
    assert elect_leader([]) is None


def test_quorum_is_a_majority_of_the_previous_members_or_half_with_the_previous_leader():
    assert has_quorum(None, [])
    four = PlanRecord(3, "a", {}, ("a", "b", "c", "d"))
    assert has_quorum(four, "abc") and has_quorum(four, "bcd")
    assert has_quorum(four, "ab") and not has_quorum(four, "cd")  # 2 + 2: the previous leader's side
    assert not has_quorum(four, "a") and not has_quorum(four, "xyz")
    two = PlanRecord(1, "a", {}, ("a", "b"))
    assert has_quorum(two, "a") and not has_quorum(two, "b")  # losing the leader of two pauses the survivor


class Peer:
    """One DHT node with its membership and plan board (ended by the fixture or by the test)."""

    def __init__(self, initial: tuple[str, ...], run_id: str, started_at: float):
        self.identity = Identity.generate()
        self.dht = start_dht(DHTConfig(initial_peers=initial), self.identity)
        self.membership = Membership(
            self.dht, run_id, self.identity, "s", heartbeat_s=HEARTBEAT_S, ttl_s=TTL_S
        )
        self.board = PlanBoard(self.dht, run_id, self.identity, "s", plan_ttl_s=60.0, elector=self.leader)
        self.advert = Advert(self.identity.peer_id, f"127.0.0.1:{next(PORTS)}", DEVICE, started_at)  # one endpoint each
        self.alive = True

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def leader(self) -> str | None:
        return elect_leader(self.membership.live_entries())

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
    """Five peers of one run; peer i joined after peer i-1 (and found it), so peer 0 leads, then 1, ..."""
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


def test_all_peers_elect_the_same_leader_and_follow_its_plan(swarm):
    wait_until(lambda: all(len(peer.membership.live_peers()) == 5 for peer in swarm), 10, "every peer sees all five")
    assert {peer.leader() for peer in swarm} == {swarm[0].peer_id}
    leader = swarm[0]
    epoch = leader.board.next_epoch()
    assert epoch == 1
    members = sorted(peer.peer_id for peer in swarm)
    assert leader.board.publish(epoch, leader.peer_id, {"pipelines": [["p0", "p1"], ["p2", "p3"]]}, members)
    for peer in swarm:
        want = PlanRecord(1, leader.peer_id, {"pipelines": [["p0", "p1"], ["p2", "p3"]]}, tuple(members))
        assert peer.board.latest() == want
    epoch, leader_id, plan, members = swarm[3].board.latest()  # unpacks as a 4-tuple
    assert (epoch, leader_id) == (1, leader.peer_id)
    assert leader.board.republish()


def failover(swarm: list[Peer], kill: Callable[[Peer], None]) -> None:
    wait_until(lambda: all(len(peer.membership.live_peers()) == 5 for peer in swarm), 10, "every peer sees all five")
    old = swarm[0]
    everyone = [peer.peer_id for peer in swarm]
    assert old.board.publish(old.board.next_epoch(), old.peer_id, {"by": "old"}, everyone)
    old_epoch = old.board.highest_epoch
    survivors = swarm[1:]
    assert all(peer.board.latest().epoch == old_epoch for peer in survivors)
    kill(old)

    def daemons_loop() -> bool:
        """Every survivor runs the daemon's loop: derive the leader; if it is me, publish the next epoch. Then:
        does every survivor read the new leader's plan?"""
        for peer in survivors:
            if peer.leader() == peer.peer_id and peer.board.latest().leader_id != peer.peer_id:
                live = [a.peer_id for a in peer.membership.live_peers()]
                peer.board.publish(peer.board.next_epoch(), peer.peer_id, {"by": peer.peer_id}, live)
        return all(peer.board.latest().leader_id == swarm[1].peer_id for peer in survivors)

    wait_until(daemons_loop, FAILOVER_DEADLINE_S, "a new plan from a new leader")
    assert {peer.leader() for peer in survivors} == {swarm[1].peer_id}
    assert all(peer.board.latest().epoch == old_epoch + 1 for peer in survivors)


def test_new_leader_after_the_leader_leaves(swarm):
    failover(swarm, lambda peer: peer.close())


def test_new_leader_after_the_leader_crashes(swarm):
    failover(swarm, lambda peer: peer.crash())


def test_plans_order_by_epoch_then_leader_and_only_the_elected_leader_counts(swarm):
    wait_until(lambda: all(len(peer.membership.live_peers()) == 5 for peer in swarm), 10, "every peer sees all five")
    a, b = swarm[0], swarm[1]  # a is elected everywhere
    everyone = [peer.peer_id for peer in swarm]
    assert a.board.publish(3, a.peer_id, {"by": "a"}, everyone)
    # a forged leader claim: b is not elected, so its higher epoch changes nothing
    assert b.board.publish(4, b.peer_id, {"by": "b"}, everyone)
    for peer in swarm:
        if peer is not b:  # b's own board follows what it published itself
            assert peer.board.latest() == PlanRecord(3, a.peer_id, {"by": "a"}, tuple(sorted(everyone)))
    assert a.board.next_epoch() == 4
    # the leader cannot go back, nor republish at the same (epoch, leader), nor jump epochs
    with pytest.raises(ValueError, match="older than the highest epoch seen"):
        a.board.publish(3, a.peer_id, {"by": "a"}, everyone)
    with pytest.raises(ValueError, match=f"more than {MAX_EPOCH_STEP} above"):
        a.board.publish(4 + MAX_EPOCH_STEP, a.peer_id, {"by": "a"}, everyone)
    # nor publish without a quorum of the previous plan's members
    with pytest.raises(NoQuorumError):
        a.board.publish(4, a.peer_id, {"by": "a"}, [a.peer_id])
    assert a.board.republish()


def test_a_plan_of_epoch_2_62_and_a_huge_jump_are_ignored(swarm):
    wait_until(lambda: all(len(peer.membership.live_peers()) == 5 for peer in swarm), 10, "every peer sees all five")
    a, reader = swarm[0], swarm[3]
    everyone = [peer.peer_id for peer in swarm]
    assert a.board.publish(2, a.peer_id, {"n": 2}, everyone)
    assert reader.board.latest().epoch == 2
    key, now = f"{a.membership.run_id}:plans", get_dht_time()
    for index, epoch in enumerate((2**62, 2 + MAX_EPOCH_STEP + 1)):
        payload = {"epoch": epoch, "leader": a.peer_id, "plan": {"n": epoch}, "members": everyone, "at": now}
        suffix, expiry = b"|epoch=%d" % epoch, now + 30 + index
        # written by the elected leader's own DHT node (as a buggy or hostile leader would), correctly sealed
        mac = a.board.store.mac("plans", a.peer_id, suffix, expiry, payload)
        a.dht.store(key, {"p": payload, "mac": mac}, expiry, subkey=a.identity.owner_tag + suffix)
    assert reader.board.latest().epoch == 2
    assert reader.board.next_epoch() == 3
    assert a.board.publish(3, a.peer_id, {"n": 3}, everyone)  # the swarm goes on
    assert reader.board.latest().epoch == 3


def test_epochs_never_go_back_on_a_board(swarm):
    a = swarm[0]
    watcher = PlanBoard(swarm[2].dht, a.membership.run_id, None, "s")  # read-only board
    assert a.board.publish(7, a.peer_id, {"n": 7})
    wait_until(lambda: watcher.latest() is not None, 5, "the watcher reads the plan")
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
    now, me = get_dht_time(), forger.peer_id
    bad = [
        ({"epoch": 9, "leader": honest.peer_id, "plan": {}, "members": [], "at": now}, b"|epoch=9"),  # another leader
        ({"epoch": 8, "leader": me, "plan": {}, "members": [], "at": now}, b"|epoch=9"),  # epoch != key
        ({"epoch": 9, "leader": me, "plan": [1], "members": [], "at": now}, b"|epoch=9"),  # plan not a dict
        ({"epoch": 9, "leader": me, "plan": {}, "members": ["bad id!"], "at": now}, b"|epoch=9"),  # bad member
        ({"epoch": 9, "leader": me, "plan": {}, "at": now}, b"|epoch=9"),  # missing field
        ({"epoch": 9, "leader": me, "plan": {}, "members": [], "at": now}, b"|nine"),  # bad suffix
    ]
    for index, (payload, suffix) in enumerate(bad):
        expiry = now + 30 + 0.01 * index
        mac = forger.board.store.mac("plans", me, suffix, expiry, payload)
        forger.dht.store(key, {"p": payload, "mac": mac}, expiry, subkey=tag + suffix)
    # Signed by the honest leader's tag but stored by the forger: refused by the signature validator.
    forged = {"epoch": 9, "leader": honest.peer_id, "plan": {}, "members": [], "at": now}
    forged_mac = forger.board.store.mac("plans", honest.peer_id, b"|epoch=9", now + 31, forged)
    honest_subkey = honest.identity.owner_tag + b"|epoch=9"
    forger.dht.store(key, {"p": forged, "mac": forged_mac}, now + 31, subkey=honest_subkey)
    any_signer = PlanBoard(reader.dht, run_id, None, "s")  # no election: only the record checks apply
    expected = PlanRecord(2, honest.peer_id, {"ok": True}, (honest.peer_id,))
    assert any_signer.latest() == expected
    assert reader.board.latest() == expected
