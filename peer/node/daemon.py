"""The peer daemon: what `peer start` and `peer join` run on a volunteer's machine.

One process holds: a hivemind DHT node (membership, plans, progress), a stage worker (gRPC server: compute
and data plane), a heartbeat that re-announces this peer's signed advert, a link prober, and a control loop
that derives the leader from the live adverts. The peer the loop elects runs a
:class:`~peer.node.leader_role.LeaderRole` (coordinator + planner) next to its worker. What the loop reads of
the DHT, and when, is :class:`~peer.swarm.view.SwarmView`'s: every advert only while it leads, has no
confirmed leader, suspects the leader or holds no assignment; otherwise one small record (the leader's beat)
a heartbeat, so a worker's DHT reads do not grow with the swarm.

Life cycle: start -> announce -> (lead or follow) -> the run reports "done" -> leave. SIGINT/SIGTERM leave
gracefully: the leader writes a checkpoint if it has a checkpoint folder, then everyone stores a departure
record so the others notice within a heartbeat instead of after the advert expires.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from tasklet.peer.compute.device_probe import DeviceInfo, measure_device
from tasklet.peer.config import RunConfig
from tasklet.peer.identity.keys import Identity
from tasklet.peer.net import local
from tasklet.peer.net.endpoint import EndpointError, parse_endpoint
from tasklet.peer.net.limits import raise_nofile
from tasklet.peer.net.relay import relay_key
from tasklet.peer.net.shaping import set_download_cap, set_upload_cap
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.node.control_socket import OwnerControl, open_control
from tasklet.peer.node.emulated_links import EmulatedLinks, Emulation, NetworkModel, emulated_device
from tasklet.peer.node.join_watch import JoinWatch, WatchSources
from tasklet.peer.node.joining import JoinError, check_files, find_run
from tasklet.peer.node.leader_role import LeaderContext, LeaderRole
from tasklet.peer.node.leadership import Leadership
from tasklet.peer.node.prober import LinkProber, ProbeSources
from tasklet.peer.node.reachability import Reach, ReachabilityError, establish, refuse_undialable
from tasklet.peer.node.roles import Action, State
from tasklet.peer.node.schedule import Schedule, leaves_at
from tasklet.peer.node.watch import CoordinatorWatch, signed_step
from tasklet.peer.observe.node import NodeObserver, ObserveError, ObserveOptions
from tasklet.peer.observe.phases import PhaseReporter
from tasklet.peer.observe.snapshot import SwarmSource
from tasklet.peer.runtime.lead.driver import RunDriver
from tasklet.peer.runtime.stage.worker import StageWorker
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.dht import (
    DHT_OPS,
    DHTConfig,
    DHTStartError,
    ops_delta,
    reconnect,
    restrict_writers,
    start_dht,
    visible_maddrs,
)
from tasklet.peer.swarm.membership import ClockSkewError, Membership
from tasklet.peer.swarm.plans import PlanBoard, PlanRecord
from tasklet.peer.swarm.progress import ProgressBoard
from tasklet.peer.swarm.records import RunRecordValidator, record_key
from tasklet.peer.swarm.view import SwarmView
from tasklet.peer.timing import (
    ADVERT_TTL_HEARTBEATS,
    DHT_RECONNECT_HEARTBEATS,
    EXIT_COPY_WAIT_S,
    EXIT_STEP_WAIT_S,
    HEARTBEAT_S,
    PLAN_RENEW_TICKS,
    TICKS_PER_HEARTBEAT,
    TRUST_KEEP_MIN_S,
    now,
)

log = logging.getLogger(__name__)

COORDINATOR_THREADS = 64  # extra worker-server threads for a coordinator mounted on it
DHT_JOIN_ATTEMPTS = 4  # joining through a node too busy to answer the DHT's ping is tried this often
BUSY_BOOTSTRAP = "none of the initial_peers responded to a ping"  # hivemind's words for that
OPS_LOG_HEARTBEATS = 5  # the daemon logs its DHT gets and stores per heartbeat this often
STEWARDS_READ_HEARTBEATS = 2  # the organiser's steward records are read this often


class DaemonError(RuntimeError):
    """A one-line reason why the peer cannot start or go on (shown to the user without a traceback)."""


@dataclass
class PeerOptions:
    """Command-line options of one peer (see `peer join --help`)."""

    host: str = "127.0.0.1"
    port: int = 0
    dht_host: str = "127.0.0.1"
    dht_port: int = 0
    announce: str | None = None
    identity: str | None = None
    secret: str | None = None
    run_id: str = "tasklet"
    device: str = "auto"
    emulate_tflops: float | None = None
    emulate_device: int | None = None
    resume: bool = False
    measure_seconds: float = 1.0
    metrics_port: int | None = None  # serve /metrics here (0: a free port); None: off
    dashboard_port: int | None = None  # serve the swarm dashboard here; None: off
    progress: bool = False  # the join phases and progress on stderr (peer.observe.phases); False: silent
    json_log: bool = False  # --json-log: phase events as JSON log records instead of lines and bars
    relay_port: int | None = None  # serve a relay for peers behind NAT on this port of --host; None: off
    bulk_port: int | None = 0  # the bulk lane's port on --host (peer.net.bulk_server); 0: a free one, None: off
    # the owner's limits, honoured by the plan (advertised) and, for upload, by the transport's shaper
    max_vram_gb: float | None = None
    max_upload_mbps: float | None = None
    max_download_mbps: float | None = None
    state_dir: str | None = None  # the control socket's folder; None: the --identity file's, or no socket
    schedule: Schedule | None = None  # the owner's availability hours (peer.node.schedule); None: always
    local_paths: dict[tuple[str, str], str] = field(default_factory=dict)  # a joiner's own (peer.node.joining)
    organiser: str | None = None  # the organiser's peer id of the join line; None: the only one the DHT names


def bulk_lane_port(announce: str | None, bulk_port: int | None) -> int | None:
    """The bulk lane's port for a peer's options: off (None) when an address is announced and no lane port was
    chosen, since the ports an announced address forwards are the user's choice, and a lane on a port picked
    now is not among them (peers outside would wait for it before falling back to gRPC)."""
    if announce and bulk_port == 0:
        log.info("--announce without --bulk-port: the bulk lane is off (give --bulk-port and forward it)")
        return None
    return bulk_port


class PeerDaemon:
    """One peer. ``config`` is given to the first peer (`peer start`); joiners read it from the DHT."""

    def __init__(self, opts: PeerOptions, dht_peers: list[str], config: RunConfig | None = None,
                 emulation: Emulation | None = None) -> None:
        """``emulation``: what an emulated run's peer emulates (peer.node.emulated_links); None: a real peer."""
        self.opts = opts
        self.dht_peers = dht_peers
        self.config = config
        self.identity = Identity.load_or_create(opts.identity)
        # mutual TLS with a certificate of the identity key; trust = peers with a live, verified advert
        self.tls = TlsContext(self.identity)
        self.trust = AdvertTrust(self.tls)
        self.dht: Any = None
        self.worker: StageWorker | None = None
        self.membership: Membership | None = None
        self.plan_board: PlanBoard | None = None
        self.progress: ProgressBoard | None = None
        self.view: SwarmView | None = None
        self.emulation = emulation
        self.network: NetworkModel | None = None
        self.declared_tflops: float | None = None  # this peer's emulated speed (None: measured)
        self._emulated_extra: dict[str, Any] = {}  # the advert's emulated device and region
        self.role: LeaderRole | None = None
        self.leadership: Leadership | None = None  # the organiser's policy and this peer's role (from _join_run)
        self.observer: NodeObserver | None = None
        self.phases = PhaseReporter.for_stream(sys.stderr, enabled=opts.progress, json_log=opts.json_log)
        self.watch: JoinWatch | None = None  # feeds self.phases once a heartbeat (from start)
        self.done = threading.Event()
        self.stop_requested = threading.Event()
        self._live: list[Advert] = []
        self._live_lock = threading.Lock()
        self.prober: LinkProber | None = None
        self.advert: Advert | None = None
        self.links = EmulatedLinks(None, lambda: self.advert, self.live_adverts)
        self._ticks = 0
        self._ops_mark: tuple[dict[str, int], int] = ({}, 0)  # DHT_OPS snapshot and tick of the last ops line
        self._announced_at = time.monotonic()
        self.exit_error: str | None = None
        self.control: OwnerControl | None = None  # pause, resume, schedule (peer.node.control_socket)
        self.reach: Reach | None = None
        self.organiser = ""  # the run's organiser (its signature is the run record's root of trust)

    # ------------------------------------------------------------------------------------------- start-up
    def start(self) -> None:
        """Join the swarm; raise DaemonError (one line) when that is impossible."""
        o = self.opts
        set_upload_cap(None if o.max_upload_mbps is None else o.max_upload_mbps * 1e6)
        set_download_cap(None if o.max_download_mbps is None else o.max_download_mbps * 1e6)
        phases: dict[str, float] = {"process": _process_age_s()}
        mark = time.monotonic()

        def phase(name: str) -> None:
            nonlocal mark
            phases[name] = time.monotonic() - mark
            mark = time.monotonic()

        raise_nofile()  # before any port opens: the listeners' connection caps are derived from this limit
        try:
            refuse_undialable(o.host, o.announce, self.dht_peers, self.config is not None, o.relay_port)
        except ReachabilityError as exc:
            raise DaemonError(str(exc)) from None
        config = DHTConfig(initial_peers=tuple(self.dht_peers), host=o.dht_host, port=o.dht_port,
                           announce_host=_host_of(o.announce))
        run_id = self.config.run.run_id if self.config else o.run_id
        secret = (self.config.swarm.secret if self.config else "") or o.secret or None
        guard = RunRecordValidator(run_id, None if secret is None else record_key(secret, run_id))
        self.dht = _join_dht(config, self.identity, guard)
        phase("dht")
        try:
            self._join_run()
            phase("run")
            self._start_worker()
            phase("worker")
            self._establish_reach()
            phase("reach")
            self._announce()
            phase("announce")
            self._start_observer()
            self.control, self.watch = open_control(self), join_watch(self)
            log.info("others can join through this peer: %s", self.join_line())
            # seconds of each start-up phase ("process": from the process's start to here, imports included)
            log.info("start-up phases %s", json.dumps({k: round(v, 2) for k, v in phases.items()}))
        except BaseException:
            self.shutdown()
            raise

    def _join_run(self) -> None:
        o = self.opts
        run_id = self.config.run.run_id if self.config else o.run_id
        try:
            found = find_run(self.dht, run_id, o.secret or None, self.config, o.local_paths, o.organiser)
            files = check_files(found.config, found.existing)
        except JoinError as exc:
            raise DaemonError(str(exc)) from None
        self.started_run = found.existing is None
        self.config, existing = found.config, found.existing
        self.opts = o = replace(o, secret=found.secret)  # the run's secret, as found (an invite's, or the config's)
        self.spec, self._corpus = files.spec, files.corpus
        self.membership = Membership(
            self.dht, run_id, self.identity, o.secret or None, heartbeat_s=self.config.swarm.heartbeat_s
        )
        self.membership.use_live_extra(lambda: live_extra(self.worker))
        self.plan_board = PlanBoard(self.dht, run_id, self.identity, o.secret or None, elector=self.elected)
        self.progress = ProgressBoard(self.dht, run_id, self.identity, o.secret or None)
        self.view = SwarmView(self.membership, self.plan_board, self.progress)
        if existing is None:
            record = self.membership.publish_run(files.record(self.config))
        else:
            try:  # the median of the credited peers' clocks: free identities cannot refuse us
                self.membership.check_clock(witnesses=self.view.credited(self.membership.live_entries()))
            except ClockSkewError as exc:
                raise DaemonError(str(exc)) from None
            self.membership.adopt_run(existing)
            record = existing
        self.organiser = record.organiser
        self.leadership = Leadership(self.identity.peer_id, self.config.run.steps, self.config.swarm.heartbeat_s,
                                     self.config.swarm.leaders, self.view, self.membership, self.live_adverts,
                                     guard=partial(restrict_writers, self.dht))
        self.leadership.adopt(record.organiser)
        try:
            self.network, self.declared_tflops, self._emulated_extra = emulated_device(
                self.emulation, self.config.emulation, o.emulate_tflops, o.emulate_device)
        except ValueError as exc:
            raise DaemonError(str(exc)) from None
        self.links = EmulatedLinks(self.network, lambda: self.advert, self.live_adverts, self.membership.live_peers)
        self.prober = LinkProber(self.identity.peer_id, self.tls, ProbeSources(
            self.live_adverts, self.elected, self._followed_plan, self.links.link, self.membership.report_links,
        ), self.spec.seed)

    def _start_worker(self) -> None:
        o = self.opts
        bulk_port = bulk_lane_port(o.announce, o.bulk_port)
        self.worker = StageWorker(
            o.host,
            o.port,
            bulk_port=bulk_port,
            peer_id=self.identity.peer_id,
            device="cpu" if o.device == "auto" and self.declared_tflops else o.device,
            tls=self.tls,
            clock=None if self.declared_tflops is None or self.emulation is None
            else self.emulation.clock(self.declared_tflops),
            links=self.links.by_endpoint if self.network is not None else None,
            # copies of the leader's checkpoints (a new leader on another host resumes from them)
            checkpoint_copies=(Path(self.config.swarm.checkpoint_dir) / "copies"
                               if self.config.swarm.checkpoint_dir else None),
        )
        assert self.leadership is not None
        self.worker.set_policies(
            may_assign=self.leadership.may_assign,  # the elected leader's orders only
            may_dial=self.leadership.may_dial,  # naming only live peers of the run
            on_refused=self.leadership.refuse,  # and keeping to the signed run
            on_fetch=self.phases.fetch_progress,  # a stage's state arriving, shown
        )
        self.worker.server.reserve_threads(COORDINATOR_THREADS)  # in case this peer leads (coordinator mounted)
        try:
            self.endpoint = self.worker.start(compute_thread=False)  # run() serves it
        except OSError as exc:
            raise DaemonError(f"{exc}: the address is in use or not available (--host/--port)") from None
        self.worker.server.set_reply_shaper(self.links.reply_shaper)
        self.worker.preload_corpus(self._corpus, self.spec)  # and this peer's own paths, not the leader's
        if o.announce:
            self.endpoint = o.announce

    def _establish_reach(self) -> None:
        """Direct, or through a relay when nobody can dial this peer (peer.node.reachability)."""
        o = self.opts
        assert self.worker is not None and self.membership is not None and self.worker.server.port is not None
        me, membership = self.identity.peer_id, self.membership

        def relays() -> list[str] | None:
            others = [a for a in membership.live_peers() if a.peer_id != me]
            return [a.relay for a in others if a.relay] if others else None

        try:
            key = relay_key(o.secret, self.config.run.run_id) if o.secret and self.config else None
            self.reach = establish(self.identity, o.host, self.worker.server.port, o.announce, o.relay_port, relays,
                                   is_first=self.started_run, key=key)
        except ReachabilityError as exc:
            raise DaemonError(str(exc)) from None
        self.endpoint = self.reach.endpoint
        self._serve_own_calls()

    def _serve_own_calls(self) -> None:
        """This process's calls to its own endpoints (the leader's to its worker, and back) skip the network."""
        assert self.worker is not None
        local.publish(self.worker.server.endpoint, self.worker.server)
        local.publish(self.endpoint, self.worker.server)

    def _announce(self) -> None:
        o = self.opts
        tflops, extra = self.declared_tflops, self._emulated_extra
        self.phases.measuring("this device: matmul speed and memory")
        device = measure_device("cpu" if tflops else o.device, emulate_tflops=tflops, seconds=o.measure_seconds)
        device, extra = owner_limits(device, extra, o)
        assert self.worker is not None
        self.worker.limit_memory(device.memory_bytes)  # what the plan may give this peer, and no more
        self.advert = Advert(
            peer_id=self.identity.peer_id,
            endpoint=self.endpoint,
            device=device,
            started_at=now(),
            corpus=self.spec.corpus_fingerprint,
            extra=extra,
            reachable=self.reach.reachable,
            relay=self.reach.relay_address,
            cert=self.tls.certificate_text,
            dials_from=self.reach.dials_from,
            dht=str(self.dht.peer_id),  # others ask it when it is reachable; its finds are a member's either way
        )
        assert self.membership is not None
        self.membership.announce(self.advert)
        self._announced_at = time.monotonic()
        log.info("peer %s announced: %s, %.4g TFLOP/s%s, gRPC at %s", self.identity.peer_id, device.name,
                 device.tflops, " (emulated)" if device.emulated else "", self.endpoint)

    def announce_as_newcomer(self, extra: dict[str, Any]) -> None:
        """Announce again with ``extra`` as a newcomer (back from a pause): a new start time, so it does not take the
        lead back, and the guard against leading too early starts over."""
        assert self.advert is not None and self.membership is not None
        self.advert = replace(self.advert, started_at=now(), extra=extra)
        self._announced_at = time.monotonic()
        self.membership.announce(self.advert)

    def _start_observer(self) -> None:
        """/metrics, the optional dashboard (read-only boards of its own) and terminal progress."""
        o = self.opts
        assert self.config is not None and self.membership is not None and self.worker is not None
        run_id, secret = self.spec.run_id, o.secret or None
        plans, progress = PlanBoard(self.dht, run_id, None, secret, elector=self.elected), ProgressBoard(
            self.dht, run_id, None, secret
        )
        source = SwarmSource(
            self.membership.live_entries,
            self.membership.links,
            plans.latest,
            lambda: progress.read(_progress_leader(plans.latest(), self.elected())),
            self.membership.get_run,
            lambda: self.leadership.summary() if self.leadership is not None else None,
        )
        opts = ObserveOptions(o.host, o.metrics_port, o.dashboard_port, o.progress and not self.phases.fancy,
                              self.config.run.steps, max(2.0, self.config.swarm.heartbeat_s))
        try:
            self.observer = NodeObserver(opts, run_id, source, self.worker.status)
        except ObserveError as exc:
            raise DaemonError(str(exc)) from None
        for what, url in (("metrics", self.observer.metrics_url), ("dashboard", self.observer.dashboard_url)):
            if url:
                log.info("%s at %s", what, url)

    def join_line(self) -> str:
        """The command others run to join this swarm."""
        return format_join_line(visible_maddrs(self.dht)[0], self.spec.run_id, self.organiser, bool(self.opts.secret))

    # ------------------------------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Follow or lead until done or a signal arrives; return the exit status (compute here, control beside)."""
        assert self.worker is not None
        self.worker.run_beside(self._control_loop)  # torch on the main thread: docs/benchmarks/overhead.md
        return 0 if self.exit_error is None else 1

    def _control_loop(self) -> None:
        assert self.config is not None and self.view is not None
        period = self.config.swarm.heartbeat_s / TICKS_PER_HEARTBEAT
        prober = threading.Thread(target=self._probe_loop, name="prober", daemon=True)
        watch = CoordinatorWatch(self.config.swarm.heartbeat_s, self.tls, self.identity.peer_id,
                                 lambda: self.worker.assignment if self.worker else None,
                                 lambda: self.role is not None, self.elected, self.view.depose, self.stop_requested,
                                 progress_step=signed_step(self.view))
        threading.Thread(target=watch.run, name="coordinator-watch", daemon=True).start()
        while not self.done.is_set() and not self.stop_requested.is_set():
            self._tick()
            if not prober.is_alive() and not prober.ident:
                prober.start()  # after the first tick: the prober picks its targets from the adverts it read
            self.stop_requested.wait(period)

    def _tick(self) -> None:
        assert self.membership is not None and self.view is not None
        leading = self.role is not None and not self.role.finished.is_set()
        self.view.note_holding_plan(self.worker is not None and self.worker.assignment is not None)
        tick = self.view.tick(leading)
        if tick.entries is not None:
            entries = [entry.advert for entry in tick.entries]
            with self._live_lock:
                self._live = entries
            self._trust_adverts(entries)
        self._role_tick(tick.leader)
        if self.leadership is not None and self.leadership.state is State.DONE:
            return
        self._ticks += 1
        if self.dht_peers and self._ticks % (TICKS_PER_HEARTBEAT * DHT_RECONNECT_HEARTBEATS) == 0:
            reconnect(self.dht, self.dht_peers)  # a partitioned DHT merges again once the network heals
        paused = self.control is not None and self.control.paused  # a paused peer stays out until resumed
        if self._ticks % TICKS_PER_HEARTBEAT == 0 and self.reach is not None and not paused and self.reach.refresh():
            self.endpoint = self.reach.endpoint  # our relay went away: publish one that still holds us
            self._serve_own_calls()
            self.advert = replace(self.advert, endpoint=self.endpoint)
            self.membership.announce(self.advert)
        if self._ticks % TICKS_PER_HEARTBEAT == 0:  # once a heartbeat is enough to notice the end of the run
            progress = self.view.beat  # the leader's beat, read by the view once a heartbeat
            if self.observer is not None and self.watch is not None:
                self.observer.on_progress(progress, peers_live=self._peers_live(), is_leader=self.role is not None)
                self.watch.tick()
            assert self.leadership is not None
            self.leadership.on_progress(progress)
            if self.view.elected_beat is not progress:  # a leader elected but not yet planning is watched too
                self.leadership.on_progress(self.view.elected_beat)
            if self._ticks % (TICKS_PER_HEARTBEAT * STEWARDS_READ_HEARTBEATS) == 0:
                self.leadership.read_stewards()
        if self.role is not None and self._ticks % PLAN_RENEW_TICKS == 0 and self.plan_board is not None:
            self.plan_board.republish()  # the plan record lives PLAN_TTL_S; renew it well before (peer.timing)
        if self._ticks % (TICKS_PER_HEARTBEAT * OPS_LOG_HEARTBEATS) == 0:
            self._log_ops()

    def _role_tick(self, leader: str | None) -> None:
        """One step of the role machine (peer.node.leadership, peer.node.roles) and its actions."""
        assert self.leadership is not None
        me, role = self.identity.peer_id, self.role
        finished = role is not None and role.finished.is_set()
        stopped = finished and role.stopped is not None  # the lead given up before the run's end: not the end
        may_lead = leader == me and self.leadership.state is not State.LEADER and self._may_lead()
        for action in self.leadership.step(leader, may_lead, finished and not stopped,
                                           finished and role.error is not None, role_stopped=stopped):
            if action is Action.START_ROLE:
                log.info("this peer (%s) leads the swarm", me)
                self.role = LeaderRole(self._leader_context())
                self.role.start()
            elif action is Action.STOP_ROLE and self.role is not None:
                if stopped:
                    log.warning("this peer's leadership ended before the run's (%s); following", role.stopped)
                else:
                    log.warning("leadership moved to %s; stepping down", leader)
                self.role.stop()
                self.role = None
            elif action is Action.RESIGN:
                _resign(self.progress)  # our followers look for the new leader now, not when our beat has aged
            elif action is Action.LEAVE:
                if role is not None and role.error is not None:
                    self.exit_error = f"leader failed: {role.error}"
                elif self.worker is not None and self.worker.prune_copies(self.spec.run_id):
                    log.info("the run is over: its checkpoint copies on this peer are removed")
                self.done.set()
        if self.leadership.state is State.LEADER and self.role is not None and not self.role.finished.is_set():
            self.role.beat()

    def _peers_live(self) -> int:
        """Live peers as far as this peer knows: its last full read, or the members of the plan it follows."""
        plan = self.view.followed_plan() if self.view is not None else None
        if self.role is None and plan is not None and self.view is not None and self.view.holding_plan:
            return len(plan.members)
        return len(self.live_adverts())

    def _log_ops(self) -> None:
        """One line of this peer's DHT gets and stores per heartbeat since the last line (bench.formation reads
        it): what the control plane costs the swarm, by role."""
        role = "leader" if self.role is not None else ("worker" if self.view and self.view.holding_plan else "idle")
        self._ops_mark = _log_ops(self._ops_mark, self._ticks, role)

    def _leader_context(self) -> LeaderContext:
        """What the leader role may use of this daemon, and nothing more."""
        assert self.config is not None and self.membership is not None and self.worker is not None
        assert self.plan_board is not None and self.progress is not None
        return LeaderContext(
            peer_id=self.identity.peer_id,
            config=self.config,
            spec=self.spec,
            worker_server=self.worker.server,  # the coordinator shares the worker's (announced) port
            worker_endpoint=self.endpoint,
            resume=bool(self.opts.resume),
            plan_board=self.plan_board,
            progress=self.progress,
            live_adverts=self.live_adverts,
            links=self.membership.links,
            probe_links_now=self.probe_links_now,
        )

    def _trust_adverts(self, entries: list[Advert]) -> None:
        """Trust live adverts' certificates (:class:`AdvertTrust`)."""
        assert self.config is not None
        self.trust.saw(entries, max(TRUST_KEEP_MIN_S, self.config.swarm.heartbeat_s * ADVERT_TTL_HEARTBEATS))
        hosts = member_hosts(entries)  # the doors keep most of their connections for the members' hosts
        if self.worker is not None:
            self.worker.server.set_members(hosts)
        if self.reach is not None and self.reach.server is not None:
            self.reach.server.set_members(hosts)

    def elected(self) -> str | None:
        """The leader this peer elects now (not yet confirmed): the only peer whose plans it accepts.

        The election (``peer.swarm.view``) acts only on a result stable for LEADER_CONFIRM_TICKS full reads: a
        DHT read under load can miss adverts, and acting on one such read would make a follower believe it
        leads (and start a rival plan) or the leader step down."""
        return None if self.view is None else self.view.elected()

    def _may_lead(self) -> bool:
        """Guards against a peer that simply cannot see the leader yet (a fresh DHT view misses adverts):
        a joiner waits one advert lifetime after announcing itself, and nobody takes over while another
        leader's progress record is still fresh (the leader renews it every tick)."""
        assert self.config is not None and self.membership is not None
        assert self.plan_board is not None and self.progress is not None
        ttl = self.membership.ttl_s
        if self.started_run is False and time.monotonic() - self._announced_at < ttl:
            return False
        beat = self.progress.read_beat(_progress_leader(self.plan_board.latest(), self.elected()))
        deposed = self.view is not None and self.view.is_deposed(str((beat or {}).get("leader")))
        if beat and beat.get("leader") != self.identity.peer_id and beat.get("state") not in ("done", "resigned") \
                and not deposed:  # a deposed leader's beat holds nobody back: its coordinator is gone
            age = now() - float(beat.get("at", 0.0))
            if age < ttl:
                return False
        return True

    def live_adverts(self) -> list[Advert]:
        with self._live_lock:
            return list(self._live)


    # ----------------------------------------------------------------------------------------- probing
    def _probe_loop(self) -> None:
        while not self.done.is_set() and not self.stop_requested.is_set():
            self.probe_links_now()
            self.stop_requested.wait(self.config.swarm.heartbeat_s if self.config else HEARTBEAT_S)

    def probe_links_now(self) -> None:
        """One round of link measurements (peer.node.prober), now."""
        if self.prober is not None:
            self.prober.probe_now()

    def _followed_plan(self) -> dict[str, Any] | None:
        plan = self.view.followed_plan() if self.view is not None else None
        return plan.plan if plan is not None else None

    def latest_progress(self) -> dict[str, Any] | None:
        """Progress (with the loss history) of the leader of the plan this peer follows (before any plan: of the
        elected leader): read on demand, never by the control loop."""
        assert self.progress is not None and self.plan_board is not None
        return self.progress.read(_progress_leader(self.plan_board.latest(), self.elected()))

    # ----------------------------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Leave gracefully: checkpoint (leader), departure record, stop serving, stop the DHT."""
        for part in (self.observer, self.control, self.phases):
            if part is not None:
                part.close()
        if self.role is not None:
            resigning = not self.role.finished.is_set()  # leaving before the end of the run
            if self.stop_requested.is_set() and self.role.driver is not None:
                _checkpoint_on_exit(self.role.driver, self.role.finished)
            self.role.stop()
            if resigning:
                _resign(self.progress)  # the others elect a new leader at once (see peer.swarm.view)
        if self.membership is not None:
            try:
                self.membership.leave()
            except Exception as exc:  # the DHT may already be unreachable
                log.info("leave: %s", exc)
        if self.worker is not None:
            local.withdraw(self.worker.server)
            self.worker.stop()
        if self.reach is not None:
            self.reach.close()
        if self.dht is not None:
            try:
                self.dht.shutdown()
            except Exception as exc:  # the child process may be gone already
                log.info("DHT shutdown: %s", exc)


