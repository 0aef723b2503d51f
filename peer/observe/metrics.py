"""A daemon's Prometheus metrics (``/metrics`` on ``--metrics-port``), through prometheus-client.

Each daemon has its own registry (not the library's global one), so several daemons in one test process do
not collide. Three kinds of figures, each read where it lives:

* the run, as every peer sees it in the leader's progress record: step, loss, tokens/s, s/step, plan
  epoch, re-plans seen, live peers, whether this peer leads (set by the daemon with :meth:`observe_progress`);
* the transport, read at scrape time from ``peer.net.counters.TRAFFIC``: bytes and messages sent and
  received per message kind, calls this peer's server refused by gRPC status;
* the stage worker, read at scrape time from its stats: micro-batches computed (forward and backward
  passes), seconds of compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tasklet.peer.net.counters import TRAFFIC, TrafficCounters

WorkerStats = Callable[[], dict[str, Any]]


class _TransportCollector(Collector):
    def __init__(self, traffic: TrafficCounters) -> None:
        self.traffic = traffic

    def collect(self) -> Iterator[CounterMetricFamily]:
        snap = self.traffic.snapshot()
        for name, doc, table, label in (
            ("tasklet_net_sent_bytes", "Bytes sent, by message kind", snap.sent, "kind"),
            ("tasklet_net_received_bytes", "Bytes received, by message kind", snap.received, "kind"),
            ("tasklet_net_sent_messages", "Messages sent, by kind", snap.messages_sent, "kind"),
            ("tasklet_net_received_messages", "Messages received, by kind", snap.messages_received, "kind"),
            ("tasklet_net_refused_messages", "Calls this peer's server refused, by gRPC status", snap.refused,
             "reason"),
        ):
            family = CounterMetricFamily(name, doc, labels=[label])
            for key, value in sorted(table.items()):
                family.add_metric([key], value)
            yield family


class _WorkerCollector(Collector):
    def __init__(self, stats: WorkerStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.stats()
        passes = CounterMetricFamily(
            "tasklet_microbatches_computed", "Micro-batch passes this peer's stage computed", labels=["pass"]
        )
        for name in ("forward", "backward"):
            value = stats.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                passes.add_metric([name], value)
        yield passes
        busy = stats.get("busy_s")
        if isinstance(busy, (int, float)) and not isinstance(busy, bool):
            yield CounterMetricFamily("tasklet_compute_busy_seconds", "Seconds this peer's stage computed", busy)


class NodeMetrics:
    """The registry of one daemon, and the gauges it sets from what it reads of the swarm."""

    def __init__(self, worker_stats: WorkerStats | None = None, traffic: TrafficCounters = TRAFFIC) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("tasklet_step", "Training steps the run has completed (leader's progress)", registry=r)
        self.loss = Gauge("tasklet_loss", "Loss of the latest step", registry=r)
        self.tokens_per_s = Gauge("tasklet_tokens_per_second", "Training throughput of the latest step", registry=r)
        self.step_s = Gauge("tasklet_step_seconds", "Wall time of the latest step", registry=r)
        self.plan_epoch = Gauge("tasklet_plan_epoch", "Epoch of the plan being followed", registry=r)
        self.replans = Counter("tasklet_replans", "New plans (epoch changes) this peer has seen", registry=r)
        self.peers_live = Gauge("tasklet_peers_live", "Live peers this peer sees in the DHT", registry=r)
        self.is_leader = Gauge("tasklet_is_leader", "1 while this peer leads the swarm", registry=r)
        self.done = Gauge("tasklet_run_done", "1 once the run has trained every step", registry=r)
        r.register(_TransportCollector(traffic))
        if worker_stats is not None:
            r.register(_WorkerCollector(worker_stats))
        self._epoch: int | None = None

    def observe_progress(self, progress: dict[str, Any] | None, *, peers_live: int, is_leader: bool) -> None:
        """Set the run gauges from the newest progress record (None: nothing published yet)."""
        self.peers_live.set(peers_live)
        self.is_leader.set(1 if is_leader else 0)
        if not progress:
            return
        for gauge, key in ((self.step, "step"), (self.loss, "loss"), (self.tokens_per_s, "tokens_per_s"),
                           (self.step_s, "step_s")):
            value = progress.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.set(value)
        epoch = progress.get("epoch")
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > 0:
            if self._epoch is not None and epoch > self._epoch:
                self.replans.inc()
            if self._epoch is None or epoch > self._epoch:
                self._epoch = epoch
                self.plan_epoch.set(epoch)
        self.done.set(1 if progress.get("state") == "done" else 0)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition (an ``ObserveServer`` route)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
