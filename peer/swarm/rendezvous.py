"""Reads and writes of the run's records that a DHT eclipse cannot hide: they go through members' DHT nodes too.

A hivemind lookup trusts the nodes nearest a key, and a node chooses its own id: stranger nodes with ids next to
a run key become its replicas, swallow every store and answer every lookup with nothing (an eclipse; tried, it
stopped a training swarm and hid the run from every joiner). So besides hivemind's own lookup and store:

* a write is also kept in the writer's own DHT node and pushed to a few members' DHT nodes (the bootstrap nodes
  of the join line while no member is known);
* a read also asks a few members' DHT nodes directly and the writer's own node, merges every answer (per subkey,
  the latest expiry wins) and keeps what the members answered in its own node, so each member's node gathers the
  run's records from the others, read after read, whoever the nearest nodes are.

The members' DHT nodes are named by their sealed adverts (``Advert.dht``): only a peer with the join secret can
put one there, so stranger ids chosen next to the keys cannot be among them (in an open swarm anyone may advertise,
and the defence is as good as the honest share of the adverts). Every entry a member's node answers passes the same
validators as a lookup's (signature, seal, schema), and its own storage's budgets bound what a node keeps. Costs:
each read asks :data:`ASK_MEMBERS` more nodes for the whole key and waits for them at most
:data:`MEMBER_GRACE_S` past its lookup; each write is pushed to as many, in the background, so that no member's
node slows a heartbeat (docs/security.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration

from tasklet.peer.swarm.adverts import DHT_PEER_ID_RE
from tasklet.peer.swarm.findgate import gate_members

ASK_MEMBERS = 2  # members' DHT nodes each read asks and each write is pushed to, besides hivemind's own
QUIET_S = 10.0  # a member's node that did not answer is not asked again for this long (a healed partition's
# nodes are asked again soon after)
MEMBER_GRACE_S = 1.0  # a read waits for the members' answers at most this long after hivemind's lookup ended
MAX_MEMBER_NODES = 4096  # member DHT nodes one peer remembers


class MemberNodes:
    """The DHT nodes this peer asks directly: the live members' (from their sealed adverts) and, while it knows
    none, the bootstrap nodes of its join line. A node that did not answer is left out for :data:`QUIET_S` (each
    read would wait its grace for it). Thread-safe."""

    def __init__(self, bootstrap: Iterable[str] = (), own: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bootstrap = tuple(dict.fromkeys(p for p in bootstrap if p != own))
        self.own, self.clock = own, clock
        self._members: tuple[str, ...] = ()
        self.gated: frozenset[str] = frozenset()  # the members' nodes the find gate was last told of
        self._quiet: dict[str, float] = {}  # _lock: node -> until when it is left out
        self._lock = threading.Lock()

    def failed(self, peers: Iterable[str]) -> None:
        """These nodes did not answer: leave them out for a while."""
        until = self.clock() + QUIET_S
        with self._lock:
            for peer in peers:
                self._quiet[peer] = until
            if len(self._quiet) > MAX_MEMBER_NODES:
                self._quiet = dict(sorted(self._quiet.items(), key=lambda kv: kv[1])[-MAX_MEMBER_NODES:])

    def note(self, dht: Any, adverts: Iterable[Any]) -> None:
        """The live members' adverts as the last read names them: the reachable ones' nodes are asked, and the
        DHT process's find gate (peer.swarm.findgate) favours every member's node; it is told when that changes."""
        adverts = list(adverts)
        self.update(a.dht for a in adverts if a.reachable)
        every = frozenset(a.dht for a in adverts if a.dht)
        if every != self.gated and isinstance(dht, hivemind.DHT):
            self.gated = every
            gate_members(dht, every)

    def update(self, peer_ids: Iterable[str]) -> None:
        """The members' DHT nodes as the last read of the adverts names them."""
        members = tuple(dict.fromkeys(p for p in peer_ids if p and p != self.own))[:MAX_MEMBER_NODES]
        with self._lock:
            self._members = members

    def pick(self, rng: random.Random | None = None) -> tuple[str, ...]:
        """Whom one read or write asks: :data:`ASK_MEMBERS` members at random (of those not left out), or the
        bootstrap nodes while it knows no member."""
        at = self.clock()
        with self._lock:
            members = self._members
            answering = [p for p in members if self._quiet.get(p, 0.0) <= at]
        if not members:
            return self.bootstrap
        return tuple((rng or random).sample(answering, min(ASK_MEMBERS, len(answering))))


_NODES: weakref.WeakKeyDictionary[hivemind.DHT, MemberNodes] = weakref.WeakKeyDictionary()


