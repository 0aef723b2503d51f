"""Run a plan on this machine: bare worker processes driven by a coordinator in this process (no DHT, no daemons).

Used by tests and benchmarks (``peer swarm``, a swarm of whole daemons, is ``peer.emulation.daemon_swarm``).
Device ``i`` of the plan is a worker process listening on ``127.0.0.{i+2}``; with a ``LinkModel`` every worker
is given its link source and device clock (peer.emulation.network): it shapes what it sends to device ``j`` to
the scenario's bandwidth and one-way delay, and stretches its compute to the device's declared TFLOP/s.

Every process started here is ended by :meth:`LocalWorkers.close` (also on errors, via ``with``), and each
worker exits by itself when its parent dies.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tasklet.peer.emulation.network import LinkModel, loopback_device, loopback_host
from tasklet.peer.emulation.procs import launch, read_line
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.lead.coordinator import Coordinator, StepReport
from tasklet.peer.runtime.lead.driver import DriverConfig, Pipelines, Planner, RunDriver, RunEvents, Stages
from tasklet.peer.runtime.lead.step import TooFewPeersError
from tasklet.peer.runtime.spec import Assignment, RunSpec

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0
LOCAL_PEERS_WAIT_S = 60.0  # a local swarm short of devices waits this long for the test or bench to add some


@dataclass
class RunResult:
    """What a local run produced."""

    reports: list[StepReport]
    states: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    events: RunEvents = field(default_factory=RunEvents)

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.reports]

    @property
    def step_seconds(self) -> list[float]:
        return [r.seconds for r in self.reports]


class LocalWorkers:
    """Worker processes on loopback; ``endpoints[i]`` serves device ``i``. Devices can be added and killed."""

    def __init__(
        self,
        n: int,
        log_dir: str | os.PathLike[str] | None = None,
        log_level: str = "WARNING",
        faults: dict[int, str] | None = None,
        coordinator_cert: str = "",
        links: LinkModel | None = None,
    ) -> None:
        """``links``: the emulated network and devices every worker is started with (None: unshaped, real
        speed)."""
        self.n = n
        self.links = links
        self._links_dir: tempfile.TemporaryDirectory[str] | None = None
        self.coordinator_cert = coordinator_cert  # the one peer that may assign the workers (one-line form)
        self.certificates: dict[str, str] = {}  # endpoint -> certificate (one-line form) of each worker
        self.log_dir = Path(log_dir) if log_dir else None
        self.log_level = log_level
        self.faults = dict(faults or {})
        self.procs: list[subprocess.Popen[str]] = []
        self.endpoints: list[str] = []
        self._logs: list[IO[str]] = []
        self._add_lock = threading.Lock()
        self._spawn_lock = threading.Lock()

    def __enter__(self) -> LocalWorkers:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, i: int) -> subprocess.Popen[str]:
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "tasklet.peer.emulation.worker_main",
            "--host",
            loopback_host(i),
            "--peer-id",
            f"device-{i}",
            "--log-level",
            self.log_level,
        ]
        if i in self.faults:
            cmd += ["--fault", self.faults[i]]
        if self.coordinator_cert:
            cmd += ["--coordinator-cert", self.coordinator_cert]
        if self.links is not None:
            cmd += ["--links", str(self._links_file()), "--device", str(i)]
        # not in a group of their own: a worker starts no children, and exits by itself when its parent dies
        proc, log = launch(cmd, self.log_dir / f"worker-{i}.log" if self.log_dir else None, own_group=False)
        if log is not None:
            self._logs.append(log)
        return proc

    def _links_file(self) -> Path:
        """The emulated network as a file the worker processes read (written once)."""
        assert self.links is not None
        if self._links_dir is None:
            self._links_dir = tempfile.TemporaryDirectory(prefix="tasklet-links-")
            self.links.save(Path(self._links_dir.name) / "links.json")
        return Path(self._links_dir.name) / "links.json"

    def start(self) -> None:
        self.procs = [self._spawn(i) for i in range(self.n)]
        ready = [_read_ready(proc, i) for i, proc in enumerate(self.procs)]
        self.endpoints = [ep for ep, _ in ready]
        self.certificates = dict(ready)

    def add(self) -> int:
        """Start one more worker (a peer joining); return its device index. One add at a time."""
        with self._spawn_lock:
            i = len(self.procs)
            proc = self._spawn(i)
            try:
                endpoint, certificate = _read_ready(proc, i)
            except BaseException:
                proc.kill()
                proc.wait(timeout=5)
                raise
            with self._add_lock:  # live() must never see a process without its endpoint
                self.procs.append(proc)
                self.endpoints.append(endpoint)
                self.certificates[endpoint] = certificate
                self.n += 1
            return i

    def kill(self, device: int) -> None:
        """SIGKILL a worker: no goodbye, no flushing — a peer whose machine vanished."""
        proc = self.procs[device]
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def live(self) -> dict[int, str]:
        with self._add_lock:
            pairs = list(zip(self.procs, self.endpoints, strict=True))
        return {i: ep for i, (proc, ep) in enumerate(pairs) if proc.poll() is None}

    def close(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            if proc.stdout:
                proc.stdout.close()
        for f in self._logs:
            f.close()
        self.procs, self._logs = [], []
        if self._links_dir is not None:
            self._links_dir.cleanup()
            self._links_dir = None


def _read_ready(proc: subprocess.Popen[str], i: int) -> tuple[str, str]:
    """Wait (bounded) for the worker's ``READY host:port certificate`` line."""
    text = read_line(proc, READY_TIMEOUT_S, "READY ")
    if not text or len(text.split()) != 3:
        raise RuntimeError(f"worker {i} did not start within {READY_TIMEOUT_S:.0f} s (exit status {proc.poll()})")
    _, endpoint, certificate = text.split()
    return endpoint, certificate


