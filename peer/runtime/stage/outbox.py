"""The worker's two seams to the world outside its state: the :class:`Outbox` every message leaves through, and
the :class:`DeviceClock` every compute op is timed by.

Both are given to the worker (defaults: the real ones), so a test or an emulated fault changes what leaves the
peer or how long its device takes without touching the worker (peer.emulation.faults: a tampering outbox, a
slowing clock), and a unit test drives the step with fakes in virtual time. An emulated network reaches the
outbox the same way: a :data:`LinkSource` (peer.emulation.network) says how to shape the link to each endpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.shaping import LinkTable
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.spec import Assignment
from tasklet.peer.runtime.stage.snapshot import Tasklet
from tasklet.peer.timing import CONTROL_TIMEOUT_S, SEND_TIMEOUT_S
from tasklet.protocol import tasklet_pb2 as pb

log = logging.getLogger(__name__)

LinkSource = Callable[[str], "tuple[float, float] | None"]  # endpoint -> (bit/s, one-way delay s); None: unshaped


class Outbox:
    """Everything a worker sends: data pushes to its neighbours and group (asynchronous, shaped per link, so a
    slow link never stalls compute), reports to the coordinator and task-pool calls (through a small executor,
    for the same reason). It owns the client per destination; a new assignment (``reset``) drops them all.

    ``current`` gives the current snapshot (the peer ids its roles expect), ``current_step`` the step a report
    without one is filed under, ``stopped`` silences failures reported during shutdown. Links are shaped as
    the source given to :meth:`shape_links` says (an emulated network's; None, the default: unshaped)."""

    def __init__(self, config: TransportConfig, peer_id: str, current: Callable[[], Tasklet | None],
                 current_step: Callable[[], int], stopped: threading.Event) -> None:
        self.config, self.peer_id, self.stopped = config, peer_id, stopped
        self._current, self._current_step = current, current_step
        self._lock = threading.Lock()  # clients and their shapers
        self._clients: dict[str, PeerClient] = {}
        self._link_source: LinkSource | None = None
        self._links = LinkTable(self._link_of)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="worker-control")

    def send(self, t: Tasklet, endpoint: str, env: pb.Envelope) -> None:
        """Push ``env`` asynchronously; a failure is reported to the coordinator, which checks the receiver."""

        def done(fut: Future[None]) -> None:
            exc = fut.exception()
            if exc is not None and not self.stopped.is_set():
                log.warning("send to %s failed: %s", endpoint, exc)
                self.report(t, ctl.PeerError(endpoint, str(exc)[:500]))

        self.client(endpoint).push_async(env, SEND_TIMEOUT_S).add_done_callback(done)

    def report(self, t: Tasklet, msg: ctl.Message) -> Future[None]:
        """Send a report to the coordinator without blocking the caller."""
        step = getattr(msg, "step", None)
        if step is None:
            step = self._current_step()
        a = t.assignment
        env = ctl.encode(msg, t.spec.run_id, a.epoch, step, stage=a.stage, replica=a.replica)
        return self._pool.submit(self.client(a.coordinator).push, env, CONTROL_TIMEOUT_S)

    def call(self, t: Tasklet, key: pb.Key, op: ctl.Op) -> pb.Envelope:
        """A task-pool call (lease, commit) to the coordinator; blocks (feeder and commit threads only)."""
        return self.client(t.assignment.coordinator).fetch(
            ctl.pool_kind(op), key, timeout_s=CONTROL_TIMEOUT_S
        )

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn`` off the caller's thread (the compute thread must not wait on the network)."""
        return self._pool.submit(fn, *args)

    def client(self, endpoint: str) -> PeerClient:
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                t = self._current()
                expect = "" if t is None else t.roles.ids.get(endpoint, "")
                client = PeerClient(
                    endpoint, self.config, shaper=self._links.get(endpoint), sender=self.peer_id, expect_peer=expect
                )
                self._clients[endpoint] = client
            return client

    def _link_of(self, endpoint: str) -> tuple[float, float] | None:
        return None if self._link_source is None else self._link_source(endpoint)

    def shape_links(self, source: LinkSource | None) -> None:
        """Shape each link as ``source`` says from the next client on (None: unshaped); set before sending."""
        self._link_source = source

    def reset(self) -> None:
        """Close every client: the next send dials again under the current links and roles."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            self._links = LinkTable(self._link_of)  # an emulated network may know endpoints it did not know
        for client in clients:
            client.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.reset()


class DeviceClock:
    """Times compute ops on the real device: it only measures. An emulated device (many peers sharing one
    machine, each declaring a speed) is a clock that stretches each op (peer.emulation.network)."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def finish(self, a: Assignment, step: int, started: float, forward_units: float) -> tuple[float, bool]:
        """End an op of ``step`` begun at ``started`` worth ``forward_units`` forwards: (busy seconds, whether
        it overran the time the device should take; a real device never does)."""
        return self.now() - started, False
