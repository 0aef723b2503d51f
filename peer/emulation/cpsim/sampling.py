"""Sampled against full link measurement, in simulation: does a plan made from k probes per peer cost (on the
true network) at most a few percent more than a plan made from every pair measured?

The procedure is the one the swarm follows: in round 0 every peer probes ``k + n_random`` peers at random (no
plan exists yet); the leader estimates the other pairs (``scheduler.coords.estimate_links``) and plans. In each
later round every peer probes what the plan it got makes relevant (its pipeline neighbours and replica group,
then its nearest peers by estimated RTT) plus a few at random, and the leader plans again. Both plans are
evaluated on the scenario's true matrix with the same cost model.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from tasklet.scheduler import Cluster, Plan, Workload, plan
from tasklet.scheduler.api import predict
from tasklet.scheduler.coords import LinkEstimate, Sample, estimate_links, nearest_peers, probe_targets
from tasklet.scheduler.memetic import MemeticConfig


@dataclass
class SampledComparison:
    """How a plan from sampled links compares with a plan from the full matrix, both costed on the truth."""

    scenario: str
    cost_model: str
    full_cost_s: float
    sampled_cost_s: float
    measured_fraction: float  # of the N (N - 1) directed pairs
    probes_per_peer: float
    rounds: int

    @property
    def ratio(self) -> float:
        return self.sampled_cost_s / self.full_cost_s


def measure(truth: Cluster, pairs: set[tuple[int, int]]) -> list[Sample]:
    """What probing ``pairs`` of the true network reports (RTT = twice the one-way delay)."""
    return [Sample(i, j, 2.0 * float(truth.delay_s[i, j]), float(truth.bandwidth_bps[i, j])) for i, j in sorted(pairs)]


def estimated_cluster(truth: Cluster, estimate: LinkEstimate) -> Cluster:
    return Cluster(delay_s=estimate.delay_s, bandwidth_bps=estimate.bandwidth_bps, tflops=truth.tflops.copy(),
                   memory_bytes=truth.memory_bytes.copy(), regions=["-"] * truth.n, name=f"{truth.name}~sampled")


def probe_round(n: int, k: int, n_random: int, measured: set[tuple[int, int]], seed: int | str,
                pipelines: Sequence[Sequence[int]] | None = None, estimate: LinkEstimate | None = None
                ) -> set[tuple[int, int]]:
    """The pairs every peer probes in one round (``scheduler.coords.probe_targets``)."""
    peers = list(range(n))
    done: dict[int, set[int]] = {}
    for i, j in measured:
        done.setdefault(i, set()).add(j)
    out = set()
    for i in peers:
        near = nearest_peers(estimate.coordinates, i, k) if estimate is not None else []
        for j in probe_targets(i, peers, k, pipelines=pipelines, nearest=near, exclude=done.get(i, set()),
                               n_random=n_random, seed=seed):
            out.add((i, int(j)))
    return out


def compare_sampled_plan(truth: Cluster, workload: Workload, cost_model: str = "dtfm", k: int = 6,
                         n_random: int = 2, rounds: int = 3, seed: int = 0, max_evaluations: int = 60_000,
                         hosts: Sequence[Hashable] | None = None) -> SampledComparison:
    """Plan from the full matrix and from ``rounds`` rounds of sampled probes; cost both on ``truth``.

    The searches are bounded by evaluations, not time, so the result is the same on a loaded machine.
    """
    cfg = MemeticConfig(max_evaluations=max_evaluations)
    full_plan = plan(truth, workload, cost_model=cost_model, seed=seed, config=cfg)
    full_cost = float(predict(truth, workload, full_plan, cost_model)["total_s"])
    measured: set[tuple[int, int]] = set()
    pipelines: list[list[int]] | None = None
    estimate: LinkEstimate | None = None
    sampled: Plan | None = None
    for r in range(rounds):
        measured |= probe_round(truth.n, k, n_random, measured, f"{seed}:{r}", pipelines, estimate)
        estimate = estimate_links(truth.n, measure(truth, measured), seed=seed, hosts=hosts)
        sampled = plan(estimated_cluster(truth, estimate), workload, cost_model=cost_model, seed=seed, config=cfg)
        pipelines = sampled.pipelines
    assert sampled is not None
    cost = float(predict(truth, workload, sampled, cost_model)["total_s"])
    n = truth.n
    return SampledComparison(truth.name, cost_model, full_cost, cost, len(measured) / (n * (n - 1)),
                             len(measured) / n, rounds)


def hosts_of(truth: Cluster, max_per_host: int = 8) -> list[str] | None:
    """Host labels for a scenario whose regions are machines (data-centre instances: GPUs of one machine share
    its address); None when regions are geographic. A region with more than ``max_per_host`` devices, or
    one of the scenario's ``standalone`` GPUs, is not one machine."""
    counts: dict[str, int] = {}
    for r in truth.regions:
        counts[r] = counts.get(r, 0) + 1
    if not any("instance" in r for r in counts):
        return None
    return [r if "instance" in r and counts[r] <= max_per_host else f"{r}#{i}" for i, r in enumerate(truth.regions)]


@dataclass
class PlanInputs:
    """What a sampled-against-full comparison plans from: the true matrix, the leader's estimate of it (same
    devices, same order), the workload and the run's fixed layer split (None: the search picks one)."""

    truth: Cluster
    estimated: Cluster
    workload: Workload
    stages: list[tuple[int, int]] | None = None


@dataclass
class PlanComparison:
    """Plans from the estimate and from the truth, one pair per seed (the same seeds and budget for both), all
    costed on the truth. ``ratio`` is best against best: at a large swarm one search is noisy (its spread over
    seeds on the truth alone is ``full_spread``), and the best of a few is what a planner with more time gets;
    ``seed_ratios`` are the per-seed pairs."""

    seeds: list[int]
    evaluations: int
    full_costs_s: list[float]
    sampled_costs_s: list[float]

    @property
    def ratio(self) -> float:
        return min(self.sampled_costs_s) / min(self.full_costs_s)

    @property
    def seed_ratios(self) -> list[float]:
        return [s / f for s, f in zip(self.sampled_costs_s, self.full_costs_s, strict=True)]

    @property
    def full_spread(self) -> float:
        return max(self.full_costs_s) / min(self.full_costs_s)


def compare_on_truth(inputs: PlanInputs, seeds: Sequence[int] = (0, 1, 2), evaluations: int = 200,
                     cost_model: str = "full") -> PlanComparison:
    """Plan from ``inputs.estimated`` and from ``inputs.truth`` with each seed and ``evaluations`` of search
    (offline: not the budget the swarm's planner has), and cost every plan on the truth."""
    cfg = MemeticConfig(max_evaluations=evaluations)
    full, sampled = [], []
    for seed in seeds:
        for cluster, out in ((inputs.truth, full), (inputs.estimated, sampled)):
            p = plan(cluster, inputs.workload, cost_model=cost_model, seed=seed, stages=inputs.stages, config=cfg)
            out.append(float(predict(inputs.truth, inputs.workload, p, cost_model)["total_s"]))
    return PlanComparison(list(seeds), evaluations, full, sampled)


def ratios(results: Sequence[SampledComparison]) -> np.ndarray:
    return np.array([r.ratio for r in results])