class AdvertTrust:
    """The swarm's trusted certificates: each live advert's, for ``keep_s`` (at least TRUST_KEEP_MIN_S, an advert
    lifetime) after its last sighting, so that DHT reads missing an advert for a while (a DHT node died) do not cut
    a live peer off."""

    def __init__(self, tls: TlsContext) -> None:
        self.tls = tls
        self._trusted: dict[str, tuple[str, float]] = {}  # peer id -> (certificate, trusted until, monotonic)

    def saw(self, entries: list[Advert], keep_s: float) -> None:
        """The live adverts of one read: trust their certificates, forget those not seen for ``keep_s``."""
        now_s = time.monotonic()
        for a in entries:
            if a.cert:
                self._trusted[a.peer_id] = (a.cert, now_s + keep_s)
        self._trusted = {pid: v for pid, v in self._trusted.items() if v[1] > now_s}
        self.tls.trust.set_group("swarm", [cert for cert, _ in self._trusted.values()])


def stop_on_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set ``stop``: the daemon leaves the swarm (checkpointing first when it leads)."""
    def on_signal(signum: int, _frame: Any) -> None:
        log.warning("received %s; leaving the swarm", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def join_watch(d: PeerDaemon) -> JoinWatch:
    """What the phase reporter is told once a heartbeat (peer.node.join_watch), read from ``d`` and nothing more."""
    assert d.config is not None and d.leadership is not None and d.view is not None and d.worker is not None
    leadership, view, worker = d.leadership, d.view, d.worker
    sources = WatchSources(
        worker_status=worker.status,
        role_state=lambda: leadership.state,
        waiting_line=lambda: (leadership.summary() or {}).get("waiting"),
        beat=lambda: view.beat,
        elected=d.elected,
        leading=lambda: d.role is not None,
        followed_plan=view.followed_plan,
        paused_by=lambda: (d.control.paused_by or "owner") if d.control is not None and d.control.paused else None,
        probe_rounds=lambda: d.prober.rounds_done if d.prober is not None else 1,
        peers_live=lambda: len(d.live_adverts()),
        memory_bytes=lambda: d.advert.device.memory_bytes if d.advert is not None else None,
    )
    return JoinWatch(d.identity.peer_id, d.spec, d.config.run.steps, sources, d.phases)


def live_extra(worker: StageWorker | None) -> dict[str, Any]:
    """What the advert says of this peer's last applied step: the share of it its device computed."""
    last = None if worker is None else worker.loop.sync.times.last
    return {} if last is None else {"compute_share": round(last.compute_share, 3)}


