"""Attacks on a peer's open doors, run as a stranger (no join secret): for tests/test_doors_swarm.py and bench.doors.

``python -m tasklet.peer.emulation.doors_attack KIND ...`` runs one attack and prints one JSON line of what the target
answered (so the caller can tell "refused" from "held"). Kinds:

* ``relay HOST:PORT PEERID``: 64 sockets trickling a byte every 9 s at the relay, 256 REGISTERs with fresh
  keys, and a flood of CONNECTs to ``PEERID``, for ``--seconds``;
* ``ports HOST:PORT ...``: ``--count`` TCP connections held open to each port for ``--seconds``;
* ``dht MULTIADDR RUN``: a hivemind DHT node of its own that stores, under every key of the run, untagged
  subkeys and oversized values.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import socket
import sys
import threading
import time
from functools import partial

RUN_KEYS = ("peers", "links", "run", "plans", "progress", "beat")


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

    from tasklet.peer.swarm.identity import peer_id_from_public_key

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasklet.peer.emulation.doors_attack")
    p.add_argument("kind", choices=["relay", "ports", "dht"])
    p.add_argument("args", nargs="+")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--count", type=int, default=400)
    p.add_argument("--untagged", type=int, default=200)
    p.add_argument("--oversized", type=int, default=2)
    p.add_argument("--value-bytes", type=int, default=512 << 10)
    a = p.parse_args(argv)
    if a.kind == "relay":
        result = relay_attack(a.args[0], a.args[1], a.seconds)
    elif a.kind == "ports":
        result = port_flood(a.args, a.count, a.seconds)
    else:
        result = dht_flood(a.args[0], a.args[1], a.untagged, a.oversized, a.value_bytes, a.seconds)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
