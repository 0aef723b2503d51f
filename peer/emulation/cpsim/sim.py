"""A thousand peers' control plane in virtual time: the real membership, election, plan board, progress board,
read policy and planner, against an in-memory DHT, with churn.

What runs for real (unchanged production code): ``peer.swarm.membership.Membership`` (adverts, tombstones,
link reports, ``found`` testimony), ``peer.swarm.view.SwarmView`` (who reads what, and when; the election
and its confirmation), ``peer.swarm.plans.PlanBoard`` (epochs, fencing, quorum), ``peer.swarm.progress``
(the leader's beat), ``peer.node.planning`` (the cluster from sampled link reports, the planner with its
re-plans from the current plan) and the scheduler. What is modelled:

* the DHT (``memdht``): one in-memory store with a latency per call; records are not RSA-signed;
* time: every peer's control loop ticks on one grid (``heartbeat / TICKS_PER_HEARTBEAT``), all reading the
  DHT as it was at that instant; ``peer.timing.now`` reads the simulator's clock (``set_clock``);
* the leader's run driver: it waits for ``min_peers``, then up to ``LINK_REPORT_WAIT_HEARTBEATS`` heartbeats
  for the link reports, plans, and publishes the plan ``plan_charge_s`` later (the daemon's default
  ``plan_time_limit_s``: at a thousand peers the search runs to its limit). It re-plans when a member of its
  plan left (seen in the adverts: a tombstone or an expired advert) or died (its coordinator's pings miss:
  ``PING_MISSES`` heartbeats plus a ping deadline), and at a step boundary (every ``step_s``) when newcomers
  allow one more pipeline. The training itself is not simulated (it is data plane);
* probes (data plane): a peer measures the true link to the peers ``peer.node.planning.probe_targets_for``
  names, once when it joins and once per new plan it is part of;
* churn and the network: ``churn`` (a Weibull availability model of volunteer machines, with its sources).

Deterministic for a seed: the searches are bounded by evaluations (``plan_evaluations``), not time, and every
random draw comes from the seed. Only ``scheduler_s`` (real CPU seconds of each plan) varies between runs.

To keep a thousand peers within minutes on two cores, peers that read every advert (or every plan) at the same
instant share one parse of them, and one election over it (``SharedReads``: both are pure functions of the
DHT's content and the time; while a run lasts, ``peer.swarm.view`` calls the election through that cache).
"""

from __future__ import annotations

import heapq
import logging
import math
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.emulation.cpsim.churn import ChurnModel, Network
from tasklet.peer.emulation.cpsim.memdht import DHTHandle, LatencyModel, MemoryDHT
from tasklet.peer.emulation.cpsim.sampling import PlanComparison, PlanInputs, compare_on_truth
from tasklet.peer.identity.keys import owner_tag, peer_id_from_public_key
from tasklet.peer.node.planning import (
    PROBE_K,
    PROBE_RANDOM,
    build_cluster,
    make_planner,
    probe_targets_for,
    workload_for,
)
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.swarm.adverts import Advert, LinkReport
from tasklet.peer.swarm.charter import LeaderPolicy
from tasklet.peer.swarm.election import elect, elect_leader
from tasklet.peer.swarm.membership import Membership, PeerEntry
from tasklet.peer.swarm.plans import PlanBoard, has_quorum
from tasklet.peer.swarm.progress import ProgressBoard
from tasklet.peer.swarm.view import SwarmView
from tasklet.peer.timing import (
    HEARTBEAT_S,
    LINK_REPORT_WAIT_HEARTBEATS,
    PING_MISSES,
    PING_TIMEOUT_S,
    TICKS_PER_HEARTBEAT,
    set_clock,
)
from tasklet.scheduler import Cluster, MemeticConfig, PlanningError

log = logging.getLogger(__name__)

EPOCH_S = 1.7e9  # virtual DHT time starts here (records carry absolute times)
RUN_ID = "cpsim"
READER = "reader"  # the DHT caller of the shared parse's real reads of every advert (charged to nobody else)


