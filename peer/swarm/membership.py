"""Swarm membership: signed, expiring adverts in the hivemind DHT, renewed on a heartbeat.

Liveness is expiry. A peer stores its advert with ``expires_at = now + ttl_s`` and re-stores it every
``heartbeat_s``; with ``ttl_s = 3 * heartbeat_s`` two heartbeats may be lost (a slow DHT round, a GC pause)
before others drop the peer, and a peer that dies without a word disappears at most ``ttl_s`` after its last
heartbeat. A peer that leaves on purpose does better: it overwrites its advert with a *tombstone*. The DHT
keeps, per subkey, the value with the latest expiration, so the tombstone must expire later than the last
advert did; it does (``now + ttl_s`` > ``last heartbeat + ttl_s``), and readers that see it drop the peer at
their next read instead of waiting for the expiry.

Records (all under ``run_id``; see ``peer.swarm.records`` for signatures and the join secret):

* ``peers``: one advert (or tombstone) per peer, ``{"advert": {...}, "at": heartbeat time, "found": [...]}``.
  ``found`` is the peers this one saw alive when it joined, fixed for its lifetime: the others' testimony
  of who is older, from which the leader is elected (``peer.swarm.election``) instead of from a start time
  a peer reports about itself.
* ``links``: one list of link reports per reporting peer. It lives ``LINK_REPORT_MIN_TTL_S`` (longer than an
  advert: a pair is measured once, and a report of a peer that left is simply not used) and the heartbeat
  renews it only when less than two advert lifetimes are left, or at once when it changes: one store per
  heartbeat per peer less, each of which visits several DHT nodes.
* ``run``: the run's configuration, published by the first peer (and adopted by others so it outlives it).
  It never holds the join secret (:meth:`Membership.publish_run` refuses a config that does).

At join a peer also compares its clock with the heartbeat times of the live peers (:func:`check_clock`):
expiry is wall-clock time, so a skewed clock would make its records expire early or late.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import hivemind

from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert, LinkReport, check_peer_id
from tasklet.peer.swarm.charter import CharterError, run_organiser, sign_run, stewards_of
from tasklet.peer.swarm.records import MacStatus, RecordStore
from tasklet.peer.swarm.rendezvous import member_nodes
from tasklet.peer.timing import (
    ADVERT_TTL_HEARTBEATS,
    DHT_CALL_TIMEOUT_S,
    HEARTBEAT_S,
    MAX_CLOCK_SKEW_S,
    RUN_RECORD_MIN_TTL_S,
    now,
)

logger = logging.getLogger(__name__)

MAX_LINK_REPORTS = 1024
LINK_REPORT_MIN_TTL_S = 30.0  # a link report lives max(advert lifetime, this) (see the module docstring)
MAX_FOUND = 256  # peers named in one ``found`` testimony
LATE_HEARTBEAT_SLACK_S = 3.0  # how much later than a heartbeat a busy swarm's advert may look at the clock check


class SwarmSecretError(RuntimeError):
    """This peer's join secret does not match the run's; the message is one line meant for the user."""


class RunReadTimeoutError(SwarmSecretError):
    """The run record could not be read in time (a busy DHT): worth trying again, unlike a wrong secret."""


class ClockSkewError(RuntimeError):
    """This peer's clock is too far from the swarm's; the message is one line meant for the user."""


@dataclass(frozen=True)
class PeerEntry:
    """A live peer as read from the DHT: its advert, its last heartbeat, when its advert expires, and the
    peers it found alive when it joined."""

    advert: Advert
    heartbeat_at: float
    expires_at: float
    found: frozenset[str] = frozenset()

    def last_seen_s(self, at: float | None = None) -> float:
        return max(0.0, (now() if at is None else at) - self.heartbeat_at)


@dataclass(frozen=True)
class EndpointHints:
    """What decides an endpoint first seen with several claimants: the peers of the signed plan this peer follows
    (its leader and pipelines) and the credit the leader signed per identity (verified micro-batches)."""

    plan_members: frozenset[str] = frozenset()
    credit: Mapping[str, int] = field(default_factory=dict)


class EndpointBinding:
    """An endpoint belongs to the first peer seen advertising it: a later advert naming it (another member
    claiming a victim's address, so that whoever dials it pins the claimant's certificate and the victim looks
    dead) is logged and ignored, whatever its peer id. An endpoint first seen with several claimants at once (a
    fresh reader of a squatted address) goes to the one the followed signed plan names, else to the one the most
    credited witnesses name (peers whose testimony lists it), else to the oldest advert: never to none, so a
    squatter cannot blind a joiner to the leader. This peer's own endpoint is always its own. A holder whose advert
    is gone releases its endpoint (a peer restarted with a new identity at the same address)."""

    def __init__(self) -> None:
        self.holders: dict[str, str] = {}  # endpoint -> peer id
        self._logged: set[tuple[str, str]] = set()

    def filter(self, entries: list[PeerEntry], own: Advert | None = None,
               hints: EndpointHints | None = None) -> list[PeerEntry]:
        """``entries`` without the adverts whose endpoint another peer holds."""
        claims: dict[str, list[PeerEntry]] = {}
        for entry in entries:
            claims.setdefault(entry.advert.endpoint, []).append(entry)
        live = {entry.advert.peer_id for entry in entries}
        self.holders = {ep: pid for ep, pid in self.holders.items() if pid in live}
        if own is not None:
            self.holders[own.endpoint] = own.peer_id
        kept: list[PeerEntry] = []
        for endpoint, group in claims.items():
            holder = self.holders.get(endpoint)
            if holder is None:
                holder = self.holders[endpoint] = _first_holder(group, entries, hints or EndpointHints())
            for entry in group:
                if entry.advert.peer_id == holder:
                    kept.append(entry)
                elif (endpoint, entry.advert.peer_id) not in self._logged:
                    self._logged.add((endpoint, entry.advert.peer_id))
                    logger.warning("ignoring the advert of %s: endpoint %s is held by %s", entry.advert.peer_id,
                                   endpoint, holder)
        return sorted(kept, key=lambda entry: entry.advert.peer_id)


def _first_holder(group: list[PeerEntry], entries: list[PeerEntry], hints: EndpointHints) -> str:
    """Who holds an endpoint nobody held yet, among its claimants ``group`` (see EndpointBinding)."""
    claimants = sorted({e.advert.peer_id for e in group})
    if len(claimants) == 1:
        return claimants[0]
    in_plan = [pid for pid in claimants if pid in hints.plan_members]
    if len(in_plan) == 1:
        return in_plan[0]
    # (credit of the witnesses naming it, their number): free identities add to the count only, which decides
    # only between claimants equally credited; a claimant's own testimony, or another claimant's, counts for nothing
    weight = {pid: (0, 0) for pid in claimants}
    for witness in entries:
        if witness.advert.peer_id not in weight:
            credit = hints.credit.get(witness.advert.peer_id, 0)
            credit = credit if type(credit) is int and credit > 0 else 0
            for pid in witness.found & weight.keys():
                weight[pid] = (weight[pid][0] + credit, weight[pid][1] + 1)
    best = max(weight.values())
    named = [pid for pid in claimants if weight[pid] == best]
    if len(named) == 1:
        return named[0]
    oldest = min((e for e in group if e.advert.peer_id in named), key=lambda e: (e.advert.started_at, e.advert.peer_id))
    return oldest.advert.peer_id


@dataclass(frozen=True)
class RunRecord:
    """The run's configuration, who stored this copy and when the run was created, and the organiser who signed
    it (``peer.swarm.charter``: only the organiser's signature makes a record the run's)."""

    config: dict
    created_at: float
    publisher: str
    organiser: str = ""
    seal: dict | None = None  # the organiser's {"key", "sig"} over config and created_at


class Membership:
    """Announce this peer, keep it alive, and read who else is alive.

    ``dht`` must sign with ``identity`` (``peer.swarm.dht.start_dht``). ``secret`` is the swarm's join
    secret or None. Every DHT call waits at most ``timeout_s``; a read that times out, or that misses our own
    live advert (so it is incomplete), returns what the previous complete read returned minus what has expired
    since, and an advert missing from a read is kept until its own expiry (or its tombstone is read), so one
    slow round does not make the whole swarm (or a few peers) "disappear" and a partitioned-away peer still
    disappears after its advert's lifetime.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        identity: Identity,
        secret: str | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        ttl_s: float | None = None,
        timeout_s: float = DHT_CALL_TIMEOUT_S,
    ):
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be positive, got {heartbeat_s}")
        self.ttl_s = ADVERT_TTL_HEARTBEATS * heartbeat_s if ttl_s is None else ttl_s
        if self.ttl_s <= heartbeat_s:
            raise ValueError(f"ttl_s ({self.ttl_s}) must exceed heartbeat_s ({heartbeat_s})")
        self.identity, self.run_id, self.heartbeat_s = identity, run_id, heartbeat_s
        self.store = RecordStore(dht, run_id, identity, secret, timeout_s)
        self._lock = threading.Lock()
        self._advert: Advert | None = None
        # what changes between heartbeats (the daemon: its device's compute share), merged into the advert's extra
        self._live_extra: Callable[[], dict[str, Any]] | None = None
        self._links: list[LinkReport] = []
        self._run: RunRecord | None = None
        self._stewards: dict[int, dict] = {}  # revision -> the organiser's signed stewards record, kept alive
        self._run_renew_at = 0.0  # DHT time after which the heartbeat stores the run record again
        self._links_renew_at = 0.0  # the same for the link reports
        self._last_expiry = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_entries: list[PeerEntry] = []
        self._last_links: list[LinkReport] = []
        self._found: list[str] | None = None  # who was alive when we joined (read once, at the first announce)
        self._endpoints = EndpointBinding()  # an endpoint is its first advertiser's
        # the followed plan's members and the signed credit, for an endpoint first seen with several claimants
        self._endpoint_hints: Callable[[], EndpointHints] = EndpointHints

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    # ---- writing --------------------------------------------------------------------------------------

    def use_live_extra(self, extra: Callable[[], dict[str, Any]]) -> None:
        """What each heartbeat's advert adds to its extra (the daemon: its device's compute share)."""
        self._live_extra = extra

    def use_endpoint_hints(self, hints: Callable[[], EndpointHints]) -> None:
        """Where a contested endpoint's holder is looked up (peer.swarm.view: the followed plan, the credited)."""
        self._endpoint_hints = hints

    def announce(self, advert: Advert) -> bool:
        """Store (or replace) our advert now and keep renewing it until :meth:`leave`.

        Returns whether the DHT accepted this first store; the heartbeat retries either way.
        """
        if advert.peer_id != self.peer_id:
            raise ValueError(f"advert.peer_id {advert.peer_id!r} is not this identity's {self.peer_id!r}")
        if self._found is None:
            self._found = sorted(
                entry.advert.peer_id for entry in self.live_entries() if entry.advert.peer_id != self.peer_id
            )[:MAX_FOUND]
        with self._lock:
            self._advert = advert
        self._stop.clear()
        stored = self._store_advert()
        if self._thread is None or not self._thread.is_alive():
            name = f"heartbeat-{self.peer_id}"
            self._thread = threading.Thread(target=self._heartbeat, name=name, daemon=True)
            self._thread.start()
        return stored

    def _store_advert(self) -> bool:
        with self._lock:
            advert = self._advert
        if advert is None:
            return False
        if self._live_extra is not None:
            advert = replace(advert, extra={**advert.extra, **self._live_extra()})
        at = now()
        expires_at = max(at + self.ttl_s, self._last_expiry + 1e-3)
        payload = {"advert": advert.to_record(), "at": at, "found": list(self._found or [])}
        stored = self.store.put("peers", payload, expires_at)
        if stored:
            self._last_expiry = expires_at
        else:
            logger.warning("advert of %s was not stored; retrying at the next heartbeat", self.peer_id)
        return stored

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._store_advert()
                with self._lock:
                    links, run = list(self._links), self._run
                if links and now() >= self._links_renew_at:
                    self._store_links(links)
                if run is not None and now() >= self._run_renew_at:
                    self._store_run(run)
            except Exception:  # a heartbeat must survive anything the DHT throws; the next one retries
                logger.exception("heartbeat of %s failed", self.peer_id)

    def stop_heartbeat(self) -> None:
        """Stop renewing our records without announcing departure: they expire within ``ttl_s``.

        This is what a crash looks like to others; :meth:`leave` is the graceful way out.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.store.timeout_s * 4 + self.heartbeat_s)
            self._thread = None

    def leave(self) -> None:
        """Stop the heartbeat and announce our departure (others drop us at their next read)."""
        self.stop_heartbeat()
        with self._lock:
            had_advert, self._advert = self._advert is not None, None
        if had_advert:
            at = now()
            expires_at = max(at + self.ttl_s, self._last_expiry + 1e-3)
            if self.store.put("peers", {"left": True, "at": at}, expires_at):
                self._last_expiry = expires_at
            else:
                logger.warning("departure of %s was not stored; it will expire within %.1f s",
                               self.peer_id, self.ttl_s)

    def report_links(self, reports: list[LinkReport]) -> bool:
        """Publish our view of our links (replaces the previous one; renewed with the heartbeat)."""
        if len(reports) > MAX_LINK_REPORTS:
            raise ValueError(f"at most {MAX_LINK_REPORTS} link reports, got {len(reports)}")
        for report in reports:
            if report.src != self.peer_id:
                raise ValueError(f"link.src {report.src!r} is not this peer {self.peer_id!r}")
        with self._lock:
            self._links = list(reports)
        return self._store_links(reports)

    def _store_links(self, reports: list[LinkReport]) -> bool:
        at = now()
        ttl = max(self.ttl_s, LINK_REPORT_MIN_TTL_S)
        payload = {"links": [report.to_record() for report in reports], "at": at}
        stored = self.store.put("links", payload, at + ttl)
        if stored:
            self._links_renew_at = at + max(self.heartbeat_s, ttl - 2 * self.ttl_s)
        return stored

    def publish_run(self, run_config: dict, created_at: float | None = None, seal: dict | None = None) -> RunRecord:
        """Publish the run configuration (the organiser, which signs it) and keep it alive with our heartbeat.

        Joiners re-publish what they read, with its original ``created_at`` and the organiser's ``seal``
        (:meth:`adopt_run`), so the run outlives the organiser's peer; readers take only the organiser's.
        """
        if not isinstance(run_config, dict):
            raise ValueError(f"run config must be a dict, got {type(run_config).__name__}")
        swarm = run_config.get("swarm")
        if isinstance(swarm, dict) and swarm.get("secret"):
            raise ValueError("the run record must not hold the join secret (publish RunConfig.public_dict())")
        created_at = now() if created_at is None else float(created_at)
        if seal is None:
            seal = sign_run(self.identity, self.run_id, dict(run_config), created_at)
        organiser = run_organiser(self.run_id, {"config": run_config, "created_at": created_at, "organiser": seal})
        record = RunRecord(dict(run_config), created_at, self.peer_id, organiser, seal)
        with self._lock:
            self._run = record
        if not self._store_run(record):
            logger.warning("run %s was not stored yet; retrying at the next heartbeat", self.run_id)
        return record

    def adopt_run(self, record: RunRecord) -> None:
        """Keep an existing run alive under our own key too (same config, ``created_at`` and signature)."""
        if record.seal is None:
            raise ValueError("a run record without the organiser's signature cannot be adopted")
        self.publish_run(record.config, record.created_at, record.seal)

    def _store_run(self, record: RunRecord) -> bool:
        """Store the run record; the heartbeat renews it only when less than two advert lifetimes are left (it
        lives much longer than an advert, and every peer keeps it: one store per heartbeat each is waste)."""
        at = now()
        ttl = max(self.ttl_s, RUN_RECORD_MIN_TTL_S)
        payload = {"config": record.config, "created_at": record.created_at, "organiser": record.seal}
        stored = self.store.put("run", payload, at + ttl)
        with self._lock:
            stewards = dict(self._stewards)
        for revision, signed in stewards.items():  # the organiser's additions outlive its peer like the run
            self.store.put("stewards", signed, at + ttl, suffix=b"/%d" % revision)
        if stored:
            self._run_renew_at = at + max(self.heartbeat_s, ttl - 2 * self.ttl_s)
        return stored

    # ---- reading --------------------------------------------------------------------------------------

    def live_entries(self) -> list[PeerEntry]:
        """Live peers with heartbeat times, sorted by peer id (expired, departed and malformed dropped)."""
        records = self.store.get_all("peers")
        at = now()
        if records is None:
            return self._unexpired(at)
        entries = []
        departed = set()
        for record in records:
            payload = record.payload
            if payload.get("left") is True:
                departed.add(record.owner)
                continue
            try:
                if set(payload) != {"advert", "at", "found"}:
                    raise ValueError("peers record must hold exactly advert, at and found")
                advert = Advert.from_record(payload["advert"])
                heartbeat_at = payload["at"]
                if isinstance(heartbeat_at, bool) or not isinstance(heartbeat_at, (int, float)):
                    raise ValueError("at: expected a number")
                found = _check_found(payload["found"], record.owner)
            except ValueError as error:
                logger.warning("ignoring the advert of %s: %s", record.owner, error)
                continue
            if advert.peer_id != record.owner:
                logger.warning("ignoring an advert for %s signed by %s", advert.peer_id, record.owner)
                continue
            entries.append(PeerEntry(advert, float(heartbeat_at), record.expires_at, found))
        entries.sort(key=lambda entry: entry.advert.peer_id)
        with self._lock:
            announced = self._advert is not None
        if announced and self._last_expiry > at and not any(e.advert.peer_id == self.peer_id for e in entries):
            # our own advert is stored and alive, so a read without it is incomplete (a DHT whose other nodes
            # do not answer, e.g. under a partition): keep the previous view, minus what has expired since
            logger.info("incomplete read of %s (our own advert is missing); keeping the previous view",
                        self.store.key("peers"))
            return self._unexpired(at)
        # a read that reaches only some of the nodes holding the record misses some adverts (a busy swarm: a node
        # did not answer in time); an advert seen before stays live until it expires or its tombstone is read,
        # as it does in the DHT, so one partial read neither shrinks the leader's plan nor resets the election
        seen = {entry.advert.peer_id for entry in entries}
        entries += [entry for entry in self._unexpired(at)
                    if entry.advert.peer_id not in seen and entry.advert.peer_id not in departed]
        with self._lock:
            own = self._advert
        entries = self._endpoints.filter(entries, own, self._endpoint_hints())
        self._last_entries = entries
        member_nodes(self.store.dht).note(self.store.dht, (e.advert for e in entries))  # reads also go there
        return list(entries)

    def _unexpired(self, at: float) -> list[PeerEntry]:
        self._last_entries = [entry for entry in self._last_entries if entry.expires_at >= at]
        return list(self._last_entries)

    def live_peers(self) -> list[Advert]:
        """Adverts of the live peers, sorted by peer id."""
        return [entry.advert for entry in self.live_entries()]

    def links(self) -> list[LinkReport]:
        """Every valid link report of every reporter (a report must come from its ``src``)."""
        records = self.store.get_all("links")
        if records is None:
            return list(self._last_links)
        reports = []
        for record in records:
            items = record.payload.get("links")
            if not isinstance(items, list) or len(items) > MAX_LINK_REPORTS:
                logger.warning("ignoring the link reports of %s: not a list of at most %d",
                               record.owner, MAX_LINK_REPORTS)
                continue
            for item in items:
                try:
                    report = LinkReport.from_record(item)
                except ValueError as error:
                    logger.warning("ignoring a link report of %s: %s", record.owner, error)
                    continue
                if report.src == record.owner:
                    reports.append(report)
        reports.sort(key=lambda report: (report.src, report.dst))
        self._last_links = reports
        return list(reports)

    def check_clock(self, max_skew_s: float = MAX_CLOCK_SKEW_S, attempts: int = 3,
                    witnesses: Collection[str] = ()) -> float | None:
        """Compare our clock with the live peers' heartbeat times; :class:`ClockSkewError` beyond ``max_skew_s``.

        Returns the median of (their heartbeat time - our clock when the read began), None when nobody else is
        there. A heartbeat time is at most one heartbeat old when written, so the synchronised range is about
        [-heartbeat_s, 0]; records that look expired by our clock count too (an early clock would otherwise see
        none). A heartbeat looks older than it is when the machines are busy (a store or a read taking seconds):
        a clock that looks ahead by less than ``LATE_HEARTBEAT_SLACK_S`` more than allowed is read again, up to
        ``attempts`` times half a heartbeat apart, and judged by the freshest reading; one that looks behind, or
        further ahead, is refused at once (lateness cannot make a record look newer, nor seconds older).
        ``witnesses``: when given, only these peers' records count (the credited peers, ``peer.swarm.election``),
        so free identities with skewed clocks cannot move the median and refuse an honest joiner.
        """
        best: float | None = None
        count = 0
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.heartbeat_s / 2)
            started = now()
            records = self.store.read("peers", include_expired=True)
            offsets = [
                float(record.payload["at"]) - started
                for record in records or []
                if record.owner != self.peer_id
                and (not witnesses or record.owner in witnesses)
                and isinstance(record.payload.get("at"), (int, float))
                and not isinstance(record.payload.get("at"), bool)
                and "advert" in record.payload
            ]
            if not offsets:
                return best
            offset, count = statistics.median(offsets), len(offsets)
            if offset > max_skew_s:
                raise ClockSkewError(
                    f"this machine's clock is {offset:.1f} s behind the swarm's ({count} peers; at most "
                    f"{max_skew_s:g} s allowed): synchronise it (e.g. enable NTP) and join again"
                )
            best = offset if best is None else max(best, offset)
            if best >= -(max_skew_s + self.heartbeat_s):
                return best
            if best < -(max_skew_s + self.heartbeat_s + LATE_HEARTBEAT_SLACK_S):
                break
        assert best is not None
        raise ClockSkewError(
            f"this machine's clock is {-best - self.heartbeat_s:.1f} s or more ahead of the swarm's "
            f"({count} peers; at most {max_skew_s:g} s allowed): synchronise it (e.g. enable NTP) and join again"
        )

    @property
    def organiser(self) -> str | None:
        """The organiser of the run this peer published or adopted (None before either)."""
        with self._lock:
            return None if self._run is None else self._run.organiser

    def read_stewards(self, organiser: str) -> tuple[str, ...] | None:
        """The stewards ``organiser`` added to the run by signed records (``peer stewards``), in revision order;
        None when the read timed out. Every record that verifies is also kept alive under our own subkey."""
        records = self.store.get_all("stewards")
        if records is None:
            return None
        found: dict[int, tuple[dict, tuple[str, ...]]] = {}
        for record in records[:MAX_STEWARD_RECORDS * 8]:
            try:
                ids = stewards_of(self.run_id, organiser, record.payload)
            except CharterError:
                continue
            found[record.payload["revision"]] = (record.payload, ids)
        revisions = sorted(found)[:MAX_STEWARD_RECORDS]
        with self._lock:
            new = [r for r in revisions if r not in self._stewards]
            for r in revisions:
                self._stewards[r] = found[r][0]
        if new and self._run is not None:
            self._run_renew_at = 0.0  # store them at the next heartbeat
        return tuple(dict.fromkeys(p for r in revisions for p in found[r][1]))

    def get_run_record(self) -> RunRecord | None:
        """The run as its organiser signed it (the organiser of the run this peer took part in; before that, the
        only organiser any record names), or None when nobody (with our secret) published it."""
        records = self.store.get_all("run") or []
        try:
            return organisers_run(records, self.run_id, self.organiser)
        except OrganiserError:  # a reader that took part in no run (peer status): the run most members keep
            return most_kept_run(records, self.run_id)

    def get_run(self) -> dict | None:
        record = self.get_run_record()
        return None if record is None else record.config


def _check_found(value: object, owner: str) -> frozenset[str]:
    if not isinstance(value, list) or len(value) > MAX_FOUND:
        raise ValueError(f"found: expected a list of at most {MAX_FOUND} peer ids")
    found = frozenset(check_peer_id(item, "found[]") for item in value)
    if owner in found:
        raise ValueError("found: a peer cannot testify that it found itself")
    return found


MAX_STEWARD_RECORDS = 16  # the organiser's stewards records a peer reads and keeps alive


class OrganiserError(SwarmSecretError):
    """The run's records name several organisers and the joiner named none (or none is the one it named)."""


