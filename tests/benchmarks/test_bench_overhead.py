"""``bench.overhead``: a peer's step against a plain PyTorch loop. The breakdown a peer logs per step is parsed and
summed right (unit), and one quick real run of a lone peer and two replicas finishes and reports it
(integration; no ratio asserted: timings depend on the machine's load)."""

from __future__ import annotations

import json

import pytest

from bench import overhead
from tasklet.peer.runtime.stage.timing import StepBreakdown, StepTimes


@pytest.mark.unit
def test_a_logged_breakdown_reads_back() -> None:
    clock = iter([0.0, 10.0]).__next__
    times = StepTimes(now=clock)
    times.begin(3)
    times.add("compute", 6.0)
    times.add("host", 1.5)
    times.add("optimizer", 1.0)
    times.move("host", "optimizer", 0.5)
    done = times.finish(3)
    assert done is not None and times.last is done and times.finish(3) is None
    assert done.parts["host"] == 1.0 and done.parts["optimizer"] == 1.5
    assert done.compute_share == pytest.approx(0.75) and done.idle_s == pytest.approx(1.5)
    [row] = overhead.peer_times("2026 INFO peer.runtime.stage.sync: " + done.line())
    assert row["step"] == 3 and row["wall"] == 10.0 and row["compute"] == 6.0 and row["compute_share"] == 0.75
    assert StepBreakdown(0, 0.0).compute_share == 0.0


@pytest.mark.unit
def test_summary_leaves_the_warm_up_out() -> None:
    log = "\n".join(f"2026-12-07 10:57:{sec:02d},{ms:03d} INFO tasklet.peer.node.leader_role: step {k}: loss 6.0, "
                    f"{own} s, 100 tokens/s" for k, (sec, ms, own) in
                    enumerate([(40, 0, 9.0), (41, 0, 0.5), (42, 500, 0.7), (45, 500, 2.0), (47, 0, 1.0)]))
    steps = overhead.leader_steps(log)
    assert [r.get("cycle_s") for r in steps] == [None, 1.0, 1.5, 3.0, 1.5], "from one step's line to the next"
    case = {"steps": steps,
            "peers": [[{"step": 0, "compute": 9.0}, {"step": 1, "compute": 1.0}, {"step": 2, "compute": 3.0}]]}
    got = overhead.summarise(case, 1)
    assert got["step_s"] == 1.5, "the median time between step lines after the warm-up, not the leader's figure"
    assert got["leader_step_s"] == 0.85 and got["peers"] == [{"compute": 2.0}]
    row = {"cases": {"plain": {"step_s": 2.0}, "lone": {"step_s": 2.2}, "pipeline": {"step_s": 2.2}}}
    assert overhead.ratios(row) == {"lone_over_plain": 1.1, "pipeline_over_lone": 1.0}


@pytest.mark.integration
@pytest.mark.light_processes  # a quick bench, no bed, no ratio asserted: lane 1 (tests/conftest.py)
def test_a_quick_run_reports_each_case(tmp_path, capsys, processes) -> None:
    assert overhead.main(["--quick", "--json", "--tokens", "64", "--steps", "3", "--cases", "plain,lone,replicas",
                          "--out", str(tmp_path)]) == 0
    [row] = json.loads(capsys.readouterr().out)["results"]
    assert set(row["cases"]) == {"plain", "lone", "replicas"}
    assert row["cases"]["lone"]["finished"] and row["cases"]["replicas"]["finished"]
    assert len(row["cases"]["replicas"]["peers"]) == 2
    for case in ("lone", "replicas"):
        for peer in row["cases"][case]["peers"]:
            assert peer["wall"] > 0 and 0.0 <= peer["compute_share"] <= 1.0
    assert {"lone_over_plain", "replicas_over_lone_plus_wire"} <= set(row["ratios"])


@pytest.mark.unit
def test_an_adverts_compute_share_is_a_claim_checked_before_it_is_shown() -> None:
    from tasklet.peer.swarm.adverts import compute_share

    assert compute_share({"compute_share": 0.5}) == 0.5 and compute_share({}) is None
    for bad in (1.5, -0.1, float("nan"), True, "0.5", None):
        assert compute_share({"compute_share": bad}) is None


@pytest.mark.unit
def test_rounds_pair_each_ratio_in_time_and_take_the_median(monkeypatch, tmp_path) -> None:
    """With --rounds, a ratio is the median of each round's own ratio, the round's peers against the mean of the
    plain loops timed just before and just after them (one more plain loop closes the last round): a machine whose
    speed drifts linearly gives every round the true ratio. A case's figures are those of its median round."""
    drift = iter(1.0 + 0.1 * k for k in range(7))  # the machine slows by 10 % of its first speed per case
    truth = {"plain": 1.0, "lone": 1.2}

    def fake(row, case, *_args):
        row["params"] = 10
        return {"step_s": truth[case] * next(drift), "case": case}

    monkeypatch.setattr(overhead, "_run_case", fake)
    [row] = overhead.run([overhead.byte_gpt(2, 64, 4, 32)], [64], ["plain", "lone"], 3, 1, "cpu", "fp32", tmp_path,
                         60.0, rounds=3)
    assert [r["lone_over_plain"] for r in row["ratios_by_round"]] == [1.2, 1.2, 1.2]  # unpaired: 1.32, 1.3, 1.29
    assert row["ratios"]["lone_over_plain"] == 1.2
    assert row["plain_closing_step_s"] == pytest.approx(1.6)
    assert row["cases"]["plain"]["step_s"] == pytest.approx(1.2)
    assert row["cases"]["plain"]["rounds_step_s"] == pytest.approx([1.0, 1.2, 1.4])
    assert row["cases"]["lone"]["step_s"] == pytest.approx(1.2 * 1.3)


def test_a_single_round_is_not_bracketed(monkeypatch, tmp_path) -> None:
    """One round runs each case once: no closing plain loop, the ratio is the two figures'."""
    times = iter([1.0, 1.25])
    seen = []

    def fake(row, case, *_args):
        row["params"] = 10
        seen.append(case)
        return {"step_s": next(times), "case": case}

    monkeypatch.setattr(overhead, "_run_case", fake)
    [row] = overhead.run([overhead.byte_gpt(2, 64, 4, 32)], [64], ["plain", "lone"], 3, 1, "cpu", "fp32", tmp_path,
                         60.0, rounds=1)
    assert seen == ["plain", "lone"] and "plain_closing_step_s" not in row
    assert row["ratios"]["lone_over_plain"] == 1.25
