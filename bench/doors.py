"""Doors benchmark: what each attack on a public peer's open doors costs it, and what it costs a legitimate joiner.

``python -m bench.doors [--json] [--seconds 30]`` builds a namespace bed (peer/emulation/netbed.py; needs root):
a public leader with a relay and a metrics port (the victim), a second public member, a stranger's host, and one
home host behind NAT per scenario. The swarm has a join secret (from a file) and waits for more peers than join,
so nothing trains and the figures are the doors'. Scenarios, one after the other in the same swarm:

* ``none``: no attack (the baseline);
* ``relay``: 64 sockets trickling a byte every 9 s at the relay, 256 fresh-key REGISTERs, a CONNECT flood at the
  joiner's peer id;
* ``ports``: 300 connections held to each of the victim's gRPC, bulk-lane and metrics ports;
* ``dht``: untagged subkeys and 1 MiB values under every key of the run;
* ``dht_foreign_flood``: a plain hivemind node (the join line, no key, no secret) stores 1,024 values of 1 MiB under
  random keys with hour-long expiries.

For each: the victim's peak descriptors, threads and resident MiB while the attack runs and a NAT'd member joins
(sampled from /proc every 0.5 s; its DHT process and p2pd apart, as the largest and the sum of its children), the
joiner's time from launch to "reached through relay" and its start-up ``reach`` phase (reachability check and relay
registration), and what the attacker got. Prints one JSON object. Not measured yet: steps/s under attack (this
swarm waits for more peers, so nothing trains).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tasklet.peer.emulation import multihost, netbed
from tasklet.peer.emulation.doors_attack import PeakSampler, descendants, proc_usage
from tasklet.peer.identity.keys import Identity

REPO = Path(__file__).resolve().parent.parent
METRICS_PORT = 31404
SCENARIOS = ("none", "relay", "ports", "dht", "dht_foreign_flood")


def _attack(host: netbed.Host, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(host.cmd(sys.executable, "-m", "tasklet.peer.emulation.doors_attack", *args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _wait_for(peers: multihost.BedPeers, name: str, needle: str, timeout_s: float) -> float | None:
    started = time.monotonic()
    while needle not in peers.log(name):
        if time.monotonic() - started > timeout_s or peers.procs[name].poll() is not None:
            return None
        time.sleep(0.1)
    return time.monotonic() - started


def run(seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {"scenarios": {}}
    with netbed.open_bed() as bed, tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        pub0, pub1, evil = bed.add_public("pub0"), bed.add_public("pub1"), bed.add_public("evil")
        secret = folder / "secret"
        secret.write_text("bench doors\n")
        member = ["--secret-file", str(secret)]
        cfg = multihost.write_config(folder, 4, 99, folder / "save", stages=2)
        with multihost.BedPeers(folder / "logs") as peers:
            dht = peers.start(pub0, cfg, *multihost.readme_flags(pub0), "--relay-port", str(multihost.RELAY_PORT),
                              "--metrics-port", str(METRICS_PORT), *member)
            peers.join(pub1, dht, *multihost.readme_flags(pub1), *member)
            _wait_for(peers, "pub1", "others can join through this peer", 120)
            victim = peers.procs["pub0"].pid
            out["victim_idle"] = proc_usage(victim)
            for i, scenario in enumerate(SCENARIOS):
                out["scenarios"][scenario] = _scenario(bed, peers, evil, pub0, dht, member, folder, i, scenario,
                                                       seconds, victim)
            out["victim_after"] = proc_usage(victim)
    return out


def _scenario(bed: netbed.NetBed, peers: multihost.BedPeers, evil: netbed.Host, pub0: netbed.Host, dht: str,
              member: list[str], folder: Path, i: int, scenario: str, seconds: float, victim: int) -> dict[str, Any]:
    home = bed.add_home(f"home{i}")
    identity = Identity.generate()
    identity.save(folder / f"home{i}.key")
    ports = [f"{pub0.addr}:{p}" for p in (multihost.GRPC_PORT, multihost.BULK_PORT, METRICS_PORT)]
    relay = f"{pub0.addr}:{multihost.RELAY_PORT}"
    children = {f"child{pid}": pid for pid in descendants(victim)}  # its DHT process, p2pd, any other
    with PeakSampler({"victim": victim, **children}) as sampler:
        attack = None
        if scenario == "relay":
            attack = _attack(evil, "relay", relay, identity.peer_id, "--seconds", str(seconds))
        elif scenario == "ports":
            attack = _attack(evil, "ports", *ports, "--count", "300", "--seconds", str(seconds))
        elif scenario == "dht":
            attack = _attack(evil, "dht", dht, "tasklet", "--untagged", "300", "--oversized", "2", "--seconds",
                             str(seconds))
        elif scenario == "dht_foreign_flood":
            attack = _attack(evil, "dht-foreign", dht, "--count", "1024", "--value-bytes", str(1 << 20), "--seconds",
                             str(seconds * 4))
        time.sleep(8 if attack is not None else 1)
        peers.join(home, dht, *multihost.readme_flags(home, announce=False), *member,
                   "--identity", str(folder / f"home{i}.key"))
        join_s = _wait_for(peers, home.name, "reached through relay", 90)
        _wait_for(peers, home.name, "start-up phases", 30)  # logged once the whole start-up is done
        phases = re.search(r"start-up phases (\{.*\})", peers.log(home.name))
        got = None
        if attack is not None:
            stdout, _ = attack.communicate(timeout=seconds * 4 + 120)
            got = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else None
    peers.kill(home.name)
    peak = sampler.peak["victim"]
    child_rss = [sampler.peak[name].get("rss", 0) for name in children]
    return {
        "victim_dht_peak_rss_mib": round(max(child_rss, default=0) / 2**20, 1),
        "victim_children_peak_rss_mib": round(sum(child_rss) / 2**20, 1),
        "victim_peak_fds": peak.get("fds"),
        "victim_peak_threads": peak.get("threads"),
        "victim_peak_rss_mib": round(peak.get("rss", 0) / 2**20, 1),
        "victim_fd_limit": peak.get("fd_limit"),
        "joiner_reached_s": None if join_s is None else round(join_s, 2),
        "joiner_reach_phase_s": json.loads(phases.group(1)).get("reach") if phases else None,
        "attack": got,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.doors", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seconds", type=float, default=30.0, help="how long the relay and port attacks last")
    args = p.parse_args(argv)
    reason = netbed.unavailable_reason()
    if reason:
        print(f"bench.doors needs network namespaces: {reason}", file=sys.stderr)
        return 2
    result = run(args.seconds)
    if args.json:
        print(json.dumps(result))
    else:
        for name, row in result["scenarios"].items():
            print(f"{name:>6}: victim fds {row['victim_peak_fds']} threads {row['victim_peak_threads']} "
                  f"rss {row['victim_peak_rss_mib']} MiB; joiner {row['joiner_reached_s']} s "
                  f"(reach {row['joiner_reach_phase_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
