"""Who may lead, in process: the organiser's signatures, the stewards policy, the members' election with an incumbent
and pinned testimony, and the daemon's role machine (peer.swarm.charter, peer.swarm.election, peer.node.roles)."""

from __future__ import annotations

import pytest

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.config import ConfigError, RunConfig
from tasklet.peer.identity.keys import Identity
from tasklet.peer.node.leadership import Leadership
from tasklet.peer.node.roles import Action, Observed, State, transition
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.charter import (
    CharterError,
    LeaderPolicy,
    run_organiser,
    sign_run,
    sign_stewards,
    stewards_of,
    waiting_line,
)
from tasklet.peer.swarm.election import elect
from tasklet.peer.swarm.membership import PeerEntry
from tasklet.peer.swarm.plans import check_plan_body
from tasklet.peer.swarm.records import SignedRecord
from tasklet.peer.swarm.view import SwarmView

pytestmark = pytest.mark.unit

DEVICE = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)
ORGANISER, MEMBER = Identity.generate(), Identity.generate()
RUN = "run-x"


def entry(peer_id: str, found: set[str] = frozenset()) -> PeerEntry:
    return PeerEntry(Advert(peer_id, "127.0.0.1:5000", DEVICE, 0.0), 0.0, 0.0, frozenset(found))


# ---- signatures ------------------------------------------------------------------------------------------------
def test_the_run_record_verifies_only_as_the_organiser_signed_it() -> None:
    config = {"run": {"steps": 10}, "optim": {"lr": 0.001}}
    seal = sign_run(ORGANISER, RUN, config, 100.0)
    payload = {"config": config, "created_at": 100.0, "organiser": seal}
    assert run_organiser(RUN, payload) == ORGANISER.peer_id
    for changed in ({**payload, "config": {**config, "optim": {"lr": 1.0}}},  # a 1000x learning rate
                    {**payload, "created_at": 1.0},  # an earlier creation
                    {**payload, "organiser": {**seal, "key": MEMBER.public_key.decode()}}):  # another key
        with pytest.raises(CharterError):
            run_organiser(RUN, changed)
    with pytest.raises(CharterError):
        run_organiser("another-run", payload)  # a record moved to another run
    for bad in (None, {}, {"key": 3, "sig": "x"}, {"key": "ssh-rsa AAAA", "sig": "!!"}, {"key": "x" * 9999, "sig": ""}):
        with pytest.raises(CharterError):
            run_organiser(RUN, {**payload, "organiser": bad})


def test_a_stewards_record_counts_only_when_the_organiser_signed_it() -> None:
    signed = sign_stewards(ORGANISER, RUN, ["steward-a", "steward-b"], 1)
    assert stewards_of(RUN, ORGANISER.peer_id, signed) == ("steward-a", "steward-b")
    forged = sign_stewards(MEMBER, RUN, ["member"], 2)
    with pytest.raises(CharterError, match="not by the organiser"):
        stewards_of(RUN, ORGANISER.peer_id, forged)
    with pytest.raises(CharterError):
        stewards_of(RUN, ORGANISER.peer_id, {**signed, "stewards": ["member"]})
    for bad in ({**signed, "revision": True}, {**signed, "stewards": []}, {**signed, "extra": 1}, [1]):
        with pytest.raises(CharterError):
            stewards_of(RUN, ORGANISER.peer_id, bad)


def test_leaders_in_the_run_file() -> None:
    base = {"run": {"run_id": "r", "steps": 2}}
    assert RunConfig.from_dict(base).swarm.leaders is None
    assert RunConfig.from_dict({**base, "swarm": {"leaders": "any"}}).swarm.leaders == "any"
    assert RunConfig.from_dict({**base, "swarm": {"leaders": ["abc", "d-e"]}}).swarm.leaders == ["abc", "d-e"]
    for bad in ("all", ["bad id!"], [3], "", {"a": 1}):
        with pytest.raises(ConfigError, match="leaders"):
            RunConfig.from_dict({**base, "swarm": {"leaders": bad}})


