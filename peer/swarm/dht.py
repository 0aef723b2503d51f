"""Start (or join) the hivemind DHT with the peer's signing key, failing fast with a one-line reason.

A ``hivemind.DHT`` runs in a child process that starts a libp2p daemon; errors come back as
``P2PDaemonError("Daemon failed to start: 2026/01/01 12:00:00 failed to connect to bootstrap peers")``.
:func:`start_dht` bounds the start-up with a deadline, always cleans the child up on failure and turns the
daemon's message into a :class:`DHTStartError` that says what to fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import ipaddress
import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import TimedStorage, ValueWithExpiration, get_dht_time

from tasklet.peer.identity.keys import Identity, split_owner_subkey
from tasklet.peer.swarm.findgate import FindGate, asking, gated_find
from tasklet.peer.swarm.rendezvous import register
from tasklet.peer.timing import DHT_STARTUP_TIMEOUT_S

RECONNECT_PING_S = 5.0  # one re-ping of a bootstrap node waits at most this
OTHERS_ANSWER_BYTES = 256 * 1024  # of one key, what a find answer to an asker that is not a member's node carries
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


@dataclass(frozen=True)
class KeyBudget:
    """What one DHT node stores under one key: bytes (subkey + signed value of every live entry) and entries,
    in all and of one owner (the writer whose owner tag starts the subkey)."""

    max_bytes: int
    max_entries: int
    owner_bytes: int
    owner_entries: int
    group: str = ""  # keys of one group (the shards of one kind) share the storage's ``group_bytes`` for it


@dataclass(frozen=True)
class StorageBudget:
    """The keys (DHTID bytes) a DHT node stores, each with its budget, and the bytes of all of them together.
    ``steward_keys``: the keys that only the writers :func:`restrict_writers` names may store under, once named."""

    keys: dict[bytes, KeyBudget]
    total_bytes: int
    steward_keys: frozenset[bytes] = frozenset()
    group_bytes: dict[str, int] = field(default_factory=dict)


class _Usage:
    """A key's live entries as the budget counts them: subkey -> (owner, bytes, expiry), with sums."""

    def __init__(self) -> None:
        self.entries: dict[Any, tuple[str, int, float]] = {}
        self.bytes = 0
        self.owner_bytes: Counter[str] = Counter()
        self.owner_entries: Counter[str] = Counter()
        self.pruned_at = float("-inf")

    def add(self, subkey: Any, owner: str, size: int, expiry: float) -> None:
        self.remove(subkey)
        self.entries[subkey] = (owner, size, expiry)
        self.bytes += size
        self.owner_bytes[owner] += size
        self.owner_entries[owner] += 1

    def remove(self, subkey: Any) -> int:
        """Forget ``subkey``; the bytes it held (0 if none)."""
        old = self.entries.pop(subkey, None)
        if old is None:
            return 0
        owner, size, _ = old
        self.bytes -= size
        self.owner_bytes[owner] -= size
        self.owner_entries[owner] -= 1
        if not self.owner_entries[owner]:
            del self.owner_bytes[owner], self.owner_entries[owner]
        return size


