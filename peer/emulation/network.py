"""The emulated network and devices of a swarm on one machine, and the bridge to the scheduler's model of a cluster.

A local swarm runs real processes on one machine, so the devices and links of a scenario are *emulated*:
each worker stretches its compute to the declared TFLOP/s and shapes what it sends to the scenario's
bandwidth and delay. The scheduler predicts the same run from the same numbers. Keeping the translation in one
place (this module) means a prediction and the run it predicts cannot silently disagree on units.

Scaling: real scenarios (10 Gbit/s links, 100 TFLOP/s GPUs, billion-parameter models) do not fit on a laptop
CPU. ``bandwidth_scale`` and ``tflops_scale`` multiply every link's bandwidth and every device's speed, so a
scaled-down model keeps the scenario's *ratios* (which links are slow, which devices are fast). Whoever
reports a result must say which scales it used.

What production code receives from here, through the seams it defines (it never imports this package): a
worker's :data:`~peer.runtime.stage.outbox.LinkSource` (how to shape the link to each endpoint) and
:class:`~peer.runtime.stage.outbox.DeviceClock` (:class:`DeclaredSpeedClock`: each op takes the time the
declared TFLOP/s gives it), and a daemon's :class:`~peer.node.emulated_links.Emulation`
(:class:`ScenarioEmulation`: a run's ``[emulation]`` scenario, its links and device speeds by emulated device).
The leader never sees any of it: it measures the emulated links through the shaping, as on the internet.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tasklet.peer.config import EmulationSection
from tasklet.peer.runtime.spec import Assignment
from tasklet.peer.runtime.stage.outbox import DeviceClock
from tasklet.scheduler import Cluster
from tasklet.scheduler.cluster import default_scenarios_path, load_scenario


@dataclass(frozen=True)
class LinkModel:
    """Emulated network and devices of a local swarm: per-pair bandwidth (bit/s) and one-way delay (s), per-device
    TFLOP/s. ``bandwidth_bps[i][j]`` and ``delay_s[i][j]`` describe the directed link i -> j; ``None``: unshaped."""

    bandwidth_bps: Sequence[Sequence[float]] | None = None
    delay_s: Sequence[Sequence[float]] | None = None
    tflops: Sequence[float | None] | None = None

    def link(self, i: int, j: int) -> tuple[float, float] | None:
        if self.bandwidth_bps is None or self.delay_s is None or i == j:
            return None
        return float(self.bandwidth_bps[i][j]), float(self.delay_s[i][j])

    def device_tflops(self, i: int) -> float | None:
        if self.tflops is None or self.tflops[i] is None:
            return None
        return float(self.tflops[i])  # type: ignore[arg-type]

    def save(self, path: Path) -> None:
        """Write as JSON (a worker process reads it with :meth:`load`)."""
        path.write_text(json.dumps({k: None if v is None else [list(r) if isinstance(r, Sequence) else r for r in v]
                                    for k, v in asdict(self).items()}))

    @classmethod
    def load(cls, path: Path) -> LinkModel:
        d = json.loads(path.read_text())
        return cls(d.get("bandwidth_bps"), d.get("delay_s"), d.get("tflops"))


class DeclaredSpeedClock(DeviceClock):
    """An emulated device of ``tflops``: every op takes exactly ``forward_units x forward_flops / TFLOP/s``
    (a backward counts two forwards), stretched by sleeping; an op that takes longer on the real machine
    overran its emulated time."""

    def __init__(self, tflops: float) -> None:
        if not tflops > 0:
            raise ValueError(f"an emulated device needs TFLOP/s > 0, got {tflops}")
        self.tflops = tflops

    def finish(self, a: Assignment, step: int, started: float, forward_units: float) -> tuple[float, bool]:
        elapsed = self.now() - started
        target = forward_units * a.forward_flops / (self.tflops * 1e12)
        if target > elapsed:
            self.sleep(target - elapsed)
        return self.now() - started, target <= elapsed


class LoopbackLinks:
    """The link source of device ``me`` of a local swarm, whose device ``j`` listens on ``loopback_host(j)``
    (peer.emulation.local): an endpoint's address says which device it is."""

    def __init__(self, model: LinkModel, me: int) -> None:
        self.model, self.me = model, me

    def __call__(self, endpoint: str) -> tuple[float, float] | None:
        device = loopback_device(endpoint)
        return None if device is None else self.model.link(self.me, device)


def loopback_host(device: int) -> str:
    """127.0.0.2, 127.0.0.3, ... (127.0.0.1 is left to the coordinator and the DHT)."""
    if not 0 <= device < 250 * 250:
        raise ValueError(f"device index {device} out of range for loopback addresses")
    return f"127.0.{device // 250}.{device % 250 + 2}"


def loopback_device(endpoint: str) -> int | None:
    """The device whose :func:`loopback_host` ``endpoint`` is on (None: not one of them)."""
    host = endpoint.rpartition(":")[0]
    try:
        parts = ipaddress.IPv4Address(host).packed
    except ValueError:
        return None
    if parts[0] != 127 or parts[1] != 0 or not 2 <= parts[3] < 252:
        return None
    return parts[2] * 250 + parts[3] - 2


def scaled_cluster(cluster: Cluster, bandwidth_scale: float = 1.0, tflops_scale: float = 1.0,
                   delay_scale: float = 1.0) -> Cluster:
    """The same cluster with every bandwidth, device speed and one-way delay multiplied (delays: 1 unless told)."""
    if not (bandwidth_scale > 0 and tflops_scale > 0 and delay_scale > 0):
        raise ValueError("bandwidth_scale, tflops_scale and delay_scale must be positive")
    return Cluster(delay_s=cluster.delay_s * delay_scale, bandwidth_bps=cluster.bandwidth_bps * bandwidth_scale,
                   tflops=cluster.tflops * tflops_scale, memory_bytes=cluster.memory_bytes.copy(),
                   regions=list(cluster.regions), labels=list(cluster.labels), name=cluster.name)


def link_model(cluster: Cluster) -> LinkModel:
    """What the workers emulate for ``cluster``: its bandwidth (bit/s), one-way delays (s) and TFLOP/s."""
    bw = np.array(cluster.bandwidth_bps, dtype=float)
    delay = np.array(cluster.delay_s, dtype=float)
    np.fill_diagonal(bw, np.inf)
    np.fill_diagonal(delay, 0.0)
    return LinkModel(bandwidth_bps=bw.tolist(), delay_s=delay.tolist(), tflops=[float(x) for x in cluster.tflops])


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


class ScenarioEmulation:
    """What a daemon of an emulated run receives (peer.node.emulated_links.Emulation): the scenario of its
    ``[emulation]`` section, and a device clock for a declared speed."""

    def network(self, section: EmulationSection) -> EmulatedNetwork:
        return EmulatedNetwork(section)

    def clock(self, tflops: float) -> DeviceClock:
        return DeclaredSpeedClock(tflops)
