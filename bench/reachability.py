"""Reachability benchmark: how fast are the paths to a peer nobody can dial, and what does NAT cost a step?

``python -m bench.reachability [--json] [--rate-mbit 100] [--delay-ms 20] [--steps 8]`` builds a test bed of
network namespaces (peer/emulation/netbed.py; needs root, ``ip``, ``nft``, ``tc``): two public hosts and two home hosts
behind masquerading NAT routers, every host's link shaped to ``--rate-mbit`` with tbf. Measured with our real
gRPC transport and mutual TLS (PeerClient.probe: receiver-timed bulk stream of 8 MiB, median of ``--trials``;
PeerClient.ping: median round trip of 20; the roles share one TLS key so that they trust each other):

* direct: pub1 -> pub0's gRPC server;
* reversed: pub1 -> home0, which registered with pub1's relay and dials back (the network path is direct);
* relayed: home1 -> home0 through pub0's relay (two NAT'd peers);
* punched: not implemented (``null``): TCP hole punching through the routers was not attempted, see
  docs/operating.md ("Behind NAT").

``--delay-ms``: netem is not available here, so the one-way delay is emulated by the transport's own link
shaper (peer.net.shaping) on the client's sends and the server's replies, for every path alike (RTTs include
it; bulk throughput is measured free of latency). Then two swarms of real ``peer`` daemons (the README's
commands; 2 stages x 2 pipelines of a small GPT) train ``--steps`` steps on the same shaped bed: the four
peers all public, and two of them behind NAT (topology (b) of tests/swarms/test_multihost.py); the median step
time of each (steps after the first) is reported. The daemons' links are shaped by tbf only (no added delay).

Prints ``{"direct_mbps", "punched_mbps", "relayed_mbps", "reversed_mbps", "nat_step_s", "public_step_s", ...}``.
The bed and the daemons come from the emulation harness (peer/emulation/netbed.py, peer/emulation/multihost.py),
which the tests use too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tasklet.peer.emulation import multihost, netbed

REPO = Path(__file__).resolve().parent.parent
SERVER_PORT, RELAY_PORT = 5400, 5402
PROBE_BYTES = 8 << 20


# ---- roles run inside the bed's namespaces ------------------------------------------------------------------


def _shaper(delay_ms: float) -> Any:
    from tasklet.peer.net.shaping import LinkShaper

    return LinkShaper(None, delay_ms / 1e3) if delay_ms > 0 else None


def _transport(key: str, **kwargs: Any) -> Any:
    """Mutual TLS with the bench's one shared key (every role trusts itself, so all trust each other), or
    plaintext when ``key`` is "-"."""
    from tasklet.peer.identity.keys import Identity
    from tasklet.peer.net.config import TransportConfig
    from tasklet.peer.net.tls import TlsContext

    return TransportConfig(tls=None if key == "-" else TlsContext(Identity.load(key)), **kwargs)


def _serve(host: str, port: int, delay_ms: float, key: str) -> Any:
    from tasklet.peer.net.server import PeerServer

    server = PeerServer(_transport(key, host=host, port=port, max_concurrent_streams=8, thread_pool_size=12))
    shaper = _shaper(delay_ms)
    server.set_reply_shaper(lambda sender: shaper)
    server.start()
    return server


def role_public(port: int, relay_port: int, delay_ms: float, tls_key: str) -> None:
    """A public peer: a gRPC server (direct target) and a relay."""
    from tasklet.peer.net.relay import RelayServer

    _serve("0.0.0.0", port, delay_ms, tls_key)
    RelayServer("0.0.0.0", relay_port).start()
    print("ready", flush=True)
    time.sleep(3600)


def role_nated(port: int, relays: list[str], delay_ms: float, key: str, tls_key: str) -> None:
    """A peer behind NAT: a gRPC server on loopback, reached only through its relay registrations."""
    from tasklet.peer.identity.keys import Identity
    from tasklet.peer.net.relay import RelayAgent

    _serve("127.0.0.1", port, delay_ms, tls_key)
    identity = Identity.load(key)
    agent = RelayAgent(identity, relays, f"127.0.0.1:{port}")
    agent.start()
    if len(agent.wait_registered(20)) == 0:
        raise SystemExit("no relay accepted the registration")
    deadline = time.monotonic() + 20
    while len(agent.registered()) < len(relays) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"ready {identity.peer_id}", flush=True)
    time.sleep(3600)


def role_client(endpoint: str, delay_ms: float, relay_port: int, trials: int, tls_key: str) -> None:
    """Measure one path: bulk throughput (median of ``trials`` probes) and RTT (median of 20 pings)."""
    from tasklet.peer.net.client import PeerClient
    from tasklet.peer.net.endpoint import set_local_relay
    from tasklet.peer.net.relay import RelayServer

    if relay_port:  # this host's own relay, with which the target registered: connection reversal
        relay = RelayServer("0.0.0.0", relay_port)
        relay.start()
        set_local_relay(relay.lookup)
        print("ready", flush=True)
        peer = endpoint.partition("@")[0]
        deadline = time.monotonic() + 30
        while not relay.registered(peer) and time.monotonic() < deadline:
            time.sleep(0.1)
    with PeerClient(endpoint, _transport(tls_key), shaper=_shaper(delay_ms), sender="bench") as client:
        client.ping(timeout_s=30)
        rtts = sorted(client.ping(timeout_s=30) for _ in range(20))
        rates = [client.probe(PROBE_BYTES, timeout_s=120) for _ in range(trials)]
        print(json.dumps({"path": client.path, "mbps": statistics.median(rates) / 1e6,
                          "mbps_trials": [round(r / 1e6, 2) for r in rates],
                          "rtt_ms": rtts[len(rtts) // 2] * 1e3}), flush=True)


# ---- the benchmark --------------------------------------------------------------------------------------------


def _role(host: Any, *args: str) -> subprocess.Popen[str]:
    return host.popen(sys.executable, "-m", "bench.reachability", "--role", *args, cwd=str(REPO))


def _ready(proc: subprocess.Popen[str], timeout_s: float = 60) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("ready"):
            return line.strip()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"role exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
    raise TimeoutError("role did not become ready")


def _measure(proc: subprocess.Popen[str], timeout_s: float = 300) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout_s)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measurement failed ({proc.returncode}): {err[-2000:]}")
    return json.loads(lines[-1])


def measure_paths(rate_mbit: float, delay_ms: float, trials: int, tls: bool) -> dict[str, Any]:
    from tasklet.peer.identity.keys import Identity

    d, t = str(delay_ms), str(trials)
    with netbed.open_bed() as bed, tempfile.TemporaryDirectory(prefix="bench-reach-") as tmp:
        (pub0, pub1), (home0, home1) = netbed.two_public_two_home(bed)
        for host in (pub0, pub1, home0, home1):
            bed.shape(host, rate_mbit)
        identity = Identity.generate()  # home0's, so that the clients know whom to ask for
        key = Path(tmp) / "home0.key"
        identity.save(key)
        tls_key = "-"
        if tls:
            tls_key = str(Path(tmp) / "tls.key")
            Identity.generate().save(tls_key)
        _ready(_role(pub0, "public", str(SERVER_PORT), str(RELAY_PORT), d, tls_key))
        out = {"direct": _measure(_role(pub1, "client", f"{pub0.addr}:{SERVER_PORT}", d, "0", t, tls_key))}
        # reversed: the client runs the relay home0 registers with, and reaches home0 through it
        reversed_client = _role(pub1, "client", f"{identity.peer_id}@{pub1.addr}:{RELAY_PORT}", d, str(RELAY_PORT), t,
                                tls_key)
        _ready(reversed_client)
        _ready(_role(home0, "nated", str(SERVER_PORT), f"{pub0.addr}:{RELAY_PORT},{pub1.addr}:{RELAY_PORT}", d,
                     str(key), tls_key))
        out["reversed"] = _measure(reversed_client)
        out["relayed"] = _measure(_role(home1, "client", f"{identity.peer_id}@{pub0.addr}:{RELAY_PORT}", d, "0", t,
                                        tls_key))
        return out


def measure_steps(rate_mbit: float, steps: int, nat: bool, log_dir: Path) -> dict[str, Any]:
    """Median step time of 4 real daemons (2 stages x 2 pipelines), all public or two of them behind NAT."""
    relay = ["--relay-port", str(multihost.RELAY_PORT)]
    with netbed.open_bed() as bed:
        if nat:
            pubs, homes = netbed.two_public_two_home(bed)
        else:
            pubs, homes = [bed.add_public(f"pub{i}") for i in range(4)], []
        hosts = [*pubs, *homes]
        for host in hosts:
            bed.shape(host, rate_mbit)
        folder = log_dir / ("nat" if nat else "public")
        folder.mkdir(parents=True, exist_ok=True)
        cfg = multihost.write_config(folder, steps, 4, folder / "save", stages=2)
        with multihost.BedPeers(folder / "logs") as peers:
            dht = peers.start(hosts[0], cfg, *multihost.readme_flags(hosts[0]), *relay)
            for host in hosts[1:]:
                peers.join(host, dht, *multihost.readme_flags(host), *(relay if host in pubs else []))
            codes = peers.wait_all(400)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"swarm ({'nat' if nat else 'public'}) failed: {codes}; logs in {folder / 'logs'}")
        run = json.loads((folder / "save" / "run.json").read_text())
        times = run["step_s"][1:] or run["step_s"]
        return {"step_s": statistics.median(times), "steps": [round(t, 3) for t in run["step_s"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reachability", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rate-mbit", type=float, default=100.0, help="tbf rate of every host's link (default: 100)")
    p.add_argument("--delay-ms", type=float, default=20.0,
                   help="one-way delay emulated by the transport on the path measurements (default: 20)")
    p.add_argument("--trials", type=int, default=3, help="bulk probes per path (default: 3)")
    p.add_argument("--steps", type=int, default=8, help="training steps per swarm (default: 8)")
    p.add_argument("--skip-swarms", action="store_true", help="measure the paths only")
    p.add_argument("--no-tls", action="store_true", help="plaintext gRPC on the path measurements (default: TLS)")
    p.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        kind, rest = args.role[0], args.role[1:]
        if kind == "public":
            role_public(int(rest[0]), int(rest[1]), float(rest[2]), rest[3])
        elif kind == "nated":
            role_nated(int(rest[0]), rest[1].split(","), float(rest[2]), rest[3], rest[4])
        elif kind == "client":
            role_client(rest[0], float(rest[1]), int(rest[2]), int(rest[3]), rest[4])
        return 0
    paths = measure_paths(args.rate_mbit, args.delay_ms, args.trials, not args.no_tls)
    result: dict[str, Any] = {
        "direct_mbps": round(paths["direct"]["mbps"], 2),
        "punched_mbps": None,
        "relayed_mbps": round(paths["relayed"]["mbps"], 2),
        "reversed_mbps": round(paths["reversed"]["mbps"], 2),
        "direct_rtt_ms": round(paths["direct"]["rtt_ms"], 2),
        "reversed_rtt_ms": round(paths["reversed"]["rtt_ms"], 2),
        "relayed_rtt_ms": round(paths["relayed"]["rtt_ms"], 2),
        "punched_note": "TCP hole punching not attempted; a peer behind NAT is reached by reversal (it dials a "
                        "public peer's relay back) or through a public peer's relay",
        "rate_mbit": args.rate_mbit,
        "delay_ms": args.delay_ms,
        "tls": not args.no_tls,
        "nat_step_s": None,
        "public_step_s": None,
    }
    if not args.skip_swarms:
        with tempfile.TemporaryDirectory(prefix="bench-reach-") as tmp:
            public = measure_steps(args.rate_mbit, args.steps, False, Path(tmp))
            nat = measure_steps(args.rate_mbit, args.steps, True, Path(tmp))
        result.update(nat_step_s=round(nat["step_s"], 4), public_step_s=round(public["step_s"], 4),
                      nat_steps=nat["steps"], public_steps=public["steps"])
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