def owner_limits(device: DeviceInfo, extra: dict[str, Any], o: PeerOptions) -> tuple[DeviceInfo, dict[str, Any]]:
    """The device and advert extras as the owner allows them to be planned: memory capped by --max-vram, the
    upload/download caps announced (``peer.node.planning.apply_owner_caps`` prices links with them), and when the
    owner's schedule ends the current window (``leaves_at``: the leader plans around it)."""
    if o.max_vram_gb is not None:
        device = replace(device, memory_bytes=min(device.memory_bytes, int(o.max_vram_gb * 1e9)))
    extra = dict(extra)
    for key, value in (("max_upload_mbps", o.max_upload_mbps), ("max_download_mbps", o.max_download_mbps),
                       ("leaves_at", leaves_at(o.schedule, datetime.now().astimezone()))):
        if value is not None:
            extra[key] = float(value)
    return device, extra


def _checkpoint_on_exit(driver: RunDriver, finished: threading.Event) -> None:
    """A leader leaving before the end: the step in flight ends first (the checkpoint then holds one step's states,
    all of them), then the checkpoint and its copies to peers, which outlive this host. Never raises."""
    try:
        driver.stop_event.set()
        if not finished.wait(EXIT_STEP_WAIT_S):
            log.warning("the step in flight did not end within %.0f s; checkpointing what answers", EXIT_STEP_WAIT_S)
        driver.checkpoint()
        driver.wait_for_copies(EXIT_COPY_WAIT_S)
    except Exception as exc:  # leaving must not fail because a checkpoint did
        log.warning("checkpoint on exit failed: %s", exc)


