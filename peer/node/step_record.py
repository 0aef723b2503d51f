"""The leader's signed step record, carried by every ``start_step`` order: how far the run had trained.

A takeover trusts no worker more than one step past what the previous leader recorded (``judge_claims``): the
only honest way past it is a leader that died while its workers applied the next step. The progress record in
the DHT says how far the run had trained, but storing it before every step puts a DHT store (a round trip or
more across the internet, two signed stores' CPU on one machine) between every two steps. So the leader signs
the same facts (run, plan epoch, trained steps, the parameters hash of each stage at that step) into a small
record and sends it with the next step's ``start_step``; each worker keeps the newest it was sent and shows it
in its status. No worker can apply step ``k`` without having been sent the record of ``k`` trained steps
first, so the newest record a new leader finds among the workers (or in the DHT, whichever is newer) bounds
every honest claim exactly as the stored record did. The DHT record (``peer status``, the loss history, the
contribution record) is stored by the leader's beat, every control-loop tick, and at re-plans, pauses, new
checkpoints and the run's end, never on a step's way; its history and credit are rebuilt at most every
``PROGRESS_BUILD_S``.

A record is the predecessor's claim, checked like any: it counts only when it is well formed, within
``MAX_STEP_RECORD_CHARS``, of this run, and signed by the leader of the previous plan. A worker can withhold its record
(then its own claim past the others' is refused) but cannot forge one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tasklet.peer.identity.keys import Identity
from tasklet.peer.runtime.control import MAX_HASH, MAX_STEP_RECORD_CHARS
from tasklet.peer.swarm.charter import CharterError, seal, signer_of
from tasklet.peer.swarm.records import canonical_json

log = logging.getLogger(__name__)

DOMAIN = b"tasklet leader step v1"
MAX_STAGES = 1024  # stage hashes one record may carry (more stages than any plan has)


@dataclass(frozen=True)
class StepRecord:
    """What a step record says: the run had trained ``step`` steps under plan ``epoch``, and each stage's
    parameters (layers -> hash) at that step, where its replicas agreed."""

    epoch: int
    step: int
    hashes: dict[tuple[int, int], str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step,
                "stage_hashes": [[a, b, h] for (a, b), h in sorted(self.hashes.items())]}


def sign_record(identity: Identity, run_id: str, record: StepRecord) -> str:
    """The record as the text a ``start_step`` carries: its body and the leader's seal over it."""
    body = record.body()
    text = canonical_json({**body, "seal": seal(identity, DOMAIN, run_id, body)}).decode()
    if len(text) > MAX_STEP_RECORD_CHARS:
        raise ValueError(f"a step record of {len(text)} characters is over {MAX_STEP_RECORD_CHARS}")
    return text


def read_record(text: object, run_id: str, leader: str) -> StepRecord:
    """The record ``text`` states, if ``leader`` signed it for ``run_id``; ValueError (saying why) otherwise."""
    if not isinstance(text, str) or not text or len(text) > MAX_STEP_RECORD_CHARS:
        raise ValueError("no step record, or one over its size")
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError("a step record that is not JSON") from None
    if not isinstance(value, dict) or set(value) != {"epoch", "step", "stage_hashes", "seal"}:
        raise ValueError("a step record without exactly epoch, step, stage_hashes and seal")
    epoch, step, items = value["epoch"], value["step"], value["stage_hashes"]
    if not all(type(x) is int and x >= 0 for x in (epoch, step)):
        raise ValueError("a step record whose epoch or step is not a count")
    if not isinstance(items, list) or len(items) > MAX_STAGES or not all(
            isinstance(i, list) and len(i) == 3 and type(i[0]) is int and type(i[1]) is int
            and isinstance(i[2], str) and 0 < len(i[2]) <= MAX_HASH for i in items):
        raise ValueError("a step record with malformed stage hashes")
    body = {"epoch": epoch, "step": step, "stage_hashes": items}
    try:
        signer = signer_of(DOMAIN, run_id, body, value["seal"], "leader")
    except CharterError as exc:
        raise ValueError(f"a step record whose seal fails: {exc}") from None
    if signer != leader:
        raise ValueError(f"a step record signed by {signer}, not by the previous leader {leader}")
    return StepRecord(epoch, step, {(a, b): h for a, b, h in items})


def newest_record(texts: Iterable[tuple[str, object]], run_id: str, leader: str | None) -> StepRecord | None:
    """The newest (highest plan epoch, then most trained steps: a re-plan may roll the step back) of the records
    ``(endpoint, text)`` that ``leader`` signed for ``run_id``; one that fails is logged with its sender and
    skipped."""
    best: StepRecord | None = None
    if leader is None:
        return None
    for endpoint, text in texts:
        if text is None:
            continue
        try:
            record = read_record(text, run_id, leader)
        except ValueError as exc:
            log.warning("takeover: %s's step record is refused: %s", endpoint, exc)
            continue
        if best is None or (record.epoch, record.step) > (best.epoch, best.step):
            best = record
    return best
