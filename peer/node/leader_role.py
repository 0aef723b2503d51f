"""What the leader peer does on top of being a worker: plan, coordinate, publish plans and progress.

Every peer derives the same leader from the live adverts (``peer.swarm.election.elect_leader``); the one that finds
itself elected starts a :class:`LeaderRole`. The role owns a coordinator (its own gRPC server) and a
:class:`~peer.runtime.lead.driver.RunDriver`, publishes each plan on the DHT's plan board under an epoch one above
anything seen, and publishes progress (step, loss, tokens/s) for ``peer status``.

Taking over from a dead leader: the workers still hold their stages. The new leader asks every live worker
how many steps it has applied; if the old leader died while telling the workers to apply a step, the workers
that had not applied it yet still hold its averaged gradient and are told to apply it now (the averaging is
only ever started when every stage can apply it, so this finishes the step rather than guessing). The run
then continues from there under a new, higher epoch.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasklet.peer.compute.model import unflatten_stage
from tasklet.peer.config import RunConfig
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.server import PeerServer
from tasklet.peer.node.history import LossHistory
from tasklet.peer.node.history import newest_record as newest_progress
from tasklet.peer.node.partition import QuorumWait, find_rival, judge, split_step
from tasklet.peer.node.planning import ClusterView, build_cluster, make_planner, workload_for
from tasklet.peer.node.schedule import leaving_soon
from tasklet.peer.node.step_record import MAX_STAGES, StepRecord, newest_record, sign_record
from tasklet.peer.observe.scalars import ScalarWriter
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.control import MAX_HASH, Apply, encode
from tasklet.peer.runtime.lead.coordinator import Coordinator, StepReport
from tasklet.peer.runtime.lead.driver import DriverConfig, Pipelines, RunDriver, Stages
from tasklet.peer.runtime.lead.recovery import KEPT_DIGESTS, Inherited, verified_states
from tasklet.peer.runtime.lead.resync import Digests
from tasklet.peer.runtime.lead.spot import Ledger
from tasklet.peer.runtime.outer import assignment_record
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.swarm.adverts import Advert, LinkReport
from tasklet.peer.swarm.credit import CreditBook
from tasklet.peer.swarm.election import MAX_CREDITED, credited_of
from tasklet.peer.swarm.plans import PlanBoard, has_quorum
from tasklet.peer.swarm.progress import ProgressBoard, publishable
from tasklet.peer.timing import (
    LINK_REPORT_WAIT_HEARTBEATS,
    PREDECESSOR_READ_HEARTBEATS,
    PROGRESS_BUILD_S,
    STATUS_TIMEOUT_S,
    TAKEOVER_APPLY_TIMEOUT_S,
    TAKEOVER_WAIT_S,
    TICKS_PER_HEARTBEAT,
    now,
)

log = logging.getLogger(__name__)

HEAVY = frozenset({"history", "credit", "unverified", "discarded"})  # progress fields built only for a store
MAX_RECORDED_STAGES = MAX_STAGES  # parameters hashes read from a progress record, as from a step record


@dataclass(frozen=True)
class LeaderContext:
    """Exactly what the leader role uses of its daemon; the daemon builds it (see ``PeerDaemon._leader_context``).

    worker_server: the daemon's worker gRPC server; the coordinator is served on its port (one reachable port
    per peer). worker_endpoint: that server's announced endpoint (what the others dial).
    """

    peer_id: str
    config: RunConfig
    spec: RunSpec
    worker_server: PeerServer
    worker_endpoint: str
    resume: bool
    plan_board: PlanBoard
    progress: ProgressBoard
    live_adverts: Callable[[], list[Advert]]  # the daemon's current view of the live adverts
    links: Callable[[], list[LinkReport]]  # the link reports in the DHT
    probe_links_now: Callable[[], None]  # measure links to peers not measured yet, publish the reports


class LeaderRole:
    """Runs in a thread of the leader's daemon until the run ends or leadership is lost."""

    def __init__(self, ctx: LeaderContext) -> None:
        self.ctx, self.config, self.spec = ctx, ctx.config, ctx.spec
        self.stop_event = threading.Event()
        self.coordinator = Coordinator(self.spec, liveness_interval_s=self.config.swarm.heartbeat_s,
                                       host_server=ctx.worker_server, public_endpoint=ctx.worker_endpoint)
        self.index: dict[str, int] = {}  # peer id -> device id (stable for the whole leadership)
        self._last_live: set[str] = set()  # live workers at the previous look
        self._ever_live: set[str] = set()
        self.excluded: set[str] = set()  # left out of a takeover's plans: no answer, or a claim no state explains
        self.peer_of: dict[int, str] = {}
        self.driver: RunDriver | None = None
        self.thread = threading.Thread(target=self._run, name="leader", daemon=True)
        self.error: BaseException | None = None
        self.stopped: str | None = None  # why the role gave up the lead before the run's end (InterruptedError)
        self.finished = threading.Event()
        # step -> (loss, seconds) of the whole run, also the steps before a takeover (read from the progress
        # record the previous leader published), so run.json and status keep the full curve
        self.losses = LossHistory(ctx.config.run.steps)
        self.history, self.missing = self.losses.steps, self.losses.missing  # the same dicts, read by tests
        self._predecessor: dict[str, Any] = {}  # the newest progress record of the previous leader read so far
        self._last_progress: dict[str, Any] = {"epoch": 0, "step": 0, "state": "forming"}
        self._stored_checkpoints: Any = None  # the checkpoint hashes the last progress store signed
        self._heavy: dict[str, Any] = {}  # the history, credit, ... last built (on the driver thread)
        self._built_at = float("-inf")  # when (monotonic)
        self._noted: StepRecord | None = None  # the newest step record of the previous leader a worker showed
        self._bound_by_record = ""  # what the DHT's record said when a step record was newer (the log says it)
        # peers whose pipelines applied a step of the run (carried over from the previous leader's plan): the
        # only witnesses of the election once there are some (peer.swarm.election), listed in every plan
        self.credited: set[str] = set()
        self.published_credited: set[str] = set()  # the credited list of the last plan published
        self._takeover_digests = Digests()  # what the previous leader signed for the step a takeover starts from
        self.credit = CreditBook()  # each identity's verified work (peer.swarm.credit), signed in every progress
        self.pause: dict[str, Any] | None = None  # why, since and until when (DHT time) the leader pauses
        self.waive_epoch: int | None = None  # the plan epoch the next plan fences without its quorum
        self.waived: dict[str, Any] | None = None  # what the quorum waiver of the next plan says
        self.discarded: dict[str, Any] | None = None  # the losing side of the last healed partition
        self.start_epoch = 0  # the plan epoch this leadership began at: a later plan of another leader is a rival
        self._tokens_per_step = self.spec.micro_batch * self.spec.n_microbatches * self.spec.model.seq_len
        self._act_bytes = activation_bytes(self.spec)
        logs = self.config.log  # TensorBoard / W&B scalars of each step (peer.observe.scalars)
        self.scalars = ScalarWriter(
            logs.tensorboard_dir, logs.wandb_project, self.spec.run_id, self.config.public_dict()
        )

    def start(self) -> None:
        self.coordinator.start()
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.driver is not None:
            self.driver.stop_event.set()
        self.coordinator.close()

    # ----------------------------------------------------------------------------------------- membership
    def _workers(self) -> dict[str, Any]:
        """Live worker adverts by peer id (the DHT's view, refreshed by the daemon), less those whose owner's
        schedule ends within SCHEDULE_NOTICE_S: they are planned around before they leave."""
        at = now()
        return {a.peer_id: a for a in self.ctx.live_adverts() if a.role == "worker" and not leaving_soon(a.extra, at)}

    def live_devices(self) -> dict[int, str]:
        live = self._workers()
        for pid in sorted(live):
            if pid not in self.index:
                self.index[pid] = len(self.index)
                self.peer_of[self.index[pid]] = pid
        returning = self._forgive_returning(live)
        if returning and self.driver is not None:
            self._check_heal(returning, live)
        return {self.index[pid]: a.endpoint for pid, a in live.items()}

    def _forgive_returning(self, live: dict[str, Advert]) -> set[str]:
        """A peer whose advert vanished and came back (a healed partition, a restart) may be planned again,
        even if the driver banned its endpoint as dead while it was away. Returns the peers new in this view."""
        returning = set(live) - self._last_live
        self._last_live = set(live)
        if self.driver is not None:
            for pid in returning & set(self._ever_live):
                if live[pid].endpoint in self.driver.banned:
                    log.info("leader: %s is back; it may be planned again", pid)
                    self.driver.banned.discard(live[pid].endpoint)
        self._ever_live |= set(live)
        return returning

    def _check_heal(self, returning: set[str], live: dict[str, Advert]) -> None:
        """Peers came into view: if they followed a rival plan (the other side of a partition that went on after
        ``quorum_wait_s``), the side with the newer (epoch, step) wins (``peer.node.partition``); the loser's
        work since the split is discarded, logged and published (``discarded``, shown by `peer status`)."""
        assert self.driver is not None
        plans = self.ctx.plan_board.plans()
        rival = find_rival(plans, self.ctx.peer_id, self.start_epoch, returning)
        if rival is None:
            return
        self.start_epoch = max(self.start_epoch, rival.epoch)  # judged once: a flickering advert is no new heal
        progress = self.ctx.progress.read(rival.leader_id) or {}
        steps = self.config.run.steps
        v = judge(rival, progress, self.ctx.peer_id, (self.driver.epoch, self.driver.trained), steps,
                  split_step(plans, rival, steps))
        their_eps = {live[pid].endpoint for pid in v.their_peers if pid in live}
        if v.theirs:
            self.losses.forget_from(v.split)
            self._adopt_history(v.step, progress, since=v.split)
            self.driver.heal(v.step, v.epoch, keep=their_eps, discard=set())
        else:
            self.driver.heal(v.step, v.epoch, keep=None, discard=their_eps)
        d = v.discarded
        log.warning("leader: a partition healed; the side of %s (plan epoch %d, step %d) lost to the side of %s "
                    "(epoch %d, step %d): its %d step(s) since step %d are discarded", d["leader"], d["epoch"],
                    d["step"], d["kept_leader"], d["kept_epoch"], d["kept_step"], d["steps"], v.split)
        self.discarded = d
        self._publish({**self._last_progress, "discarded": dict(d)})

    def _view(self, devices: list[int]) -> ClusterView:
        live = self._workers()
        adverts = [live[self.peer_of[d]] for d in devices]
        return build_cluster(adverts, self.ctx.links())

    def _assignments(self, stages: Stages, pipelines: Pipelines, epoch: int) -> dict[str, Assignment]:
        live = self._workers()
        n = len(self.index)
        endpoints = [""] * n
        for pid, d in self.index.items():
            if pid in live:
                endpoints[d] = live[pid].endpoint
        peer_of = {a.endpoint: pid for pid, a in live.items()}
        self.coordinator.liveness.use_link_speeds(_slowest_measured(peer_of, self.ctx.links()))
        workload = workload_for(self.spec, len(stages), len(pipelines))
        self._wait_for_quorum()  # never send a plan that a majority of the previous plan's members does not back
        return build_assignments(
            self.spec,
            stages,
            pipelines,
            endpoints,
            self.coordinator.endpoint,
            epoch=epoch,
            forward_flops=workload.stage_forward_flops,
            leader=self.ctx.peer_id,
            certificates={
                **{a.endpoint: a.cert for pid, a in live.items() if pid in self.index and a.cert},
                self.coordinator.endpoint: self.coordinator.tls.certificate_text,
            },
        )

    # ------------------------------------------------------------------------------------------------ run
    def _run(self) -> None:
        try:
            self._lead()
        except InterruptedError as exc:  # stopped on purpose (leadership lost, or the peer is leaving)
            log.info("leadership ended: %s", exc)
            self.stopped = str(exc)
        except BaseException as exc:  # reported by the daemon, which decides whether to exit
            log.exception("leadership ended with an error")
            self.error = exc
        finally:
            self.scalars.close()
            self.finished.set()

    def _wait_for_peers(self, taking_over: bool) -> None:
        """Wait for [swarm] min_peers before the first plan; a leader taking over a running run goes on with
        whoever is left (the run must not stall because it lost peers)."""
        need = 1 if taking_over else self.config.swarm.min_peers
        last = -1
        while not self.stop_event.is_set():
            have = len(self._workers())
            if have >= need:
                return
            if have != last:
                log.info("leader: %d of %d peers present; waiting for more", have, need)
                last = have
            self.stop_event.wait(self.config.swarm.heartbeat_s / TICKS_PER_HEARTBEAT)
        raise InterruptedError("stopped while waiting for peers")

    def _wait_for_quorum(self) -> None:
        """Pause until a quorum of the previous plan's members is live here (``peer.swarm.plans.has_quorum``),
        for at most ``[swarm] quorum_wait_s``; then go on with the members present, in a new epoch whose plan
        waives the quorum and fences the previous one (``PlanBoard.publish(waive_quorum=...)``).

        A partition's minority side cannot tell a partition from a crash of the others: pausing forever would stop
        a run that lost half its peers for good, never pausing would let both sides of every short partition
        train apart. The bounded wait is the trade-off (docs/architecture.md, "Partitions"): a partition shorter
        than ``quorum_wait_s`` costs nothing; a longer one lets both sides train, and when it heals the side with
        the newer (epoch, trained step) wins and the other side's work since the split is discarded and reported.
        """
        wait = QuorumWait(self.config.swarm.quorum_wait_s)
        while not self.stop_event.is_set():
            previous, live = self.ctx.plan_board.latest(), set(self._workers())
            elector = self.ctx.plan_board.elector
            if elector is None or elector() == self.ctx.peer_id:  # else the election moved (e.g. a healed
                # partition): act on nothing until the daemon confirms it and stops this role, or elects us again
                quorum = has_quorum(previous, live) or (previous is not None and self.waive_epoch == previous.epoch)
                verdict = wait.step(previous, live, quorum, time.monotonic())
                self.pause = wait.pause
                if verdict == "paused":
                    self._publish({**self._last_progress, "state": "paused", "paused": dict(self.pause or {})})
                elif verdict in ("go", "waived"):
                    if verdict == "waived":
                        assert previous is not None
                        self.waive_epoch, self.waived = previous.epoch, wait.waiver
                    return
            self.stop_event.wait(self.config.swarm.heartbeat_s / TICKS_PER_HEARTBEAT)
        raise InterruptedError("stopped while waiting for a quorum")

    def _wait_for_link_reports(self) -> None:
        """Give every peer a few heartbeats to publish its link measurements: the first plan is only as good as
        the network it sees. Pairs still unmeasured after that are estimated (see peer.node.planning)."""
        deadline = time.monotonic() + LINK_REPORT_WAIT_HEARTBEATS * self.config.swarm.heartbeat_s
        while time.monotonic() < deadline and not self.stop_event.is_set():
            live = set(self._workers())
            reporters = {r.src for r in self.ctx.links()}
            if live <= reporters | {self.ctx.peer_id}:
                return
            self.stop_event.wait(self.config.swarm.heartbeat_s / TICKS_PER_HEARTBEAT)

    def _lead(self) -> None:
        board = self.ctx.plan_board
        previous = board.latest()
        self.credited = set(credited_of(previous.plan if previous else None))
        record = self._read_predecessor()
        self.credit = CreditBook.from_record(record.get("credit"))  # kept in the records published while it waits
        self.coordinator.verification.inherit(Ledger.from_record(record.get("unverified")))  # its roll-backs too
        self.start_epoch = board.highest_epoch
        self._wait_for_peers(taking_over=previous is not None)
        self._wait_for_quorum()
        self.ctx.probe_links_now()
        self._wait_for_link_reports()
        self._wait_for_quorum()  # again: the election or the membership may have changed while we waited
        takeover = self._takeover_point(previous.plan if previous else None) if previous else None
        if previous is not None:  # the loss history up to the takeover step (none without one) and the credit
            self._adopt_history(takeover[0] if takeover is not None else 0)
        planner = make_planner(
            self.spec,
            self._view,
            self.config.swarm.stages,
            time_limit_s=self.config.swarm.plan_time_limit_s,
            seed=self.spec.seed,
        )
        s = self.config.swarm
        cfg = DriverConfig(
            steps=self.config.run.steps,
            checkpoint_dir=Path(s.checkpoint_dir) if s.checkpoint_dir else None,
            checkpoint_every=s.checkpoint_every,
            checkpoint_keep=s.checkpoint_keep,
            checkpoint_copies=s.checkpoint_copies,
        )
        inherited = Inherited(
            step=self._recorded()[0] if previous else None,
            # holders must match what the previous leader signed for the step a takeover starts from
            digests=self._takeover_digests if takeover is not None and takeover[0] == self._takeover_digests.step
            else Digests(),
            checkpoint_digests=recorded_checkpoints(record.get("checkpoint_hashes")),
            checkpoint_manifests=recorded_manifests(record.get("checkpoint_manifests")))
        self.driver = RunDriver(self.spec, self.coordinator, self.live_devices, planner, self._assignments, cfg,
                                on_step=self._on_step, epoch=board.next_epoch() - 1, on_replan=self._on_replan,
                                on_pause=self._on_pause, inherited=inherited)
        for ep in self.excluded:
            self.driver.banned.add(ep)
        if takeover is not None and takeover[0] >= self.config.run.steps:  # planned only to save the final state
            log.info("the run already reached step %d", takeover[0])
        self.driver.run(resume=self.ctx.resume, takeover=takeover)
        self._finish()

    def _takeover_point(self, plan: dict[str, Any] | None) -> tuple[int, Stages] | None:
        """(trained steps, stages) of a run whose previous leader is gone, finishing an interrupted apply.

        The workers' Status replies are claims: the step is bounded by the one the previous leader recorded and
        signed in its progress record (``judge_claims``). A worker whose claim no honest state explains, or that
        does not answer, is left out of the plans for a ban's time (``self.excluded``)."""
        if not plan or "stages" not in plan:
            return None
        stages = [(int(a), int(b)) for a, b in plan["stages"]]
        asked = list(self._workers().values())  # one view: a worker seen only later was not asked, not silent
        statuses = self._statuses(asked)
        silent = set() if not statuses else {a.endpoint for a in asked} - set(statuses)
        for ep in sorted(silent):  # planning it would stall the first assignment on it (the old leader, often)
            log.warning("takeover: %s is left out of the first plan: it did not answer its status query", ep)
        self.excluded |= silent
        previous = self.ctx.plan_board.latest()
        self._noted = newest_record(((ep, st.get("step_record")) for ep, st in statuses.items()), self.spec.run_id,
                                    None if previous is None else previous.leader_id)
        recorded, digests = self._recorded()
        if self._bound_by_record:
            log.info("takeover: the bound is the step record a worker showed (%d steps trained; the progress record "
                     "in the DHT said %s)", recorded, self._bound_by_record)
        judged = judge_claims(statuses, stages, recorded, digests)
        self._takeover_digests = Digests(recorded, digests) if recorded is not None else Digests()
        for ep, why in judged.liars.items():
            log.warning("takeover: %s is left out: %s", ep, why)
        self.excluded |= set(judged.liars)
        if judged.top is None:
            return None
        top = judged.top
        for ep in judged.pending:
            st = statuses[ep]
            log.info("takeover: %s still has step %d to apply; applying it", ep, top - 1)
            try:
                with PeerClient(ep, TransportConfig(tls=self.coordinator.tls), sender="leader") as client:
                    client.push(encode(Apply(top - 1), self.spec.run_id, int(st["epoch"]), top - 1,
                                       stage=int(st["stage"]), replica=int(st["replica"])),
                                timeout_s=TAKEOVER_APPLY_TIMEOUT_S)
            except Exception as exc:  # it stays behind: not a holder of the step, it fetches the stage
                log.warning("takeover: %s did not apply step %d: %s", ep, top - 1, exc)
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        while judged.pending and time.monotonic() < deadline:
            statuses = self._statuses()
            if all(statuses.get(ep, {}).get("trained_steps") == top for ep in judged.pending):
                break
            time.sleep(0.2)
        log.info("takeover at step %d with stages %s (the previous leader recorded step %s)", top, stages, recorded)
        return top, stages

    def _recorded(self) -> tuple[int | None, dict[tuple[int, int], str]]:
        """The trained step and stage hashes the previous plan's leader last signed: in its progress record
        (``recorded_progress``) or in the step record a worker was sent with a start_step, whichever is newer
        (plan epoch, then step: a re-plan may roll the step back)."""
        record = self._read_predecessor()
        step, hashes = recorded_progress(record)
        noted = self._noted
        epoch = record.get("epoch") if type(record.get("epoch")) is int else -1
        if noted is not None and (step is None or (noted.epoch, noted.step) > (epoch, step)):
            self._bound_by_record = f"epoch {epoch}, step {step}" if step is not None else "nothing"
            return noted.step, dict(noted.hashes)
        self._bound_by_record = ""
        return step, hashes

    def _read_predecessor(self) -> dict[str, Any]:
        """The previous plan's leader's progress record, read again; the newest of the reads so far. The step a
        takeover starts from and the history it adopts come from one record, or the newer: a stale read for the
        history would leave the steps between the two without a loss."""
        self._predecessor = newest_progress(self._predecessor, predecessor_progress(self.ctx, self.stop_event))
        return self._predecessor

    def _statuses(self, adverts: list[Any] | None = None) -> dict[str, dict[str, Any]]:
        out = {}
        for a in self._workers().values() if adverts is None else adverts:
            try:
                with PeerClient(a.endpoint, TransportConfig(tls=self.coordinator.tls), sender="leader",
                                expect_peer=a.peer_id) as client:
                    out[a.endpoint] = client.status(timeout_s=STATUS_TIMEOUT_S)
            except Exception as exc:  # a peer that does not answer holds nothing we can use
                log.info("status of %s: %s", a.endpoint, exc)
        return out

    # -------------------------------------------------------------------------------------- publication
    def _publish(self, payload: dict[str, Any], due: bool = True) -> None:
        """Publish progress; every record carries the loss history, so a takeover at any moment keeps it.
        ``due`` False (a step's end): no store here unless the checkpoints it signs changed; the next beat stores
        it, from the daemon's thread (a takeover's bound is the step record, peer.node.step_record). The history
        and credit are built here, on the driver's thread, at most every ``PROGRESS_BUILD_S`` between steps
        (they grow with the run)."""
        self._last_progress = {k: v for k, v in payload.items() if k not in HEAVY}
        checkpoints = self._last_progress.get("checkpoint_hashes")
        now_s = time.monotonic()
        if due or checkpoints != self._stored_checkpoints or now_s - self._built_at >= PROGRESS_BUILD_S:
            heavy = {"history": self._history_payload(), "credit": self.credit.to_record(),
                     "unverified": self.coordinator.verification.ledger.to_record()}
            if self.discarded is not None:  # the last healed partition's lost work stays in view
                heavy["discarded"] = dict(self.discarded)
            self._heavy, self._built_at = heavy, now_s
        if due or checkpoints != self._stored_checkpoints:
            self._store()

    def _store(self) -> None:
        """Store the newest progress with the history and credit last built (a beat, from the daemon's thread,
        reads both dicts but changes neither)."""
        light = self._last_progress
        self._stored_checkpoints = light.get("checkpoint_hashes")
        self.ctx.progress.publish({**light, **self._heavy})

    def _sign_step(self, epoch: int, trained: int) -> None:
        """Sign the record of ``trained`` steps that every start_step carries from now on (peer.node.step_record)."""
        identity = self.ctx.progress.store.identity
        if identity is None or self.driver is None:
            return
        hashes = self.driver.digests.at(trained) or {}
        self.coordinator.note_trained(sign_record(identity, self.spec.run_id, StepRecord(epoch, trained, hashes)))

    def _on_pause(self, pause: dict[str, Any] | None) -> None:
        """The driver waits for enough live peers to hold the stages (``pause``), or trains on (None)."""
        self.pause = pause
        rest = {k: v for k, v in self._last_progress.items() if k != "paused"}
        if pause is None:
            self._publish({**rest, "state": "training"})
        else:
            self._publish({**rest, "state": "paused", "paused": dict(pause)})

    def beat(self) -> None:
        """Renew the progress record (called every tick): followers see a live leader even between steps."""
        self._store()

    def _on_replan(self, info: dict[str, Any]) -> None:
        self.losses.forget_from(info["step"])  # a rollback redoes these steps
        plan = {
            "stages": info["stages"],
            "pipelines": [[self.peer_of[dv] for dv in p] for p in info["pipelines"]],
            "step": info["step"],
            "reason": info["reason"][:200],
            "coordinator": self.coordinator.endpoint,
            "credited": sorted(self.credited)[:MAX_CREDITED],
        }
        self.published_credited = set(self.credited)
        self.credit.plan(pid for pipe in plan["pipelines"] for pid in pipe)
        waive = self.waived is not None and self.waive_epoch == self.ctx.plan_board.highest_epoch
        if waive:
            plan["quorum_waived"] = dict(self.waived or {})
        try:
            stored = self.ctx.plan_board.publish(info["epoch"], self.ctx.peer_id, plan, members=sorted(self._workers()),
                                                 waive_quorum=waive)
        except ValueError as exc:  # a newer plan was accepted meanwhile, or the quorum was lost: stop leading
            raise InterruptedError(f"plan of epoch {info['epoch']} not published: {exc}") from None
        if not stored:
            log.warning("plan of epoch %d was not stored in the DHT", info["epoch"])
        self._sign_step(info["epoch"], info["step"])
        self._publish({"epoch": info["epoch"], "step": info["step"], "state": "training"})

    def _adopt_history(self, trained: int, progress: dict[str, Any] | None = None, since: int = 0) -> None:
        """Take the loss history of steps ``since`` .. ``trained`` - 1, with the reasons of the steps it lacks
        (``adopt_history``), and the contribution record from a progress record (default: the newest read of
        the previous plan's leader's)."""
        if progress is None:
            progress = self._read_predecessor()
        self.credit = CreditBook.from_record(progress.get("credit"))  # signed by that leader: no worker wrote it
        self.losses.adopt(progress, trained, since)

    def _history_payload(self) -> dict[str, Any]:
        return self.losses.payload()

    def _on_step(self, report: StepReport) -> None:
        loss = report.loss if math.isfinite(report.loss) else None  # a micro-batch's loss report was refused or lost
        self.losses.record(report.step, loss, report.seconds)
        tokens_per_s = self._tokens_per_step / report.seconds if report.seconds > 0 else 0.0
        log.info("step %d: loss %s, %.3f s, %.0f tokens/s", report.step, "-" if loss is None else f"{loss:.4f}",
                 report.seconds, tokens_per_s)
        assert self.driver is not None
        for r in report.applied:  # accepted work: the peers of each pipeline that applied the step
            if 0 <= r < len(self.driver.pipelines):
                self.credited.update(self.peer_of[d] for d in self.driver.pipelines[r] if d in self.peer_of)
        self.driver.replan_when_a_peer_joins(bool(self.credited - self.published_credited))
        credit_step(self.credit, report, self.driver.pipelines, self.peer_of, self.coordinator, self._act_bytes)
        self.scalars.add(report.step, {"train/loss": report.loss, "train/tokens_per_s": tokens_per_s,
                                       "train/step_s": report.seconds, "swarm/plan_epoch": self.driver.epoch,
                                       "swarm/peers": len(self._workers())})
        self._sign_step(self.driver.epoch, report.step + 1)  # before the next start_step: the takeover's bound
        self._publish({"epoch": self.driver.epoch, "step": report.step + 1, "loss": loss, "step_s": report.seconds,
                       "tokens_per_s": tokens_per_s, "state": "training",
                       **signed_hashes(self.driver, report.step + 1)}, due=False)

    def _finish(self) -> None:
        save = self.config.swarm.save_dir
        if save and self.driver is not None:
            self.save(Path(save))
        final = self.driver.reports[-1] if self.driver and self.driver.reports else None
        self._publish({"epoch": self.driver.epoch if self.driver else 0, "step": self.config.run.steps,
                       "loss": final.loss if final else None, "state": "done"})
        log.info("run finished: %d steps", self.config.run.steps)

    def save(self, folder: Path) -> None:
        """Final parameters of every stage (torch state dicts by parameter name) and run.json."""
        assert self.driver is not None and self.driver.stages is not None
        folder.mkdir(parents=True, exist_ok=True)
        saved = save_stages(verified_states(self.coordinator.live_states, self.driver.stages, self.driver.digests,
                                            self.driver.trained), self.spec, folder)
        live = self._workers()
        peers = {
            d: {
                "peer_id": pid,
                "emu": live[pid].extra.get("emu") if pid in live else None,
                "region": live[pid].extra.get("region") if pid in live else None,
            }
            for pid, d in self.index.items()
        }
        run = {
            "config": self.config.public_dict(),
            "spec": self.spec.to_dict(),  # the resolved model (config dict), what `peer export` reads
            "stages": self.driver.stages,
            "peers": peers,
            "plan": self.driver.events.replans[-1] if self.driver.events.replans else None,
            "plans": self.driver.events.replans,
            "rollbacks": self.driver.events.rollbacks,
            **self.losses.run_fields(),  # loss, step_s, and loss_missing: why a loss there is null
            "microbatches_per_pipeline": [r.microbatches_per_pipeline for r in self.driver.reports],
            "record": assignment_record(self.driver.reports),  # replayable (peer.compute.reference)
            "credit": self.credit.to_record(),  # each identity's verified work (peer.swarm.credit)
        }
        (folder / "run.json").write_text(json.dumps(publishable(run), indent=1, default=str))
        log.info("saved %d stage(s) and run.json to %s", len(saved), folder)


