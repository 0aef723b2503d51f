"""What a daemon of an emulated run (a run.toml with an `[emulation]` scenario) receives, and how it uses it.

The daemon never imports the emulation: the `peer` command hands it an :class:`Emulation`
(``peer.emulation.network.ScenarioEmulation``), which gives the scenario's :class:`NetworkModel` and a device
clock for a declared speed. Peer ``i`` of an emulated swarm is scenario device ``emu`` (its advert's ``extra``);
its traffic to another emulated peer is shaped on the scenario's link between the two (:class:`EmulatedLinks`):
the link probes measure the emulated network, and the leader plans from those measurements, never from the
scenario.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from tasklet.peer.config import EmulationSection
from tasklet.peer.net.shaping import LinkShaper, with_upload_cap
from tasklet.peer.runtime.stage.outbox import DeviceClock
from tasklet.peer.swarm.adverts import Advert

REFRESH_S = 2.0  # an endpoint no advert read so far names is looked up again at most this often


class NetworkModel(Protocol):
    """A scenario's emulated devices: their links and declared speeds, by emulated device index."""

    def __len__(self) -> int: ...

    def link(self, i: int, j: int) -> tuple[float, float]: ...

    def tflops(self, i: int) -> float: ...

    def region(self, i: int) -> str: ...


class Emulation(Protocol):
    """Where a daemon gets its emulated network and device clock from (None for a real peer)."""

    def network(self, section: EmulationSection) -> NetworkModel: ...

    def clock(self, tflops: float) -> DeviceClock: ...


def emulated_device(emulation: Emulation | None, section: EmulationSection, tflops: float | None,
                    device: int | None) -> tuple[NetworkModel | None, float | None, dict[str, Any]]:
    """(the scenario's network, this peer's declared TFLOP/s, its advert's emulated device and region) for a
    peer that declares ``tflops`` (``--emulate-tflops``) and, in a run with a scenario, emulates scenario device
    ``device`` (``--emulate-device``); ValueError says why that cannot be."""
    if (section.scenario or tflops) and emulation is None:
        raise ValueError("this peer was started without emulation support; an emulated run is started with the "
                         "`peer` command")
    if not section.scenario or emulation is None:
        return None, tflops, {}
    try:
        network = emulation.network(section)
    except ValueError as exc:
        raise ValueError(f"[emulation] {exc}") from None
    if device is None:
        return network, tflops, {}
    if not 0 <= device < len(network):
        raise ValueError(f"--emulate-device {device}: the run emulates {len(network)} devices")
    return network, tflops or network.tflops(device), {"emu": device, "region": network.region(device)}


class EmulatedLinks:
    """The scenario's links from this peer (``own_advert()``'s emulated device) to the peers it sees."""

    def __init__(self, network: NetworkModel | None, own_advert: Callable[[], Advert | None],
                 live_adverts: Callable[[], list[Advert]],
                 fresh_adverts: Callable[[], list[Advert]] | None = None) -> None:
        """``fresh_adverts`` reads the adverts anew (a DHT read), for an endpoint ``live_adverts`` does not name:
        a plan can name a peer this daemon has not read yet."""
        self.network = network
        self._own_advert = own_advert
        self._live_adverts = live_adverts
        self._fresh_adverts = fresh_adverts
        self._reply_shapers: dict[str, LinkShaper | None] = {}
        self._lock = threading.Lock()
        self._refreshed = -REFRESH_S
        self._fresh: list[Advert] = []

    def link(self, other: Advert) -> tuple[float, float] | None:
        """(bit/s, one-way delay s) to ``other``, or None when either side is not emulated."""
        me = self._own_advert()
        emu_me = None if me is None else me.extra.get("emu")
        emu_other = other.extra.get("emu")
        if self.network is None or emu_me is None or emu_other is None:
            return None
        return self.network.link(int(emu_me), int(emu_other))

    def by_endpoint(self, endpoint: str) -> tuple[float, float] | None:
        """The link to the peer announced at ``endpoint`` (the worker's link source); None when unknown."""
        if self.network is None:
            return None
        other = self._advert_at(endpoint)
        return None if other is None else self.link(other)

    def _advert_at(self, endpoint: str) -> Advert | None:
        found = next((a for a in self._live_adverts() if a.endpoint == endpoint), None)
        with self._lock:
            if found is None:
                found = next((a for a in self._fresh if a.endpoint == endpoint), None)
            if found is None and self._fresh_adverts is not None and time.monotonic() - self._refreshed >= REFRESH_S:
                self._refreshed = time.monotonic()
                self._fresh = self._fresh_adverts()
                found = next((a for a in self._fresh if a.endpoint == endpoint), None)
        return found

    def reply_shaper(self, sender: str) -> LinkShaper | None:
        """The shaper for replies to the peer ``sender`` (None: unshaped, or not seen yet), under the owner's
        upload cap when there is one."""
        if sender not in self._reply_shapers:
            other = next((a for a in self._live_adverts() if a.peer_id == sender), None)
            if other is None:
                return with_upload_cap(None)
            self._reply_shapers[sender] = with_upload_cap(self.link(other))
        return self._reply_shapers[sender]
