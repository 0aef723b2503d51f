"""``bench.scaling``: the world it builds, its arithmetic, and one small real run (figures printed, no times
asserted: they depend on the machine's load)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from bench import scaling
from bench.headline.run import PlanRun
from bench.scaling import ScalingConfig, ScalingConfigError, city_devices, headline, measured_step_s
from tasklet.scheduler.cluster import load_scenario


def test_peers_are_taken_round_robin_over_the_cities() -> None:
    world = load_scenario(scaling.SCENARIO)
    for n, per_city in ((4, 1), (8, 1), (16, 2), (32, 4)):
        devs = city_devices(world, n)
        assert len(set(devs)) == n
        cities = [world.regions[d] for d in devs]
        assert max(cities.count(c) for c in set(cities)) == per_city
        assert len(set(cities)) == min(n, 8)


def test_cluster_is_scaled_as_declared() -> None:
    cfg = ScalingConfig()
    c = scaling.build_cluster(cfg, 16)
    world = load_scenario(scaling.SCENARIO).subset(city_devices(load_scenario(scaling.SCENARIO), 16))
    assert c.n == 16
    assert c.bandwidth_bps[0, 1] == pytest.approx(world.bandwidth_bps[0, 1] * cfg.bandwidth_scale)
    assert c.delay_s[0, 1] == pytest.approx(world.delay_s[0, 1])
    assert c.tflops[0] == pytest.approx(world.tflops[0] * cfg.tflops_scale)


def test_a_dilated_world_is_k_times_slower_and_its_rows_come_back_in_emulated_seconds() -> None:
    cfg = replace(ScalingConfig(), dilation=((16, 8.0),))
    plain, slow = scaling.build_cluster(ScalingConfig(), 16), scaling.build_cluster(cfg, 16)
    assert slow.delay_s[0, 1] == pytest.approx(8 * plain.delay_s[0, 1])
    assert slow.bandwidth_bps[0, 1] == pytest.approx(plain.bandwidth_bps[0, 1] / 8)
    assert slow.tflops[0] == pytest.approx(plain.tflops[0] / 8)
    assert scaling.build_cluster(cfg, 8).delay_s[0, 1] == pytest.approx(scaling.build_cluster(ScalingConfig(), 8)
                                                                        .delay_s[0, 1])  # other sizes: K = 1
    prof = {"round_trip": {"compute_s": 8.0, "wire_s": 4.0, "delay_s": 2.0}, "queue_s": 8.0, "averaging_s": 8.0,
            "control_rounds_s": 0.8, "control_s_not_emulated": 1.6, "leader_rtt_s": 0.8, "pipeline": 1}
    row = {"measured_step_s": 16.0, "predicted_step_s": 8.0, "lower_bound_step_s": 4.0, "tokens_per_s": 100.0,
           "device_tokens_per_s_sum": 1000.0, "efficiency": 0.1, "measured_pipeline_s": None, "profile": prof,
           "step_seconds": [24.0, 8.0]}
    out = scaling.undilated(row, 8.0)
    assert (out["measured_step_s"], out["predicted_step_s"], out["lower_bound_step_s"]) == (2.0, 1.0, 0.5)
    assert out["wall_step_s"] == 16.0 and out["time_dilation"] == 8.0 and out["step_seconds"] == [3.0, 1.0]
    assert out["tokens_per_s"] == 800.0 and out["device_tokens_per_s_sum"] == 8000.0
    assert out["efficiency"] == pytest.approx(out["tokens_per_s"] / out["device_tokens_per_s_sum"])
    assert out["profile"]["round_trip"]["compute_s"] == 1.0 and out["profile"]["pipeline"] == 1
    assert out["measured_pipeline_s"] is None and row["measured_step_s"] == 16.0  # the input is left alone
    assert scaling.undilated(row, 1.0)["measured_step_s"] == 16.0


def test_dilation_on_the_command_line() -> None:
    assert scaling._dilation("8") == ((0, 8.0),)
    assert scaling._dilation("16=4,32=8") == ((16, 4.0), (32, 8.0))
    with pytest.raises(Exception, match="N=K"):
        scaling._dilation("32:8")


@pytest.mark.parametrize("change, needle", [({"peers": (6,)}, "peers"), ({"peers": (128,)}, "peers"),
                                            ({"steps": 1}, "steps"), ({"placements": ("best",)}, "placements"),
                                            ({"bandwidth_scale": 0.0}, "bandwidth_scale"),
                                            ({"dilation": ((32, 0.5),)}, "dilation")])
def test_bad_settings_name_the_setting(change: dict, needle: str) -> None:
    with pytest.raises(ScalingConfigError, match=needle):
        replace(ScalingConfig(), **change).validate()


def test_step_time_is_the_median_over_whole_sync_periods() -> None:
    run = PlanRun(step_seconds=[9.0, 1.0, 3.0, 1.0, 3.0, 1.0, 7.0, 5.0], losses=[0.0] * 8, ended_at_s=[0.0] * 8)
    assert measured_step_s(run, warmup=1, period=1) == pytest.approx(3.0)  # median of 1, 3, 1, 3, 1, 7, 5
    # periods (1, 3), (1, 3), (1, 7): means 2, 2, 4; the odd last step is left out
    assert measured_step_s(run, warmup=1, period=2) == pytest.approx(2.0)


def test_headline_divides_random_by_scheduled() -> None:
    def row(placement: str, measured: float | None, predicted: float) -> dict:
        return {"peers": 16, "placement": placement, "measured_step_s": measured, "predicted_step_s": predicted}

    h = headline([row("scheduled", 2.0, 1.5), row("random", 5.0, 4.5), row("exact", 2.5, 2.0)])
    assert h is not None
    assert h["scheduled_over_random"] == pytest.approx(2.5)
    assert h["predicted_scheduled_over_random"] == pytest.approx(3.0)
    assert h["exact_over_random"] == pytest.approx(2.0)
    assert headline([row("scheduled", None, 1.5), row("random", 5.0, 4.5)])["scheduled_over_random"] is None
    assert headline([row("scheduled", 2.0, 1.5)]) is None


def test_device_throughput_counts_three_forwards_per_token() -> None:
    cfg = ScalingConfig()
    cluster = scaling.build_cluster(cfg, 4)
    spec = cfg.spec(1)
    from tasklet.peer.node.planning import workload_for

    w = workload_for(spec, stages=4, replicas=1)
    per_token = w.stage_forward_flops(0, w.n_layers) / (w.micro_batch * w.seq_len)
    assert scaling.device_tokens_per_s(cluster, w) == pytest.approx(4 * cluster.tflops[0] * 1e12 / (3 * per_token))


@pytest.mark.light_processes  # four small workers, no bed, no timing asserted: lane 1 (tests/conftest.py)
def test_small_real_run_prints_its_rows(processes: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Four worker processes, the scheduler's plan (its compression choice included), two steps: the row is
    filled and the table prints."""
    cfg = replace(ScalingConfig().quick(), steps=2, placements=("scheduled",))
    out = scaling.run(cfg)
    print(scaling.table(out))
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
    assert [(r["peers"], r["placement"]) for r in out["rows"]] == [(4, "scheduled")]
    for r in out["rows"]:
        assert "error" not in r, r.get("error")
        assert r["measured_step_s"] > 0 and math.isfinite(r["measured_step_s"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["measured_step_s"])
        assert 0 < r["efficiency"] < 1  # a pipeline can never beat the sum of its devices
        assert r["predicted_step_s"] > 0 and r["lower_bound_step_s"] > 0
        assert len(r["losses"]) == 2
    assert out["headline_16"] is None  # no 16-peer run here


def test_saved_outputs_merge_by_size_and_placement(tmp_path) -> None:
    base = {"scenario": "w", "bandwidth_scale": 0.003, "tflops_scale": 3e-5, "model": {}, "stages": 4,
            "micro_batch": 4, "microbatches_per_pipeline": 4, "seconds": 10.0}

    def row(n: int, placement: str, step: float, k: float = 1.0) -> dict:
        return {"peers": n, "placement": placement, "measured_step_s": step, "predicted_step_s": step,
                "time_dilation": k}

    first = dict(base, rows=[row(16, "random", 6.0), row(16, "scheduled", 2.0), row(4, "scheduled", 1.0)])
    second = dict(base, rows=[row(16, "scheduled", 1.5, 8.0), row(32, "scheduled", 1.0, 8.0)])
    out = scaling.merge([first, second])
    assert [(r["peers"], r["placement"]) for r in out["rows"]] == [(4, "scheduled"), (16, "scheduled"),
                                                                   (16, "random"), (32, "scheduled")]
    assert out["headline_16"]["scheduled_over_random"] == pytest.approx(4.0)  # the later 16-peer row won
    assert out["dilation"] == {"4": 1.0, "16": 8.0, "32": 8.0} and out["seconds"] == 20.0
    with pytest.raises(ValueError, match="tflops_scale"):
        scaling.merge([first, dict(second, tflops_scale=1e-4)])
    (tmp_path / "a.json").write_text(json.dumps(first))
    assert scaling.main(["--merge", str(tmp_path / "a.json"), "--json"]) == 0


def test_the_figure_says_how_each_size_was_dilated() -> None:
    assert scaling._dilation_text({"4": 1.0, "32": 1.0}) == ""
    assert scaling._dilation_text({"4": 8.0, "32": 8.0}) == "; time-dilated x8"
    assert scaling._dilation_text({"4": 1.0, "16": 4.0, "32": 8.0}) == "; time-dilated x4 at 16, x8 at 32"