class BudgetedStorage(DHTLocalStorage):
    """hivemind's local storage holding only the budget's keys, each as a dictionary within its budget.

    hivemind's own storage takes any key, any number of subkeys and any expiry, without a size limit: a stranger
    could fill a volunteer's DHT process until it is killed for memory. This one refuses a plain (non-dictionary)
    value, a key outside the budget, an entry whose subkey has no owner tag, and a new or larger entry that would
    take its key, its owner's share of the key or all keys past their bytes or entries; expired entries are
    pruned before refusing (at most once a second per key, so a flood at the cap costs no scan per store). A
    re-store of an entry with a later expiry replaces it, as in hivemind (the old bytes are given back).
    Under a steward key, once the run's writers are known (:meth:`restrict`), only their entries are stored: free
    identities could otherwise fill the leader's keys (plans, beats) until no leader can store.
    hivemind keeps a heap of expiries with one item per store; it is compacted when it holds more than twice the
    live items, so re-stores of one entry cannot grow it either. Used on stores only: lookups are unaffected.
    """

    def __init__(self, budget: StorageBudget) -> None:
        super().__init__()
        self.budget = budget
        self._keys = {DHTID.from_bytes(key): limits for key, limits in budget.keys.items()}
        self._usage: dict[DHTID, _Usage] = {}
        self._steward_keys = {DHTID.from_bytes(key) for key in budget.steward_keys}
        self.writers: frozenset[str] | None = None  # who may store under the steward keys (None: any owner)
        self.gate = FindGate()  # how much of the keys' values finds hand out, and to whom
        self.total_bytes = 0
        self.group_used: Counter[str] = Counter()  # bytes held by each group's keys
        self._pruned_all_at = float("-inf")
        self.refused: Counter[str] = Counter()

    def get(self, key: DHTID) -> ValueWithExpiration | None:
        """hivemind's ``get``; while a find is answered (peer.swarm.findgate), the value only within the asker's
        budget (None otherwise: the answer says not found), and to an asker that is not a member's node only its
        smallest entries, up to :data:`OTHERS_ANSWER_BYTES` (honest records are small: the run's record, adverts;
        a key filled by free identities is mostly their padding)."""
        item = super().get(key)
        asker = asking()
        if item is None or asker is None:
            return item
        if asker.asker in asker.gate.members or not isinstance(item.value, DictionaryDHTValue):
            usage = self._usage.get(key)
            return item if asker.gate.allow(asker.asker, key, usage.bytes if usage else 0) else None
        trimmed, size = DictionaryDHTValue(), 0
        for subkey, (value, expiry) in sorted(item.value.items(), key=lambda kv: _entry_bytes(kv[0], kv[1].value)):
            entry = _entry_bytes(subkey, value)
            if size + entry > OTHERS_ANSWER_BYTES:
                break
            trimmed.store(subkey, value, expiry)
            size += entry
        if not size or not asker.gate.allow(asker.asker, key, size):
            return None
        return ValueWithExpiration(trimmed, item.expiration_time)

    def restrict(self, writers: frozenset[str] | None) -> int:
        """Only ``writers`` store under the steward keys from now on (None: any owner); entries of others already
        stored there are dropped. Returns how many were dropped."""
        self.writers = writers
        dropped = 0
        for key in self._steward_keys if writers is not None else ():
            item, usage = self.get(key), self._usage.get(key)
            if item is None or not isinstance(item.value, DictionaryDHTValue) or usage is None:
                continue
            for subkey in [k for k, (owner, _, _) in usage.entries.items() if owner not in writers]:
                self._forget(key, usage, subkey)
                if subkey in item.value:
                    del item.value[subkey]
                dropped += 1
        return dropped

    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is None:
            self.refused["plain value"] += 1
            return False
        return self.store_subkey(key, subkey, value, expiration_time)

    def store_subkey(self, key: DHTID, subkey: Any, value: Any, expiration_time: float) -> bool:
        reason = self._refusal(key, subkey, value, expiration_time)
        if reason:
            self.refused[reason] += 1
            return False
        if not super().store_subkey(key, subkey, value, expiration_time):
            return False
        usage = self._usage.setdefault(key, _Usage())
        self._forget(key, usage, subkey)
        size = _entry_bytes(subkey, value)
        usage.add(subkey, _owner(subkey) or "", size, expiration_time)
        self.total_bytes += size
        self.group_used[self._keys[key].group] += size
        self._compact(key)
        return True

    def _forget(self, key: DHTID, usage: _Usage, subkey: Any) -> None:
        """Stop counting ``subkey`` of ``key`` (if counted) in the key's, its group's and the total bytes."""
        size = usage.remove(subkey)
        self.total_bytes -= size
        self.group_used[self._keys[key].group] -= size

    def _prune(self, key: DHTID, usage: _Usage, at: float) -> None:
        for stale in [k for k, (_, _, expiry) in usage.entries.items() if expiry < at]:
            self._forget(key, usage, stale)

    def _refusal(self, key: DHTID, subkey: Any, value: Any, expiration_time: float) -> str:
        limits = self._keys.get(key)
        if limits is None:
            return "not a key of this node's run"
        if not isinstance(value, bytes):
            return "not a binary value"
        owner = _owner(subkey)
        if owner is None:
            return "no owner tag"
        if self.writers is not None and key in self._steward_keys and owner not in self.writers:
            return "not a steward of this run"
        at = get_dht_time()
        if expiration_time < at:
            return ""  # hivemind refuses it itself
        usage = self._usage.setdefault(key, _Usage())
        old = usage.entries.get(subkey)
        if old is not None and old[2] >= at and expiration_time <= old[2]:
            return ""  # hivemind keeps the stored entry, which is counted already
        reason = self._over(limits, usage, subkey, owner, _entry_bytes(subkey, value))
        if reason and at - usage.pruned_at >= 1.0:
            usage.pruned_at = at
            self._prune(key, usage, at)
            reason = self._over(limits, usage, subkey, owner, _entry_bytes(subkey, value))
        if reason in ("group bytes", "total bytes") and at - self._pruned_all_at >= 1.0:
            self._pruned_all_at = at  # the stale entries of the other keys count too
            for other, other_usage in self._usage.items():
                self._prune(other, other_usage, at)
            reason = self._over(limits, usage, subkey, owner, _entry_bytes(subkey, value))
        return reason

    def _over(self, limits: KeyBudget, usage: _Usage, subkey: Any, owner: str, size: int) -> str:
        """Which budget storing this entry would break ("" when none)."""
        old = usage.entries.get(subkey)
        freed = old[1] if old is not None else 0
        new = old is None
        if usage.bytes - freed + size > limits.max_bytes:
            return "key bytes"
        if new and len(usage.entries) >= limits.max_entries:
            return "key entries"
        if usage.owner_bytes[owner] - (freed if old is not None and old[0] == owner else 0) + size > limits.owner_bytes:
            return "owner bytes"
        if new and usage.owner_entries[owner] >= limits.owner_entries:
            return "owner entries"
        group = self.budget.group_bytes.get(limits.group)
        if group is not None and self.group_used[limits.group] - freed + size > group:
            return "group bytes"
        if self.total_bytes - freed + size > self.budget.total_bytes:
            return "total bytes"
        return ""

    def _compact(self, key: DHTID) -> None:
        """Drop the heap items of replaced entries when they outnumber the live ones."""
        for storage in (self, (self.data.get(key) or (None, 0))[0]):
            if isinstance(storage, TimedStorage) and len(storage.expiration_heap) > 2 * len(storage.data) + 64:
                storage.expiration_heap = [storage.key_to_heap[k] for k in storage.data if k in storage.key_to_heap]
                heapq.heapify(storage.expiration_heap)


