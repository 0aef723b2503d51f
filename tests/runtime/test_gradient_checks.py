"""The gradient exchange's defences are one ordered list (peer.runtime.stage.gradient_checks.GRADIENT_CHECKS): its
order and names are what the docs say, and a check added to it is run by the exchange, its refusal reaching the
caller, while the list without it accepts the same attempt."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tasklet.peer.runtime.stage import gradient_checks
from tasklet.peer.runtime.stage.exchange import GradientExchange
from tasklet.peer.runtime.stage.gradient_checks import (
    GRADIENT_CHECKS,
    AttemptView,
    GradientCheck,
    OutlierContributionError,
    Phase,
)
from tasklet.protocol.errors import BadMessage

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("norm", "direction", "exactly_once", "digest")
NUMEL = 11


class RefuseEverything:
    """A dummy defence: refuses every attempt before the sum, naming every other participant."""

    name = "refuse_everything"
    phase = Phase.SUM

    def __init__(self) -> None:
        self.seen: list[AttemptView] = []

    def inspect(self, view: AttemptView) -> None:
        self.seen.append(view)
        raise OutlierContributionError(view.tag, [r for r in view.participants if r != view.replica], "refused")


def _reduce(box: GradientExchange, tag: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """One honest attempt of two participants at replica 0's exchange: (the sum it returns, the true sum)."""
    parts = [0, 1]
    lo, hi = box.shard_of(parts, 0)
    gen = torch.Generator().manual_seed(0)
    shards = [torch.randn(hi - lo, generator=gen) for _ in parts]
    for r in parts:
        box.put_contribution(tag, parts, r, shards[r].clone(), [r])
    return box.shard_sum(tag, parts, 2, timeout_s=1.0), shards[0] + shards[1]


def test_the_list_holds_the_documented_checks_in_order() -> None:
    assert tuple(c.name for c in GRADIENT_CHECKS) == NAMES
    assert [c.phase for c in GRADIENT_CHECKS] == [Phase.SUM, Phase.SUM, Phase.SUM, Phase.VERIFY]
    assert all(isinstance(c, GradientCheck) for c in GRADIENT_CHECKS)
    # the module docstring's numbered list names the same checks in the same order
    doc = gradient_checks.__doc__ or ""
    assert tuple(re.findall(r"^\d+\. ``(\w+)``", doc, flags=re.M)) == NAMES
    # and so does the architecture's row of the peer side
    row = next(line for line in (ROOT / "docs/architecture.md").read_text().splitlines()
               if line.startswith("| runtime: peer side |"))
    assert tuple(re.findall(r"`(\w+)`", row.split("GRADIENT_CHECKS", 1)[1])[:len(NAMES)]) == NAMES


def test_an_exchange_runs_the_list_as_it_is_when_built() -> None:
    assert GradientExchange(0, NUMEL).gradient_checks == GRADIENT_CHECKS


def test_an_appended_check_refuses_and_removing_it_restores_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    dummy = RefuseEverything()
    monkeypatch.setattr(gradient_checks, "GRADIENT_CHECKS", (*GRADIENT_CHECKS, dummy))  # the one line to register
    with pytest.raises(OutlierContributionError) as info:
        _reduce(GradientExchange(0, NUMEL))
    assert info.value.replicas == [1] and "refused" in str(info.value)
    assert len(dummy.seen) == 1 and dummy.seen[0].tag == (0, 1) and set(dummy.seen[0].contributions) == {0, 1}

    monkeypatch.setattr(gradient_checks, "GRADIENT_CHECKS", GRADIENT_CHECKS)
    summed, expected = _reduce(GradientExchange(0, NUMEL))
    assert torch.equal(summed, expected)
    assert len(dummy.seen) == 1, "the removed check ran again"


def test_checks_given_to_the_exchange_run_in_their_order() -> None:
    """An explicit list: the dummy placed before the built-in checks refuses first an attempt that the
    exactly-once check would refuse too; placed after them, the built-in refusal comes first and the dummy
    never runs."""
    first, last = RefuseEverything(), RefuseEverything()
    box = GradientExchange(0, NUMEL, checks=(first, *GRADIENT_CHECKS))
    parts, tag = [0, 1], (2, 1)
    lo, hi = box.shard_of(parts, 0)
    for r in parts:
        box.put_contribution(tag, parts, r, torch.ones(hi - lo), [0])  # micro-batch 0 twice
    with pytest.raises(OutlierContributionError):
        box.shard_sum(tag, parts, 2, timeout_s=1.0)

    box = GradientExchange(0, NUMEL, checks=(*GRADIENT_CHECKS, last))
    for r in parts:
        box.put_contribution(tag, parts, r, torch.ones(hi - lo), [0])
    with pytest.raises(BadMessage, match="exactly once"):
        box.shard_sum(tag, parts, 2, timeout_s=1.0)
    assert first.seen and not last.seen


def test_a_check_of_the_verify_phase_runs_after_the_all_gather_and_the_attempt_is_forgotten() -> None:
    class RefuseAfterGather(RefuseEverything):
        name, phase = "refuse_after_gather", Phase.VERIFY

    dummy = RefuseAfterGather()
    box = GradientExchange(0, NUMEL, checks=(*GRADIENT_CHECKS, dummy))
    parts, tag = [0], (1, 1)
    flat = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
    box.put_contribution(tag, parts, 0, flat.clone(), [0])
    box.put_reduced(tag, parts, 0, box.shard_sum(tag, parts, 1, 1.0))
    assert not dummy.seen, "a VERIFY check ran before the sum"
    box.gather(tag, parts, 1.0)
    box.put_digest(tag, parts, 0, box.my_digest(tag, parts, flat))
    with pytest.raises(OutlierContributionError):
        box.verify(tag, parts, 1.0)
    assert len(dummy.seen) == 1 and tag not in box._attempts
