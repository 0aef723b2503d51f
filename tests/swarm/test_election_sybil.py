"""Sybil weight in the election and the joiner's clock check: free identities neither move the election nor refuse
an honest joiner, because only peers the leader's plan credits with accepted work testify (peer.swarm.election)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.election import bootstrap_credited, credited_of, elect_leader, seniority
from tasklet.peer.swarm.membership import ClockSkewError, Membership, PeerEntry
from tasklet.peer.timing import now

DEVICE = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)
HONEST = ["h-lead", "h-1", "h-2", "h-3"]  # joined in this order
SYBILS = [f"a-sybil-{i:02d}" for i in range(40)]  # ids that sort before every honest one


def entry(peer_id: str, found: set[str]) -> PeerEntry:
    return PeerEntry(Advert(peer_id, "127.0.0.1:5000", DEVICE, 0.0), 0.0, 0.0, frozenset(found))


def swarm(with_leader: bool = True) -> list[PeerEntry]:
    """Four honest peers, each found those before it; then 40 Sybils, each testifying only for the Sybils before it
    (``found`` is written by its owner, so a Sybil leaves the honest peers out)."""
    honest = HONEST if with_leader else HONEST[1:]
    out = [entry(p, set(honest[:i])) for i, p in enumerate(honest)]
    return out + [entry(s, set(SYBILS[:i])) for i, s in enumerate(SYBILS)]


def test_forty_free_identities_out_vote_plain_testimony_but_not_credited_testimony():
    entries = swarm()
    assert elect_leader(entries) == SYBILS[0]  # the attack: 39 Sybils testify for the first of them
    credited = frozenset(HONEST)
    assert elect_leader(entries, credited) == "h-lead"
    counts = seniority(entries, credited)
    assert counts["h-lead"] == 3 and all(counts[s] == 0 for s in SYBILS)
    # the order of the records changes nothing
    assert elect_leader(list(reversed(entries)), credited) == "h-lead"


def test_with_the_leader_dead_a_credited_peer_wins_even_against_smaller_sybil_ids():
    credited = frozenset(HONEST)
    assert elect_leader(swarm(with_leader=False), credited) == "h-1"  # found by h-2 and h-3
    # only h-3 is left of the honest peers: nobody credited testifies for anyone, the credited tie-break decides
    alone = [entry("h-3", set(HONEST[:3]))] + [entry(s, set(SYBILS[:i])) for i, s in enumerate(SYBILS)]
    assert elect_leader(alone, credited) == "h-3"
    assert elect_leader(alone) == SYBILS[0]


def test_a_sybil_that_has_done_work_counts_once_like_any_volunteer():
    credited = frozenset([*HONEST, SYBILS[1]])
    counts = seniority(swarm(), credited)
    assert counts["h-lead"] == 3  # h-1..h-3 found it; the credited Sybil left it out of its testimony
    assert counts[SYBILS[0]] == 1 and elect_leader(swarm(), credited) == "h-lead"  # one credited witness


def test_credited_of_refuses_malformed_lists():
    assert credited_of({"credited": ["h-1", "h-2"]}) == {"h-1", "h-2"}
    assert credited_of(None) == frozenset() and credited_of({}) == frozenset()
    assert credited_of({"credited": "h-1"}) == frozenset()
    assert credited_of({"credited": ["h-1", "bad id!"]}) == frozenset()
    assert credited_of({"credited": ["h-1", 7]}) == frozenset()
    assert credited_of({"credited": [f"p{i}" for i in range(5000)]}) == frozenset()


def test_bootstrap_takes_the_newest_plan_whose_own_credited_peers_elect_its_signer():
    entries = swarm()
    honest_plan = ("h-lead", {"credited": HONEST})
    inconsistent = ("a-sybil-05", {"credited": HONEST})  # h-lead's witnesses do not elect a-sybil-05
    empty = ("a-sybil-06", {"credited": []})
    assert bootstrap_credited(entries, [inconsistent, empty, honest_plan]) == frozenset(HONEST)
    assert bootstrap_credited(entries, [inconsistent, empty]) == frozenset()


class _Records:
    """Membership's record store, answering ``read("peers")`` with given heartbeat times."""

    def __init__(self, offsets: dict[str, float]) -> None:
        self.offsets = offsets

    def read(self, key: str, include_expired: bool = False) -> list[SimpleNamespace]:
        at = now()
        return [SimpleNamespace(owner=p, payload={"advert": {}, "at": at + off}) for p, off in self.offsets.items()]


@pytest.fixture(scope="module")
def identity() -> Identity:
    return Identity.generate()


def test_forty_skewed_identities_do_not_refuse_an_honest_joiner(identity: Identity):
    membership = Membership(None, "sybil-clock", identity, heartbeat_s=1.0)  # type: ignore[arg-type]
    # the honest peers' clocks agree with ours (their heartbeats are a fraction of a heartbeat old); 40 free
    # identities write heartbeat times an hour ahead
    membership.store = _Records({**{p: -0.2 for p in HONEST}, **{s: 3600.0 for s in SYBILS}})  # type: ignore[assignment]
    with pytest.raises(ClockSkewError):
        membership.check_clock(attempts=1)
    offset = membership.check_clock(attempts=1, witnesses=frozenset(HONEST))
    assert offset is not None and -0.5 < offset <= 0.0
    # a joiner whose clock really is off is still refused by the credited peers
    membership.store = _Records({**{p: 3600.0 for p in HONEST}, **{s: -0.2 for s in SYBILS}})  # type: ignore[assignment]
    with pytest.raises(ClockSkewError):
        membership.check_clock(attempts=1, witnesses=frozenset(HONEST))