# ---- the policy and the election -------------------------------------------------------------------------------
def test_stewards_lead_in_the_organisers_order_and_a_live_incumbent_steward_keeps_the_lead() -> None:
    policy = LeaderPolicy.from_record("org", None, ("s1",))
    assert policy.stewards == ("org", "s1") and not policy.any
    live = [entry("org"), entry("s1"), entry("0-ground-small-id", {"s1"})]
    assert elect(live, (), policy) == "org"
    assert elect(live, (), policy, incumbent="s1") == "s1"  # s1 led while the organiser was away: it keeps it
    assert elect(live, (), policy, incumbent="0-ground-small-id") == "org"  # a non-steward is no incumbent
    assert elect(live[1:], (), policy) == "s1"
    assert elect(live[2:], (), policy) is None  # nobody the organiser trusts: the swarm waits
    assert waiting_line(policy) == "waiting for a leader the organiser trusts: 2 stewards, none live"
    named = LeaderPolicy.from_record("org", ["s2", "s1"], ("s3", "s1"))
    assert named.stewards == ("s2", "s1", "s3")  # a named list replaces the organiser's default place
    assert LeaderPolicy.from_record("org", ["bad id!"]).stewards == ("org",)  # malformed: the organiser alone


def test_an_early_member_lying_in_found_with_a_small_id_never_leads_while_a_steward_lives() -> None:
    """The attack the issue names: the second peer leaves the organiser out of ``found`` and grinds a small id."""
    org, liar = "f" * 20, "0" * 20
    entries = [entry(org), entry(liar), entry("h-2", {org, liar}), entry("h-3", {org, liar, "h-2"})]
    entries[1] = entry(liar, set())  # testifies for nobody, and nobody's testimony is needed
    policy = LeaderPolicy.from_record(org, None)
    assert elect(entries, (), policy) == org
    assert elect(entries, (), policy, incumbent=liar) == org


def test_under_any_a_live_incumbent_wins_every_tie_of_testimony() -> None:
    """The liar of the issue under "any": it testifies for nobody and grinds a small id; the organiser and it are
    then found by the same witnesses, a tie that the smallest id would win; the incumbent wins it instead."""
    policy = LeaderPolicy.from_record("org", "any")
    assert policy.any and policy.may_lead("whoever")
    liar, witnesses = "0" * 20, {"org", "0" * 20}
    entries = [entry("org"), entry(liar), entry("h-2", witnesses), entry("h-3", {*witnesses, "h-2"})]
    assert elect(entries, (), policy) == liar  # no incumbent (forming): the tie goes to the smallest id
    assert elect(entries, (), policy, incumbent="org") == "org"
    # strictly more witnesses still move the lead: a healed partition reaches one leader everywhere
    assert elect(entries, (), policy, incumbent="h-2") == liar  # h-2 has 1 witness, the top two have 2
    assert elect([e for e in entries if e.advert.peer_id != "org"], (), policy, incumbent="org") == liar  # gone


class _Plans:
    def __init__(self) -> None:
        self.followed_plan = None

    def followed(self):  # noqa: ANN201 - a PlanRecord or None
        return self.followed_plan

    def plans(self) -> list:
        return []


class _Membership:
    peer_id = "me"
    ttl_s = 3.0

    def use_endpoint_hints(self, hints: object) -> None:
        pass

    def __init__(self, entries: list[PeerEntry]) -> None:
        self.entries = entries

    def live_entries(self) -> list[PeerEntry]:
        return list(self.entries)


class _Progress:
    def read_beat(self, leader: str | None) -> None:
        return None


def test_each_reader_pins_a_peers_testimony_at_first_sight() -> None:
    """Under "any": a member that rewrites ``found`` later (to move the election) is read as it first testified."""
    members = [entry("me", {"old"}), entry("old"), entry("x", {"old"}), entry("y", {"old"})]
    membership = _Membership(members)
    view = SwarmView(membership, _Plans(), _Progress(), confirm_ticks=1)  # type: ignore[arg-type]
    view.policy = LeaderPolicy.from_record("old", "any")
    view.tick(leading=False)
    assert view.elected() == "old"
    membership.entries = [entry("me", {"old"}), entry("old"), entry("x", {"y"}), entry("y", {"x"})]  # rewritten
    view.tick(leading=False)
    assert view.elected() == "old"  # x and y still count for "old", as first seen


