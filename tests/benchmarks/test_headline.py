"""Smoke tests of the headline benchmark's machinery (``bench.headline*``), not of its timings.

What is checked: the emulated world is the scenario's, scaled as declared; the three plan families are valid
placements of the same devices with their predictions; the report's arithmetic (median seed, speed-ups, loss
agreement); the figure is written; bad settings give one-line errors; and one real 4-process swarm trains
through the bench's runner and reports phases, worker counters and losses, leaving no process behind.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.headline import cli as headline
from bench.headline.plot import write_png
from bench.headline.report import RunSummary, max_loss_difference, representatives, table, targets
from bench.headline.run import run_plan
from bench.headline.setup import ONE_PER_CITY, HeadlineConfig, HeadlineConfigError, build_cluster, prepare
from tasklet.peer.compute.model import ModelConfig
from tasklet.scheduler import Cluster
from tasklet.scheduler.cluster import default_scenarios_path

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)


def test_world_is_one_device_per_city_with_scaled_bandwidth_and_unscaled_delays() -> None:
    cfg = HeadlineConfig()
    cluster = build_cluster(cfg)
    world = Cluster.from_scenario(default_scenarios_path(), cfg.scenario).subset(list(ONE_PER_CITY))
    assert cluster.n == 8
    assert len(set(cluster.regions)) == 8  # every city once
    off = ~np.eye(8, dtype=bool)
    np.testing.assert_allclose(cluster.bandwidth_bps[off], world.bandwidth_bps[off] * cfg.bandwidth_scale)
    np.testing.assert_allclose(cluster.delay_s, world.delay_s)
    np.testing.assert_allclose(cluster.tflops, world.tflops * cfg.tflops_scale)


def test_candidates_are_valid_placements_of_the_same_devices() -> None:
    cfg = replace(HeadlineConfig(), random_seeds=(0, 1), search_time_limit_s=5.0)
    _, cluster, workload, cands = prepare(cfg)
    assert [c.name for c in cands] == ["scheduled", "random", "random", "rank_order"]
    for c in cands:
        assert sorted(d for p in c.plan.pipelines for d in p) == list(range(8))
        assert len(c.plan.pipelines) == cfg.replicas and len(c.plan.stages) == cfg.stages
        assert c.predicted_step_s > 0 and math.isfinite(c.predicted_step_s)
    assert cands[-1].plan.pipelines == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cands[1].plan.pipelines != cands[2].plan.pipelines  # different seeds, different placements
    # the search optimises the very model that predicts: it must do at least as well as the baselines
    assert cands[0].predicted_step_s <= min(c.predicted_step_s for c in cands[1:]) + 1e-9


def _summary(name: str, label: str, measured: float, predicted: float, losses: list[float]) -> RunSummary:
    return RunSummary(name=name, label=label, pipelines=[[0, 1], [2, 3]], stages=[(0, 2), (2, 4)],
                      measured_step_s=measured, predicted_step_s=predicted,
                      tokens_per_s=2048 / measured, losses=losses, step_s=[measured] * len(losses),
                      ended_at_s=[measured * (i + 1) for i in range(len(losses))], measured_pipeline_s=measured,
                      measured_dp_s=0.1, predicted_pipeline_s=predicted, predicted_dp_s=0.1, overrun_ops=0,
                      compute_ops=10)


def test_report_takes_the_median_random_seed_and_computes_the_targets() -> None:
    runs = [
        _summary("scheduled", "scheduled", 2.0, 2.0, [5.0, 4.0]),
        _summary("random", "random seed 0", 5.0, 4.0, [5.0, 4.0]),
        _summary("random", "random seed 1", 3.0, 3.2, [5.0, 4.0 + 2e-4]),
        _summary("random", "random seed 2", 4.0, 3.6, [5.0, 4.0]),
        _summary("rank_order", "rank order", 3.3, 3.0, [5.0, 4.0]),
    ]
    reps = representatives(runs)
    assert reps["random"].label == "random seed 2"  # median of 5.0, 3.0, 4.0
    assert max_loss_difference(runs) == pytest.approx(2e-4)
    t = targets(reps, runs)
    assert t["speedup"]["measured"] == pytest.approx(4.0 / 2.0)
    assert t["speedup"]["predicted"] == pytest.approx(3.6 / 2.0)
    assert t["speedup"]["met"]
    assert t["measured_over_predicted"]["per_run"]["random seed 0"] == pytest.approx(1.25)
    assert not t["measured_over_predicted"]["met"]  # 1.25 is outside 20 %
    assert t["losses_agree"]["met"]
    text = table(runs, reps)
    assert "random seed 2 (median)" in text and text.count("\n") == len(runs) + 1


def test_loss_disagreement_and_nan_are_caught() -> None:
    a = _summary("scheduled", "a", 1.0, 1.0, [5.0, 4.0])
    b = _summary("random", "b", 1.0, 1.0, [5.0, 4.5])
    c = _summary("random", "c", 1.0, 1.0, [5.0, float("nan")])
    assert max_loss_difference([a, b]) == pytest.approx(0.5)
    assert max_loss_difference([a, c]) == math.inf


def test_figure_is_written(tmp_path: Path) -> None:
    runs = [_summary("scheduled", "scheduled", 2.0, 2.1, [5.0, 4.8, 4.6]),
            _summary("random", "random seed 0", 3.0, 3.2, [5.0, 4.8, 4.6]),
            _summary("random", "random seed 1", 3.5, 3.4, [5.0, 4.8, 4.6]),
            _summary("rank_order", "rank order", 2.8, 2.9, [5.0, 4.8, 4.6])]
    path = write_png(tmp_path / "sub" / "h.png", representatives(runs), runs, 2048, "test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize(("argv", "needle"), [
    (["--steps", "1"], "steps"),
    (["--random-seeds", "0"], "--random-seeds"),
    (["--bandwidth-scale", "-1"], "bandwidth_scale"),
    (["--steps", "many"], "--steps"),
])
def test_bad_settings_are_one_line_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        headline.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(HeadlineConfigError, match="devices"):
        HeadlineConfig(devices=(0, 8, 16)).validate()
    with pytest.raises(HeadlineConfigError, match="devices"):
        build_cluster(replace(HeadlineConfig(), devices=(0, 8, 16, 24, 32, 40, 48, 99)))


def _children() -> set[int]:
    """Live child processes of this test process (from /proc, no extra dependency)."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(entry))
    return out


