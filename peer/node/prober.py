"""The link prober: which peers this peer measures, the measurement itself, and the reports it publishes.

Not every pair of peers is measured: a peer probes up to ``PROBE_SAMPLE`` peers a round and ``PROBE_PEERS`` in
all (the elected leader, its neighbours in the plan it follows, then a few at random:
``peer.node.planning.probe_targets_for``), and the leader estimates the other pairs
(``peer.node.planning.build_cluster``). Only peers this peer trusts are probed (certificates from its last
full read of the adverts or from its assignment), since they trust it back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.shaping import LinkShaper
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.node.planning import PROBE_K, PROBE_RANDOM, probe_targets_for
from tasklet.peer.swarm.adverts import Advert, LinkReport
from tasklet.peer.timing import PROBE_PING_TIMEOUT_S, PROBE_TIMEOUT_S, now

log = logging.getLogger(__name__)

PROBE_BYTES = 256 * 1024
PROBE_SAMPLE = 8  # peers probed per round; the rest are estimated (see peer.node.planning.build_cluster)
PROBE_PEERS = PROBE_K + PROBE_RANDOM  # peers one peer measures in all; the other pairs are estimated
PROBE_RETRY_ROUNDS = 2  # a peer whose probe failed is tried again after this many rounds (in a forming swarm a
# first probe often fails only because the target has not read the prober's advert, and its certificate, yet)


@dataclass(frozen=True)
class ProbeSources:
    """What the prober reads of its daemon, each read when a round starts."""

    live_adverts: Callable[[], list[Advert]]
    elected: Callable[[], str | None]  # the leader this peer elects now
    followed_plan: Callable[[], dict[str, Any] | None]  # the plan record this peer follows (None: none yet)
    emulated_link: Callable[[Advert], tuple[float, float] | None]  # (bit/s, s) to shape the probe with, or None
    report_links: Callable[[list[LinkReport]], None]  # publish the reports (the membership's)


class LinkProber:
    """Measures RTT and bandwidth to a few trusted peers a round and publishes the reports."""

    def __init__(self, peer_id: str, tls: TlsContext, sources: ProbeSources, seed: int | str) -> None:
        self.peer_id = peer_id
        self.tls = tls
        self.sources = sources
        self.seed = seed
        self.probed: dict[str, LinkReport] = {}
        self._failed: dict[str, int] = {}  # peer id -> the round its last probe failed in
        self._rounds = 0
        self.rounds_done = 0  # rounds finished (the first one ends this peer's "measuring" phase)
        self._lock = threading.Lock()
        self._reported: frozenset[str] = frozenset()

    def probe_now(self) -> None:
        """One round: probe up to PROBE_SAMPLE peers not measured yet, publish the reports if they changed.
        A round already running elsewhere makes this one return at once; a failed target waits
        PROBE_RETRY_ROUNDS rounds."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._rounds += 1
            others = [a for a in self.sources.live_adverts() if a.peer_id != self.peer_id and a.role == "worker"]
            live = {a.peer_id for a in others}
            budget = min(PROBE_SAMPLE, PROBE_PEERS - len(live & set(self.probed)))
            for a in self.order(others)[:max(0, budget)]:
                report = self._measure(a)
                if report is None:
                    self._failed[a.peer_id] = self._rounds
                else:
                    self.probed[a.peer_id] = report
            reports = [r for pid, r in self.probed.items() if pid in live]
            key = frozenset(r.dst for r in reports)
            if self.probed and key != self._reported:  # unchanged reports are renewed by the membership heartbeat
                self.sources.report_links(reports)
                self._reported = key
        finally:
            self.rounds_done += 1
            self._lock.release()

    def _measure(self, a: Advert) -> LinkReport | None:
        """The link to ``a`` (three pings, one bandwidth probe), or None when it cannot be measured."""
        link = self.sources.emulated_link(a)
        shaper = LinkShaper(*link) if link else None
        try:
            with PeerClient(a.endpoint, TransportConfig(tls=self.tls), shaper=shaper, sender=self.peer_id,
                            expect_peer=a.peer_id) as client:
                path = client.path  # direct, reversed or relayed (peer.net.endpoint)
                rtt = min(client.ping(timeout_s=PROBE_PING_TIMEOUT_S) for _ in range(3))
                bw = client.probe(PROBE_BYTES, timeout_s=PROBE_TIMEOUT_S)
        except Exception as exc:  # an unreachable peer is simply not measured
            log.info("probe of %s failed: %s", a.peer_id, exc)
            return None
        log.info("link to %s (%s): %.1f Mbit/s, RTT %.2f ms", a.peer_id, path, bw / 1e6, rtt * 1e3)
        return LinkReport(self.peer_id, a.peer_id, rtt, bw, True, now(), path)

    def order(self, others: list[Advert]) -> list[Advert]:
        """Peers to probe next, most useful first: the elected leader, then the choice of
        ``peer.node.planning.probe_targets_for`` (plan neighbours, then a few at random)."""
        trusted = self.tls.trust.peers()
        eligible = {a.peer_id: a for a in others if a.peer_id in trusted
                    and self._rounds - self._failed.get(a.peer_id, -PROBE_RETRY_ROUNDS) >= PROBE_RETRY_ROUNDS}
        chosen = probe_targets_for(self.peer_id, sorted(eligible), self.sources.followed_plan(), set(self.probed),
                                   k=PROBE_K, n_random=PROBE_RANDOM, seed=self.seed)
        leader = self.sources.elected()
        if leader in eligible and leader not in self.probed:
            chosen = [leader, *(pid for pid in chosen if pid != leader)]
        return [eligible[pid] for pid in chosen]