def _owner(subkey: Any) -> str | None:
    owner = split_owner_subkey(subkey)
    return None if owner is None else owner[0]


def _entry_bytes(subkey: Any, value: bytes) -> int:
    return (len(subkey) if isinstance(subkey, bytes) else 64) + len(value)


async def _install_storage(_dht: hivemind.DHT, node: hivemind.DHTNode, budget: StorageBudget) -> int:
    """Runs in the DHT's process: swap in a budgeted storage (entries stored meanwhile are moved into it, within
    the budget), a cache that takes nothing (our nodes never ask others to cache: ``cache_nearest`` 0) and a find
    handler whose answers draw on the storage's :class:`FindGate`. Returns the entries moved."""
    storage = BudgetedStorage(budget)
    moved = 0
    for key, item in list(node.protocol.storage.items()):
        if isinstance(item.value, DictionaryDHTValue):
            for subkey, (value, expiry) in list(item.value.items()):
                moved += storage.store_subkey(key, subkey, value, expiry)
    node.protocol.storage = storage
    node.protocol.cache = BudgetedStorage(StorageBudget(keys={}, total_bytes=0))
    protocol, p2p = node.protocol, node.protocol.p2p
    if not protocol.client_mode:  # a client-mode node answers no finds: hivemind registered no handler
        name = protocol._get_handle_name(None, "rpc_find")  # noqa: SLF001 - the name hivemind registered it under
        await p2p.remove_protobuf_handler(name)
        await p2p.add_protobuf_handler(name, gated_find(protocol, storage.gate), dht_pb2.FindRequest)
    return moved