@pytest.mark.timeout(240)
@pytest.mark.light_processes  # two steps of a tiny model, no bed: lane 1 (tests/conftest.py)
def test_one_real_swarm_trains_through_the_runner_and_leaves_nothing_running() -> None:
    cfg = replace(HeadlineConfig(), devices=(0, 24, 40, 48), stages=2, replicas=2, steps=2, random_seeds=(0,),
                  model=ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=32, seed=0), bandwidth_scale=0.1,
                  search_time_limit_s=2.0)
    spec, cluster, workload, cands = prepare(cfg)
    before = _children()
    run = run_plan(spec, cluster, workload, cands[0].plan, cfg.steps, step_timeout_s=120.0)
    assert _children() <= before
    assert len(run.step_seconds) == len(run.losses) == len(run.ended_at_s) == len(run.phases) == cfg.steps
    assert all(math.isfinite(x) and x > 0 for x in run.losses)
    assert run.ended_at_s == sorted(run.ended_at_s)
    assert all(0 < p.pipeline_s < s and 0 < p.dp_s < s for p, s in zip(run.phases, run.step_seconds, strict=True))
    assert len(run.workers) == 4 and run.overrun_ops >= 0
    # every micro-batch is forwarded and backpropagated once on every stage, every step
    assert run.compute_ops == 2 * cfg.n_microbatches * cfg.stages * cfg.steps


def test_saved_result_redraws_the_same_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [_summary("scheduled", "scheduled", 2.0, 2.1, [5.0, 4.8]),
            _summary("random", "random seed 0", 3.0, 3.2, [5.0, 4.8]),
            _summary("rank_order", "rank order", 2.8, 2.9, [5.0, 4.8])]
    saved = {"runs": [r.as_dict() for r in runs], "tokens_per_step": 2048, "stages": 2, "replicas": 2,
             "scenario": "x", "bandwidth_scale": 0.01, "tflops_scale": 1e-5}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    out = headline.replot(path, tmp_path / "f.png")
    assert out["table"] == table(runs, representatives(runs))
    assert (tmp_path / "f.png").stat().st_size > 10_000
    path.write_text(json.dumps({"runs": [{"label": "x"}]}))
    assert headline.main(["--replot", str(path), "--png", str(tmp_path / "g.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --replot") and "Traceback" not in err
