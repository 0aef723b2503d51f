"""The leader's signed step record: what a takeover's bound rests on when the DHT's progress record lags (unit
tests: real RSA identities, the real control message, leader roles over a fake DHT; no processes).

The record travels with every ``start_step``; a worker keeps the newest and shows it in its status. A new leader
believes only a record of this run signed by the previous plan's leader, whatever a worker sends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tasklet.peer.config import RunConfig
from tasklet.peer.identity.keys import Identity
from tasklet.peer.node.leader_role import LeaderRole, judge_claims
from tasklet.peer.node.step_record import StepRecord, newest_record, read_record, sign_record
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.spec import RunSpec

pytestmark = pytest.mark.unit

RUN = "steps"
LEADER, OTHER = Identity.generate(), Identity.generate()
HASHES = {(0, 2): "a" * 64, (2, 4): "b" * 64}


def signed(step: int, epoch: int = 1, who: Identity = LEADER, run: str = RUN) -> str:
    return sign_record(who, run, StepRecord(epoch, step, HASHES))


def test_a_signed_record_reads_back_as_its_leader_wrote_it() -> None:
    record = read_record(signed(7), RUN, LEADER.peer_id)
    assert (record.epoch, record.step, record.hashes) == (1, 7, HASHES)


def tampered(text: str, **changes: Any) -> str:
    value = json.loads(text)
    value.update(changes)
    return json.dumps(value)


@pytest.mark.parametrize(("text", "why"), [
    (signed(7, who=OTHER), "not by the previous leader"),
    (signed(7, run="another run"), "seal fails"),
    (tampered(signed(7), step=9), "seal fails"),  # a worker raising the step of a genuine record
    (tampered(signed(7), stage_hashes=[[0, 2, "c" * 64], [2, 4, "b" * 64]]), "seal fails"),
    (tampered(signed(7), step=True), "not a count"),
    (tampered(signed(7), extra=1), "exactly"),
    (tampered(signed(7), stage_hashes=[[0, 2, "x" * 65]]), "malformed stage hashes"),
    ("{not json", "not JSON"),
    ("x" * (ctl.MAX_STEP_RECORD_CHARS + 1), "over its size"),
    (None, "no step record"),
])
def test_a_record_the_previous_leader_did_not_sign_as_it_stands_is_refused(text: object, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        read_record(text, RUN, LEADER.peer_id)


def test_the_newest_genuine_record_wins_and_a_forged_newer_one_is_skipped() -> None:
    shown = [("w1", signed(5)), ("w2", signed(6)), ("liar", signed(40, who=OTHER)),
             ("liar2", tampered(signed(6), step=41)), ("w3", None), ("w4", signed(2, epoch=2))]
    best = newest_record(shown, RUN, LEADER.peer_id)
    assert best is not None and (best.epoch, best.step) == (2, 2), "a re-plan's epoch outranks an older step"
    assert newest_record(shown[:3], RUN, LEADER.peer_id).step == 6  # type: ignore[union-attr]
    assert newest_record(shown, RUN, None) is None, "no previous leader: no record is anyone's"


def test_the_record_rides_the_start_step_and_is_bounded_there() -> None:
    text = signed(3)
    msg = ctl.StartStep(4, 0, feed=True, record=text)
    back = ctl.StartStep.from_pb(msg.to_pb().start_step)
    assert back == msg
    oversize = ctl.StartStep.from_pb(ctl.StartStep(4, record="y" * (3 * ctl.MAX_STEP_RECORD_CHARS)).to_pb().start_step)
    assert len(oversize.record) == ctl.MAX_STEP_RECORD_CHARS  # kept within its bound: it then fails to verify


class StaleProgress:
    """The DHT's newest progress record of the dead leader: throttled, so behind the step records."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def read_patiently(self, leader: str, patience_s: float, wait: Any) -> dict[str, Any] | None:
        return json.loads(json.dumps(self.record))


