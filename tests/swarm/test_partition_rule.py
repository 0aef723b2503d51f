"""The bounded-pause and healed-partition rules as pure functions: a plan that waives the quorum
(peer.swarm.plans.waives), the rival plan a leader finds when peers come back and its verdict
(peer.node.partition), and the election of both sides after a heal (peer.swarm.election)."""

from __future__ import annotations

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.node.partition import QuorumWait, bounded_step, find_rival, judge, side_wins, split_step
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.election import elect_leader
from tasklet.peer.swarm.membership import PeerEntry
from tasklet.peer.swarm.plans import PlanRecord, has_quorum, waives
from tasklet.peer.swarm.status import SwarmStatus, format_status
from tasklet.peer.timing import now

DEVICE = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)
OLD = PlanRecord(3, "p0", {"pipelines": [["p0"], ["p1"], ["p2"], ["p3"]]}, ("p0", "p1", "p2", "p3"))


def test_a_waived_plan_fences_exactly_the_plan_followed():
    waived = PlanRecord(4, "p2", {"quorum_waived": {"fenced_epoch": 3, "waited_s": 8.0, "step": 10}}, ("p2", "p3"))
    assert not has_quorum(OLD, waived.members)
    assert waives(waived, OLD)
    assert not waives(waived, PlanRecord(2, "p0", {}, OLD.members))  # it fences another plan
    assert not waives(waived._replace(epoch=3), OLD)  # not newer
    assert not waives(PlanRecord(4, "p2", {"quorum_waived": "yes"}, ("p2", "p3")), OLD)
    assert not waives(PlanRecord(4, "p2", {}, ("p2", "p3")), OLD)
    assert not waives(waived, None)


def test_the_newer_side_wins_and_the_losers_steps_since_the_split_are_reported():
    first = PlanRecord(4, "p2", {"pipelines": [["p2"], ["p3"]], "step": 10, "quorum_waived": {"fenced_epoch": 3}},
                       ("p2", "p3"))
    rival = PlanRecord(5, "p2", {"pipelines": [["p2"], ["p3"]], "step": 12}, ("p2", "p3"))
    assert split_step([rival, first, OLD], rival, 40) == 10  # where the rival lineage went on without a quorum
    assert split_step([rival, OLD], rival, 40) is None
    assert find_rival([rival, first, OLD], "p0", start_epoch=3, returning={"p3"}) == rival
    assert find_rival([rival, OLD], "p0", start_epoch=5, returning={"p3"}) is None  # judged already
    assert find_rival([rival], "p0", start_epoch=3, returning={"p1"}) is None  # nobody of that side came back
    assert find_rival([rival], "p2", start_epoch=3, returning={"p3"}) is None  # our own plan
    ours_newer = judge(rival, {"step": 14}, "p0", (6, 20), steps=40, split=10)
    assert not ours_newer.theirs and ours_newer.step == 20 and ours_newer.their_peers == {"p2", "p3"}
    assert ours_newer.discarded == {"leader": "p2", "epoch": 5, "step": 14, "steps": 4, "kept_leader": "p0",
                                    "kept_epoch": 6, "kept_step": 20}
    theirs_newer = judge(rival, {"step": 14}, "p0", (4, 20), steps=40, split=10)
    assert theirs_newer.theirs and theirs_newer.step == 14
    assert theirs_newer.discarded["leader"] == "p0" and theirs_newer.discarded["steps"] == 10
    # no split known: the lesser step; a split above either side's step is not believed
    assert judge(rival, {"step": 14}, "p0", (6, 20), steps=40).discarded["steps"] == 0
    assert judge(rival, {"step": 14}, "p0", (6, 20), steps=40, split=30).discarded["steps"] == 0
    # equal epochs: the step decides
    assert judge(rival, {"step": 14}, "p0", (5, 13), steps=40).theirs
    assert not judge(rival, {"step": 14}, "p0", (5, 15), steps=40).theirs


def test_both_leaders_of_a_heal_reach_the_same_verdict_including_on_an_exact_tie():
    # each leader judges the other's plan and progress record against its own (epoch, step)
    def both(a: tuple[int, int], b: tuple[int, int], split: int = 10) -> tuple[str, str]:
        plan_a = PlanRecord(a[0], "pa", {"pipelines": [["pa"]], "step": a[1]}, ("pa",))
        plan_b = PlanRecord(b[0], "pb", {"pipelines": [["pb"]], "step": b[1]}, ("pb",))
        seen_by_a = judge(plan_b, {"step": b[1]}, "pa", a, steps=40, split=split)
        seen_by_b = judge(plan_a, {"step": a[1]}, "pb", b, steps=40, split=split)
        assert seen_by_a.discarded == seen_by_b.discarded  # the same loser, the same steps thrown away
        assert seen_by_a.step == seen_by_b.step  # the run goes on from one step
        return ("pb" if seen_by_a.theirs else "pa"), ("pa" if seen_by_b.theirs else "pb")

    assert both((5, 14), (5, 14)) == ("pa", "pa")  # a tie: the smaller leader id wins on both sides
    assert both((6, 12), (5, 14)) == ("pa", "pa")  # the newer epoch
    assert both((5, 12), (6, 11)) == ("pb", "pb")
    assert both((5, 13), (5, 14)) == ("pb", "pb")  # equal epochs: the step
    assert both((5, 15), (5, 14)) == ("pa", "pa")
    tie = judge(PlanRecord(5, "pa", {"pipelines": [["pa"]]}, ("pa",)), {"step": 14}, "pb", (5, 14), steps=40,
                split=10)
    assert tie.theirs and tie.discarded == {"leader": "pb", "epoch": 5, "step": 14, "steps": 4, "kept_leader": "pa",
                                            "kept_epoch": 5, "kept_step": 14}
    # the rule is a total order: for distinct leaders exactly one side wins
    for a in [(4, 9), (5, 9), (5, 10)]:
        for b in [(4, 9), (5, 9), (5, 10)]:
            assert side_wins(a, "pa", b, "pb") != side_wins(b, "pb", a, "pa")


