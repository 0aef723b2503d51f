"""Stopping at the gap, the bound below every returned plan, robustness to device numbering, warm re-plans.

Searches here are bounded by evaluations or generations (or stop at the gap), never by time, so the results do
not depend on the machine's load; the seconds they take are in ``python -m tasklet.scheduler bench``, not asserted.
"""

from __future__ import annotations

import numpy as np
import pytest

from tasklet.scheduler import Cluster, MemeticConfig, Plan, Workload, api, plan, replan
from tasklet.scheduler.api import default_time_limit, evaluation_budget, stopping
from tasklet.scheduler.bench import synthetic
from tasklet.scheduler.canonical import canonical_order
from tasklet.scheduler.cluster import PACKAGED_SCENARIOS
from tasklet.scheduler.cost_dtfm import DtfmPairs, evaluate
from tasklet.scheduler.errors import PlanningError

PAPER = ("datacenter_on_demand", "datacenter_spot", "multi_universities", "regional_geo_distributed",
         "worldwide_geo_distributed")
SMALL = MemeticConfig(generations=4, population=3, gap=0.02)


def paper(name: str) -> Cluster:
    return Cluster.from_scenario(PACKAGED_SCENARIOS, name)


def test_search_stops_at_the_gap_and_says_so() -> None:
    c = paper("datacenter_spot")
    p = plan(c, Workload.preset("gpt3-xl-dtfm"), cost_model="dtfm")
    assert p.search["stopped_by"] == "gap" and p.search["gap"] <= 0.02 and p.search["gap_target"] == 0.02
    assert p.search["lower_bound"] <= p.predicted["total_s"]
    # without a gap target the same search runs on to another rule
    q = plan(c, Workload.preset("gpt3-xl-dtfm"), cost_model="dtfm", config=MemeticConfig(generations=3),
             gap=0.0)
    assert q.search["stopped_by"] in ("gap", "generations", "stalled", "converged")
    assert q.search["evaluations"] >= p.search["evaluations"]


def test_stopping_defaults() -> None:
    assert stopping(64, None, None, None) == (0.02, pytest.approx(5.0))
    assert default_time_limit(256) == pytest.approx(10.0) and default_time_limit(16) < 5.0
    assert stopping(64, SMALL, None, None) == (0.02, None)  # a caller's config is its own budget
    assert stopping(64, MemeticConfig(), None, 3.0) == (0.0, 3.0)
    with pytest.raises(PlanningError):
        stopping(64, None, 1.5, None)


@pytest.mark.parametrize("cost_model", ["dtfm", "full"])
def test_bound_below_every_plan_on_the_bundled_scenarios(cost_model: str) -> None:
    cfg = SMALL if cost_model == "dtfm" else MemeticConfig(generations=1, population=2, max_evaluations=300)
    for name in PAPER:
        p = plan(paper(name), Workload.preset("gpt3-xl-dtfm"), cost_model=cost_model, config=cfg)
        assert 0 < p.search["lower_bound"] <= p.predicted["total_s"] * (1 + 1e-6), name


def test_same_cost_under_any_device_numbering() -> None:
    w = Workload.preset("gpt3-xl-dtfm")
    for c in [paper(n) for n in PAPER] + [synthetic("hetero64_1")]:
        costs = []
        for k in range(3):
            perm = np.random.default_rng(k).permutation(c.n) if k else np.arange(c.n)
            costs.append(plan(c.subset(perm), w, cost_model="dtfm", config=SMALL, canonical=True).predicted["total_s"])
        assert max(costs) <= min(costs) * 1.005, (c.name, costs)


def test_evaluation_budget_scales_with_the_time_limit_and_the_measured_rates() -> None:
    assert evaluation_budget(64, "dtfm", 5.0) == int(api.BUDGET_SHARE * 5.0 * 127e3)
    assert evaluation_budget(64, "dtfm", 10.0) == 2 * evaluation_budget(64, "dtfm", 5.0)
    assert evaluation_budget(128, "dtfm", 5.0) == int(api.BUDGET_SHARE * 5.0 * (127e3 + 176e3) / 2)  # log-linear
    assert evaluation_budget(4096, "full", 1.0) == evaluation_budget(1024, "full", 1.0)  # flat beyond the table
    assert evaluation_budget(64, "full", 1e-3) == 1000  # a floor: a tiny limit is the time limit's to end


