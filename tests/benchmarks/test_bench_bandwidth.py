"""bench.bandwidth in its tiny configuration: the output has the promised shape, the table it writes is one the
scheduler reads, and the plot is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import bandwidth
from tasklet.scheduler.compression import PenaltyTable


@pytest.mark.light_processes  # a quick bench, no bed, no timing asserted: lane 1 (tests/conftest.py)
def test_quick_bench_output_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str], processes: None) -> None:
    table, plot = tmp_path / "penalties.json", tmp_path / "loss.svg"
    assert bandwidth.main(["--quick", "--json", "--table", str(table), "--plot", str(plot),
                           "--search-seconds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("exact_time_to_loss_s", "chosen_time_to_loss_s", "speedup", "final_loss_gap", "chosen",
                "bytes_per_step"):
        assert key in out
    assert out["exact_time_to_loss_s"] > 0 and math.isfinite(out["final_loss_gap"])
    if out["chosen_time_to_loss_s"] is not None:
        assert out["speedup"] == pytest.approx(out["exact_time_to_loss_s"] / out["chosen_time_to_loss_s"], rel=1e-2)
    chosen = out["chosen"]
    assert len(chosen["activation"]) == 3 and chosen["sync_period"] >= 1
    assert chosen["predicted_loss_penalty"] <= bandwidth.MAX_LOSS_PENALTY + 1e-9
    # bytes per step: every option, and compression sends fewer bytes than exact training
    assert {"exact", "chosen", "act-int4", "diloco-H16-topk"} <= set(out["bytes_per_step"])
    assert all(v < out["bytes_per_step"]["exact"] for k, v in out["bytes_per_step"].items() if k != "exact")
    assert "modeled" in out["step_time"]
    assert out["looser_limit"]["chosen"]["predicted_loss_penalty"] <= bandwidth.LOOSE_LOSS_PENALTY + 1e-9
    # the target is exact training's mean loss over its last evaluations up to N: it gets there by step N
    assert 0 < out["options"]["exact"]["steps_to_loss"] <= out["steps"]
    assert math.isfinite(out["seed_noise"]) and len(out["seed_spread"]) == len(out["seeds"]) == 2
    # every gap is the mean of the per-seed gaps, each against the same seed's exact run
    for o in out["options"].values():
        assert o["final_loss_gap"] == pytest.approx(sum(o["final_loss_gap_per_seed"]) / 2, abs=1e-5)
    # DiLoCo's outer setting is picked per period on its tuning seeds (several at H = 2), never measurement seeds
    tuning = out["diloco_tuning"]
    for h in bandwidth.SYNC_PERIODS:
        tune_seeds = tuning["seeds"][f"H{h}"]
        assert len(set(tune_seeds)) == bandwidth.TUNE_SEEDS.get(h, 1) and not set(tune_seeds) & set(out["seeds"])
    assert len(tuning["seeds"]["H2"]) > 1
    assert len(tuning["tried"]) == sum(len(bandwidth.OUTER_SETTINGS[h]) for h in bandwidth.SYNC_PERIODS)
    for h in bandwidth.SYNC_PERIODS:
        tried = [t for t in tuning["tried"] if t["period"] == h]
        best = min(tried, key=lambda t: t["final_loss"])
        for t in tried:  # a setting's loss is its mean over the period's tuning seeds
            assert t["final_loss"] == pytest.approx(sum(t["final_loss_per_seed"]) / len(t["seeds"]), abs=1e-4)
        assert tuning["chosen"][f"H{h}"] == {"outer_lr": best["outer_lr"], "outer_momentum": best["outer_momentum"]}
    assert out["speedup_vs_best_exact"] is None or out["speedup_vs_best_exact"] > 0
    assert all(o["cut_at_step"] is None or o["cut_at_step"] < out["steps"] for o in out["options"].values())
    loaded = PenaltyTable.load(table)
    # the chosen combinations' penalties were measured together, never summed from their parts
    for limit_key in (out["chosen"], out["looser_limit"]["chosen"]):
        if limit_key["sync"] != "exact" and set(limit_key["activation"]) != {"none"}:
            assert max(limit_key["activation"], key=["none", "fp16", "int8", "int4", "int2"].index) + "+" \
                + limit_key["sync"] in loaded.joint
    assert set(loaded.activation) == {"none", "fp16", "int8", "int4", "int2"}
    assert all(v >= 0 for v in loaded.sync.values())
    assert plot.stat().st_size > 1000
