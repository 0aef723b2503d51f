"""The loss history a new leader adopts is complete, or says which steps it lacks and why (unit tests: leader
roles built directly over a fake DHT, no processes).

A step's loss reaches only the leader that ran it; a new leader takes the history from its predecessor's signed
progress record. The takeover step and the history must come from one record (or the newer): a stale read for the
history left the step between the two reads without a loss (``null`` in run.json). Where a loss cannot be known
(the leader died applying the step, a loss report was refused) the history keeps the step with a reason
(``missing`` in the progress record, ``loss_missing`` in run.json).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tasklet.peer.config import RunConfig
from tasklet.peer.node.history import (
    HISTORY_STEPS,
    MAX_REASON,
    NO_LOSS,
    NOT_IN_RECORD,
    UNRECORDED,
    adopt_history,
    newest_record,
)
from tasklet.peer.node.leader_role import LeaderRole
from tasklet.peer.runtime.spec import RunSpec

pytestmark = pytest.mark.unit


class FakeProgress:
    """The DHT's progress records of the dead leader, one per read, in order (the last one repeats)."""

    def __init__(self, reads: list[dict[str, Any]]) -> None:
        self.reads = reads

    def read_patiently(self, leader: str, patience_s: float, wait: Any) -> dict[str, Any] | None:
        assert leader == "dead"
        record = self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]
        return json.loads(json.dumps(record))  # through JSON, as a DHT value is


def role_over(reads: list[dict[str, Any]]) -> LeaderRole:
    ctx = SimpleNamespace(config=RunConfig(), spec=RunSpec(run_id="history"), worker_server=None,
                          worker_endpoint=None, progress=FakeProgress(reads),
                          plan_board=SimpleNamespace(latest=lambda: SimpleNamespace(leader_id="dead")))
    return LeaderRole(ctx)  # type: ignore[arg-type]


@pytest.fixture
def roles() -> Iterator[list[LeaderRole]]:
    made: list[LeaderRole] = []
    yield made
    for role in made:
        role.coordinator.close()


def record_of(losses: list[float | None], missing: dict[str, str] | None = None) -> dict[str, Any]:
    """The progress record a leader publishes after ``len(losses)`` steps."""
    history = {"from": 0, "loss": losses, "step_s": [1.0] * len(losses)}
    if missing is not None:
        history["missing"] = missing
    return {"step": len(losses), "history": history}


def test_a_stale_read_for_the_history_does_not_lose_the_recorded_step(roles: list[LeaderRole]) -> None:
    newer, older = record_of([5.0 - k / 10 for k in range(9)]), record_of([5.0 - k / 10 for k in range(8)])
    role = role_over([newer, older])  # the takeover's read saw step 9; the history's read came back stale
    roles.append(role)
    assert role._recorded()[0] == 9
    role._adopt_history(9)
    assert sorted(role.history) == list(range(9)) and role.history[8] == (pytest.approx(4.2), 1.0)
    assert role.missing == {}, "the newer record's step 8 is kept"


def test_a_step_without_a_loss_says_why_and_the_reason_survives_the_next_takeover(roles: list[LeaderRole]) -> None:
    # leader 1 ran steps 0..3; step 2's loss report was refused; it died applying step 4 (claims move one past)
    first = role_over([record_of([4.0, 3.9, None, 3.7])])
    roles.append(first)
    first._adopt_history(5)
    assert first.missing == {2: NO_LOSS, 4: UNRECORDED}
    assert [first.history[k][0] for k in range(5)] == [4.0, 3.9, None, 3.7, None], "aligned by step"
    first.history[5] = (3.5, 1.0)  # leader 2 runs step 5, publishes, and dies
    published = {"step": 6, "history": first._history_payload()}
    second = role_over([published])
    roles.append(second)
    second._adopt_history(6)
    assert second.missing == {2: NO_LOSS, 4: UNRECORDED}, "the reasons go with the history"
    assert [second.history[k][0] for k in range(6)] == [4.0, 3.9, None, 3.7, None, 3.5]


def test_steps_older_than_the_published_history_are_kept_as_lacking() -> None:
    n = HISTORY_STEPS + 3
    payload = {"from": 3, "loss": [1.0] * HISTORY_STEPS, "step_s": [1.0] * HISTORY_STEPS}
    history, missing = adopt_history({"step": n, "history": payload}, n)
    assert len(history) == n and missing == {0: NOT_IN_RECORD, 1: NOT_IN_RECORD, 2: NOT_IN_RECORD}


def test_the_history_is_read_as_hostile() -> None:
    hostile = {"step": 4, "history": {"from": 0, "loss": [1.0, "x", math.inf, None], "step_s": [1.0, 1.0, 1.0, 2.0],
                                      "missing": {"3": "r" * 10_000, "-1": "neg", "7": "beyond", "a": "no step",
                                                  "0": "a loss it has"}}}
    history, missing = adopt_history(json.loads(json.dumps(hostile, allow_nan=True)), 4)
    assert history[0] == (1.0, 1.0) and history[3] == (None, 2.0)
    assert sorted(missing) == [1, 2, 3] and len(missing[3]) == MAX_REASON
    assert missing[1] == NOT_IN_RECORD and missing[2] == NOT_IN_RECORD
    history, missing = adopt_history({"step": "nine", "history": ["not", "a", "dict"]}, 2)
    assert [history[k][0] for k in (0, 1)] == [None, None] and missing == {0: NOT_IN_RECORD, 1: NOT_IN_RECORD}


def test_the_newest_record_is_the_one_with_the_highest_step() -> None:
    a, b, broken = {"step": 3}, {"step": 5}, {"step": True}
    assert newest_record(a, b) is b and newest_record(b, a) is b
    assert newest_record({}, broken) is broken and newest_record(broken, a) is a
    assert newest_record({}, {}) == {}


def test_the_payload_carries_the_reasons_within_its_bounds(roles: list[LeaderRole]) -> None:
    role = role_over([{}])
    roles.append(role)
    for k in range(HISTORY_STEPS + 10):
        role.history[k] = (None, 1.0)
        role.missing[k] = NO_LOSS
    payload = json.loads(json.dumps(role._history_payload()))
    assert payload["from"] == 10 and len(payload["loss"]) == HISTORY_STEPS
    kept = sorted(int(k) for k in payload["missing"])
    assert kept and kept[0] >= 10 and kept[-1] == HISTORY_STEPS + 9 and len(kept) <= 256