async def _restrict(_dht: hivemind.DHT, node: hivemind.DHTNode, writers: frozenset[str] | None) -> int:
    """Runs in the DHT's process: the writers of the steward keys (see :meth:`BudgetedStorage.restrict`)."""
    storage = node.protocol.storage
    return storage.restrict(writers) if isinstance(storage, BudgetedStorage) else 0


def restrict_writers(dht: hivemind.DHT, writers: Sequence[str] | None, timeout_s: float = 10.0) -> int:
    """Tell this node's storage who may write the run's steward keys (the organiser and its stewards; None: any
    owner, as in a swarm that elects its leaders); the entries it dropped, -1 when the DHT did not answer."""
    names = None if writers is None else frozenset(writers)
    try:
        return int(dht.run_coroutine(partial(_restrict, writers=names), return_future=True).result(timeout_s))
    except Exception as error:  # a DHT process that is gone or busy: the next policy change tries again
        logger.warning("could not restrict the run's steward keys: %s: %s", type(error).__name__, error)
        return -1


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
    dht = _CommandPipeDHT(
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
    try:
        dht.run_coroutine(_blocking_commands)
    except Exception as error:
        _stop(dht)
        raise DHTStartError(f"cannot set up the DHT's command pipe: {type(error).__name__}: {error}") from error
    register(dht, config.initial_peers)  # reads and writes of the run also go through members' nodes
    budgets = [v.storage_budget() for v in validators if hasattr(v, "storage_budget")]
    if budgets:
        try:
            dht.run_coroutine(partial(_install_storage, budget=budgets[0]))
        except Exception as error:
            _stop(dht)
            raise DHTStartError(f"cannot set up the DHT's storage: {type(error).__name__}: {error}") from error
    return dht


class _OneWriter:
    """hivemind's end of the command pipe to the DHT process, written by one thread at a time. hivemind sends from
    whichever thread calls ``get`` or ``store``, unlocked; a command larger than the room left in the pipe (the DHT
    process busy, the pipe full) goes in several writes, which two threads interleave, and the DHT process then
    reads a broken command and dies."""

    def __init__(self, pipe: Any) -> None:
        self._pipe, self._lock = pipe, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self._pipe.send(obj)

    def close(self) -> None:
        with self._lock:
            self._pipe.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


class _CommandPipeDHT(hivemind.DHT):
    """hivemind's DHT whose command pipe has one writer at a time (:class:`_OneWriter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._outer_pipe = _OneWriter(self._outer_pipe)


async def _blocking_commands(dht: hivemind.DHT, _node: hivemind.DHTNode) -> None:
    """Runs in the DHT's process: its end of the command pipe reads blocking again. hivemind watches the pipe
    with the event loop, which makes it non-blocking; a command still being written then reads as EAGAIN halfway,
    the rest of it as the next command, and the process dies (a leader's DHT, under a member's fill of the run's
    keys on 2 busy cores). Blocking, the read waits the moment the writer needs to finish."""
    os.set_blocking(dht._inner_pipe.fileno(), True)  # noqa: SLF001 - hivemind's own pipe, no API for it


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