@dataclass
class SimConfig:
    peers: int = 1000
    seed: int = 0
    heartbeat_s: float = HEARTBEAT_S
    join_spread_s: float = 10.0  # the initial peers start within this window
    min_peers_fraction: float = 0.9  # the leader's [swarm] min_peers, as a fraction of the initial peers
    churn_window_s: float = 60.0  # simulated after the first plan
    stages: int = 8
    plan_evaluations: int = 50  # search budget of each plan (deterministic); the virtual time charged is:
    plan_charge_s: float = 5.0  # ... the daemon's default plan_time_limit_s
    step_s: float = 5.0  # a training step: joins are planned in at step boundaries
    probe_rounds: int = 3  # a peer probes at join and for each of its first plans, up to this many rounds
    compare_full_matrix: bool = True  # also plan from the true matrix, to rate the sampled plan (offline)
    compare_seeds: tuple[int, ...] = (0, 1, 2)  # ... with these seeds for both plans
    compare_evaluations: int = 1000  # ... and this search budget for each (a swap descent checks it every 256)
    churn: ChurnModel = field(default_factory=ChurnModel)


@dataclass
class SimResult:
    first_plan_s: float
    replan_s: list[float]
    replans: int
    leader_msgs_per_s: float
    leader_rpcs_per_s: float
    worker_msgs_per_s_median: float
    comparison: PlanComparison | None  # sampled against full matrix (``compare_full_matrix``)
    scheduler_s: list[float]
    peers_at_first_plan: int
    pipelines_at_first_plan: int
    joins: int
    leaves: int
    deaths: int
    leader_changes: int
    virtual_s: float
    events: list[str]

    def summary(self) -> dict[str, Any]:
        """The figures that are the same on every run with the same seed (not ``scheduler_s``)."""
        c = self.comparison
        return {
            "first_plan_s": round(self.first_plan_s, 3),
            "replan_s_median": round(statistics.median(self.replan_s), 3) if self.replan_s else None,
            "replans": self.replans,
            "departures_replanned": len(self.replan_s),
            "leader_msgs_per_s": round(self.leader_msgs_per_s, 3),
            "leader_rpcs_per_s": round(self.leader_rpcs_per_s, 3),
            "worker_msgs_per_s_median": round(self.worker_msgs_per_s_median, 4),
            "plan_cost_ratio_sampled_vs_full": None if c is None else round(c.ratio, 4),
            "plan_cost_ratio_seeds": None if c is None else [round(r, 4) for r in c.seed_ratios],
            "full_matrix_plan_spread": None if c is None else round(c.full_spread, 4),
            "peers_at_first_plan": self.peers_at_first_plan,
            "pipelines_at_first_plan": self.pipelines_at_first_plan,
            "joins": self.joins, "leaves": self.leaves, "deaths": self.deaths,
            "leader_changes": self.leader_changes,
            "virtual_s": round(self.virtual_s, 3),
        }


class SimIdentity:
    """What the record store needs of an identity (peer id, owner tag), without an RSA key: the in-memory DHT
    checks no signatures, and a thousand 2048-bit keys would take a minute to generate."""

    def __init__(self, seed: int, index: int) -> None:
        import base64
        import hashlib

        digest = hashlib.sha256(f"cpsim|{seed}|{index}".encode()).digest()
        self.public_key = b"ssh-rsa " + base64.b64encode(digest * 4)
        self.owner_tag = owner_tag(self.public_key)
        self.peer_id = peer_id_from_public_key(self.public_key)


class _NoThread:
    """Stands in for the membership's heartbeat thread: the simulator renews adverts on its own clock."""

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        return None


