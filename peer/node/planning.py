"""From what the swarm knows (adverts, link reports) to a plan: the leader's side of the scheduler.

* :func:`build_cluster` turns live adverts and link reports into the scheduler's ``Cluster``. A pair nobody
  measured gets an estimate — the median of the measured links of its source, else of all measured links,
  else a conservative default — and is counted as estimated, so the plan's quality can be judged.
* :class:`EmulatedNetwork` is what a local swarm pretends the network is: peer ``i`` emulates device
  ``devices[i]`` of a scenario. Workers shape their traffic with it; the leader still *measures* links through
  that shaping rather than reading the scenario, exactly as it would on the internet.
* :func:`make_planner` keeps the stage split fixed after the first plan (see ``peer.runtime.driver``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from peer.compute.hf import HFModelSpec
from peer.config import EmulationSection
from peer.runtime.driver import Pipelines, Planner, Stages
from peer.runtime.spec import RunSpec
from peer.swarm.adverts import Advert, LinkReport
from scheduler import Cluster, Plan, PlanningError, Workload, plan, replan
from scheduler.cluster import default_scenarios_path, load_scenario
from scheduler.model_workload import from_hf_config

log = logging.getLogger(__name__)

DEFAULT_BANDWIDTH_BPS = 100e6
DEFAULT_DELAY_S = 0.02


def workload_for(spec: RunSpec, stages: int | None = None, replicas: int | None = None) -> Workload:
    """The scheduler's description of the run's model and batch (4-byte params, activations in fp32/bf16);
    a Hugging Face model's figures come from its config (``scheduler.model_workload``)."""
    m = spec.model
    if isinstance(m, HFModelSpec):
        return from_hf_config(m.config, m.seq_len, spec.micro_batch, spec.n_microbatches, spec.precision,
                              stages, replicas, name=m.source)
    act_bytes = 4 if spec.precision == "fp32" else 2
    return Workload.gpt(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, seq_len=m.seq_len,
                        vocab=m.vocab_size, micro_batch=spec.micro_batch, n_microbatches=spec.n_microbatches,
                        stages=stages, replicas=replicas, param_bytes=4, act_bytes=act_bytes)


def check_model_fits(spec: RunSpec, memory_bytes: list[float]) -> None:
    """Refuse, before anything trains, a model whose smallest possible first or last stage (one layer, with the
    embeddings or the head, one micro-batch in flight) fits none of the devices."""
    if not memory_bytes:
        return
    w, largest = workload_for(spec), max(memory_bytes)
    n = w.n_layers
    for what, (a, b) in (("layer 0 with the embeddings", (0, 1)), (f"layer {n - 1} with the head", (n - 1, n))):
        need = w.stage_memory_bytes(a, b, in_flight=1)
        if need > largest:
            source = getattr(spec.model, "source", "") or "[model]"
            raise PlanningError("memory_gb", f"{source}: the smallest stage ({what}) needs {need / 1e9:.3g} GB at "
                                f"{spec.precision}, the largest device has {largest / 1e9:.3g} GB")


@dataclass
class ClusterView:
    """The leader's picture: a Cluster over ``peers`` (in that order) and how much of it was measured."""

    cluster: Cluster
    peers: list[Advert]
    measured_pairs: int
    estimated_pairs: int


def build_cluster(peers: list[Advert], links: list[LinkReport]) -> ClusterView:
    n = len(peers)
    index = {p.peer_id: i for i, p in enumerate(peers)}
    delay = np.full((n, n), np.nan)
    bw = np.full((n, n), np.nan)
    for rep in links:
        i, j = index.get(rep.src), index.get(rep.dst)
        if i is None or j is None or not rep.measured or rep.bandwidth_bps <= 0:
            continue
        delay[i, j] = rep.rtt_s / 2.0
        bw[i, j] = rep.bandwidth_bps
    off = ~np.eye(n, dtype=bool)
    measured = int((~np.isnan(bw) & off).sum())
    all_bw = bw[~np.isnan(bw) & off]
    all_delay = delay[~np.isnan(delay) & off]
    fallback_bw = float(np.median(all_bw)) if all_bw.size else DEFAULT_BANDWIDTH_BPS
    fallback_delay = float(np.median(all_delay)) if all_delay.size else DEFAULT_DELAY_S
    for i in range(n):
        row_bw = bw[i][~np.isnan(bw[i]) & off[i]]
        row_delay = delay[i][~np.isnan(delay[i]) & off[i]]
        est_bw = float(np.median(row_bw)) if row_bw.size else fallback_bw
        est_delay = float(np.median(row_delay)) if row_delay.size else fallback_delay
        for j in range(n):
            if i != j and np.isnan(bw[i, j]):
                # the reverse direction is the best estimate of an unmeasured one, then the source's median
                bw[i, j] = bw[j, i] if not np.isnan(bw[j, i]) else est_bw
                delay[i, j] = delay[j, i] if not np.isnan(delay[j, i]) else est_delay
    np.fill_diagonal(bw, np.inf)
    np.fill_diagonal(delay, 0.0)
    cluster = Cluster(
        delay_s=delay,
        bandwidth_bps=bw,
        tflops=np.array([max(p.device.tflops, 1e-9) for p in peers], dtype=float),
        memory_bytes=np.array([float(p.device.memory_bytes) for p in peers]),
        regions=[str(p.extra.get("region", "-")) for p in peers],
        labels=[p.peer_id[:8] for p in peers],
        name="swarm",
    )
    return ClusterView(cluster, list(peers), measured, n * (n - 1) - measured)


