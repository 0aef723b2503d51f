"""The emulated network and devices reach production code only through its seams: a worker's link source and
device clock, a daemon's Emulation. Nothing emulated travels in an assignment."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest

from tasklet.peer.config import EmulationSection
from tasklet.peer.emulation.network import (
    DeclaredSpeedClock,
    LinkModel,
    LoopbackLinks,
    ScenarioEmulation,
    loopback_device,
    loopback_host,
)
from tasklet.peer.node.emulated_links import EmulatedLinks, emulated_device
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage.outbox import DeviceClock
from tasklet.peer.swarm.adverts import Advert


class VirtualSpeedClock(DeclaredSpeedClock):
    def __init__(self, tflops: float) -> None:
        super().__init__(tflops)
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def _assignment(forward_flops: float) -> Assignment:
    spec = RunSpec().validate()
    a = build_assignments(spec, [(0, 1), (1, 2)], [[0, 1]], ["127.0.0.2:1", "127.0.0.3:1"], "127.0.0.1:9",
                          forward_flops=lambda lo, hi: forward_flops)
    return a["127.0.0.2:1"]


def test_an_assignment_carries_no_emulated_links_or_speeds() -> None:
    names = {f.name for f in fields(Assignment)}
    assert not names & {"links", "emulate_tflops"}
    assert "links" not in _assignment(1e6).to_dict()


def test_a_declared_speed_clock_stretches_each_op_and_the_real_one_only_measures() -> None:
    a = _assignment(2e6)
    clock = VirtualSpeedClock(1e-6)  # 2e6 FLOPs at 1e6 FLOP/s: a forward takes 2 s
    assert clock.finish(a, 0, clock.now(), 1.0) == (2.0, False)
    start = clock.now()
    assert clock.finish(a, 0, start, 2.0) == (4.0, False)  # a backward counts two forwards
    start = clock.now()
    clock.t += 5.0  # the op took longer on the real machine than on the emulated device
    assert clock.finish(a, 0, start, 1.0) == (5.0, True)
    assert DeviceClock().finish(a, 0, 0.0, 1.0)[1] is False
    with pytest.raises(ValueError):
        DeclaredSpeedClock(0.0)


def test_a_local_worker_finds_each_device_by_its_loopback_address(tmp_path: Path) -> None:
    model = LinkModel(bandwidth_bps=[[0, 1e6, 2e6], [3e6, 0, 4e6], [5e6, 6e6, 0]],
                      delay_s=[[0, 0.01, 0.02], [0.03, 0, 0.04], [0.05, 0.06, 0]], tflops=[1.0, None, 3.0])
    model.save(tmp_path / "links.json")
    loaded = LinkModel.load(tmp_path / "links.json")
    assert loaded == LinkModel([list(map(float, r)) for r in model.bandwidth_bps or []],
                               [list(r) for r in model.delay_s or []], [1.0, None, 3.0])
    links = LoopbackLinks(loaded, 1)
    assert links(f"{loopback_host(2)}:5000") == (4e6, 0.04)
    assert links(f"{loopback_host(0)}:1") == (3e6, 0.03)
    assert links(f"{loopback_host(1)}:1") is None  # itself
    assert links("10.0.0.2:1") is None and links("127.0.0.1:80") is None and links("[::1]:80") is None
    assert loaded.device_tflops(1) is None and loaded.device_tflops(2) == 3.0
    assert [loopback_device(f"{loopback_host(d)}:1") for d in (0, 249, 250, 1000)] == [0, 249, 250, 1000]


@dataclass(frozen=True)
class _Advert:
    """What EmulatedLinks reads of an advert."""

    peer_id: str
    endpoint: str
    extra: dict[str, Any]


def _advert(peer: str, endpoint: str, emu: int) -> Advert:
    return _Advert(peer, endpoint, {"emu": emu})  # type: ignore[return-value]


def test_a_daemon_shapes_a_plan_neighbour_it_has_not_read_yet() -> None:
    world = EmulationSection(scenario="worldwide_geo_distributed")
    network, tflops, extra = emulated_device(ScenarioEmulation(), world, None, 1)
    assert network is not None and tflops == network.tflops(1) and extra["emu"] == 1
    me, other = _advert("me", "h:1", 1), _advert("them", "h:2", 2)
    reads: list[int] = []

    def fresh() -> list[Advert]:
        reads.append(1)
        return [me, other]

    links = EmulatedLinks(network, lambda: me, lambda: [me], fresh)
    assert links.by_endpoint("h:2") == network.link(1, 2)  # not in the last read: read again
    assert links.by_endpoint("h:3") is None and len(reads) == 1  # unknown, and not read again at once
    with pytest.raises(ValueError, match="--emulate-device 99"):
        emulated_device(ScenarioEmulation(), world, None, 99)
    with pytest.raises(ValueError, match="without emulation support"):
        emulated_device(None, world, None, 1)
    assert emulated_device(None, EmulationSection(), None, None) == (None, None, {})
