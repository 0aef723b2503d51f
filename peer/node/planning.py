"""From what the swarm knows (adverts, link reports) to a plan: the leader's side of the scheduler.

* :func:`build_cluster` turns live adverts and link reports into the scheduler's ``Cluster``. Each peer
  measures only a few links (:func:`probe_targets_for`); every pair nobody measured gets an estimate from
  what was (``scheduler.coords.estimate_links``: RTT from Vivaldi coordinates, bandwidth from the peers'
  capacities, their sites and the measured paths of similar RTT) and is counted as estimated, so the plan's
  quality can be judged. With no measurement at all, conservative defaults stand in.
* :func:`probe_targets_for` is what a peer's prober asks: which peers to measure next (its neighbours in the
  plan it follows, then a few at random), so the measurements a plan depends on are the ones taken.
* :class:`SwarmPlanner` (:func:`make_planner`) keeps the stage split fixed after the first plan (see
  ``peer.runtime.lead.driver``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasklet.peer.compute.family import family_of
from tasklet.peer.compute.workload import workload_for
from tasklet.peer.runtime.lead.driver import Pipelines, Stages
from tasklet.peer.runtime.lead.step import TooFewPeersError
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.swarm.adverts import Advert, LinkReport
from tasklet.scheduler import Cluster, MemeticConfig, Plan, PlanningError, Workload, plan, replan
from tasklet.scheduler.coords import Sample, estimate_links, probe_targets

log = logging.getLogger(__name__)

DEFAULT_BANDWIDTH_BPS = 100e6
DEFAULT_DELAY_S = 0.02
PROBE_K = 6  # relevant peers a peer measures (plan neighbours first)
PROBE_RANDOM = 2  # ... and this many more at random, so the estimates keep seeing the whole swarm


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
            source = family_of(spec.model).describe(spec.model)
            raise PlanningError("memory_gb", f"{source}: the smallest stage ({what}) needs {need / 1e9:.3g} GB at "
                                f"{spec.precision}, the largest device has {largest / 1e9:.3g} GB")


def owner_cap_bps(advert: Advert, key: str) -> float | None:
    """An owner's cap from an advert's ``extra`` (``max_upload_mbps`` / ``max_download_mbps``) in bit/s; None
    when absent or not a positive finite number (a bad value caps nothing: it could only hurt its own peer)."""
    value = advert.extra.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < 1e9):
        return None
    return float(value) * 1e6


def apply_owner_caps(bw: np.ndarray, peers: list[Advert]) -> np.ndarray:
    """Bandwidths no faster than each owner allows: row i at most i's upload cap, column j at most j's download
    cap, so every plan is priced, and chosen, as the capped peers will really carry it."""
    for i, p in enumerate(peers):
        up, down = owner_cap_bps(p, "max_upload_mbps"), owner_cap_bps(p, "max_download_mbps")
        if up is not None:
            bw[i, :] = np.minimum(bw[i, :], up)
        if down is not None:
            bw[:, i] = np.minimum(bw[:, i], down)
    return bw


@dataclass
class ClusterView:
    """The leader's picture: a Cluster over ``peers`` (in that order) and how much of it was measured."""

    cluster: Cluster
    peers: list[Advert]
    measured_pairs: int
    estimated_pairs: int


def build_cluster(peers: list[Advert], links: list[LinkReport], seed: int | str = 0) -> ClusterView:
    """The Cluster of ``peers`` (in that order): measured links as reported, every other pair estimated."""
    n = len(peers)
    index = {p.peer_id: i for i, p in enumerate(peers)}
    samples = []
    for rep in links:
        i, j = index.get(rep.src), index.get(rep.dst)
        if i is None or j is None or i == j or not rep.measured or rep.bandwidth_bps <= 0:
            continue
        samples.append(Sample(i, j, rep.rtt_s, rep.bandwidth_bps))
    if samples:
        est = estimate_links(n, samples, seed=seed)
        delay, bw = est.delay_s, est.bandwidth_bps
        measured = int(est.measured.sum())
    else:
        delay = np.full((n, n), DEFAULT_DELAY_S)
        bw = np.full((n, n), DEFAULT_BANDWIDTH_BPS)
        measured = 0
    bw = apply_owner_caps(np.array(bw, dtype=float), peers)
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