def test_a_default_search_ends_on_its_evaluation_budget_with_one_plan_for_every_numbering(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget, not the clock, ends a default search that the gap does not: renumbered devices (searched in
    the canonical order) give the same plan. Rates are lowered so that the budget is small and a minute-long
    limit cannot be what ends it."""
    monkeypatch.setitem(api.EVALUATION_RATE, "dtfm", ((64, 50.0),))
    c, w = synthetic("hetero64_1"), Workload.preset("gpt3-xl-dtfm")
    budget = evaluation_budget(c.n, "dtfm", 60.0)
    assert budget == int(api.BUDGET_SHARE * 60.0 * 50.0)
    plans = []
    for k in range(3):
        perm = np.random.default_rng(k).permutation(c.n) if k else np.arange(c.n)
        p = plan(c.subset(perm), w, cost_model="dtfm", time_limit_s=60.0)
        assert p.search["stopped_by"] == "evaluations" and budget <= p.search["evaluations"] < budget + 200
        plans.append((p.predicted["total_s"], sorted(sorted(perm[d] for d in row) for row in p.pipelines)))
    assert plans[1] == plans[0] and plans[2] == plans[0]


def test_canonical_order_ignores_the_numbering() -> None:
    c = synthetic("hetero64_2")
    perm = np.random.default_rng(3).permutation(c.n)
    a = canonical_order(c)
    b = perm[canonical_order(c.subset(perm))]  # back to the original ids
    assert a.tolist() == b.tolist()  # no two devices of this scenario are alike: the order is unique


def test_warm_replan_after_one_departure_starts_from_the_running_plan() -> None:
    cluster = synthetic("hetero64_0")
    w = Workload.preset("gpt3-xl-dtfm").with_split(8, 7)
    first = plan(cluster, w, cost_model="dtfm", config=SMALL)
    gone = first.pipelines[3][4]
    live = [d for d in range(cluster.n) if d != gone]
    index = {d: i for i, d in enumerate(live)}
    current = Plan(first.stages, [[index.get(d, -1) for d in row] for row in first.pipelines])
    sub = cluster.subset(live)
    new = replan(sub, w, current, cost_model="dtfm", time_limit_s=60.0)  # the limit is never reached
    assert new.search["warm"] and new.search["stopped_by"] in ("gap", "stalled", "generations", "converged")
    assert 1 <= new.predicted["moves"]["moved_tasklets"] <= 4
    assert new.search["lower_bound"] <= new.predicted["total_s"]
    pairs = DtfmPairs.build(sub, w, 8, 7)
    assert new.predicted["total_s"] == pytest.approx(evaluate(pairs, new.matrix())[0])


def test_stopping_bench_smoke() -> None:
    from tasklet.scheduler.bench import format_stop_table, replan_run, stop_run

    c = paper("datacenter_spot")
    w = Workload.preset("gpt3-xl-dtfm")
    rows = [stop_run(c, w, "dtfm", seed) for seed in (None, 1001)]
    for r in rows:
        assert r["stopped_by"] == "gap" and r["lower_bound"] <= r["cost"] and r["gap"] <= 0.02
        assert r["cost_at_2s"] is None or r["cost_at_2s"] >= r["cost"]
    rp = replan_run(c, w.with_split(8, 7), "dtfm", cold=True)
    assert rp["moved_tasklets"] >= 1 and rp["lower_bound_after"] <= rp["cost_after"]
    assert rp["objective_s"] <= rp["cold_objective_s"] * 1.05  # warm: far fewer evaluations, same objective
    table = format_stop_table({"runs": rows, "permutations": [], "replan": [rp]})
    assert "datacenter_spot" in table and "gap" in table