def chunk_planner(live: list[int], stages: Stages | None, n_layers: int, n_stages: int) -> tuple[Stages, Pipelines]:
    """Fallback planner without a cost model: consecutive live devices form pipelines (rank order)."""
    if stages is None:
        stages = [(s * n_layers // n_stages, (s + 1) * n_layers // n_stages) for s in range(n_stages)]
    n_st = len(stages)
    n_rep = len(live) // n_st
    if n_rep < 1:
        raise TooFewPeersError(f"{len(live)} live device(s) cannot hold {n_st} stages")
    return stages, [live[r * n_st : (r + 1) * n_st] for r in range(n_rep)]


class LocalSwarm:
    """A coordinator plus local worker processes, trained through the :class:`RunDriver`.

    ``initial``: the first plan as ``(stages, pipelines)``; later re-plans (deaths, joins) use ``planner`` if
    given, else consecutive live devices. Tests reach in to kill or add devices while it trains.
    """

    def __init__(
        self,
        spec: RunSpec,
        n_devices: int,
        *,
        links: LinkModel | None = None,
        forward_flops: Callable[[int, int], float] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        faults: dict[int, str] | None = None,
        heartbeat_s: float = 2.0,
    ) -> None:
        self.spec = spec
        self.links = links
        self.forward_flops = forward_flops
        self.coordinator = Coordinator(spec, liveness_interval_s=heartbeat_s, tls=TlsContext.generate())
        self.coordinator.liveness.use_link_speeds(self._slowest_link_bps)
        coordinator_cert = self.coordinator.tls.certificate_text
        self.workers = LocalWorkers(n_devices, log_dir=log_dir, faults=faults, coordinator_cert=coordinator_cert,
                                    links=links)
        self.driver: RunDriver | None = None

    def __enter__(self) -> LocalSwarm:
        self.coordinator.start()
        try:
            self.workers.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.coordinator.stop_workers()
        finally:
            self.coordinator.close()
            self.workers.close()

    def _assignments(self, stages: Stages, pipelines: Pipelines, epoch: int) -> dict[str, Assignment]:
        return build_assignments(
            self.spec,
            stages,
            pipelines,
            self.workers.endpoints,
            self.coordinator.endpoint,
            epoch=epoch,
            forward_flops=self.forward_flops,
            certificates={
                **self.workers.certificates,
                self.coordinator.endpoint: self.coordinator.tls.certificate_text,
            },
        )

    def _slowest_link_bps(self, endpoint: str) -> float | None:
        """The slowest emulated link from the worker at ``endpoint`` to the others of the plan (None: unshaped)."""
        me = loopback_device(endpoint)
        if self.links is None or me is None:
            return None
        others = {loopback_device(ep) for ep in self.coordinator.assignments if ep != endpoint}
        rates = [link[0] for j in others if j is not None and (link := self.links.link(me, j)) is not None]
        return min((r for r in rates if r > 0), default=None)

    def train(
        self,
        initial: tuple[Stages, Pipelines],
        steps: int,
        *,
        planner: Planner | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 0,
        on_step: Callable[[StepReport], None] | None = None,
        step_timeout_s: float = 600.0,
        collect_states: bool = True,
        on_replan: Callable[[dict[str, Any]], None] | None = None,
    ) -> RunResult:
        first_plan = [initial]
        n_layers, n_stages = self.spec.model.n_layers, len(initial[0])

        def plan(live: list[int], stages: Stages | None) -> tuple[Stages, Pipelines]:
            if first_plan:
                st, pipes = first_plan.pop()
                if all(d in live for p in pipes for d in p):
                    return list(st), [list(p) for p in pipes]
                stages = list(st)
            if planner is not None:
                return planner(live, stages)
            return chunk_planner(live, stages, n_layers, n_stages)

        cfg = DriverConfig(
            steps=steps,
            checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None,
            checkpoint_every=checkpoint_every,
            step_timeout_s=step_timeout_s,
            peers_wait_s=LOCAL_PEERS_WAIT_S,
        )
        self.driver = RunDriver(
            self.spec,
            self.coordinator,
            self.workers.live,
            plan,
            self._assignments,
            cfg,
            on_step=on_step,
            on_replan=on_replan,
        )
        reports = self.driver.run()
        result = RunResult(reports, events=self.driver.events)
        if collect_states:
            result.states = self.coordinator.live_states(every_replica=True)
        return result


def train_plan(
    spec: RunSpec,
    stages: Sequence[tuple[int, int]],
    pipelines: Sequence[Sequence[int]],
    steps: int,
    *,
    links: LinkModel | None = None,
    forward_flops: Callable[[int, int], float] | None = None,
    collect_states: bool = True,
    log_dir: str | os.PathLike[str] | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    step_timeout_s: float = 600.0,
) -> RunResult:
    """Start workers for every device of the plan, train ``steps`` steps, return losses, timings, states."""
    n_devices = 1 + max(d for p in pipelines for d in p)
    with LocalSwarm(spec, n_devices, links=links, forward_flops=forward_flops, log_dir=log_dir) as swarm:
        return swarm.train(
            ([tuple(x) for x in stages], [list(p) for p in pipelines]),
            steps,
            on_step=on_step,
            step_timeout_s=step_timeout_s,
            collect_states=collect_states,
        )