def activation_bytes(spec: RunSpec) -> int:
    """One micro-batch's activation between two stages, uncompressed (what ``bytes_served`` credits per hop)."""
    w = workload_for(spec)
    return w.micro_batch * w.seq_len * w.d_model * w.act_bytes


def credit_step(book: CreditBook, report: StepReport, pipelines: Pipelines, peer_of: dict[int, str],
                coordinator: Coordinator, act_bytes: int = 0) -> None:
    """Credit an applied step to the peers of the pipelines in its commit record, and record the exclusions the
    coordinator made since the last step (a culprit named by the checks earns nothing for the work redone)."""
    committed = {r: report.microbatches_per_pipeline.get(r, 0) for r in report.applied}
    book.step(report.step, report.seconds, committed, [[peer_of.get(d, "") for d in p] for p in pipelines], act_bytes)
    for plan_epoch, peer, reason in coordinator.take_exclusions():
        book.exclude(plan_epoch, peer, reason)


def _slowest_measured(peer_of: dict[str, str], reports: list[LinkReport]) -> Callable[[str], float | None]:
    """endpoint -> the slowest bandwidth (bit/s) measured from that worker (None: nothing measured): how long a
    large message may hold up a ping to it (the coordinator's liveness)."""
    slowest: dict[str, float] = {}
    for r in reports:
        if r.measured and r.bandwidth_bps > 0:
            slowest[r.src] = min(slowest.get(r.src, r.bandwidth_bps), r.bandwidth_bps)
    return lambda endpoint: slowest.get(peer_of.get(endpoint, ""))


