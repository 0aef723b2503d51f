"""Who is online when: an availability model of volunteer machines, and the network between them.

Sessions (time a peer stays in the swarm) are **Weibull** distributed with shape ``k = 0.5`` and scale
``lambda = 1 h`` (mean 2 h, median 29 min), not exponential. Why Weibull: measured availability of volunteer
and peer-to-peer hosts is heavy-tailed — many short sessions and a few very long ones — so the hazard of
leaving falls with uptime, which an exponential cannot express:

* Stutzbach and Rejaie, "Understanding churn in peer-to-peer networks", IMC 2006: session lengths in
  Gnutella, BitTorrent and Kad fit Weibull distributions with shape 0.34-0.59 and scales of 21-42 minutes
  (BitTorrent); peer inter-arrival times are close to Poisson.
* Javadi, Kondo, Vincent and Anderson, "Discovering statistical models of availability in large distributed
  systems: an empirical study of SETI@home", IEEE TPDS 22(11), 2011: the availability intervals of most
  SETI@home hosts fit heavy-tailed distributions (Weibull, log-normal, gamma), not exponential ones.

The shape is the middle of Stutzbach and Rejaie's range; the scale is longer than their file-sharing
sessions because a machine lent to a training run stays on for longer (both are parameters). Peers online
when a run starts are a snapshot of machines already up, so their *remaining* time is the stationary
residual life: a length-biased session (for a Weibull, ``lambda * G^(1/k)`` with ``G ~ Gamma(1 + 1/k)``) cut
at a uniform point. Later arrivals are a Poisson process whose rate (N / mean session) keeps the swarm's size
steady, each with a fresh session. A departure is graceful (the daemon's ``leave``: a tombstone) with
probability 0.3 and otherwise a crash (the advert expires) — volunteers mostly close lids and lose power.

The network: peers sit in the ten AWS regions of the bundled scenarios (``aws_10_region_measurements``:
region-to-region delay and bandwidth); each has an access link of log-normal capacity (median 200 Mbit/s,
sigma 0.7) and 1-5 ms access delay. A link carries the least of both access links and the regions' path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tasklet.scheduler.cluster import load_scenario

SESSION_SHAPE = 0.5
SESSION_SCALE_S = 3600.0
GRACEFUL_FRACTION = 0.3
ACCESS_MEDIAN_BPS = 200e6
ACCESS_SIGMA = 0.7
REGIONS_SCENARIO = "aws_10_region_measurements"


@dataclass(frozen=True)
class ChurnModel:
    shape: float = SESSION_SHAPE
    scale_s: float = SESSION_SCALE_S
    graceful_fraction: float = GRACEFUL_FRACTION

    @property
    def mean_session_s(self) -> float:
        return self.scale_s * math.gamma(1.0 + 1.0 / self.shape)

    def session_s(self, rng: np.random.Generator) -> float:
        """A fresh session (a peer that just came online)."""
        return float(self.scale_s * rng.weibull(self.shape))

    def residual_s(self, rng: np.random.Generator) -> float:
        """What is left of the session of a peer found online (the stationary residual life)."""
        biased = self.scale_s * rng.gamma(1.0 + 1.0 / self.shape) ** (1.0 / self.shape)
        return float(biased * rng.uniform())

    def arrival_rate_per_s(self, population: int) -> float:
        return population / self.mean_session_s

    def graceful(self, rng: np.random.Generator) -> bool:
        return bool(rng.uniform() < self.graceful_fraction)


class Network:
    """The true links between simulated peers (see the module docstring); grows as peers arrive."""

    def __init__(self, seed: int) -> None:
        self.regions = load_scenario(REGIONS_SCENARIO)
        self.rng = np.random.default_rng([seed, 17])
        self.region: list[int] = []
        self.access_bps: list[float] = []
        self.access_delay_s: list[float] = []

    def add_peer(self) -> int:
        self.region.append(int(self.rng.integers(0, self.regions.n)))
        self.access_bps.append(float(ACCESS_MEDIAN_BPS * math.exp(self.rng.normal(0.0, ACCESS_SIGMA))))
        self.access_delay_s.append(float(self.rng.uniform(0.001, 0.005)))
        return len(self.region) - 1

    def delay_s(self, i: int, j: int) -> float:
        if i == j:
            return 0.0
        ri, rj = self.region[i], self.region[j]
        return float(self.regions.delay_s[ri, rj]) + self.access_delay_s[i] + self.access_delay_s[j]

    def bandwidth_bps(self, i: int, j: int) -> float:
        if i == j:
            return math.inf
        ri, rj = self.region[i], self.region[j]
        return min(self.access_bps[i], self.access_bps[j], float(self.regions.bandwidth_bps[ri, rj]))

    def matrices(self, peers: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(one-way delay, bandwidth) among ``peers``, in that order."""
        idx = np.asarray(peers, dtype=int)
        reg = np.asarray(self.region)[idx]
        acc = np.asarray(self.access_bps)[idx]
        adl = np.asarray(self.access_delay_s)[idx]
        delay = self.regions.delay_s[np.ix_(reg, reg)] + adl[:, None] + adl[None, :]
        bw = np.minimum(np.minimum(acc[:, None], acc[None, :]), self.regions.bandwidth_bps[np.ix_(reg, reg)])
        np.fill_diagonal(delay, 0.0)
        np.fill_diagonal(bw, np.inf)
        return delay, bw

    def region_rtt_s(self) -> np.ndarray:
        return 2.0 * self.regions.delay_s
