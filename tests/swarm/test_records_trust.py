"""Records that cannot be forged or replayed into power, and a clock check at join (real hivemind DHTs).

Every forger here is an *insider*: it knows the join secret, so its records are correctly sealed and signed;
what stops it is who may write what (the elected leader's plans, the plan leader's progress), the bounds on
epochs, and MACs bound to the writer and the expiry.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator

import pytest

import tasklet.peer.timing
from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.dht import DHTConfig, start_dht, visible_maddrs
from tasklet.peer.swarm.election import elect_leader
from tasklet.peer.swarm.membership import ClockSkewError, Membership
from tasklet.peer.swarm.plans import PlanBoard
from tasklet.peer.swarm.progress import ProgressBoard
from tasklet.peer.timing import now
from tests.support.waits import wait_until

pytestmark = pytest.mark.usefixtures("processes")

SECRET = "correct horse battery staple"
HEARTBEAT_S = 0.5
TTL_S = 1.5
PORTS = itertools.count(5000)  # an endpoint is its first advertiser's (peer.swarm.membership)
DEVICE = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)


class Member:
    """One peer of the run: DHT node, membership, plan and progress boards, all with the secret."""

    def __init__(self, initial: tuple[str, ...], run_id: str, started_at: float) -> None:
        self.identity = Identity.generate()
        self.dht = start_dht(DHTConfig(initial_peers=initial), self.identity)
        self.membership = Membership(self.dht, run_id, self.identity, SECRET, heartbeat_s=HEARTBEAT_S, ttl_s=TTL_S)
        self.board = PlanBoard(self.dht, run_id, self.identity, SECRET, plan_ttl_s=60.0, elector=self.elected)
        self.progress = ProgressBoard(self.dht, run_id, self.identity, SECRET)
        self.advert = Advert(self.identity.peer_id, f"127.0.0.1:{next(PORTS)}", DEVICE, started_at)  # one endpoint each

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def elected(self) -> str | None:
        return elect_leader(self.membership.live_entries())

    def followed_progress(self) -> dict | None:
        """What a daemon acts on: progress of the leader of the plan it follows."""
        plan = self.board.latest()
        return self.progress.read(plan.leader_id if plan else self.elected())

    def close(self) -> None:
        self.membership.leave()
        self.dht.shutdown()


@pytest.fixture
def run() -> Iterator[list[Member]]:
    """Three peers joined in order (0 leads); peer 2 announces a start time earlier than anybody's."""
    run_id = f"trust-{uuid.uuid4().hex[:8]}"
    members: list[Member] = []
    try:
        members.append(Member((), run_id, now()))
        bootstrap = tuple(visible_maddrs(members[0].dht))
        members.append(Member(bootstrap, run_id, now()))
        members.append(Member(bootstrap, run_id, 1.0))  # claims to have started in 1970
        for member in members:
            member.membership.announce(member.advert)
        wait_until(lambda: all(len(m.membership.live_peers()) == 3 for m in members), 10, "every member sees all three")
        yield members
    finally:
        for member in members:
            member.close()


def start_run(leader: Member, members: list[Member]) -> None:
    everyone = [m.peer_id for m in members]
    assert leader.board.publish(leader.board.next_epoch(), leader.peer_id, {"by": "leader"}, everyone)
    assert leader.progress.publish({"epoch": 1, "step": 3, "state": "training"})


def test_the_leader_comes_from_testimony_not_from_a_claimed_start_time(run):
    leader, _, claimant = run
    assert claimant.advert.started_at < leader.advert.started_at
    assert {m.elected() for m in run} == {leader.peer_id}


def test_a_forged_done_is_ignored(run):
    leader, forger, reader = run
    start_run(leader, run)
    # an insider that is not the leader writes a correctly sealed "done" of a far later epoch and step
    assert forger.progress.publish({"epoch": 99, "step": 10**6, "state": "done"})
    assert reader.progress.read(forger.peer_id)["state"] == "done"  # it is there for anyone to read...
    for member in run:  # ...but nobody acts on it
        assert member.followed_progress()["state"] == "training"
        assert member.followed_progress()["leader"] == leader.peer_id


def test_a_forged_leader_claim_is_ignored(run):
    leader, forger, claimant = run
    start_run(leader, run)
    everyone = [m.peer_id for m in run]
    for index, member in enumerate((forger, claimant)):  # both publish a higher epoch as if they led
        assert member.board.publish(2 + index, member.peer_id, {"by": "usurper"}, everyone)
        assert member.progress.publish({"epoch": 2 + index, "step": 0, "state": "forming"})
    assert leader.board.latest().plan == {"by": "leader"}
    fresh = PlanBoard(leader.dht, leader.membership.run_id, None, SECRET, elector=leader.elected)
    assert fresh.latest().leader_id == leader.peer_id and fresh.latest().epoch == 1
    assert leader.followed_progress()["step"] == 3
    assert leader.board.next_epoch() == 2


def test_replayed_records_are_ignored(run):
    leader, forger, reader = run
    start_run(leader, run)
    run_id = leader.membership.run_id
    found = forger.dht.get(f"{run_id}:progress", latest=True)
    original = next(item for subkey, item in found.value.items() if leader.identity.owner_tag in subkey)
    envelope, expiry = original.value, original.expiration_time
    tag = forger.identity.owner_tag
    # the leader's sealed record copied under the forger's own subkey: with its expiry, and with a fresh one
    assert forger.dht.store(f"{run_id}:progress", envelope, expiry, subkey=tag + b"|a")
    assert forger.dht.store(f"{run_id}:progress", envelope, now() + 60, subkey=tag + b"|b")
    # the leader's old plan and advert, replayed the same way
    for name in ("plans", "peers"):
        records = forger.dht.get(f"{run_id}:{name}", latest=True).value
        item = next(item for subkey, item in records.items() if leader.identity.owner_tag in subkey)
        assert forger.dht.store(f"{run_id}:{name}", item.value, now() + 60, subkey=tag + b"|replay")
    kept = reader.progress.store.read("progress")
    replays = [record for record in kept if record.owner == forger.peer_id]
    assert len(replays) == 2 and all(record.payload == {} for record in replays)  # MAC fails, payload withheld
    assert reader.progress.read(forger.peer_id) is None
    assert reader.followed_progress()["leader"] == leader.peer_id
    assert sorted(a.peer_id for a in reader.membership.live_peers()) == sorted(m.peer_id for m in run)
    assert [plan.leader_id for plan in reader.board.plans()] == [leader.peer_id]


def test_a_skewed_clock_is_refused_at_join(run, monkeypatch):
    joiner = run[2]
    assert -HEARTBEAT_S - 0.5 <= joiner.membership.check_clock() <= 0.5
    monkeypatch.setattr(tasklet.peer.timing, "_CLOCK_OFFSET_S", -6.0)  # the TASKLET_CLOCK_OFFSET_S hook, in process
    with pytest.raises(ClockSkewError, match=r"clock is [56]\.\d s behind the swarm.s"):
        joiner.membership.check_clock()
    monkeypatch.setattr(tasklet.peer.timing, "_CLOCK_OFFSET_S", 6.0)
    with pytest.raises(ClockSkewError, match="ahead of the swarm's"):
        joiner.membership.check_clock()