@dataclass(frozen=True)
class Claims:
    """What a new leader makes of the workers' Status replies: the step the run stands at (None: nobody holds
    a stage), the workers to tell to apply the step the previous leader left half-applied, and the workers
    whose claims cannot be true, with why."""

    top: int | None
    pending: list[str]
    liars: dict[str, str]


def save_stages(states: dict[tuple[int, int], dict[str, Any]], spec: RunSpec, folder: Path) -> set[int]:
    """Write each stage's final parameters (a torch state dict by parameter name) as ``stage-<i>.pt``."""
    for (stage, _), state in states.items():
        first, last = state["layers"]
        named = unflatten_stage(spec.model, first, last, state["params"])
        torch.save({name: t.clone() for name, t in named.items()}, folder / f"stage-{stage}.pt")
    return {stage for stage, _ in states}


def recorded_progress(progress: dict[str, Any]) -> tuple[int | None, dict[tuple[int, int], str]]:
    """A progress record's trained ``step`` (None: not a step count) and its ``stage_hashes`` ([[first, last,
    hash], ...]) as layers -> hash; anything malformed is dropped (signed by the leader, read as hostile all the
    same)."""
    step, value = progress.get("step"), progress.get("stage_hashes")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return None, {}
    out: dict[tuple[int, int], str] = {}
    if not isinstance(value, list):
        return step, out
    for item in value[:MAX_RECORDED_STAGES]:
        if (isinstance(item, list) and len(item) == 3 and all(type(x) is int for x in item[:2])
                and isinstance(item[2], str) and 0 < len(item[2]) <= MAX_HASH):
            out[(item[0], item[1])] = item[2]
    return step, out