def test_a_rivals_claimed_step_is_believed_only_within_the_run():
    rival = PlanRecord(5, "p2", {"pipelines": [["p2"]], "step": 10}, ("p2",))
    for claim in (10**9, -1, 2.5, True, "14", None):
        v = judge(rival, {"step": claim}, "p0", (5, 12), steps=40)
        assert not v.theirs and v.discarded["step"] == 10  # the plan's own step, not the claim
    assert bounded_step(40, 40) == 40 and bounded_step(41, 40) is None and bounded_step(True, 40) is None
    assert not judge(rival, {"step": 10**9}, "p0", (5, 12), steps=40).theirs


def _entry(peer_id: str, found: set[str]) -> PeerEntry:
    return PeerEntry(Advert(peer_id, "127.0.0.1:5000", DEVICE, 0.0), 0.0, 0.0, frozenset(found))


def test_both_sides_of_a_healed_partition_elect_the_same_leader():
    # p0 started, then p1, p2, p3 joined in that order; ids chosen so that p1 sorts first
    ids = {"p0": "z-starter", "p1": "a-second", "p2": "m-third", "p3": "n-fourth"}
    order = ["p0", "p1", "p2", "p3"]
    entries = [_entry(ids[p], {ids[q] for q in order[:i]}) for i, p in enumerate(order)]
    majority = frozenset(ids.values())  # the leader's side credits everyone who trained before the split
    minority = frozenset({ids["p2"], ids["p3"]})  # the other side credits its own two
    assert elect_leader(entries, majority) == ids["p0"]
    assert elect_leader(entries, minority) == ids["p0"]  # p0 and p1 tie on credited testimony; more found p0


def test_status_says_why_the_swarm_is_paused_since_when_and_until_when():
    at = now()
    progress = {"step": 12, "state": "paused", "paused": {"reason": "only 2 of the 4 members of plan 3 are reachable "
                                                          "(a majority is needed)", "since": at - 30, "until": at + 270,
                                                          "epoch": 3},
                "discarded": {"leader": "p2", "epoch": 5, "step": 14, "steps": 4, "kept_leader": "p0",
                              "kept_epoch": 6, "kept_step": 20}}
    links = {"measured": 0, "pairs": 0, "median_bandwidth_mbps": None, "median_rtt_ms": None, "by_path": {}}
    st = SwarmStatus([], {"epoch": 3, "leader": "p2", "pipelines": [], "stages": []}, progress, links)
    text = format_status(st)
    assert "(paused)" in text
    line = next(x for x in text.splitlines() if x.startswith("paused "))
    assert "only 2 of the 4 members of plan 3" in line
    assert "30 s ago" in line and ("in 270 s" in line or "in 269 s" in line)
    assert "discarded 4 step(s) of the side of p2" in text
    assert st.to_json()["paused"]["until"] == at + 270 and st.to_json()["discarded"]["steps"] == 4


def test_status_says_a_swarm_short_of_peers_waits_for_them_without_a_deadline():
    at = now()
    progress = {"step": 5, "state": "paused", "paused": {"reason": "waiting for peers: 2 live peer(s) cannot hold 3 "
                                                         "stages", "since": at - 12, "until": None}}
    links = {"measured": 0, "pairs": 0, "median_bandwidth_mbps": None, "median_rtt_ms": None, "by_path": {}}
    text = format_status(SwarmStatus([], {"epoch": 3, "leader": "p2", "pipelines": [], "stages": []}, progress, links))
    line = next(x for x in text.splitlines() if x.startswith("paused "))
    assert "12 s ago" in line and "2 live peer(s) cannot hold 3 stages" in line
    assert line.endswith("continues when enough peers are live")


def test_the_pause_is_bounded_and_a_quorum_back_in_time_ends_it_at_no_cost():
    live = {"p2", "p3"}
    wait = QuorumWait(wait_s=10.0)
    assert wait.step(OLD, live, quorum=False, now_s=100.0) == "paused"
    assert wait.pause is not None and "only 2 of the 4 members of plan 3" in wait.pause["reason"]
    assert abs(wait.pause["until"] - wait.pause["since"] - 10.0) < 0.01
    assert wait.step(OLD, live, quorum=False, now_s=109.9) == "waiting"
    assert wait.step(OLD, live | {"p0"}, quorum=True, now_s=109.95) == "go"
    assert wait.pause is None and wait.waiver is None

    wait = QuorumWait(wait_s=10.0)
    assert wait.step(OLD, live, quorum=False, now_s=0.0) == "paused"
    assert wait.step(OLD, live, quorum=False, now_s=10.0) == "waived"
    assert wait.waiver == {"fenced_epoch": 3, "waited_s": 10.0, "present": 2, "members": 4}
    assert wait.pause is None
    assert QuorumWait(wait_s=10.0).step(OLD, set(OLD.members), quorum=True, now_s=0.0) == "go"