class EmulatedNetwork:
    """Links and device speeds of a scenario, as emulated by a local swarm (peer i = scenario device d_i)."""

    def __init__(self, section: EmulationSection) -> None:
        if not section.scenario:
            raise ValueError("emulation.scenario is empty")
        self.section = section
        self.cluster = load_scenario(section.scenario)
        self.devices = list(section.devices or range(self.cluster.n))
        bad = [d for d in self.devices if not 0 <= d < self.cluster.n]
        if bad:
            raise ValueError(
                f"emulation.devices: {bad[0]} is not a device of {self.cluster.name} (0..{self.cluster.n - 1})"
            )
        self._declared_tflops = _scenario_declares(section.scenario, "tflops")

    def __len__(self) -> int:
        return len(self.devices)

    def link(self, i: int, j: int) -> tuple[float, float]:
        """(bandwidth bit/s, one-way delay s) from emulated peer i to emulated peer j."""
        a, b = self.devices[i], self.devices[j]
        return float(self.cluster.bandwidth_bps[a, b]) * self.section.bandwidth_scale, float(self.cluster.delay_s[a, b])

    def tflops(self, i: int) -> float:
        if self._declared_tflops:
            return float(self.cluster.tflops[self.devices[i]]) * self.section.tflops_scale
        return self.section.tflops * self.section.tflops_scale

    def region(self, i: int) -> str:
        return self.cluster.regions[self.devices[i]]


def _scenario_declares(spec: str, key: str) -> bool:
    """Whether the scenario itself gives per-device ``key`` (else defaults stand in for it)."""
    path, _, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    p = Path(path or spec)
    if not p.exists():
        p, name = default_scenarios_path(), spec
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    scen = doc if "devices" in doc else doc.get(name) or (next(iter(doc.values())) if len(doc) == 1 else {})
    return isinstance(scen, dict) and key in scen


def make_planner(
    spec: RunSpec,
    view_of: callable,
    stages_hint: int = 0,
    time_limit_s: float = 5.0,  # type: ignore[valid-type]
    seed: int = 0,
) -> Planner:
    """A planner over live daemon device ids; ``view_of(ids)`` gives the ClusterView of those devices.

    The first plan chooses the layer split; later plans keep it (``stages``) and start from the pipelines this
    planner returned last, charging every moved tasklet its state transfer (``scheduler.replan``), so a
    departure moves few tasklets instead of reshuffling the swarm.
    """
    previous: dict[str, Pipelines] = {}  # the last pipelines this planner returned, in daemon device ids

    def planner(live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
        view: ClusterView = view_of(live)
        n = len(live)
        if stages is not None:
            n_st = len(stages)
        elif stages_hint:
            n_st = stages_hint
        else:
            n_st = 0
        if n_st and n // n_st < 1:
            raise PlanningError("peers", f"{n} live peer(s) cannot hold {n_st} stages")
        workload: Workload = workload_for(spec, n_st or None, (n // n_st) if n_st else None)
        p = None
        if stages is not None and previous.get("pipelines"):
            index = {dev: i for i, dev in enumerate(live)}
            current = Plan(stages=[(int(a), int(b)) for a, b in stages],
                           pipelines=[[index.get(d, -1) for d in row] for row in previous["pipelines"]])
            try:
                p = replan(view.cluster, workload, current, cost_model="full", seed=seed,
                           time_limit_s=time_limit_s, replicas=n // len(stages))
                moves = p.predicted.get("moves", {})
                log.info("re-plan from the current plan: %s tasklet(s) move, predicted state transfer %.2f s",
                         moves.get("moved_tasklets"), float(moves.get("transfer_s", 0.0)))
            except PlanningError as exc:
                log.info("re-plan from the current plan not possible (%s); planning from scratch", exc)
                p = None
        if p is None:
            p = plan(view.cluster, workload, cost_model="full", seed=seed, time_limit_s=time_limit_s,
                     stages=[(int(a), int(b)) for a, b in stages] if stages is not None else None)
        chosen = stages if stages is not None else [tuple(s) for s in p.stages]
        pipelines = [[live[d] for d in pipe] for pipe in p.pipelines]
        log.info(
            "planned %d stages x %d pipelines over %d peers (%d links measured, %d estimated); predicted "
            "%.3f s per step",
            len(chosen),
            len(pipelines),
            n,
            view.measured_pairs,
            view.estimated_pairs,
            p.predicted.get("total_s", float("nan")),
        )
        previous["pipelines"] = pipelines
        # the run driver bounds leases by this until it has measured figures (peer.timing, "Stragglers")
        planner.last_predicted = dict(p.predicted)  # type: ignore[attr-defined]
        return list(chosen), pipelines  # type: ignore[arg-type]

    return planner
