"""An in-memory DHT with the interface the control plane uses of ``hivemind.DHT``, in virtual time.

``peer.swarm.rendezvous`` (what ``peer.swarm.records.RecordStore`` reads and writes through) calls exactly two
methods of a DHT that is not hivemind's:

* ``store(key, value, expiration_time, subkey=...)``: a bool. Per subkey the DHT keeps the value with the latest
  expiration; a store that does not expire later is refused (False);
* ``get(key, latest=True)``: None or an object whose ``value`` maps each subkey to an item with ``value`` and
  ``expiration_time`` (unexpired entries only).

The real node's asks of members' DHT nodes (two per read and per write, against an eclipse) are not simulated.

:class:`MemoryDHT` is one shared store; each simulated peer gets a :class:`DHTHandle` (what it passes where a
``hivemind.DHT`` is expected) that names the caller. The :class:`LatencyModel` prices each call: a Kademlia
lookup of ``hops`` round trips plus the value's transfer over the caller's access link. A store becomes
visible to others only when it has arrived (call time + its latency); a get returns what had arrived when
it was called. The caller's own clock advances by the latency (:meth:`MemoryDHT.take_elapsed`), which is how
the simulator knows when a peer's tick ends. Nothing is signed: hivemind's RSA signature check is not
simulated (it costs CPU on each node, not messages); owner tags in subkeys are kept, so the records' owner
logic runs as in production.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

K_BUCKET = 20  # hivemind's bucket size: a lookup among N nodes takes about log2(N / K) + 1 hops


class Item(NamedTuple):
    value: Any
    expiration_time: float
    nbytes: int = 0  # serialized size, for the latency model


class Found(NamedTuple):
    value: dict
    expiration_time: float


class Done:
    """An already-completed future (the in-memory DHT answers at once; latency is charged in virtual time)."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def result(self, timeout: float | None = None) -> Any:
        return self._result

    def cancel(self) -> bool:
        return False


@dataclass
class LatencyModel:
    """Per-call latency: ``hops`` round trips between the caller's region and random regions, plus the bytes
    over the caller's access link. ``region_rtt_s`` is a region x region RTT matrix (s)."""

    region_rtt_s: np.ndarray
    access_bps: float = 50e6
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(f"latency|{self.seed}")
        self._rtt = self.region_rtt_s.tolist()

    def hops(self, n_nodes: int) -> int:
        return max(1, math.ceil(math.log2(max(n_nodes, 2) / K_BUCKET)) + 1)

    def latency_s(self, region: int, n_nodes: int, nbytes: int) -> float:
        row, k = self._rtt[region], len(self._rtt)
        return sum(row[self._rng.randrange(k)] for _ in range(self.hops(n_nodes))) + 8.0 * nbytes / self.access_bps