@pytest.fixture
def role() -> Iterator[LeaderRole]:
    ctx = SimpleNamespace(config=RunConfig(), spec=RunSpec(run_id=RUN), worker_server=None, worker_endpoint=None,
                          progress=StaleProgress({"epoch": 1, "step": 3, "stage_hashes": [[0, 2, "d" * 64]]}),
                          plan_board=SimpleNamespace(latest=lambda: SimpleNamespace(leader_id=LEADER.peer_id)))
    made = LeaderRole(ctx)  # type: ignore[arg-type]
    yield made
    made.coordinator.close()


def test_a_takeover_bounds_claims_by_the_newest_record_a_worker_shows(role: LeaderRole) -> None:
    stages = [(0, 2), (2, 4)]
    statuses = {  # the leader stored step 3 in the DHT, then sent the record of step 6 with step 6's start
        "a": {"trained_steps": 7, "layers": [0, 2], "step_record": signed(6)},
        "b": {"trained_steps": 7, "layers": [2, 4], "step_record": signed(6)},
        "liar": {"trained_steps": 9, "layers": [2, 4], "step_record": tampered(signed(6), step=8)},
    }
    assert role._recorded()[0] == 3, "without the workers' records: the DHT's"
    role._noted = newest_record(((ep, st["step_record"]) for ep, st in statuses.items()), RUN, LEADER.peer_id)
    recorded, digests = role._recorded()
    assert (recorded, digests) == (6, HASHES)
    judged = judge_claims(statuses, stages, recorded, digests)
    assert judged.top == 7 and set(judged.liars) == {"liar"}, "honest workers one past the record move the run on"
    stale = judge_claims(statuses, stages, 3, {})
    assert stale.top is None and set(stale.liars) == {"a", "b", "liar"}, "what the DHT alone would have judged"


def test_a_record_older_than_the_dhts_does_not_pull_the_bound_back(role: LeaderRole) -> None:
    role._noted = read_record(signed(2), RUN, LEADER.peer_id)
    assert role._recorded() == (3, {(0, 2): "d" * 64})


def test_a_leader_signs_each_steps_record_for_its_coordinator_to_send(role: LeaderRole) -> None:
    role.ctx.progress.store = SimpleNamespace(identity=LEADER)  # type: ignore[attr-defined]
    role.driver = SimpleNamespace(digests=SimpleNamespace(at=lambda trained: HASHES if trained == 8 else None))  # type: ignore[assignment]
    role._sign_step(2, 8)
    record = read_record(role.coordinator.step_record, RUN, LEADER.peer_id)
    assert (record.epoch, record.step, record.hashes) == (2, 8, HASHES)
    role._sign_step(2, 9)  # no agreed hashes at that step: the record says so (no hash to hold claims to)
    assert read_record(role.coordinator.step_record, RUN, LEADER.peer_id).hashes == {}


class Recorder(StaleProgress):
    """The DHT's progress board as the leader writes it: every record stored, in order."""

    def __init__(self) -> None:
        super().__init__({})
        self.stored: list[dict[str, Any]] = []

    def publish(self, record: dict[str, Any]) -> bool:
        self.stored.append(json.loads(json.dumps(record)))
        return True


def test_a_step_stores_nothing_its_beat_stores_it_and_the_history_keeps_up(role: LeaderRole) -> None:
    board = role.ctx.progress = Recorder()  # type: ignore[misc]
    role._publish({"epoch": 1, "step": 0, "state": "training"})  # a re-plan's: stored at once
    assert len(board.stored) == 1
    for step in range(6):
        role.losses.record(step, 5.0 - step, 0.1)
        role._built_at -= 10.0  # each step's end comes a build period after the last build
        role._publish({"epoch": 1, "step": step + 1, "state": "training", "checkpoint_hashes": []}, due=False)
        if step == 0:  # the checkpoints it signs changed (none -> []): stored from the driver's thread, once
            assert len(board.stored) == 2
        role.beat()  # the daemon's tick
    assert len(board.stored) == 2 + 6, "only beats stored the steps"
    newest = board.stored[-1]
    assert newest["step"] == 6 and newest["history"]["loss"] == [5.0, 4.0, 3.0, 2.0, 1.0, 0.0], "not frozen"