def signed_hashes(driver: RunDriver, trained: int) -> dict[str, Any]:
    """The hashes a leader signs in its progress record: the parameters' per stage at ``trained`` (when the replicas
    agreed on them) and per stage of its newest checkpoints, and those checkpoints' manifests (read back by
    ``recorded_progress``, ``recorded_checkpoints`` and ``recorded_manifests``)."""
    digests = driver.digests.at(trained)
    return {"stage_hashes": [[a, b, h] for (a, b), h in sorted(digests.items())] if digests else None,
            "checkpoint_hashes": [[t, a, b, h] for t, d in sorted(driver.recovery.checkpoint_digests.items())
                                  for (a, b), h in sorted(d.items())],
            "checkpoint_manifests": [[t, h] for t, h in sorted(driver.recovery.checkpoint_manifests.items())]}


def recorded_manifests(value: Any) -> dict[int, str]:
    """A progress record's ``checkpoint_manifests`` ([[step, sha256], ...]): the manifest a peer's checkpoint copy
    of that step must have before any of its files is deserialised; anything malformed is dropped."""
    items = value[:KEPT_DIGESTS] if isinstance(value, list) else []
    return {item[0]: item[1] for item in items if isinstance(item, list) and len(item) == 2 and type(item[0]) is int
            and isinstance(item[1], str) and len(item[1]) == 64}