def organisers_run(records: list, run_id: str, organiser: str | None) -> RunRecord | None:
    """The run as ``organiser`` signed it (the join line's ``--organiser``); None when no record of it is there.
    Without ``organiser``, the run of the only organiser any valid record names: a joiner that trusts its first
    sight (it says so in the log); OrganiserError when records of several organisers are there. A record
    without a valid signature is ignored, whatever its ``created_at``."""
    runs: dict[str, RunRecord] = {}
    for record in records:
        payload = record.payload
        config, created_at = payload.get("config"), payload.get("created_at")
        if set(payload) != {"config", "created_at", "organiser"} or not isinstance(config, dict):
            logger.warning("ignoring a malformed run record from %s", record.owner)
            continue
        if isinstance(created_at, bool) or not isinstance(created_at, (int, float)):
            logger.warning("ignoring a run record from %s without a numeric created_at", record.owner)
            continue
        try:
            signer = run_organiser(run_id, payload)
        except CharterError as exc:
            logger.warning("ignoring a run record stored by %s: %s", record.owner, exc)
            continue
        if organiser is not None and signer != organiser:
            logger.warning("ignoring a run record signed by %s: the organiser is %s", signer, organiser)
            continue
        run = RunRecord(config, float(created_at), record.owner, signer, payload["organiser"])
        if signer not in runs or (run.created_at, run.publisher) < (runs[signer].created_at, runs[signer].publisher):
            runs[signer] = run
    if len(runs) > 1:
        raise OrganiserError(f"run {run_id!r} is claimed by {len(runs)} organisers ({', '.join(sorted(runs))}): "
                             "join with the --organiser PEER_ID of the join line `peer start` printed")
    return next(iter(runs.values()), None)