def test_the_view_says_when_it_waits_for_a_steward() -> None:
    membership = _Membership([entry("me"), entry("other")])
    view = SwarmView(membership, _Plans(), _Progress(), confirm_ticks=1)  # type: ignore[arg-type]
    view.policy = LeaderPolicy.from_record("gone-organiser", None)
    tick = view.tick(leading=False)
    assert tick.leader is None and view.waiting_for_steward()
    membership.entries.append(entry("gone-organiser"))
    assert view.tick(leading=False).leader == "gone-organiser" and not view.waiting_for_steward()


# ---- the role machine ------------------------------------------------------------------------------------------
def test_roles_follow_wait_lead_resign_and_finish() -> None:
    s, acts = transition(State.FOLLOWER, Observed("me", None, waiting=True))
    assert (s, acts) == (State.WAITING, ())
    s, acts = transition(s, Observed("me", "me", may_lead=False))
    assert (s, acts) == (State.CANDIDATE, ())  # elected, but another leader's beat is still fresh
    s, acts = transition(s, Observed("me", "me", may_lead=True))
    assert (s, acts) == (State.LEADER, (Action.START_ROLE,))
    assert transition(s, Observed("me", None)) == (State.LEADER, ())  # an unsettled election moves nobody
    assert transition(s, Observed("me", "me", run_done=True)) == (State.LEADER, ())  # its own role decides
    s, acts = transition(s, Observed("me", "other"))
    assert (s, acts) == (State.RESIGNED, (Action.STOP_ROLE, Action.RESIGN))
    assert transition(s, Observed("me", "other")) == (State.FOLLOWER, ())
    assert transition(State.FOLLOWER, Observed("me", "other", run_done=True)) == (State.DONE, (Action.LEAVE,))
    assert transition(State.LEADER, Observed("me", "me", role_finished=True)) == (State.DONE, (Action.LEAVE,))
    assert transition(State.LEADER, Observed("me", "me", role_finished=True, role_failed=True)) == \
        (State.DONE, (Action.RESIGN, Action.LEAVE))
    assert transition(State.DONE, Observed("me", "me")) == (State.DONE, ())


def test_a_leader_role_that_gives_up_the_lead_before_the_runs_end_makes_a_follower_not_a_leaver() -> None:
    """Its plan refused (a newer plan accepted, the quorum lost): the peer resigns and follows, and may be elected
    again; it does not leave the run as if it had ended (exit 0 with the run unfinished)."""
    s, acts = transition(State.LEADER, Observed("me", "me", role_stopped=True))
    assert (s, acts) == (State.RESIGNED, (Action.STOP_ROLE, Action.RESIGN))
    assert transition(s, Observed("me", "other")) == (State.FOLLOWER, ())
    assert transition(s, Observed("me", "me", may_lead=True)) == (State.LEADER, (Action.START_ROLE,))
    assert Action.LEAVE not in acts


def test_a_stored_record_payload_is_what_is_verified() -> None:
    """The reader verifies the payload exactly as stored (a SignedRecord's), not a re-encoding of it."""
    config = {"run": {"steps": 3}, "model": {"d_model": 64}}
    payload = {"config": config, "created_at": 5.0, "organiser": sign_run(ORGANISER, RUN, config, 5.0)}
    record = SignedRecord("someone", b"", payload, 0.0, None)  # type: ignore[arg-type]
    assert run_organiser(RUN, record.payload) == ORGANISER.peer_id


