"""``bench.bandwidth --measured`` and ``--validate`` at a small size: real worker processes on the emulated
world-wide network (figures printed, no times asserted), and the arithmetic they rest on."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from bench import bandwidth
from bench.bandwidth_measured import MeasuredConfig, claim_choice, first_reaching, measured, modeled_wall, trailing
from tasklet.scheduler.compression import SyncOption


def test_trailing_mean_and_first_step_reaching_the_target() -> None:
    losses = [5.0, 4.0, 3.0, 2.0, 1.0]
    assert trailing(losses, 2) == [5.0, 4.5, 3.5, 2.5, 1.5]
    assert first_reaching(losses, 3.5, 2) == 3
    assert first_reaching(losses, 1.0, 2) is None


def test_modeled_wall_pays_the_sync_once_per_period() -> None:
    pred = {"pipeline_s": 1.0, "dp_s": 0.25}  # dp_s is the per-step mean: 0.5 s per sync at H = 2
    assert modeled_wall(pred, 1, 4) == pytest.approx(5.0)
    assert modeled_wall(pred, 2, 5) == pytest.approx(5.0 + 2 * 0.5)


def test_the_claims_choice_compresses() -> None:
    layout, choice = claim_choice(search_s=3.0)
    assert not choice.is_exact
    assert sorted(d for p in layout.pipelines for d in p) == list(range(8))


def test_measured_at_a_small_size(processes: None) -> None:
    out = measured(replace(MeasuredConfig().small(), steps=3))
    print(json.dumps({k: v for k, v in out.items() if k not in ("losses", "step_seconds")}))
    assert out["bytes_per_step"]["chosen"] < out["bytes_per_step"]["exact"]
    assert len(out["losses"]["exact"]) == 3 and len(out["losses"]["chosen"]) == 4
    assert all(math.isfinite(x) for r in out["losses"].values() for x in r)
    assert math.isfinite(out["final_loss_gap"])
    for name in ("exact", "chosen"):
        assert out["step_s"][name]["measured"] > 0 and out["step_s"][name]["predicted"] > 0


def test_validate_at_a_small_size(processes: None) -> None:
    """``--validate``'s path for one option (the DiLoCo one, which the model misses most): one 8-worker swarm."""
    out = bandwidth.validate(steps=3, options=(("none", SyncOption(4, "int8")),))
    print(json.dumps(out))
    got = out["diloco-H4-int8"]
    assert got["measured_step_s"] > 0 and got["predicted_step_s"] > 0
    assert got["error"] == pytest.approx(got["measured_step_s"] / got["predicted_step_s"] - 1.0, abs=2e-3)