class SharedReads:
    """One parse per (what, instant, DHT content), shared by every peer that reads it then.

    A parse of every advert or of every plan record is a pure function of the DHT's content and the time, the
    same for every reader (no join secret in the simulation); each reader's gets are still counted and timed as
    its own (``MemoryDHT.charge_gets``: a read of every advert is one get per shard the real read reached), and
    what it does with the result is its own code.
    """

    def __init__(self, dht: MemoryDHT, reader: Membership) -> None:
        self.dht, self.reader = dht, reader
        self._memo: dict[str, tuple[Any, ...]] = {}  # what -> (instant, parse[, the keys the parse's read got])
        self.parses = 0

    def memo(self, what: str, caller: str, compute: Callable[[], Any]) -> Any:
        key = (self.dht.clock(), self.dht.version())
        hit = self._memo.get(what)
        if hit is not None and hit[0] == key:
            self.dht.charge_get(caller, f"{RUN_ID}:{what}")
            return hit[1]
        value = compute()  # the caller's own (real) read, counted by the DHT
        self._memo[what] = ((self.dht.clock(), self.dht.version()), value)
        self.parses += 1
        return value

    def elect(self, entries: list[PeerEntry], credited: Collection[str] = ()) -> str | None:
        """``peer.swarm.election.elect_leader``, once per shared parse (it is a pure function of the entries)."""
        hit = self._memo.get("peers")
        if credited:
            return elect_leader(entries, credited)
        if hit is not None and len(entries) == len(hit[1]) and all(a is b for a, b in zip(entries, hit[1],
                                                                                         strict=True)):
            memo = self._memo.get("elect")
            if memo is None or memo[0] != hit[0]:
                memo = (hit[0], elect_leader(entries))
                self._memo["elect"] = memo
            return memo[1]
        return elect_leader(entries)

    def elect_under(self, entries: list[PeerEntry], credited: Collection[str], policy: LeaderPolicy | None,
                    incumbent: str | None = None) -> str | None:
        """``peer.swarm.election.elect`` for the peers' views: the members' election shared (:meth:`elect`)."""
        return self.elect(entries, credited) if policy is None else elect(entries, credited, policy, incumbent)

    def entries(self, caller: str) -> list[PeerEntry]:
        """Every live advert: the real ``Membership.live_entries`` of a reader that announced nothing (so it
        never falls back to an older view)."""
        stamp = (self.dht.clock(), self.dht.version())
        hit = self._memo.get("peers")
        if hit is None or hit[0] != stamp:
            log = self.dht.watched.setdefault(READER, [])
            log.clear()
            value = self.reader.live_entries()  # the real read: every shard it reached, level by level
            hit = (stamp, value, list(log))
            self._memo["peers"] = hit
            self.parses += 1
        self.dht.charge_gets(caller, hit[2])  # the caller's read: the same gets, issued together
        return list(hit[1])


class SimMembership(Membership):
    """A membership whose heartbeat is the simulator's and whose full reads share one parse per instant."""

    def __init__(self, dht: DHTHandle, identity: SimIdentity, shared: SharedReads, heartbeat_s: float) -> None:
        super().__init__(dht, RUN_ID, identity, None, heartbeat_s)  # type: ignore[arg-type]
        self._thread = _NoThread()  # type: ignore[assignment]
        self.shared = shared

    def live_entries(self) -> list[PeerEntry]:
        return self.shared.entries(self.peer_id)


class SimPlanBoard(PlanBoard):
    """A plan board whose reads of every plan record share one parse per instant (its fencing is its own)."""

    def __init__(self, dht: DHTHandle, identity: SimIdentity, shared: SharedReads, elector: Callable[[], str | None]
                 ) -> None:
        super().__init__(dht, RUN_ID, identity, elector=elector)  # type: ignore[arg-type]
        self.shared, self.caller = shared, identity.peer_id

    def plans(self) -> list:
        return list(self.shared.memo("plans", self.caller, super().plans))


