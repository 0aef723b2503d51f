"""Shaping a daemon's traffic on the links of an emulated scenario (a local swarm's `[emulation]` section).

Peer ``i`` of an emulated swarm is scenario device ``emu`` (its advert's ``extra``); its traffic to another
emulated peer is shaped on the scenario's link between the two, before any plan (so the link probes measure
the emulated network) and for the replies it serves (pings, fetched states).
"""

from __future__ import annotations

from collections.abc import Callable

from peer.net.shaping import LinkShaper
from peer.node.planning import EmulatedNetwork
from peer.swarm.adverts import Advert


class EmulatedLinks:
    """The scenario's links from this peer (``own_advert()``'s emulated device) to the peers it sees."""

    def __init__(self, network: EmulatedNetwork | None, own_advert: Callable[[], Advert | None],
                 live_adverts: Callable[[], list[Advert]]) -> None:
        self.network = network
        self._own_advert = own_advert
        self._live_adverts = live_adverts
        self._reply_shapers: dict[str, LinkShaper | None] = {}

    def link(self, other: Advert) -> tuple[float, float] | None:
        """(bit/s, one-way delay s) to ``other``, or None when either side is not emulated."""
        me = self._own_advert()
        emu_me = None if me is None else me.extra.get("emu")
        emu_other = other.extra.get("emu")
        if self.network is None or emu_me is None or emu_other is None:
            return None
        return self.network.link(int(emu_me), int(emu_other))

    def table(self, entries: list[Advert], own_peer_id: str) -> dict[str, tuple[float, float]] | None:
        """Endpoint -> link for every other emulated peer in ``entries``; None when nothing is emulated."""
        if self.network is None:
            return None
        return {a.endpoint: link for a in entries
                if a.peer_id != own_peer_id and (link := self.link(a)) is not None}

    def reply_shaper(self, sender: str) -> LinkShaper | None:
        """The shaper for replies to the peer ``sender`` (None: unshaped, or not seen yet)."""
        if sender not in self._reply_shapers:
            other = next((a for a in self._live_adverts() if a.peer_id == sender), None)
            if other is None:
                return None
            link = self.link(other)
            self._reply_shapers[sender] = None if link is None else LinkShaper(*link)
        return self._reply_shapers[sender]
