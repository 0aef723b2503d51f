"""What the headline benchmark measures: the emulated world, the model, and the three plans it compares.

The world is the paper's ``worldwide_geo_distributed`` scenario (Yuan et al., NeurIPS 2022, case 5), cut down
to one device per city, so every one of the 8 cities of the scenario holds one peer and every link between
two peers is an inter-city link with its measured one-way delay (11-238 ms) and bandwidth (0.34-1.16
Gbit/s). Eight peers train a small GPT as 4 pipeline stages x 2 data-parallel replicas.

Why the scales (both stated in every report, because every figure depends on them):

* ``bandwidth_scale`` multiplies every bandwidth. The model is ~5,000 times smaller than the paper's GPT3-XL
  per stage, so at the scenario's Gbit/s a 64 KiB activation would cross any link in under 2 ms and only the
  delays would matter. At 1/100 the links carry 3.4-11.6 Mbit/s and an activation takes 45-150 ms, the same
  order as the delays and as the emulated compute, which is the paper's regime: the slow links, not the
  GPUs, decide the step time.
* ``tflops_scale`` multiplies every device's speed. The scenario's devices are V100s (50 achieved TFLOP/s,
  see ``scheduler.cluster``); at 1e-5 a 1-layer stage forward of one micro-batch (29 MFLOP) is emulated to
  take 59 ms while the real CPU op takes 1-7 ms, so emulated compute stays well above what the shared CPU
  really spends and the workers never overrun it (each worker counts ``overrun_ops``, the bench reports it).
* Delays are the scenario's own, unscaled: they are the point of the world-wide setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.emulation.network import scaled_cluster
from tasklet.peer.node.planning import workload_for
from tasklet.peer.runtime.spec import RunSpec
from tasklet.scheduler import Cluster, Plan, Workload, plan
from tasklet.scheduler.baselines import random_plan, rank_order_plan
from tasklet.scheduler.cluster import default_scenarios_path
from tasklet.scheduler.cost_full import predict

SCENARIO = "worldwide_geo_distributed"
# Device i of the scenario lies in city i // 8 (Oregon, Virginia, Ohio, Tokyo, Seoul, London, Frankfurt,
# Ireland): the first device of each city.
ONE_PER_CITY = (0, 8, 16, 24, 32, 40, 48, 56)
PLAN_NAMES = ("scheduled", "random", "rank_order")


class HeadlineConfigError(ValueError):
    """A benchmark setting is invalid; the message names the setting."""


@dataclass(frozen=True)
class HeadlineConfig:
    """Every choice the figures depend on. Defaults are the published run; ``quick()`` is a short one."""

    scenario: str = SCENARIO
    devices: tuple[int, ...] = ONE_PER_CITY
    stages: int = 4
    replicas: int = 2
    bandwidth_scale: float = 0.01
    tflops_scale: float = 1e-5
    model: ModelConfig = field(default_factory=lambda: ModelConfig(n_layers=4, d_model=64, n_heads=4,
                                                                   seq_len=64, seed=0))
    micro_batch: int = 4
    n_microbatches: int = 8
    seed: int = 0
    steps: int = 6
    warmup_steps: int = 1
    random_seeds: tuple[int, ...] = (0, 1, 2)
    search_seed: int = 0
    search_time_limit_s: float = 60.0

    def validate(self) -> HeadlineConfig:
        if self.stages < 1 or self.replicas < 1:
            raise HeadlineConfigError("stages/replicas: must be >= 1")
        if len(self.devices) != self.stages * self.replicas:
            raise HeadlineConfigError(f"devices: {len(self.devices)} devices for {self.stages} stages x "
                                      f"{self.replicas} replicas (need exactly {self.stages * self.replicas})")
        if len(set(self.devices)) != len(self.devices):
            raise HeadlineConfigError("devices: a device is listed twice")
        if not (self.bandwidth_scale > 0 and self.tflops_scale > 0):
            raise HeadlineConfigError("bandwidth_scale/tflops_scale: must be positive")
        if self.warmup_steps < 0 or self.steps <= self.warmup_steps:
            raise HeadlineConfigError(f"steps: need more than the {self.warmup_steps} warm-up step(s), "
                                      f"got {self.steps}")
        if not self.random_seeds:
            raise HeadlineConfigError("random_seeds: need at least one seed")
        return self

    def quick(self) -> HeadlineConfig:
        """Three steps (one warm-up) and a single random placement: a check that it all runs, in ~1 minute."""
        return replace(self, steps=3, random_seeds=self.random_seeds[:1], search_time_limit_s=10.0)

    def spec(self) -> RunSpec:
        return RunSpec(run_id="bench-headline", model=self.model, seed=self.seed, micro_batch=self.micro_batch,
                       n_microbatches=self.n_microbatches).validate()

    @property
    def tokens_per_step(self) -> int:
        return self.n_microbatches * self.micro_batch * self.model.seq_len


def build_cluster(cfg: HeadlineConfig) -> Cluster:
    """The scenario's devices ``cfg.devices`` (renumbered 0..n-1 in that order), bandwidth and speed scaled."""
    world = Cluster.from_scenario(default_scenarios_path(), cfg.scenario)
    bad = [d for d in cfg.devices if not 0 <= d < world.n]
    if bad:
        raise HeadlineConfigError(f"devices: {bad} not in the scenario's 0..{world.n - 1}")
    return scaled_cluster(world.subset(list(cfg.devices)), cfg.bandwidth_scale, cfg.tflops_scale)


@dataclass
class Candidate:
    """One placement to run: which plan family it belongs to, its plan and the ``full`` model's prediction."""

    name: str
    label: str
    plan: Plan
    predicted: dict[str, Any]

    @property
    def predicted_step_s(self) -> float:
        return float(self.predicted["total_s"])


def build_candidates(cfg: HeadlineConfig, cluster: Cluster, workload: Workload) -> list[Candidate]:
    """The scheduler's plan, one random placement per seed, and rank order, each with its prediction."""
    out = [Candidate("scheduled", "scheduled", plan(cluster, workload, cost_model="full", seed=cfg.search_seed,
                                                    time_limit_s=cfg.search_time_limit_s), {})]
    out += [Candidate("random", f"random seed {s}", random_plan(cluster, workload, s), {})
            for s in cfg.random_seeds]
    out.append(Candidate("rank_order", "rank order", rank_order_plan(cluster, workload), {}))
    for c in out:
        c.plan.validate(cluster.n, workload.n_layers)
        c.predicted = predict(cluster, workload, c.plan)
    return out


def prepare(cfg: HeadlineConfig) -> tuple[RunSpec, Cluster, Workload, list[Candidate]]:
    """Everything a run needs, derived from ``cfg`` alone (planning included)."""
    cfg.validate()
    spec = cfg.spec()
    cluster = build_cluster(cfg)
    workload = workload_for(spec, stages=cfg.stages, replicas=cfg.replicas)
    return spec, cluster, workload, build_candidates(cfg, cluster, workload)


def median_index(values: list[float]) -> int:
    """Index of the median of ``values`` (the lower median for an even count), so a median is a real run."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(values) - 1) // 2]

