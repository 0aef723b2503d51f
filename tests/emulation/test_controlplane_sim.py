"""The control-plane simulator: deterministic for a seed, and a small swarm forms a plan and re-plans after churn
(``python -m bench.controlplane --peers 50``)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import time

import numpy as np
import pytest

from bench.controlplane import main
from tasklet.peer.emulation.cpsim.churn import ChurnModel
from tasklet.peer.emulation.cpsim.memdht import LatencyModel, MemoryDHT
from tasklet.peer.timing import now

# sessions of minutes (scale 300 s) so that 50 peers see departures within a short window
ARGS = ["--peers", "50", "--window", "60", "--session-scale", "300", "--evaluations", "20", "--json"]
VARYING = ("wall_s", "scheduler_s_median", "scheduler_s_max")  # real CPU time: the only machine-dependent figures


@pytest.fixture(scope="module")
def two_runs() -> tuple[dict, dict]:
    return _run(), _run()


def _run() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(ARGS) == 0
    return json.loads(out.getvalue())


def test_the_simulation_is_deterministic_for_a_seed(two_runs: tuple[dict, dict]) -> None:
    a, b = two_runs
    assert {k: v for k, v in a.items() if k not in VARYING} == {k: v for k, v in b.items() if k not in VARYING}


def test_a_small_swarm_forms_a_plan_and_replans_after_churn(two_runs: tuple[dict, dict]) -> None:
    out, _ = two_runs
    for key in ("first_plan_s", "replan_s_median", "leader_msgs_per_s", "plan_cost_ratio_sampled_vs_full"):
        assert key in out
    assert math.isfinite(out["first_plan_s"]) and 0 < out["first_plan_s"] < 60
    assert out["peers_at_first_plan"] >= 45 * 0.9 and out["pipelines_at_first_plan"] >= 10  # 4 stages
    assert out["deaths"] + out["leaves"] >= 1 and out["joins"] >= 1
    assert out["replans"] >= 1 and out["departures_replanned"] >= out["replans"] and out["replan_s_median"] > 0
    assert out["plans"] >= 2  # the first plan and at least one re-plan ran the scheduler
    # the leader reads every advert each tick; a worker following it reads one beat a heartbeat
    assert out["leader_msgs_per_s"] > 2 * out["worker_msgs_per_s_median"] > 0
    assert 0.5 < out["plan_cost_ratio_sampled_vs_full"] < 2.0
    assert len(out["plan_cost_ratio_seeds"]) == 3 and out["full_matrix_plan_spread"] >= 1.0


def test_the_memory_dht_keeps_the_latest_expiry_and_delays_stores_by_their_latency() -> None:
    clock = [100.0]
    dht = MemoryDHT(lambda: clock[0], LatencyModel(np.array([[0.01]]), access_bps=1e9, seed=0))
    a, b = dht.handle("a", 0), dht.handle("b", 0)
    assert a.store("k", {"v": 1}, 200.0, subkey=b"x", return_future=True).result() is True
    assert b.get("k") is None  # not arrived yet: a store takes its latency to reach the DHT
    clock[0] += 1.0
    found = b.get("k", return_future=True).result()
    assert found.value[b"x"].value == {"v": 1} and found.value[b"x"].expiration_time == 200.0
    assert a.store("k", {"v": 2}, 150.0, subkey=b"x") is False  # an earlier expiry is refused
    clock[0] += 1.0
    assert b.get("k").value[b"x"].value == {"v": 1}
    clock[0] = 201.0
    assert b.get("k") is None  # expired
    assert dht.calls_of("a") == 2 and dht.calls_of("b") == 4 and dht.take_elapsed("b") > 0



def test_gets_issued_together_count_each_and_take_the_slowest_s_time() -> None:
    clock = [100.0]
    dht = MemoryDHT(lambda: clock[0], LatencyModel(np.array([[0.01]]), access_bps=1e6, seed=0))
    dht.handle("writer", 0).store("k/1", {"v": "x" * 100_000}, 200.0, subkey=b"x")
    clock[0] += 10.0  # the store has arrived
    dht.charge_get("one", "k/1")
    large = dht.take_elapsed("one")  # 100 kB at 1 Mbit/s
    dht.charge_gets("sharded", [f"k/{s}" for s in range(16)])  # a read of 16 shards: one of them large
    assert dht.calls_of("sharded") == 16 and dht.calls_of("one") == 1
    assert dht.take_elapsed("sharded") == pytest.approx(large)  # the large get's time, not sixteen gets in a row
    log = dht.watched.setdefault("reader", [])
    dht.handle("reader", 0).get("k/3")
    dht.handle("other", 0).get("k/4")
    assert log == ["k/3"]  # only a watched caller's gets are logged

def test_churn_sessions_are_weibull_and_residuals_longer_on_average() -> None:
    model, rng = ChurnModel(), np.random.default_rng(0)
    sessions = np.array([model.session_s(rng) for _ in range(20_000)])
    residuals = np.array([model.residual_s(rng) for _ in range(20_000)])
    assert sessions.mean() == pytest.approx(model.mean_session_s, rel=0.1)  # 2 h for Weibull(0.5, 1 h)
    assert np.median(sessions) == pytest.approx(3600 * math.log(2) ** 2, rel=0.1)
    # the stationary residual life of a Weibull(0.5) is E[L^2] / (2 E[L]) = 6 x scale on average
    assert residuals.mean() == pytest.approx(6 * 3600, rel=0.15)


def test_the_virtual_clock_is_restored_after_a_run(two_runs: tuple[dict, dict]) -> None:
    assert abs(now() - time.time()) < 5.0