def most_kept_run(records: list, run_id: str) -> RunRecord | None:
    """Among several organisers' runs, the one the most distinct members keep alive (a display's best guess for a
    reader that names no organiser; never used to join or to lead)."""
    keepers: dict[str, set[str]] = {}
    for record in records:
        try:
            keepers.setdefault(run_organiser(run_id, record.payload), set()).add(record.owner)
        except CharterError:
            continue
    if not keepers:
        return None
    best = max(keepers, key=lambda organiser: (len(keepers[organiser]), organiser))
    return organisers_run(records, run_id, best)


def verify_swarm_secret(
    dht: hivemind.DHT, run_id: str, secret: str | None, timeout_s: float = DHT_CALL_TIMEOUT_S,
    organiser: str | None = None,
) -> RunRecord | None:
    """Check our join secret against the published run before announcing anything.

    Returns the run when it is published and our secret matches (None when no run is published at all);
    raises :class:`SwarmSecretError` when the run exists but only with MACs we cannot verify.
    """
    store = RecordStore(dht, run_id, None, secret, timeout_s)
    records = store.read("run")
    if records is None:
        raise RunReadTimeoutError(f"could not read run {run_id!r} from the DHT within {timeout_s:g} s")
    accepted = [record for record in records if record.mac_status is MacStatus.OK]
    run = organisers_run(accepted, run_id, organiser)
    if run is not None or not records or accepted:
        return run
    statuses = {record.mac_status for record in records}
    if secret is None:
        raise SwarmSecretError(f"run {run_id!r} requires a join secret (--secret)")
    if MacStatus.BAD in statuses:
        raise SwarmSecretError(f"wrong join secret for run {run_id!r}")
    raise SwarmSecretError(f"run {run_id!r} has no join secret, but one was given")