def member_nodes(dht: hivemind.DHT) -> MemberNodes:
    """The member nodes known to this DHT's peer (registered by ``peer.swarm.dht.start_dht``; empty otherwise)."""
    nodes = _NODES.get(dht)
    if nodes is None:
        nodes = _NODES.setdefault(dht, MemberNodes())
    return nodes


def register(dht: hivemind.DHT, bootstrap: Sequence[str]) -> MemberNodes:
    """Start this DHT's member nodes with the bootstrap nodes' peer ids (from ``/p2p/...`` multiaddrs)."""
    ids = [m.rsplit("/p2p/", 1)[1] for m in bootstrap if "/p2p/" in m]
    nodes = MemberNodes([p for p in ids if DHT_PEER_ID_RE.match(p)], own=str(dht.peer_id))
    _NODES[dht] = nodes
    return nodes


class _Outcome:
    """The future of a read or write in the DHT's process: its result, with the nodes that did not answer left
    out of later picks."""

    def __init__(self, inner: Any, nodes: MemberNodes) -> None:
        self.inner, self.nodes = inner, nodes

    def result(self, timeout: float | None = None) -> Any:
        value, failed = self.inner.result(timeout)
        if failed:
            self.nodes.failed(failed)
        return value

    def cancel(self) -> bool:
        return bool(self.inner.cancel())


class _Ready:
    """A future already done: what a DHT without a process of its own answers (the control-plane simulation's)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value

    def cancel(self) -> bool:
        return False


def store(dht: hivemind.DHT, key: str, subkey: bytes, value: Any, expires_at: float, timeout_s: float) -> Any:
    """A future of whether ``value`` was stored: hivemind's store, the own node and :meth:`MemberNodes.pick`.
    A DHT that is not hivemind's (the control-plane simulation's one store) is written as it is."""
    if not isinstance(dht, hivemind.DHT):
        return _Ready(dht.store(key, value, expires_at, subkey=subkey))
    nodes = member_nodes(dht)
    job = partial(_store, key=key, subkey=subkey, value=value, expires_at=expires_at, peers=nodes.pick(),
                  timeout_s=timeout_s)
    return _Outcome(dht.run_coroutine(job, return_future=True), nodes)


def read(dht: hivemind.DHT, key: str, timeout_s: float) -> Any:
    """A future of ``{subkey: ValueWithExpiration}`` (values deserialised and without signatures), or None when
    nothing was found: hivemind's lookup, the own node and :meth:`MemberNodes.pick`, merged. A DHT that is not
    hivemind's (the control-plane simulation's one store) is read as it is."""
    if not isinstance(dht, hivemind.DHT):
        found = dht.get(key, latest=True)
        return _Ready(found.value if found is not None and isinstance(found.value, dict) else None)
    nodes = member_nodes(dht)
    job = partial(_read, key=key, peers=nodes.pick(), timeout_s=timeout_s)
    return _Outcome(dht.run_coroutine(job, return_future=True), nodes)


def _peer(peer: str) -> PeerID | None:
    try:
        return PeerID.from_base58(peer)
    except Exception:  # a malformed id can only come from our own caller; skip it
        return None


async def _store(_dht: hivemind.DHT, node: hivemind.DHTNode, key: str, subkey: bytes, value: Any,
                 expires_at: float, peers: tuple[str, ...], timeout_s: float) -> tuple[bool, list[str]]:
    """Runs in the DHT's process: the signed entry kept in the own node, pushed to ``peers`` in the background, and
    hivemind's store. Returns (kept or stored by hivemind, the members' nodes that did not answer a push since the
    last call)."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expires_at)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
        if not protocol.record_validator.validate(record):
            return False, []
    kept = bool(protocol.storage.store(key_id, record.value, expires_at, subkey=subkey))

    asked = [p for p in peers if _peer(p) is not None]
    for peer in asked:  # in the background: a write waits for no member's node (see _PUSHES)
        _push(protocol, peer, key_id, subkey, record.value, expires_at, timeout_s)
    # hivemind's own store goes on past our deadline, as a plain store would: cancelling it mid-traversal (its
    # nodes slow or cut off) stored the entry nowhere
    own_store = asyncio.ensure_future(node.store(key, value, expires_at, subkey=subkey))
    try:
        stored = bool(await asyncio.wait_for(asyncio.shield(own_store), timeout_s))
    except Exception:  # our deadline, or hivemind's own failure: the entry is still in our node if kept
        stored = False
    return kept or stored, _unanswered()


