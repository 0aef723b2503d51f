"""Start (or join) the hivemind DHT with the peer's signing key, failing fast with a one-line reason.

A ``hivemind.DHT`` runs in a child process that starts a libp2p daemon; errors come back as
``P2PDaemonError("Daemon failed to start: 2026/01/01 12:00:00 failed to connect to bootstrap peers")``.
:func:`start_dht` bounds the start-up with a deadline, always cleans the child up on failure and turns the
daemon's message into a :class:`DHTStartError` that says what to fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from tasklet.peer.swarm.identity import Identity
from tasklet.peer.timing import DHT_STARTUP_TIMEOUT_S

RECONNECT_PING_S = 5.0  # one re-ping of a bootstrap node waits at most this
# hivemind's defaults tuned for a run's few, small, short-lived dictionary records (see start_dht)
BUCKET_SIZE = 8  # k: nodes a lookup keeps in its beam and a find returns (hivemind: 20); >= the 5 replicas
CACHE_NEAREST = 0  # hivemind re-stores every value a get found on the nearest node without it (hivemind: 1)
CACHE_REFRESH_BEFORE_EXPIRY_S = 0.0  # hivemind re-gets cached values about to expire in the background (5 s)

logger = logging.getLogger(__name__)

_DAEMON_PREFIX_RE = re.compile(r"^(Daemon failed to start:\s*)?(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s*)?")


class DHTStartError(RuntimeError):
    """The DHT could not be started or joined; the message is one line meant for the user."""


@dataclass(frozen=True)
class DHTConfig:
    """Where the DHT listens and whom it joins.

    ``host``/``port`` are the listen address (port 0 picks a free one); ``announce_host`` the address other
    peers should dial when it differs (NAT, containers). ``client_mode`` nodes only read and write, they do
    not serve other peers (``peer status`` uses one).
    """

    initial_peers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    client_mode: bool = False
    startup_timeout_s: float = DHT_STARTUP_TIMEOUT_S

    def host_maddrs(self) -> list[str]:
        return [_tcp_maddr("host", self.host, self.port)]

    def announce_maddrs(self) -> list[str] | None:
        if self.announce_host is None:
            return None
        return [_tcp_maddr("announce_host", self.announce_host, self.port)]


class DhtOps:
    """Counts of the DHT gets and stores made through record stores, by kind and record name ("get:peers"), and
    of the records the gets returned ("rows:peers": a get of every advert returns one row per live peer).

    The control plane's load is what these count: every record store (``peer.swarm.records``) adds to its own
    counter and to the process-wide :data:`DHT_OPS`, so a daemon can log its reads per heartbeat and a test
    can hold one peer's reads constant as the swarm grows. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, kind: str, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[f"{kind}:{name}"] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def total(self, kind: str) -> int:
        """All counts of one kind ("get", "store" or "rows")."""
        with self._lock:
            return sum(n for key, n in self._counts.items() if key.startswith(kind + ":"))


DHT_OPS = DhtOps()  # every get and store of this process


def ops_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What happened between two snapshots (keys with no change left out)."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def _tcp_maddr(field: str, host: str, port: int) -> str:
    if not 0 <= port <= 65535:
        raise DHTStartError(f"port must be in 0..65535, got {port}")
    try:
        address = ipaddress.ip_address(host)
    except ValueError as error:
        raise DHTStartError(f"{field} must be an IP address, got {host!r}") from error
    return f"/ip{address.version}/{address}/tcp/{port}"