class SimPeer:
    def __init__(self, sim: Simulator, index: int, joined_at: float, leaves_at: float, graceful: bool) -> None:
        self.sim, self.index = sim, index
        self.node = sim.network.add_peer()
        identity = SimIdentity(sim.cfg.seed, index)
        self.pid = identity.peer_id
        self.dht = sim.dht.handle(self.pid, sim.network.region[self.node])
        self.membership = SimMembership(self.dht, identity, sim.shared, sim.cfg.heartbeat_s)
        self.plans = SimPlanBoard(self.dht, identity, sim.shared, lambda: self.view.elected())
        self.progress = ProgressBoard(self.dht, RUN_ID, identity)  # type: ignore[arg-type]
        self.view = SwarmView(self.membership, self.plans, self.progress, elect=sim.shared.elect_under)
        rng = sim.rng
        tflops = float(rng.choice([35.0, 50.0, 80.0, 120.0]))
        device = DeviceInfo(name="sim-gpu", kind="cuda", memory_bytes=int(rng.choice([24, 32, 48, 80])) * 2**30,
                            tflops=tflops, measured=True, emulated=False)
        self.advert = Advert(peer_id=self.pid, endpoint=f"10.{index // 65536 % 256}.{index // 256 % 256}."
                             f"{index % 256}:5000", device=device, started_at=EPOCH_S + joined_at,
                             extra={"region": sim.network.regions.regions[sim.network.region[self.node]]})
        self.joined_at, self.leaves_at, self.graceful = joined_at, leaves_at, graceful
        self.alive = False
        self.probed: dict[str, LinkReport] = {}
        self.probe_rounds = 0
        self.probed_epoch = 0
        self.known: list[str] = []  # peer ids from its last full read
        self.leader: LeaderState | None = None

    # ---- the daemon's loop, as the simulator drives it ----------------------------------------------------
    def join(self) -> None:
        self.alive = True
        self.membership.announce(self.advert)

    def tick(self, n: int) -> None:
        sim = self.sim
        heartbeat = n % TICKS_PER_HEARTBEAT == 0
        before = sim.dht.calls_of(self.pid)
        if heartbeat and n > 0:
            self.membership.announce(self.advert)  # renewal: what the heartbeat thread does
            if self.probed:
                self.membership.report_links(list(self.probed.values()))
        plan = self.view.followed_plan()
        self.view.note_holding_plan(plan is not None and any(self.pid in row for row in plan.plan.get("pipelines", [])))
        tick = self.view.tick(self.leader is not None)
        if tick.entries is not None:
            self.known = [e.advert.peer_id for e in tick.entries if e.advert.peer_id != self.pid]
        if heartbeat:
            self._probe()
        confirmed = tick.leader
        may_lead = sim.now - self.joined_at >= self.membership.ttl_s  # a joiner first sees every advert
        if self.leader is None and confirmed == self.pid and may_lead:
            self.leader = LeaderState(self)
            sim.on_new_leader(self)
        elif self.leader is not None and confirmed not in (None, self.pid):
            sim.log(f"{self.pid} steps down for {confirmed}")
            self.leader = None
        if self.leader is not None:
            self.leader.step(tick.entries or [])
        if (self.leader is not None or sim.is_leader(self.pid)) and sim.window_start is not None:
            sim.count_leader_calls(sim.dht.calls_of(self.pid) - before)

    def _probe(self) -> None:
        """Probe the peers ``probe_targets_for`` names: at join, then once per plan this peer is part of."""
        plan = self.view.followed_plan()
        epoch = plan.epoch if plan is not None else 0
        first = self.probe_rounds == 0
        if self.probe_rounds >= self.sim.cfg.probe_rounds or not (first or epoch > self.probed_epoch):
            return
        if not first and (plan is None or not self.view.holding_plan):
            return
        candidates = self.known or ([m for m in plan.members if m != self.pid] if plan is not None else [])
        if not candidates:
            return
        targets = probe_targets_for(self.pid, candidates, plan.plan if plan is not None else None,
                                    set(self.probed), PROBE_K, PROBE_RANDOM, seed=self.sim.cfg.seed)
        net, at = self.sim.network, self.sim.dht.clock()
        for pid in targets:
            other = self.sim.by_pid.get(pid)
            if other is None or not other.alive:
                continue
            rtt = 2.0 * net.delay_s(self.node, other.node)
            self.probed[pid] = LinkReport(self.pid, pid, rtt, net.bandwidth_bps(self.node, other.node), True, at)
        self.probe_rounds += 1
        self.probed_epoch = epoch
        if self.probed:
            self.membership.report_links(list(self.probed.values()))

    def depart(self) -> None:
        self.alive = False
        self.leader = None
        if self.graceful:
            self.membership.leave()