def _resign(progress: ProgressBoard | None) -> None:
    """Tell the followers this peer leads no more (they elect again at once, ``peer.swarm.view``)."""
    if progress is None:
        return
    try:
        progress.resign()
    except Exception as exc:  # the DHT may already be unreachable: the beat's age says the same, later
        log.info("resign: %s", exc)


def format_join_line(addr: str, run_id: str, organiser: str, sealed: bool) -> str:
    """The command others run to join a swarm: it names the organiser, whose signed run is the only one accepted."""
    line = f"peer join --dht {addr}"
    if run_id != "tasklet":
        line += f" --run {run_id}"
    line += f" --organiser {organiser}"
    return line + (" --secret <the swarm's secret>" if sealed else "")


def _log_ops(mark: tuple[dict[str, int], int], ticks: int, role: str) -> tuple[dict[str, int], int]:
    """Log the DHT gets and stores per heartbeat since ``mark`` (DHT_OPS snapshot, tick); the new mark."""
    before, tick = mark
    after = DHT_OPS.snapshot()
    heartbeats = (ticks - tick) / TICKS_PER_HEARTBEAT
    if heartbeats > 0:
        log.info("dht ops per heartbeat %s", json.dumps(_ops_summary(ops_delta(before, after), heartbeats, role)))
    return after, ticks