def _clean_daemon_message(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return _DAEMON_PREFIX_RE.sub("", text)


def _explain(config: DHTConfig, message: str) -> str:
    lowered = message.lower()
    if "address already in use" in lowered:
        return f"cannot listen on {config.host}:{config.port}: address already in use"
    if config.initial_peers:
        joined = " ".join(config.initial_peers)
        if "parse multiaddr" in lowered or "invalid" in lowered or "must begin with" in lowered:
            return f"bad --dht address {joined!r}: {message} (expected /ip4/HOST/tcp/PORT/p2p/PEER_ID)"
        return f"cannot join the DHT at {joined}: {message}"
    return f"cannot start the DHT: {message}"


def start_dht(config: DHTConfig, identity: Identity, validators: Sequence[RecordValidatorBase] = ()) -> hivemind.DHT:
    """A running DHT that signs this identity's records, or a :class:`DHTStartError` within the deadline.
    ``validators`` join the signature validator (e.g. peer.swarm.records.RunRecordValidator, which refuses
    what may not be stored under a run's keys before this node stores it).

    The caller owns the returned DHT and must ``shutdown()`` it.

    Why not hivemind's lookup defaults: a hivemind find returns the value the node holds, and a run's
    ``peers`` record is a dictionary of every live advert, so each node a lookup visits sends O(N) bytes, and
    every store (a heartbeat) and every get walks a beam of ``bucket_size`` nodes: with the default 20 nearly
    every node of a 32-peer swarm, O(N^2) per heartbeat for the swarm. A beam of :data:`BUCKET_SIZE` still
    covers the 5 nodes each record is stored on. The extra store of each found value to the nearest node
    (``cache_nearest``) and the background re-get of cached values (``cache_refresh_before_expiry``, with
    adverts that live 3 heartbeats: almost always) double that for no reader of ours: every read asks for the
    latest value anyway.
    """
    dht = hivemind.DHT(
        initial_peers=list(config.initial_peers) or None,
        start=False,
        record_validators=[identity.signature_validator(), *validators],
        client_mode=config.client_mode,
        host_maddrs=config.host_maddrs(),
        announce_maddrs=config.announce_maddrs(),
        startup_timeout=config.startup_timeout_s,
        bucket_size=BUCKET_SIZE,
        cache_nearest=CACHE_NEAREST,
        cache_refresh_before_expiry=CACHE_REFRESH_BEFORE_EXPIRY_S,
    )
    try:
        dht.run_in_background(await_ready=True, timeout=config.startup_timeout_s)
    except TimeoutError as error:
        _stop(dht)
        where = " ".join(config.initial_peers) or f"{config.host}:{config.port}"
        raise DHTStartError(f"DHT at {where} did not answer within {config.startup_timeout_s:g} s") from error
    except Exception as error:  # hivemind raises P2PDaemonError, ValueError, OSError, ...
        _stop(dht)
        raise DHTStartError(_explain(config, _clean_daemon_message(error))) from error
    return dht


def _stop(dht: hivemind.DHT) -> None:
    try:
        dht.shutdown()
    except Exception:  # the child may already be gone; make sure it is
        logger.debug("DHT shutdown after a failed start raised", exc_info=True)
    if dht.is_alive():
        dht.terminate()
        dht.join(5)


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """The multiaddrs other peers can pass to ``--dht`` to join through this node."""
    return [str(maddr) for maddr in dht.get_visible_maddrs()]


def reconnect(dht: hivemind.DHT, maddrs: Sequence[str]) -> None:
    """Ping these DHT nodes again, in the background, without waiting; skipped while the last round runs.

    A node drops peers that stopped answering from its routing table; after a network partition heals
    neither side would look for the other again. Re-pinging the nodes a peer bootstrapped from (the daemon
    does it every ``peer.timing.DHT_RECONNECT_HEARTBEATS``) puts them back into each other's routing table,
    and the DHT merges. A node that answers costs one ping; one that is gone costs a ping that times out
    (rounds never overlap, so they cannot pile up).
    """
    pending = _PENDING.get(id(dht))
    if not maddrs or (pending is not None and not pending.done()):
        return
    _PENDING[id(dht)] = dht.run_coroutine(partial(_ping_all, maddrs=tuple(maddrs)), return_future=True)


_PENDING: dict[int, Any] = {}  # id(dht) -> the future of its last reconnect round


async def _ping_all(_dht: hivemind.DHT, node: hivemind.DHTNode, maddrs: tuple[str, ...]) -> None:
    """Runs inside the DHT's process (so it must be a module-level function: it is pickled there)."""

    async def ping(maddr: str) -> None:
        try:
            peer_id = PeerID.from_base58(Multiaddr(maddr)["p2p"])
        except Exception:  # a bad address was refused at start-up already; nothing to re-dial
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.protocol.call_ping(peer_id, validate=False, strict=False), RECONNECT_PING_S)

    await asyncio.gather(*(ping(maddr) for maddr in maddrs))