def probe_targets_for(me: str, live: list[str], plan_record: dict | None, probed: set[str] | frozenset[str],
                      k: int = PROBE_K, n_random: int = PROBE_RANDOM, seed: int | str = 0) -> list[str]:
    """Peer ids ``me`` should measure next, most relevant first (``scheduler.coords.probe_targets``).

    ``live``: peer ids this peer knows to be alive; ``plan_record``: the plan it follows (its ``pipelines`` of
    peer ids), or None before any; ``probed``: peers already measured (never chosen again). Deterministic for
    a seed, so a peer that restarts its prober asks the same peers.
    """
    pipelines = None
    if isinstance(plan_record, dict):
        rows = plan_record.get("pipelines")
        if isinstance(rows, list) and all(isinstance(row, list) for row in rows):
            pipelines = [[str(p) for p in row] for row in rows]
    chosen = probe_targets(me, sorted(set(live)), k, pipelines=pipelines, exclude=set(probed), n_random=n_random,
                           seed=seed)
    return [str(p) for p in chosen]


class SwarmPlanner:
    """A planner over live daemon device ids; ``view_of(ids)`` gives the ClusterView of those devices.

    The first plan chooses the layer split; later plans keep it (``stages``) and start from the pipelines this
    planner returned last, charging every moved tasklet its state transfer (``scheduler.replan``), so a
    departure moves few tasklets instead of reshuffling the swarm. ``config`` bounds the search by evaluations
    instead of time (the control-plane simulator does, to be deterministic). ``time_limit_s`` bounds a plan
    from scratch; a re-plan gets ``replan_time_limit_s`` (default: the scheduler's warm limit, at most 0.5 s,
    because the swarm waits for it). ``last_predicted``: the scheduler's figures of the plan returned last,
    which the run driver bounds leases by until it has measured figures (peer.timing, "Stragglers").
    """

    def __init__(self, spec: RunSpec, view_of: Callable[[list[int]], ClusterView], stages_hint: int = 0,
                 time_limit_s: float | None = 5.0, seed: int = 0, replan_time_limit_s: float | None = None,
                 config: MemeticConfig | None = None) -> None:
        self.spec = spec
        self.view_of = view_of
        self.stages_hint = stages_hint
        self.time_limit_s = time_limit_s
        self.seed = seed
        self.replan_time_limit_s = replan_time_limit_s
        self.config = config
        self.previous: Pipelines | None = None  # the last pipelines returned, in daemon device ids
        self.last_predicted: dict[str, Any] = {}

    def __call__(self, live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
        view = self.view_of(live)
        n = len(live)
        n_st = len(stages) if stages is not None else self.stages_hint
        if n_st and n // n_st < 1:
            raise TooFewPeersError(f"{n} live peer(s) cannot hold {n_st} stages")
        workload: Workload = workload_for(self.spec, n_st or None, (n // n_st) if n_st else None)
        p = self._replan(view, workload, live, stages) if stages is not None and self.previous else None
        if p is None:
            p = plan(view.cluster, workload, cost_model="full", seed=self.seed, time_limit_s=self.time_limit_s,
                     config=self.config, stages=[(int(a), int(b)) for a, b in stages] if stages is not None else None)
        chosen = stages if stages is not None else [tuple(st) for st in p.stages]
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
        self.previous = pipelines
        self.last_predicted = dict(p.predicted)
        return list(chosen), pipelines

    def _replan(self, view: ClusterView, workload: Workload, live: list[int], stages: Stages) -> Plan | None:
        """A plan from the pipelines returned last (dead devices' places empty), or None when none is possible."""
        index = {dev: i for i, dev in enumerate(live)}
        current = Plan(stages=[(int(a), int(b)) for a, b in stages],
                       pipelines=[[index.get(d, -1) for d in row] for row in self.previous or []])
        try:
            p = replan(view.cluster, workload, current, cost_model="full", seed=self.seed,
                       time_limit_s=self.replan_time_limit_s, config=self.config, replicas=len(live) // len(stages))
        except PlanningError as exc:
            log.info("re-plan from the current plan not possible (%s); planning from scratch", exc)
            return None
        moves = p.predicted.get("moves", {})
        log.info("re-plan from the current plan: %s tasklet(s) move, predicted state transfer %.2f s",
                 moves.get("moved_tasklets"), float(moves.get("transfer_s", 0.0)))
        return p


def make_planner(
    spec: RunSpec,
    view_of: Callable[[list[int]], ClusterView],
    stages_hint: int = 0,
    time_limit_s: float | None = 5.0,
    seed: int = 0,
    replan_time_limit_s: float | None = None,
    config: MemeticConfig | None = None,
) -> SwarmPlanner:
    """The :class:`SwarmPlanner` of ``spec`` (a ``Planner`` of the run driver)."""
    return SwarmPlanner(spec, view_of, stages_hint, time_limit_s, seed, replan_time_limit_s, config)