def recorded_checkpoints(value: Any) -> dict[int, dict[tuple[int, int], str]]:
    """A progress record's ``checkpoint_hashes`` ([[step, first, last, hash], ...]) as step -> layers -> hash
    (what a peer's checkpoint copy of that step must match); anything malformed is dropped."""
    out: dict[int, dict[tuple[int, int], str]] = {}
    for item in value[:KEPT_DIGESTS * MAX_RECORDED_STAGES] if isinstance(value, list) else []:
        if (isinstance(item, list) and len(item) == 4 and all(type(x) is int for x in item[:3])
                and isinstance(item[3], str) and 0 < len(item[3]) <= MAX_HASH):
            out.setdefault(item[0], {})[(item[1], item[2])] = item[3]
    return out


def judge_claims(statuses: dict[str, dict[str, Any]], stages: Stages, recorded: int | None,
                 digests: dict[tuple[int, int], str] | None = None) -> Claims:
    """Decide the takeover step from the workers' claims, checked against the previous leader's record.

    The record says the run had trained ``recorded`` steps; the only honest way past it is a leader that died
    while telling the workers to apply step ``recorded``, so a claim beyond ``recorded + 1``, or of layers no
    stage of the run has, is a lie (one below it is a laggard: it holds no stage at the run's step). With the
    record's parameters hash of a stage (``digests``), a claim of that stage at ``recorded`` whose hash differs
    is a lie too (one without a hash is a laggard). The run moves on to ``recorded + 1`` only when, in every
    stage, a strict majority of the workers that claim it either applied that step or hold its averaged
    gradient (a lone claim cannot make others apply a step their stage never averaged). Without a record, the
    step at least half of the claims reach stands in for it."""
    liars: dict[str, str] = {}
    claims: dict[str, tuple[int, int, Any]] = {}  # endpoint -> (stage index, trained steps, pending apply)
    for ep, st in statuses.items():
        t, layers, h = st.get("trained_steps"), st.get("layers"), st.get("params_hash")
        if t is None:
            continue  # holds no stage
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            liars[ep] = f"trained_steps {t!r} is not a step count"
        elif not isinstance(layers, list) or len(layers) != 2 or tuple(layers) not in stages:
            liars[ep] = f"it claims layers {layers!r}, which no stage of the run has"
        elif recorded is not None and t > recorded + 1:
            liars[ep] = f"it claims {t} trained steps; the leader recorded {recorded}"
        elif t == recorded and (want := (digests or {}).get(tuple(layers))) is not None and h != want:
            if isinstance(h, str) and h:
                liars[ep] = f"its stage {layers} at step {t} hashes {h[:MAX_HASH]!r}; the leader recorded {want}"
        else:
            claims[ep] = (stages.index(tuple(layers)), t, st.get("pending_apply"))
    if not claims:
        return Claims(None, [], liars)
    if recorded is None:
        ordered = sorted(t for _, t, _ in claims.values())
        recorded = ordered[(len(ordered) - 1) // 2]
        for ep in [ep for ep, (_, t, _) in claims.items() if t > recorded + 1]:
            liars[ep] = f"it claims {claims.pop(ep)[1]} trained steps; most peers claim at most {recorded}"
    ahead = {ep for ep, (_, t, p) in claims.items() if t == recorded + 1 or (t == recorded and p == recorded)}
    forward = any(t == recorded + 1 for _, t, _ in claims.values())
    for stage in range(len(stages)):
        group = [ep for ep, (s, _, _) in claims.items() if s == stage]
        forward = forward and 2 * len(ahead & set(group)) > len(group)
    if not forward:
        return Claims(recorded, [], liars)
    pending = sorted(ep for ep, (_, t, p) in claims.items() if t == recorded and p == recorded)
    return Claims(recorded + 1, pending, liars)


def predecessor_progress(ctx: LeaderContext, stop: threading.Event) -> dict[str, Any]:
    """The newest progress record the previous plan's leader signed ({} without a previous plan), read patiently
    (``ProgressBoard.read_patiently``: a lookup right after a leader's death can miss it)."""
    previous = ctx.plan_board.latest()
    if previous is None:
        return {}
    patience_s = PREDECESSOR_READ_HEARTBEATS * ctx.config.swarm.heartbeat_s
    return dict(ctx.progress.read_patiently(previous.leader_id, patience_s, stop.wait) or {})