# ---- a leader's records are claims -----------------------------------------------------------------------------
def test_a_malformed_plan_is_refused_at_the_door() -> None:
    good = {"stages": [[0, 2], [2, 4]], "pipelines": [["a", "b"], ["c", "d"]], "step": 3, "reason": "join",
            "coordinator": "127.0.0.1:5000", "credited": ["a"]}
    check_plan_body(good)
    check_plan_body({"by": "a peer"})  # what a reader does not use is not its business
    for bad in ({"stages": "0-4"}, {"stages": [[0]]}, {"stages": [[0, 2], [3, 4]]}, {"stages": [[1, 4]]},
                {"stages": [["0", 4]]}, {"stages": [[0, True]]}, {"stages": [[0, 2]] * 2000},
                {**good, "pipelines": [["a"]]}, {**good, "pipelines": [["a", "bad id!"], ["c", "d"]]},
                {**good, "pipelines": "a,b"}, {**good, "step": -1}, {**good, "step": 1.5},
                {**good, "reason": 7}, {**good, "coordinator": "x" * 5000}, {**good, "credited": "a"},
                {**good, "quorum_waived": []}):
        with pytest.raises(ValueError):
            check_plan_body(bad)


class _DoneView:
    def __init__(self, policy: LeaderPolicy) -> None:
        self.policy = policy
        self.deposed: list[str] = []

    def depose(self, peer_id: str, for_s: float, why: str) -> None:
        self.deposed.append(peer_id)

    def waiting_for_steward(self) -> bool:
        return False


@pytest.mark.parametrize("leaders", [None, "any"])
def test_done_is_accepted_only_at_the_signed_last_step_and_a_false_one_deposes_an_elected_leader(leaders) -> None:
    view = _DoneView(LeaderPolicy.from_record("org", leaders))
    keeper = Leadership("me", 10, 1.0, leaders, view, None)  # type: ignore[arg-type]
    keeper.on_progress({"state": "training", "step": 10, "leader": "l"})
    for step in (1, 9, 11, "10", True, None):
        keeper.on_progress({"state": "done", "step": step, "leader": "liar"})
        assert not keeper.run_done
    # an elected leader is deposed for it; a steward (the organiser's choice) keeps the lead, its order refused
    assert view.deposed == (["liar"] * 6 if leaders == "any" else [])
    keeper.on_progress({"state": "done", "step": 10, "leader": "honest"})
    assert keeper.run_done
    assert keeper.step("other", False, False, False) == (Action.LEAVE,) and keeper.state is State.DONE


def test_an_elected_leader_that_trains_no_step_for_long_is_deposed() -> None:
    from tasklet.peer.node.leadership import NO_PROGRESS_MIN_S

    t = [0.0]
    view = _DoneView(LeaderPolicy.from_record("org", "any"))
    keeper = Leadership("me", 10, 1.0, "any", view, None, clock=lambda: t[0])  # type: ignore[arg-type]
    beat = {"state": "training", "epoch": 2, "step": 3, "leader": "slow", "step_s": 5.0}
    for t[0] in (0.0, 100.0, NO_PROGRESS_MIN_S - 1):
        keeper.on_progress(beat)
    assert view.deposed == []
    keeper.on_progress({**beat, "state": "paused"})  # news (a pause: no quorum, too few peers) starts anew
    t[0] = 2 * NO_PROGRESS_MIN_S
    keeper.on_progress(beat)
    assert view.deposed == []  # the clock restarts after the pause
    t[0] = 3 * NO_PROGRESS_MIN_S
    keeper.on_progress(beat)
    assert view.deposed == ["slow"]
    keeper.on_progress({**beat, "step": 4})
    t[0] = 4 * NO_PROGRESS_MIN_S - 1
    keeper.on_progress({**beat, "step": 4})
    assert view.deposed == ["slow"]  # it moved: a new wait


def test_a_follower_logs_each_change_of_the_leader_it_follows(caplog: pytest.LogCaptureFixture) -> None:
    view = _DoneView(LeaderPolicy.from_record("org", "any"))
    keeper = Leadership("me", 10, 1.0, "any", view, None)  # type: ignore[arg-type]
    caplog.set_level("INFO", logger="tasklet.peer.node.leadership")
    for leader in (None, "a", "a", None, "a", "b", "me", "a", "a"):
        keeper.step(leader, leader == "me", False, False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("role: ")]
    # a partition's leader "b", then ours: the last line names whom this peer follows now, and no line repeats
    assert lines == ["role: follower -> follower (leader a)", "role: follower -> follower (leader b)",
                     "role: follower -> leader", "role: leader -> resigned", "role: resigned -> follower (leader a)"]


