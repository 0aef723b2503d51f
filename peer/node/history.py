"""The run's loss history as a leader keeps it, across takeovers: step -> (loss, seconds), and for every step
without a loss, why (the progress record's ``missing``, run.json's ``loss_missing``).

A new leader adopts its predecessor's history from the newest progress record it read (:func:`newest_record`):
a stale read for the history would leave the steps between the two reads without a loss. Every adopted record is
read as hostile: only numbers, bounded reasons, steps within the run.
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)

HISTORY_STEPS = 2000  # steps of loss history a progress record carries (the newest)
MAX_MISSING = 256  # steps without a loss whose reason a progress record carries (the newest)
MAX_REASON = 200  # characters of one such reason
NO_LOSS = "no usable loss was reported (a micro-batch's loss was refused or lost)"
UNRECORDED = "applied under the previous leader, which died before publishing it: its loss died with it"
NOT_IN_RECORD = "not in the previous leader's progress record"


def _number(value: Any, none: bool = False) -> bool:
    """A finite int or float (not a bool); ``none``: None counts too."""
    if value is None:
        return none
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class LossHistory:
    """step -> (loss, seconds) of the whole run (a loss of None: none usable was reported) and step -> why a loss
    is missing; ``last_step``: the run's signed step count, beyond which no adopted step is believed."""

    def __init__(self, last_step: int) -> None:
        self.last_step = last_step
        self.steps: dict[int, tuple[float | None, float]] = {}
        self.missing: dict[int, str] = {}

    def record(self, step: int, loss: float | None, seconds: float) -> None:
        self.steps[step] = (loss, seconds)
        if loss is None:
            self.missing[step] = NO_LOSS
        else:
            self.missing.pop(step, None)

    def forget_from(self, step: int) -> None:
        """Drop steps ``step`` and later (a roll-back, or a partition's losing side redoes them)."""
        for k in [k for k in self.steps if k >= step]:
            del self.steps[k]
            self.missing.pop(k, None)

    def adopt(self, progress: dict[str, Any], trained: int, since: int = 0) -> None:
        """Steps ``since`` .. ``trained`` - 1 from a previous leader's progress record (``adopt_history``)."""
        history, missing = adopt_history(progress, min(trained, self.last_step), since)
        self.steps.update(history)
        self.missing.update(missing)
        if missing:
            log.warning("leader: %d step(s) of the adopted history have no loss: %s", len(missing),
                        {k: missing[k] for k in sorted(missing)[-8:]})

    def payload(self, limit: int = HISTORY_STEPS) -> dict[str, Any]:
        """The newest ``limit`` steps as a progress record carries them."""
        steps = sorted(self.steps)[-limit:]
        lacking = sorted(k for k in self.missing if not steps or k >= steps[0])[-MAX_MISSING:]
        return {"from": steps[0] if steps else 0, "loss": [self.steps[k][0] for k in steps],
                "step_s": [round(self.steps[k][1], 4) for k in steps],
                "missing": {str(k): self.missing[k] for k in lacking}}

    def run_fields(self) -> dict[str, Any]:
        """run.json's ``loss``, ``step_s`` and ``loss_missing`` (why a loss there is null)."""
        order = sorted(self.steps)
        return {"loss": [self.steps[k][0] for k in order], "step_s": [self.steps[k][1] for k in order],
                "loss_missing": {str(k): self.missing[k] for k in sorted(self.missing)}}


def newest_record(*records: dict[str, Any]) -> dict[str, Any]:
    """Of progress records of one leader, the one with the highest trained ``step`` (the later one on a tie;
    a record without a step count ranks lowest)."""
    def rank(record: dict[str, Any]) -> int:
        step = record.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else -1

    best: dict[str, Any] = {}
    for record in records:
        if record and rank(record) >= rank(best):
            best = record
    return best


def adopt_history(progress: dict[str, Any], trained: int,
                  since: int = 0) -> tuple[dict[int, tuple[float | None, float]], dict[int, str]]:
    """The loss history of steps ``since`` .. ``trained`` - 1 in a previous leader's progress record, as step ->
    (loss, seconds), and step -> why for every step of that range without a loss: the reason the record gives, or
    the step was applied after the record (its leader died before publishing it), or the record lacks it. Every
    step of the range is in the history (a loss of None where none is known), so a list of losses by step stays
    aligned. Read as hostile: only numbers, bounded reasons, steps within the range."""
    hist = progress.get("history") if isinstance(progress.get("history"), dict) else {}
    recorded = progress.get("step")
    recorded = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None
    first = hist.get("from", 0)
    first = first if isinstance(first, int) and not isinstance(first, bool) and 0 <= first <= trained else 0
    losses, secs = hist.get("loss"), hist.get("step_s")
    history: dict[int, tuple[float | None, float]] = {}
    if isinstance(losses, list) and isinstance(secs, list):
        for k, (loss, s) in enumerate(zip(losses, secs, strict=False)):
            if since <= first + k < trained and _number(loss, none=True) and _number(s):
                history[first + k] = (None if loss is None else float(loss), float(s))
    given = hist.get("missing") if isinstance(hist.get("missing"), dict) else {}
    reasons: dict[int, str] = {}
    for key, why in list(given.items())[:MAX_MISSING]:
        if isinstance(key, str) and key.isdigit() and isinstance(why, str) and since <= int(key) < trained:
            reasons[int(key)] = why[:MAX_REASON]
    missing: dict[int, str] = {}
    for k in range(since, trained):
        if k in history:  # in the record: a null loss there is one nobody reported
            if history[k][0] is None:
                missing[k] = reasons.get(k, NO_LOSS)
            continue
        history[k] = (None, math.nan)
        missing[k] = UNRECORDED if recorded is not None and k >= recorded else reasons.get(k, NOT_IN_RECORD)
    return history, missing
