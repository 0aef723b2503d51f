"""How much of the run's records a DHT node hands out in answer to finds, and to whom.

hivemind answers every node's find of a key with the whole key, whoever asks and however often. With reads that
also go through members' DHT nodes (peer.swarm.rendezvous), a key that a member's free identities had filled to
its 3 MiB budget was sent whole to every asker, stranger or not: stranger nodes sitting next to the keys and the
members' own reads took a bootstrap node's DHT process to 1.7 GiB and the swarm from 6.9 to 2.5 steps/s. So a
node's answers that carry a run key's value draw on byte buckets: each asker's own, and one for its class in
all: the members' DHT nodes (named by their sealed adverts: only join-secret holders put them there), or
everyone else (a joiner before its advert is read, `peer status`, strangers), whose buckets are smaller. (A
limit of one answer per key and asker every 2 s made `peer doctor`'s quick reads return its own stale copies, and
its clock check failed.) Each asker's own bucket keeps one busy asker (a stranger
asking as fast as it can) from starving another (a joiner reading the run's record); the class's keeps many
identities from taking the node's CPU. An answer over budget says "not found" and still names the nearest nodes,
as hivemind's does, so the asker's lookup goes on elsewhere. Sizes are the budgeted storage's own count of a
key's bytes (peer.swarm.dht.BudgetedStorage).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any

MiB = 2**20
MAX_ASKERS = 4096  # askers whose buckets one node remembers (the oldest are forgotten first)


@dataclass(frozen=True)
class GateLimits:
    """Bytes per second (and bursts) of values a node's finds hand out, per asker and in all: to members' DHT
    nodes, and to everyone else. Per asker, so that one busy asker (a stranger asking as fast as it can) cannot
    starve a joiner that asks for the run's record; in all, so that many identities cannot take the node's CPU."""

    member_bytes_per_s: float = 8 * MiB
    member_burst_bytes: float = 24 * MiB
    members_bytes_per_s: float = 32 * MiB
    members_burst_bytes: float = 96 * MiB
    other_bytes_per_s: float = 2 * MiB
    other_burst_bytes: float = 8 * MiB
    others_bytes_per_s: float = 16 * MiB
    others_burst_bytes: float = 48 * MiB


class _Bucket:
    """A token bucket of bytes."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = burst, clock()

    def has(self, amount: float) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return amount <= self.tokens

    def take(self, amount: float) -> bool:
        if not self.has(amount):
            return False
        self.tokens -= amount
        return True


def _remember(table: OrderedDict, key: Any, value: Any) -> None:
    """Put ``key`` last in ``table``, forgetting the oldest beyond :data:`MAX_ASKERS`."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_ASKERS:
        table.popitem(last=False)


class FindGate:
    """Decides, per find answer, whether a key's value goes out (see the module docstring). Runs in the DHT
    process's event loop, one decision at a time."""

    def __init__(self, limits: GateLimits = GateLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self.members: frozenset[str] = frozenset()
        self._all = {
            True: _Bucket(limits.members_bytes_per_s, limits.members_burst_bytes, clock),
            False: _Bucket(limits.others_bytes_per_s, limits.others_burst_bytes, clock),
        }
        self._askers: OrderedDict[tuple[str, bool], _Bucket] = OrderedDict()  # its own bucket (oldest forgotten)
        self.answered = {True: 0, False: 0}  # answers with a value, to members / to others
        self.refused = {True: 0, False: 0}

    def set_members(self, peer_ids: Iterable[str]) -> None:
        """The live members' DHT peer ids (from the adverts this peer last read)."""
        self.members = frozenset(peer_ids)

    def allow(self, asker: str, key: Any, size: int) -> bool:
        """Whether ``asker`` gets the value of ``key`` (``size`` bytes) now; counts it when so."""
        member = asker in self.members
        own = self._bucket(asker, member)
        if not own.has(size) or not self._all[member].take(size):
            self.refused[member] += 1
            return False
        own.take(size)
        self.answered[member] += 1
        return True

    def _bucket(self, asker: str, member: bool) -> _Bucket:
        bucket = self._askers.get((asker, member))
        if bucket is None:
            limits = self.limits
            rate, burst = ((limits.member_bytes_per_s, limits.member_burst_bytes) if member
                           else (limits.other_bytes_per_s, limits.other_burst_bytes))
            bucket = _Bucket(rate, burst, self.clock)
        _remember(self._askers, (asker, member), bucket)
        return bucket

    def stats(self) -> dict[str, int]:
        return {"to_members": self.answered[True], "to_others": self.answered[False],
                "refused_members": self.refused[True], "refused_others": self.refused[False]}


@dataclass
class Asking:
    """Who is asking during one find answer (set by :func:`gated_find`, read by the storage's ``get``)."""

    asker: str
    gate: FindGate
    active: bool = True


ASKING: ContextVar[Asking | None] = ContextVar("tasklet_find_asker", default=None)


def gated_find(protocol: Any, gate: FindGate) -> Callable[[Any, Any], Any]:
    """A handler for hivemind's find RPC that answers as ``protocol.rpc_find`` does, with the asker known to the
    storage's reads while it answers (hivemind's handler reads the storage synchronously; the asker is switched
    off once it returns, so tasks it started, which copy the context, read unrestricted)."""

    async def find(request: Any, context: Any) -> Any:
        asking = Asking(str(context.remote_id), gate)
        token = ASKING.set(asking)
        try:
            return await protocol.rpc_find(request, context)
        finally:
            asking.active = False
            ASKING.reset(token)

    return find


def asking() -> Asking | None:
    """The asker of the find being answered right now, if any."""
    current = ASKING.get()
    return current if current is not None and current.active else None


async def _set_members(_dht: Any, node: Any, members: frozenset[str]) -> dict[str, int]:
    """Runs in the DHT's process: the members' nodes its storage's gate favours; the gate's counts so far."""
    gate = getattr(node.protocol.storage, "gate", None)
    if not isinstance(gate, FindGate):
        return {}
    gate.set_members(members)
    return gate.stats()


def gate_members(dht: Any, members: Iterable[str]) -> Any:
    """Tell a ``hivemind.DHT``'s find gate the live members' DHT peer ids; a future of the gate's counts."""
    return dht.run_coroutine(partial(_set_members, members=frozenset(members)), return_future=True)