def _ops_summary(delta: dict[str, int], heartbeats: float, role: str) -> dict[str, Any]:
    """DHT gets, stores and rows read per heartbeat, in all and by record."""
    def per_heartbeat(prefix: str) -> float:
        return round(sum(n for k, n in delta.items() if k.startswith(prefix)) / heartbeats, 2)

    by_record = {k: round(n / heartbeats, 2) for k, n in sorted(delta.items())}
    return {"role": role, "heartbeats": heartbeats, "get": per_heartbeat("get:"), "store": per_heartbeat("store:"),
            "rows": per_heartbeat("rows:"), "by_record": by_record}


def member_hosts(adverts: list[Advert]) -> list[str]:
    """The hosts live members dial from as far as their adverts say: a direct endpoint's host, and a NAT'd peer's
    public address as its relay saw it (``dials_from``)."""
    hosts = []
    for a in adverts:
        with contextlib.suppress(EndpointError):
            endpoint = parse_endpoint(a.endpoint)
            if not endpoint.relayed:
                hosts.append(endpoint.host)
        if a.dials_from:
            hosts.append(a.dials_from)
    return hosts


def _progress_leader(plan: PlanRecord | None, elected: str | None) -> str | None:
    """Whose progress counts: the leader of the plan followed, or before any plan the elected leader."""
    return plan.leader_id if plan is not None else elected


def _process_age_s() -> float:
    """Seconds since this process started (Linux: /proc), or -1 where that cannot be read."""
    try:
        start_ticks = float(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def _host_of(announce: str | None) -> str | None:
    if not announce:
        return None
    host, _, _ = announce.rpartition(":")
    return host or None


def _join_dht(config: DHTConfig, identity: Identity, guard: RunRecordValidator) -> Any:
    """Start this peer's DHT node with the run's validator, retrying a bootstrap node that is only busy."""
    for attempt in range(DHT_JOIN_ATTEMPTS):
        try:
            return start_dht(config, identity, [guard])
        except DHTStartError as exc:
            # the node we join answered the connection but not the DHT's ping: busy (dozens of peers joining
            # through it at once), not wrong; a refused or unparsable address fails at once
            if BUSY_BOOTSTRAP not in str(exc) or attempt + 1 == DHT_JOIN_ATTEMPTS:
                raise DaemonError(str(exc)) from None
            log.warning("joining the DHT: %s; trying again (%d of %d)", exc, attempt + 2, DHT_JOIN_ATTEMPTS)
            time.sleep(random.uniform(1.0, 3.0))
    raise DaemonError("could not join the DHT")