class LeaderState:
    """The leader role's run driver, reduced to what the control plane sees (see the module docstring)."""

    def __init__(self, peer: SimPeer) -> None:
        self.peer, self.sim = peer, peer.sim
        previous = peer.plans.latest()
        self.taking_over = previous is not None
        self.stages = [tuple(s) for s in previous.plan["stages"]] if previous is not None else None
        self.current: list[list[str]] | None = None  # pipelines of the last plan this leader published
        self.phase = "peers"
        self.links_until = 0.0
        self.publish_at: float | None = None
        self.pending: tuple[list[list[str]], list[tuple[int, int]], list[str]] | None = None
        self.handled: set[str] = set()  # departed members a plan in progress or published already excludes
        self.next_step_at = 0.0
        cfg = self.sim.cfg
        self.planner = make_planner(self.sim.spec, self._view, cfg.stages, time_limit_s=None, seed=cfg.seed,
                                    config=MemeticConfig(max_evaluations=cfg.plan_evaluations))
        self.index: dict[str, int] = {}
        self.adverts: dict[str, Advert] = {}

    def _device(self, pid: str) -> int:
        return self.index.setdefault(pid, len(self.index))

    def _view(self, devices: list[int]) -> Any:
        by_dev = {d: pid for pid, d in self.index.items()}
        adverts = [self.adverts[by_dev[d]] for d in devices]
        return build_cluster(adverts, self.peer.membership.links(), seed=self.sim.cfg.seed)

    def step(self, entries: list[PeerEntry]) -> None:
        sim, me = self.sim, self.peer.pid
        self.adverts = {e.advert.peer_id: e.advert for e in entries if e.advert.role == "worker"}
        self.peer.progress.publish({"epoch": self.peer.plans.highest_epoch, "step": int(sim.now // sim.cfg.step_s),
                                    "state": self.phase})
        live = {pid for pid in self.adverts if not sim.dead_to_coordinator(pid)}
        if self.publish_at is not None:
            if sim.now >= self.publish_at:
                self._publish(live)
            return
        if self.phase == "peers":
            need = 1 if self.taking_over else sim.min_peers
            if len(live) >= need and has_quorum(self.peer.plans.latest(), live):
                self.phase, self.links_until = "links", sim.now + LINK_REPORT_WAIT_HEARTBEATS * sim.cfg.heartbeat_s
            return
        if self.phase == "links":
            reporters = {r.src for r in self.peer.membership.links()}
            if live <= reporters | {me} or sim.now >= self.links_until:
                self._plan(live, "start" if not self.taking_over else "takeover")
            return
        # training: re-plan on a departure of a member, or at a step boundary when newcomers add a pipeline
        assert self.current is not None
        members = {pid for row in self.current for pid in row}
        gone = (members - live) - self.handled
        if gone:
            self._plan(live, "departure", gone)
        elif sim.now >= self.next_step_at:
            self.next_step_at = sim.now + sim.cfg.step_s
            if self.stages and len(live) // len(self.stages) > len(self.current):
                self._plan(live, "joins")

    def _plan(self, live: set[str], reason: str, gone: set[str] = frozenset()) -> None:
        sim = self.sim
        devices = [self._device(pid) for pid in sorted(live)]
        by_dev = {d: pid for pid, d in self.index.items()}
        cpu = time.process_time()
        try:
            stages, pipelines = self.planner(devices, self.stages)
        except PlanningError as exc:
            sim.log(f"t={sim.now:.1f} plan failed: {exc}")
            return
        sim.scheduler_s.append(time.process_time() - cpu)
        self.stages = [tuple(s) for s in stages]
        rows = [[by_dev[d] for d in row] for row in pipelines]
        self.pending = (rows, [(int(a), int(b)) for a, b in stages], sorted(live))
        self.handled |= gone
        self.publish_at = sim.now + sim.cfg.plan_charge_s
        self.reason = reason

    def _publish(self, live: set[str]) -> None:
        sim, peer = self.sim, self.peer
        assert self.pending is not None
        rows, stages, members = self.pending
        self.publish_at, self.pending = None, None
        epoch = peer.plans.next_epoch()
        sim.dht.take_elapsed(peer.pid)  # the plan is visible once its own store has arrived
        record = {"stages": [list(s) for s in stages], "pipelines": rows, "step": 0, "reason": self.reason,
                  "coordinator": peer.advert.endpoint}
        try:
            peer.plans.publish(epoch, peer.pid, record, members=members)
        except ValueError as exc:
            sim.log(f"t={sim.now:.1f} plan {epoch} not published: {exc}")
            self.phase = "peers"
            return
        at = sim.now + sim.dht.take_elapsed(peer.pid)
        self.current, self.phase = rows, "training"
        self.next_step_at = sim.now + sim.cfg.step_s
        sim.on_plan(at, epoch, rows, self.reason)


class Simulator:
    """One run: ``run()`` returns a :class:`SimResult` (see the module docstring)."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.churn_rng = np.random.default_rng([cfg.seed, 1])
        self.now = 0.0
        self.network = Network(cfg.seed)
        self.dht = MemoryDHT(lambda: EPOCH_S + self.now, LatencyModel(self.network.region_rtt_s(), seed=cfg.seed),
                             n_nodes=cfg.peers)
        reader_identity = SimIdentity(cfg.seed, -1)
        reader = Membership(self.dht.handle(READER, 0), RUN_ID, reader_identity, None,  # type: ignore[arg-type]
                            cfg.heartbeat_s)
        self.shared = SharedReads(self.dht, reader)
        self.spec = RunSpec(run_id=RUN_ID, model=ModelConfig(n_layers=24, d_model=2048, n_heads=16, seq_len=1024),
                            micro_batch=4, n_microbatches=256, seed=cfg.seed)
        self.peers: list[SimPeer] = []
        self.by_pid: dict[str, SimPeer] = {}
        self.events: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = 0
        self.min_peers = max(1, int(cfg.min_peers_fraction * cfg.peers))
        self.first_plan_at: float | None = None
        self.first_plan_members = 0
        self.first_plan_pipelines = 0
        self.replans: list[float] = []  # per departed plan member: seconds to the first plan without it
        self.replan_count = 0  # plans made because members departed
        self.departed_at: dict[str, float] = {}
        self.died_at: dict[str, float] = {}
        self.scheduler_s: list[float] = []
        self.leader_calls = 0
        self.leader_pid: str | None = None
        self.last_leader: str | None = None
        self.leader_changes = 0
        self.joins = self.leaves = self.deaths = 0
        self.log_lines: list[str] = []
        self.window_start: float | None = None
        self.worker_calls_at_start: dict[str, int] = {}

    # ---- bookkeeping ------------------------------------------------------------------------------------
    def log(self, line: str) -> None:
        self.log_lines.append(line)
        log.debug(line)

    def at(self, t: float, what: str, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, what, action))

    def count_leader_calls(self, n: int) -> None:
        """``n`` DHT calls a leader (this tick's, or the previous plan's still leading) made in the window."""
        self.leader_calls += n

    def is_leader(self, pid: str) -> bool:
        return pid == self.leader_pid

    def dead_to_coordinator(self, pid: str) -> bool:
        """A crashed member is declared dead by the leader's pings: PING_MISSES missed heartbeats."""
        died = self.died_at.get(pid)
        return died is not None and self.now >= died + PING_MISSES * self.cfg.heartbeat_s + PING_TIMEOUT_S

    def on_new_leader(self, peer: SimPeer) -> None:
        if self.last_leader is not None and self.last_leader != peer.pid:
            self.leader_changes += 1
        self.leader_pid = self.last_leader = peer.pid
        self.log(f"t={self.now:.1f} {peer.pid} leads")

    def on_plan(self, at: float, epoch: int, rows: list[list[str]], reason: str) -> None:
        members = {pid for row in rows for pid in row}
        if self.first_plan_at is None:
            self.first_plan_at = at
            self.first_plan_members, self.first_plan_pipelines = len(members), len(rows)
            self.window_start = at
            self.worker_calls_at_start = {p.pid: self.dht.calls_of(p.pid) for p in self.peers if p.alive}
        else:
            handled = [t for pid, t in self.departed_at.items() if pid not in members and t <= at]
            if reason in ("departure", "takeover", "start") and handled:
                self.replans.extend(at - t for t in sorted(handled))  # one sample per departure it handles
                self.replan_count += 1
            for pid in [pid for pid in self.departed_at if pid not in members]:
                del self.departed_at[pid]
        self.log(f"t={at:.1f} plan {epoch} ({reason}): {len(rows)} pipelines over {len(members)} peers")

    # ---- peers coming and going -------------------------------------------------------------------------
    def add_peer(self, joined_at: float, remaining_s: float) -> None:
        graceful = self.cfg.churn.graceful(self.churn_rng)
        tick_s = self.cfg.heartbeat_s / TICKS_PER_HEARTBEAT
        joined_at = math.ceil(joined_at / tick_s) * tick_s  # a daemon's first act is on its first tick
        peer = SimPeer(self, len(self.peers), joined_at, joined_at + remaining_s, graceful)
        self.peers.append(peer)
        self.by_pid[peer.pid] = peer
        self.at(joined_at, "join", peer.join)
        self.at(peer.leaves_at, "leave", lambda: self._depart(peer))

    def _depart(self, peer: SimPeer) -> None:
        if not peer.alive:
            return
        was_member = self._in_plan(peer.pid)
        peer.depart()
        if peer.graceful:
            self.leaves += 1
        else:
            self.deaths += 1
            self.died_at[peer.pid] = self.now
        if was_member or peer.pid == self.leader_pid:
            self.departed_at[peer.pid] = self.now
        if peer.pid == self.leader_pid:
            self.leader_pid = None
        self.log(f"t={self.now:.1f} {peer.pid} {'leaves' if peer.graceful else 'dies'}"
                 f"{' (a plan member)' if was_member else ''}")

    def _in_plan(self, pid: str) -> bool:
        leader = self.by_pid.get(self.leader_pid or "")
        rows = leader.leader.current if leader is not None and leader.leader is not None else None
        return bool(rows) and any(pid in row for row in rows)  # type: ignore[union-attr]

    def _arrivals(self, until: float) -> None:
        rate = self.cfg.churn.arrival_rate_per_s(self.cfg.peers)
        t = self.cfg.join_spread_s
        while True:
            t += float(self.churn_rng.exponential(1.0 / rate))
            if t >= until:
                return
            self.add_peer(t, self.cfg.churn.session_s(self.churn_rng))
            self.joins += 1

    # ---- the run ----------------------------------------------------------------------------------------
    def run(self, max_virtual_s: float = 900.0) -> SimResult:
        cfg = self.cfg
        set_clock(lambda: EPOCH_S + self.now)
        try:
            for _ in range(cfg.peers):
                self.add_peer(float(self.churn_rng.uniform(0.0, cfg.join_spread_s)),
                              cfg.churn.residual_s(self.churn_rng))
            self._arrivals(max_virtual_s)
            tick_s = cfg.heartbeat_s / TICKS_PER_HEARTBEAT
            n = 0
            while self.now <= max_virtual_s:
                t_tick = n * tick_s
                while self.events and self.events[0][0] <= t_tick:
                    t, _, _, action = heapq.heappop(self.events)
                    self.now = t
                    action()
                self.now = t_tick
                for peer in self.peers:
                    if peer.alive:
                        peer.tick(n)
                        self.dht.take_elapsed(peer.pid)
                n += 1
                if self.window_start is not None and self.now >= self.window_start + cfg.churn_window_s:
                    break
        finally:
            set_clock(None)
        return self._result()

    def _result(self) -> SimResult:
        cfg = self.cfg
        window = max(self.now - (self.window_start or 0.0), 1e-9)
        hops = self.dht.latency.hops(cfg.peers)
        worker_rates = [(self.dht.calls_of(p.pid) - self.worker_calls_at_start.get(p.pid, 0)) / window
                        for p in self.peers if p.alive and p.pid != self.leader_pid
                        and p.pid in self.worker_calls_at_start]
        comparison = self._sampled_vs_full() if cfg.compare_full_matrix else None
        return SimResult(
            first_plan_s=float("nan") if self.first_plan_at is None else self.first_plan_at,
            replan_s=list(self.replans),
            replans=self.replan_count,
            leader_msgs_per_s=self.leader_calls_in_window / window,
            leader_rpcs_per_s=self.leader_calls_in_window * hops / window,
            worker_msgs_per_s_median=float(statistics.median(worker_rates)) if worker_rates else 0.0,
            comparison=comparison,
            scheduler_s=list(self.scheduler_s),
            peers_at_first_plan=self.first_plan_members,
            pipelines_at_first_plan=self.first_plan_pipelines,
            joins=self.joins, leaves=self.leaves, deaths=self.deaths,
            leader_changes=self.leader_changes,
            virtual_s=self.now,
            events=list(self.log_lines),
        )

    @property
    def leader_calls_in_window(self) -> int:
        return self.leader_calls

    def plan_inputs(self) -> PlanInputs | None:
        """At the end: the leader's view of the live peers (the link reports in the DHT, the rest estimated) and
        the true matrix for the same peers, with the run's layer split (None before a first plan)."""
        leader = self.by_pid.get(self.leader_pid or "")
        state = leader.leader if leader is not None else None
        if state is None or not state.stages or not state.adverts:
            return None
        set_clock(lambda: EPOCH_S + self.now)
        try:
            live = sorted(pid for pid in state.adverts if self.by_pid[pid].alive)
            view = state._view([state._device(pid) for pid in live])
        finally:
            set_clock(None)
        delay, bw = self.network.matrices([self.by_pid[pid].node for pid in live])
        truth = Cluster(delay_s=delay, bandwidth_bps=bw, tflops=view.cluster.tflops.copy(),
                        memory_bytes=view.cluster.memory_bytes.copy(), regions=list(view.cluster.regions),
                        name="truth")
        stages = [(int(a), int(b)) for a, b in state.stages]
        workload = workload_for(self.spec, len(stages), len(live) // len(stages))
        return PlanInputs(truth, view.cluster, workload, stages)

    def _sampled_vs_full(self) -> PlanComparison | None:
        """A plan from the leader's view against a plan from the true matrix, both costed on the truth with the
        ``full`` model, over the same seeds and (offline) search budget: see ``sampling.compare_on_truth``."""
        inputs = self.plan_inputs()
        if inputs is None:
            return None
        return compare_on_truth(inputs, seeds=self.cfg.compare_seeds, evaluations=self.cfg.compare_evaluations)


def simulate(cfg: SimConfig) -> SimResult:
    return Simulator(cfg).run()