class MemoryDHT:
    """The shared store, the virtual clock it reads, and per-caller counts of calls and bytes."""

    def __init__(self, clock: Callable[[], float], latency: LatencyModel, n_nodes: int = 1) -> None:
        """``n_nodes``: the swarm's size, which sets the hops of a lookup."""
        self.clock = clock
        self.latency = latency
        self.n_nodes = n_nodes
        self._data: dict[str, dict[bytes, Item]] = {}
        self._pending: list[tuple[float, int, str, bytes, Item]] = []  # (visible at, seq, key, subkey, item)
        self._seq = 0
        self._elapsed: Counter[str] = Counter()
        self.calls: Counter[tuple[str, str]] = Counter()  # (caller, "get"/"store") -> calls
        self.bytes: Counter[str] = Counter()  # caller -> bytes moved by its calls
        self.region: dict[str, int] = {}
        self._version = 0  # stores that have arrived so far
        self.watched: dict[str, list[str]] = {}  # caller -> the keys of its gets, logged while it is watched

    def version(self) -> int:
        """Changes whenever a store arrives: with the clock, it names what a get would return."""
        self._arrive()
        return self._version

    def calls_of(self, caller: str) -> int:
        return self.calls[caller, "get"] + self.calls[caller, "store"]

    def charge_get(self, caller: str, key: str) -> None:
        """Count and time a get of ``key`` by ``caller`` whose answer another reader already parsed."""
        self.charge_gets(caller, [key])

    def charge_gets(self, caller: str, keys: list[str]) -> None:
        """Count gets of ``keys`` issued together by ``caller`` (a read of a sharded kind), whose answers another
        reader already parsed: each is a call, and the read takes as long as its slowest get."""
        self._arrive()
        at = self.clock()
        slowest = 0.0
        for key in keys:
            entries = self._data.get(key) or {}
            size = sum(item.nbytes for item in entries.values() if item.expiration_time >= at)
            slowest = max(slowest, self._charge(caller, "get", size + len(key), timed=False))
        self._elapsed[caller] += slowest

    def handle(self, caller: str, region: int) -> DHTHandle:
        self.region[caller] = region
        return DHTHandle(self, caller)

    def take_elapsed(self, caller: str) -> float:
        """Virtual seconds the caller's calls took since the last take (the caller's tick length)."""
        return self._elapsed.pop(caller, 0.0)

    def _arrive(self) -> None:
        at = self.clock()
        while self._pending and self._pending[0][0] <= at:
            _, _, key, subkey, item = heapq.heappop(self._pending)
            if self._put(key, subkey, item):
                self._version += 1

    def _put(self, key: str, subkey: bytes, item: Item) -> bool:
        entries = self._data.setdefault(key, {})
        old = entries.get(subkey)
        if old is not None and old.expiration_time >= item.expiration_time:
            return False
        entries[subkey] = item
        return True

    def _charge(self, caller: str, kind: str, nbytes: int, timed: bool = True) -> float:
        lat = self.latency.latency_s(self.region.get(caller, 0), self.n_nodes, nbytes)
        if timed:
            self._elapsed[caller] += lat
        self.calls[caller, kind] += 1
        self.bytes[caller] += nbytes
        return lat

    def store(self, caller: str, key: str, value: Any, expiration_time: float, subkey: bytes) -> bool:
        self._arrive()
        encoded = json.dumps(value, separators=(",", ":"))  # about what a serializer would send
        lat = self._charge(caller, "store", len(encoded) + len(subkey) + len(key))
        if expiration_time < self.clock():
            return False
        current = self._data.get(key, {}).get(subkey)
        if current is not None and current.expiration_time >= expiration_time:
            return False
        # the writers (record stores) build a fresh payload for every store, so the value is not copied
        item = Item(value, float(expiration_time), len(encoded) + len(subkey))
        self._seq += 1
        heapq.heappush(self._pending, (self.clock() + lat, self._seq, key, subkey, item))
        return True

    def get(self, caller: str, key: str) -> Found | None:
        self._arrive()
        log = self.watched.get(caller)
        if log is not None:
            log.append(key)
        at = self.clock()
        entries = self._data.get(key)
        if entries:
            expired = [sk for sk, item in entries.items() if item.expiration_time < at]
            for sk in expired:
                del entries[sk]
        size = sum(item.nbytes for item in entries.values()) if entries else 0
        self._charge(caller, "get", size + len(key))
        if not entries:
            return None
        return Found(dict(entries), max(item.expiration_time for item in entries.values()))


class DHTHandle:
    """What one simulated peer holds where the real code holds a ``hivemind.DHT``."""

    def __init__(self, dht: MemoryDHT, caller: str) -> None:
        self._dht, self.caller = dht, caller

    def store(self, key: str, value: Any, expiration_time: float, subkey: bytes = b"",
              return_future: bool = False) -> Done | bool:
        ok = self._dht.store(self.caller, key, value, float(expiration_time), subkey)
        return Done(ok) if return_future else ok

    def get(self, key: str, latest: bool = True, return_future: bool = False) -> Done | Found | None:
        found = self._dht.get(self.caller, key)
        return Done(found) if return_future else found

    def shutdown(self) -> None:
        """Nothing to stop (the daemon shuts its DHT down when it leaves)."""