# Pushes of written entries to members' nodes run in the DHT's process, in the background: a write that waited for
# them stalled its writer's heartbeat for hivemind's whole RPC timeout whenever a member's node was cut off, and
# with adverts living three heartbeats, a partitioned side's adverts expired and its leader saw nobody present.
_PUSHES: set[asyncio.Task] = set()
_UNANSWERED: set[str] = set()  # members' nodes that did not answer a push, reported with the next call's result
MAX_PUSHES = 64  # pushes in flight in one DHT process; past it, a write is pushed to nobody


def _push(protocol: Any, peer: str, key_id: DHTID, subkey: bytes, value: bytes, expires_at: float,
          timeout_s: float) -> None:
    if len(_PUSHES) >= MAX_PUSHES:
        return

    async def push() -> None:
        try:
            done = await asyncio.wait_for(
                protocol.call_store(_peer(peer), [key_id], [value], expires_at, [subkey]), timeout_s)
        except Exception:
            done = None
        if done is None:  # no answer (a refusal is an answer)
            _UNANSWERED.add(peer)

    task = asyncio.ensure_future(push())
    _PUSHES.add(task)
    task.add_done_callback(_PUSHES.discard)


def _unanswered() -> list[str]:
    """The members' nodes that did not answer a push since the last call (and forgets them)."""
    out = list(_UNANSWERED)
    _UNANSWERED.clear()
    return out


async def _read(_dht: hivemind.DHT, node: hivemind.DHTNode, key: str, peers: tuple[str, ...],
                timeout_s: float) -> tuple[dict | None, list[str]]:
    """Runs in the DHT's process: see :func:`read`. Returns (the merged entries, the nodes that did not answer)."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    asked = [p for p in peers if _peer(p) is not None]
    lookup, finds = await _lookup_and_finds(node, key, key_id, [_peer(p) for p in asked], timeout_s)  # type: ignore[misc]
    failed = [p for p, found in zip(asked, finds, strict=True) if not isinstance(found, dict)] + _unanswered()
    merged: dict[Any, ValueWithExpiration] = {}

    def take(subkey: Any, value: Any, expiry: float) -> None:
        old = merged.get(subkey)
        if old is None or expiry > old.expiration_time:
            merged[subkey] = ValueWithExpiration(value, expiry)

    if isinstance(lookup, ValueWithExpiration) and isinstance(lookup.value, dict):
        for subkey, item in lookup.value.items():
            take(subkey, item.value, item.expiration_time)
    own = protocol.storage.get(key_id)
    raw = [own.value] if own is not None and isinstance(own.value, DictionaryDHTValue) else []
    for found in finds:
        if isinstance(found, dict) and found.get(key_id) is not None:
            answer = found[key_id][0]
            if answer is not None and isinstance(answer.value, DictionaryDHTValue):
                raw.append(answer.value)
                for subkey, item in answer.value.items():  # keep what a member answered (validated on receipt)
                    protocol.storage.store(key_id, item.value, item.expiration_time, subkey=subkey)
    for dictionary in raw:
        for subkey, item in dictionary.items():
            stripped = item.value
            if protocol.record_validator is not None:
                record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), item.value,
                                   item.expiration_time)
                stripped = protocol.record_validator.strip_value(record)
            try:
                take(subkey, protocol.serializer.loads(stripped), item.expiration_time)
            except Exception:  # validated entries deserialise; a malformed one is skipped, never raised
                continue
    return merged or None, failed


async def _lookup_and_finds(node: hivemind.DHTNode, key: str, key_id: DHTID, peers: list[PeerID],
                            timeout_s: float) -> tuple[Any, list[Any]]:
    """hivemind's lookup of ``key`` and finds of it at ``peers`` (each answer, or None), all within ``timeout_s``;
    the finds get at most :data:`MEMBER_GRACE_S` after the lookup ended, so a member's node that cannot be reached
    costs a read that grace, not the whole deadline, while an eclipsed lookup that ends at once still hears the
    members."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    lookup = asyncio.ensure_future(asyncio.wait_for(node.get(key, latest=True), timeout_s))
    finds = [asyncio.ensure_future(node.protocol.call_find(p, [key_id])) for p in peers]
    await asyncio.wait([lookup])
    if finds:
        await asyncio.wait(finds, timeout=max(0.0, min(MEMBER_GRACE_S, end - loop.time())))
    for task in finds:
        task.cancel()
    answers = [t.result() if t.done() and not t.cancelled() and t.exception() is None else None for t in finds]
    return (lookup.result() if lookup.exception() is None else None), answers