def test_an_order_may_name_only_live_peers_of_the_run_with_their_own_certificates() -> None:
    relayed = "0123456789abcdef0123@127.0.0.9:7000"
    adverts = [Advert("leader", "127.0.0.2:5000", DEVICE, 0.0), Advert("w1", relayed, DEVICE, 0.0, reachable=False)]
    fresh: list[PeerEntry] = []

    class _Members:
        def live_entries(self) -> list[PeerEntry]:
            return fresh

    keeper = Leadership("me", 10, 1.0, None, None, _Members(), lambda: adverts)  # type: ignore[arg-type]
    assert keeper.may_dial("127.0.0.2:5000/coordinator", "leader")  # its coordinator, under a route
    assert keeper.may_dial(relayed, "w1")  # relayed
    assert not keeper.may_dial("127.0.0.2:5000", "w1"), "the endpoint of another peer's advert"
    assert not keeper.may_dial("127.0.0.1:9", "leader"), "an address no advert holds (a canary)"
    assert not keeper.may_dial("not an endpoint", "")
    fresh.append(entry("joiner"))  # a peer the last read missed is looked up once more
    assert keeper.may_dial("127.0.0.1:5000", "joiner")


def test_the_dashboard_says_the_swarm_waits_for_a_steward() -> None:
    from tasklet.peer.observe.snapshot import SwarmSource, build_snapshot

    policy = LeaderPolicy.from_record("org", ["s1", "s2"])
    waiting = {"organiser": "org", "leaders": list(policy.stewards), "waiting": waiting_line(policy)}
    source = SwarmSource(lambda: [entry("w1")], list, lambda: None, lambda: {"state": "training", "step": 3},
                         lambda: None, lambda: waiting)
    snap = build_snapshot(source, "run-x")
    assert snap["state"] == "waiting"
    assert snap["waiting"] == "waiting for a leader the organiser trusts: 2 stewards, none live"
    assert build_snapshot(SwarmSource(lambda: [entry("w1")], list, lambda: None, lambda: {"state": "training"},
                                      lambda: None), "run-x")["state"] == "training"


def test_peer_status_says_the_swarm_waits_for_a_steward() -> None:
    from tasklet.peer.swarm.status import SwarmStatus, format_status

    line = waiting_line(LeaderPolicy.from_record("org", None))
    st = SwarmStatus([], {"epoch": 3, "leader": "org", "pipelines": [], "stages": []}, {"step": 4, "state": "training"},
                     {"measured": 0, "pairs": 0, "median_bandwidth_mbps": None, "median_rtt_ms": None, "by_path": {}},
                     {"organiser": "org", "leaders": ["org"], "live_stewards": [], "waiting": line})
    assert line in format_status(st)
    assert st.to_json()["leadership"]["waiting"] == line


def test_the_dht_is_told_who_may_write_the_leaders_records_on_each_change_of_policy() -> None:
    class _View(_DoneView):
        def adopt_policy(self, policy: LeaderPolicy) -> None:
            self.policy = policy

    class _Stewards:
        added: tuple[str, ...] | None = None

        def read_stewards(self, organiser: str) -> tuple[str, ...] | None:
            return self.added

    told: list[tuple[str, ...] | None] = []
    members = _Stewards()
    keeper = Leadership("me", 10, 1.0, None, _View(LeaderPolicy("x")), members,  # type: ignore[arg-type]
                        guard=told.append)
    keeper.adopt("org")
    assert told == [("org",)]
    keeper.read_stewards()  # unreadable: nothing changes
    members.added = ("s2", "s1")
    keeper.read_stewards()
    keeper.read_stewards()  # the same stewards: not told again
    assert told == [("org",), ("org", "s1", "s2")]
    elected = Leadership("me", 10, 1.0, "any", _View(LeaderPolicy("x")), members,  # type: ignore[arg-type]
                         guard=told.append)
    elected.adopt("org")
    assert told[-1] is None  # members elect: any member may come to write them
