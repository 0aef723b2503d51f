"""Everything a daemon shows of itself: ``/metrics``, an optional dashboard, terminal progress.

The daemon builds one :class:`NodeObserver` after it has joined, feeds it each progress record it reads
(:meth:`NodeObserver.on_progress`) and closes it when it leaves. With ``dashboard_port`` equal to
``metrics_port`` one server answers both the page and ``/metrics``; the dashboard's server always answers
``/metrics`` too.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from tasklet.peer.observe.dashboard import Dashboard
from tasklet.peer.observe.http import ObserveServer
from tasklet.peer.observe.metrics import NodeMetrics, WorkerStats
from tasklet.peer.observe.progress import ProgressDisplay
from tasklet.peer.observe.snapshot import SwarmSource


class ObserveError(RuntimeError):
    """A monitoring port cannot be served; one line for the user."""


@dataclass
class ObserveOptions:
    """``--metrics-port`` / ``--dashboard-port`` (None: off, 0: a free port) and terminal progress."""

    host: str = "127.0.0.1"
    metrics_port: int | None = None
    dashboard_port: int | None = None
    progress: bool = False  # a progress line per step, logged (on a terminal the phase reporter draws a bar instead)
    total_steps: int | None = None
    interval_s: float = 2.0


class NodeObserver:
    def __init__(self, opts: ObserveOptions, run_id: str, source: SwarmSource,
                 worker_stats: WorkerStats | None = None) -> None:
        self.metrics = NodeMetrics(worker_stats)
        self.metrics_server: ObserveServer | None = None
        self.dashboard: Dashboard | None = None
        self.display: ProgressDisplay | None = None
        metrics_route = {"/metrics": self.metrics.render}
        try:
            if opts.dashboard_port is not None:
                self.dashboard = Dashboard(source, run_id, opts.host, opts.dashboard_port, opts.interval_s,
                                           extra_routes=metrics_route)
            if opts.metrics_port is not None and not (opts.metrics_port == opts.dashboard_port != 0):
                self.metrics_server = ObserveServer(opts.host, opts.metrics_port, metrics_route)
        except OSError as exc:
            self.close()
            raise ObserveError(f"{exc} (--metrics-port/--dashboard-port)") from None
        if opts.progress:  # a line per step; a terminal's bar is the phase reporter's (peer.observe.phases)
            self.display = ProgressDisplay(opts.total_steps, stream=sys.stderr, fancy=False, plain=logging.getLogger(
                "tasklet.peer.progress").info)

    @property
    def metrics_url(self) -> str | None:
        server = self.metrics_server or (self.dashboard.server if self.dashboard else None)
        return None if server is None else f"{server.url}metrics"

    @property
    def dashboard_url(self) -> str | None:
        return None if self.dashboard is None else self.dashboard.url

    def on_progress(self, progress: dict[str, Any] | None, *, peers_live: int, is_leader: bool) -> None:
        self.metrics.observe_progress(progress, peers_live=peers_live, is_leader=is_leader)
        if self.display is not None and progress:
            step = progress.get("step")
            self.display.update(
                step if isinstance(step, int) else None,
                loss=progress.get("loss"),
                step_s=progress.get("step_s"),
                tokens_per_s=progress.get("tokens_per_s"),
                epoch=progress.get("epoch"),
                peers=peers_live,
            )

    def close(self) -> None:
        if self.display is not None:
            self.display.close()
        if self.dashboard is not None:
            self.dashboard.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
