"""Doors benchmark: what each attack on a public peer's open doors costs it, and what it costs a legitimate joiner.

``python -m bench.doors [--json] [--seconds 30]`` builds a namespace bed (peer/emulation/netbed.py; needs root):
a public leader with a relay and a metrics port (the victim), a second public member, a stranger's host (on a /24
of its own: the relay counts request slots per network), and one home host behind NAT per scenario. The swarm
has a join secret (from a file) and waits for more peers than join, so nothing trains and the figures are the
doors'. Scenarios, one after the other in the same swarm:

* ``none``: no attack (the baseline);
* ``relay``: 64 sockets trickling a byte every 9 s at the relay, 256 fresh-key REGISTERs, a CONNECT flood at the
  joiner's peer id;
* ``ports``: 300 connections held to each of the victim's gRPC, bulk-lane and metrics ports;
* ``dht``: untagged subkeys and 1 MiB values under every key of the run;
* ``dht_foreign_flood``: a plain hivemind node (the join line, no key, no secret) stores 1,024 values of 1 MiB under
  random keys with hour-long expiries.

Then, in a second bed whose swarm trains (two public members, the leader with a relay; one step at a time, data
parallel: ``MemberSwarm``), the attacks that need a training run to judge:

* ``network_caps``: a stranger with four addresses of one rented /24 (``NetBed.add_addresses``) holds 200 connections
  from each to the leader's gRPC port (800: past the strangers' share of the port) and 16 from each to its relay
  (64: every request slot, were slots counted per address), reopening what is cut. Prints steps/s over the same
  window unattacked and under attack, the leader's peak descriptors, the leadership changes the peers logged (a
  deposition, a new leader: 0 expected), and a NAT'd member's time to reach through the relay and to train;
* ``endpoint_squat``: a member (the secret, a real identity) advertises the leader's endpoint as its own with the
  oldest start time a record allows; a NAT'd joiner started after the squat: its time to train (so it found and
  followed the real leader), whether it logged the squatter ignored, and whether a fresh reader's ``peer status``
  lists the leader at its endpoint;
* ``dht_run_key_fill``: a member with 64 free identities stores, from each, its largest advert under ``peers`` and
  250 KiB under every other key of the run, and 64 ``plans`` subkeys from one of them; then a NAT'd member joins.
  Prints steps/s before and during, the members' DHT processes' peak resident MiB, the joiner's time to train,
  whether a fresh ``peer status`` on each public member's host lists every honest peer, and what each key took;
* ``dht_eclipse``: eight stranger DHT nodes with ids next to the ``peers`` key take every store there and keep
  nothing; the same figures;
* ``dht_fill_eclipse``: the fill, then the eight strangers while the fill lives, and a stranger's node asking the
  bootstrap node for the run's keys eight finds at a time; the same figures, and what the finds got.

For each: the victim's peak descriptors, threads and resident MiB while the attack runs and a NAT'd member joins
(sampled from /proc every 0.5 s; its DHT process and p2pd apart, as the largest and the sum of its children), the
joiner's time from launch to "reached through relay" and its start-up ``reach`` phase (reachability check and relay
registration), and what the attacker got. Prints one JSON object.
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
from tasklet.peer.emulation.procs import PEER_COMMAND, child_env, read_line
from tasklet.peer.identity.keys import Identity

REPO = Path(__file__).resolve().parent.parent
METRICS_PORT = 31404
SCENARIOS = ("none", "relay", "ports", "dht", "dht_foreign_flood")
MEMBER_SCENARIOS = ("network_caps", "endpoint_squat", "dht_run_key_fill", "dht_eclipse", "dht_fill_eclipse")
ECLIPSE_NODES = 8  # the stranger DHT nodes of dht_eclipse
FILL_IDENTITIES = 64  # the free identities of dht_run_key_fill
FIND_WORKERS = 8  # dht_fill_eclipse: a stranger's finds of the run's keys in flight at once
LEAVE_SETTLE_S = 6.0  # after a joiner leaves: the leader plans without it (a few heartbeats)
BLOCK_ADDRESSES = 4  # of the stranger's one rented /24
HOLD_GRPC = 200  # connections per address to the leader's gRPC port (its strangers' share is 493 at 20,000 fds)
HOLD_RELAY = 16  # per address to the relay: its request slots per source, four times over
TRAINING_LINE = "of pipeline"  # in a member's phase line once it holds a stage of the plan: it trains
# what a peer logs when leadership changes: a follower deposes its leader, the leader ends, another one leads
LEADERSHIP_CHANGES = ("electing a leader without", "leadership ended", "leads the swarm")


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


def run(seconds: float, scenarios: list[str] | tuple[str, ...] = SCENARIOS) -> dict[str, Any]:
    out: dict[str, Any] = {"scenarios": {}}
    with netbed.open_bed() as bed, tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        pub0, pub1 = bed.add_public("pub0"), bed.add_public("pub1")
        evil = bed.add_public("evil", own_network=True)  # a stranger's network is not the members' or the homes'
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
            for i, scenario in enumerate(scenarios):
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


class MemberSwarm:
    """A swarm that trains on a bed of its own: the leader ``pub0`` (with a relay) and ``pub1``, both public, one
    step after another for as long as the attacks take (data parallel: every joiner gets a pipeline of its own);
    a stranger's host ``evil`` with a rented block of addresses; NAT'd joiners added by the attacks. ``start()``
    returns once the run trains; each attack method returns its figures (bench.doors, and
    tests/swarms/test_doors_member.py on a shorter window)."""

    def __init__(self, bed: netbed.NetBed, folder: Path) -> None:
        self.bed, self.folder = bed, folder
        self.pub0, self.pub1 = bed.add_public("pub0"), bed.add_public("pub1")
        self.evil = bed.add_public("evil", own_network=True)
        self.block = [self.evil.addr, *bed.add_addresses(self.evil, BLOCK_ADDRESSES - 1)]
        self.secret = folder / "secret"
        self.secret.write_text("bench doors members\n")
        self.secret.chmod(0o600)
        self.member = ["--secret-file", str(self.secret)]
        self.ids = {name: self._identity(name) for name in ("pub0", "pub1")}
        self.peers = multihost.BedPeers(folder / "logs")
        self.dht = ""
        self.homes = 0

    def _identity(self, name: str) -> Identity:
        identity = Identity.generate()
        identity.save(self.folder / f"{name}.key")
        return identity

    def start(self, timeout_s: float = 240) -> None:
        cfg = multihost.write_config(self.folder, 100000, 2, self.folder / "save", stages=1)
        self.dht = self.peers.start(self.pub0, cfg, *multihost.readme_flags(self.pub0), "--relay-port",
                                    str(multihost.RELAY_PORT), *self.member, "--identity",
                                    str(self.folder / "pub0.key"))
        self.peers.join(self.pub1, self.dht, *multihost.readme_flags(self.pub1), *self.member, "--identity",
                        str(self.folder / "pub1.key"))
        if _wait_for(self.peers, "pub0", "leader_role: step 5:", timeout_s) is None:
            raise RuntimeError(f"the swarm did not train:\n{self.peers.log('pub0')[-3000:]}")

    def close(self) -> None:
        self.peers.close()

    def __enter__(self) -> MemberSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def steps_per_s(self, window_s: float) -> float:
        """The leader's steps per second over the next ``window_s``."""
        start = time.time()
        time.sleep(window_s)
        return multihost.steps_per_s(self.peers.log("pub0"), start, time.time())

    def marks(self) -> dict[str, int]:
        """Where each peer's log ends now (leadership_changes counts what is logged after)."""
        return {name: len(self.peers.log(name)) for name in self.peers.procs}

    def leadership_changes(self, marks: dict[str, int]) -> list[str]:
        """The lines about a change of leadership the peers logged after ``marks`` (of a peer started since: all)."""
        found = []
        for name in self.peers.procs:  # a peer started since: all of its log
            for line in self.peers.log(name)[marks.get(name, 0):].splitlines():
                if any(needle in line for needle in LEADERSHIP_CHANGES):
                    found.append(f"{name}: {line[:300]}")
        return found

    def join_home(self, timeout_s: float) -> tuple[str, float | None, float | None]:
        """A NAT'd member joins: (its name, seconds to reach through the relay, seconds to train; None: not
        within ``timeout_s``)."""
        name = f"home{self.homes}"
        self.homes += 1
        home = self.bed.add_home(name)
        self.ids[name] = self._identity(name)
        launched = time.monotonic()
        self.peers.join(home, self.dht, *multihost.readme_flags(home, announce=False), *self.member, "--identity",
                        str(self.folder / f"{name}.key"))
        reached = _wait_for(self.peers, name, "reached through relay", timeout_s)
        left = timeout_s - (time.monotonic() - launched)
        trained = _wait_for(self.peers, name, TRAINING_LINE, left) if reached is not None else None
        return name, reached, None if trained is None else time.monotonic() - launched

    def leave(self, name: str) -> None:
        """A joiner leaves once its attack is measured, so that each attack meets the same two-member swarm (on 2
        cores, every joiner left training slowed the next attack's run and joiner)."""
        self.peers.stop(name)
        time.sleep(LEAVE_SETTLE_S)

    def status(self, host: netbed.Host | None = None) -> dict[str, Any]:
        """`peer status --json` of a fresh reader (a new identity, nothing remembered) on ``host`` (``pub1``'s)."""
        host = host or self.pub1
        done = subprocess.run(host.cmd(*PEER_COMMAND, "status", "--dht", self.dht, *self.member, "--json"),
                              capture_output=True, text=True, timeout=120, cwd=REPO, env=child_env())
        if done.returncode != 0:
            return {"error": done.stderr[-2000:]}
        return json.loads(done.stdout)

    def network_caps(self, window_s: float, join_timeout_s: float = 150) -> dict[str, Any]:
        unattacked = self.steps_per_s(window_s)
        marks = self.marks()
        victim = self.peers.procs["pub0"].pid
        grpc = f"{self.pub0.addr}:{multihost.GRPC_PORT}"
        relay = f"{self.pub0.addr}:{multihost.RELAY_PORT}"
        sources = ["--sources", ",".join(self.block), "--every", "2", "--seconds", "900"]
        with PeakSampler({"victim": victim}) as sampler:
            attacks = {"grpc": _attack(self.evil, "hold", grpc, "--count", str(HOLD_GRPC), *sources),
                       "relay": _attack(self.evil, "hold", relay, "--count", str(HOLD_RELAY), *sources)}
            time.sleep(5)  # the connections are in place
            attacked = self.steps_per_s(window_s)
            name, reached, trained = self.join_home(join_timeout_s)
            got = {kind: _stop(proc) for kind, proc in attacks.items()}
        self.leave(name)
        peak = sampler.peak["victim"]
        return {
            "steps_per_s_unattacked": round(unattacked, 3),
            "steps_per_s_attacked": round(attacked, 3),
            "leadership_changes": self.leadership_changes(marks),
            "victim_peak_fds": peak.get("fds"),
            "victim_fd_limit": peak.get("fd_limit"),
            "victim_peak_threads": peak.get("threads"),
            "joiner": name,
            "joiner_reached_s": None if reached is None else round(reached, 2),
            "joiner_trains_s": None if trained is None else round(trained, 2),
            "attack": got,
        }

    def endpoint_squat(self, join_timeout_s: float = 150) -> dict[str, Any]:
        endpoint = f"{self.pub0.addr}:{multihost.GRPC_PORT}"
        squat = _attack(self.evil, "squat", self.dht, "tasklet", str(self.secret), endpoint, "--seconds", "900")
        first = read_line(squat, 90, "{")
        squatter = json.loads(first)["peer_id"] if first else ""
        time.sleep(4)  # its advert stored and renewed: every reader now finds two claimants of the endpoint
        marks = self.marks()
        name, reached, trained = self.join_home(join_timeout_s)
        status = self.status()
        got = _stop(squat)
        self.leave(name)
        leader = self.ids["pub0"].peer_id
        listed = {p.get("peer_id"): p.get("endpoint") for p in status.get("peers", [])}
        return {
            "squatter": squatter,
            "squatter_adverts_stored": (got or {}).get("stored"),
            "joiner": name,
            "joiner_reached_s": None if reached is None else round(reached, 2),
            "joiner_trains_s": None if trained is None else round(trained, 2),
            "joiner_ignored_squatter": bool(squatter) and f"ignoring the advert of {squatter}" in
            self.peers.log(name),
            "status_lists_leader": listed.get(leader) == endpoint,
            "status_lists_squatter": squatter in listed,
            "status_error": status.get("error"),
            "leadership_changes": self.leadership_changes(marks),
        }


    def dht_eclipse(self, window_s: float) -> dict[str, Any]:
        """``ECLIPSE_NODES`` stranger DHT nodes with ids next to the run's ``peers`` key swallow every store there;
        then a NAT'd member joins, and a fresh `peer status` on each public member's host lists the peers."""
        return self.dht_attacks(window_s, fill=0, eclipse=ECLIPSE_NODES)

    def dht_run_key_fill(self, window_s: float) -> dict[str, Any]:
        """A member with ``FILL_IDENTITIES`` free identities fills every key of the run; then a NAT'd member joins,
        and a fresh `peer status` on each public member's host lists the peers."""
        return self.dht_attacks(window_s, fill=FILL_IDENTITIES, eclipse=0)

    def dht_attacks(self, window_s: float, fill: int, eclipse: int, status_on: tuple[str, ...] = ("pub0", "pub1"),
                    unattacked: float | None = None, join_timeout_s: float = 150, finds: int = 0) -> dict[str, Any]:
        """The DHT attacks, one after the other: a member's ``fill`` free identities fill every key of the run, then
        ``eclipse`` stranger nodes sit next to ``peers`` (peer.emulation.doors_attack; 0: not that attack), and the
        fill stays while the strangers do, and a stranger's node asks the bootstrap node for the run's keys with
        ``finds`` finds at a time; then steps/s over
        ``window_s`` (``unattacked``: the figure before, measured here when None), a NAT'd joiner, and a fresh
        `peer status` on the hosts ``status_on``. The members' DHT processes' resident MiB before and at peak."""
        unattacked = self.steps_per_s(window_s) if unattacked is None else unattacked
        marks = self.marks()
        victims = {"pub0": self.peers.procs["pub0"].pid, "pub1": self.peers.procs["pub1"].pid}
        children = {f"{name}-{_comm(pid)}-{pid}": pid for name, v in victims.items() for pid in descendants(v)}
        before = {c: proc_usage(pid)["rss"] for c, pid in children.items()}
        out: dict[str, Any] = {}
        with PeakSampler({**victims, **children}) as sampler:
            started = time.monotonic()
            if fill:  # first: what the run's nodes took of it is what the attack reports (stranger nodes take all)
                filler = _attack(self.evil, "dht-fill", self.dht, "tasklet", str(self.secret), "--count", str(fill),
                                 "--seconds", "300")
                out["fill"] = _stop(filler, wait_s=330)
            if eclipse:
                strangers = _attack(self.evil, "eclipse", self.dht, "tasklet", "--count", str(eclipse), "--keys",
                                    "peers", "--seconds", "900")
                ready = read_line(strangers, 120, "{")
                out["stranger_nodes_ready"] = json.loads(ready).get("ready") if ready else None
                time.sleep(8)  # the run's nodes meet the strangers: every store next to ``peers`` goes to them
            if finds:
                asker = _attack(self.evil, "dht-finds", self.dht, "tasklet", "--keys", "peers,links,run,plans",
                                "--count", str(finds), "--seconds", "900")
                asking = time.monotonic()
            out["attack_s"] = round(time.monotonic() - started, 1)
            attacked = self.steps_per_s(window_s)
            name, reached, trained = self.join_home(join_timeout_s)
            hosts = {"pub0": self.pub0, "pub1": self.pub1}
            statuses = {h: self.status(hosts[h]) for h in status_on}
            if eclipse:
                out["eclipse"] = _stop(strangers)
            if finds:
                out["finds"] = _stop(asker)
                out["finds_s"] = round(time.monotonic() - asking, 1)
        self.leave(name)
        honest = {self.ids[n].peer_id for n in ("pub0", "pub1", name)}
        listed = {host: {p.get("peer_id") for p in st.get("peers", [])} for host, st in statuses.items()}
        rss = {c: (round(before[c] / 2**20), round(sampler.peak[c].get("rss", 0) / 2**20)) for c in children}
        return {
            "steps_per_s_unattacked": round(unattacked, 3),
            "steps_per_s_attacked": round(attacked, 3),
            "leadership_changes": self.leadership_changes(marks),
            "victim_dht_peak_rss_mib": max((peak for _, peak in rss.values()), default=0),
            "children_rss_mib_before_and_peak": rss,
            "joiner": name,
            "joiner_reached_s": None if reached is None else round(reached, 2),
            "joiner_trains_s": None if trained is None else round(trained, 2),
            "status_errors": {h: st["error"][-300:] for h, st in statuses.items() if "error" in st},
            "status_lists_every_honest_peer": {h: honest <= ids for h, ids in listed.items()},
            **out,
        }


def _comm(pid: int) -> str:
    """A process's command name (p2pd, python) from /proc."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"


def _stop(proc: subprocess.Popen[str], wait_s: float = 0.0) -> dict[str, Any] | None:
    """End an attack (after ``wait_s`` for it to end by itself; SIGTERM) and return what it reported."""
    try:
        stdout, _ = proc.communicate(timeout=wait_s or 0.01)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            stdout, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
    lines = (stdout or "").strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def run_members(seconds: float, scenarios: list[str] | tuple[str, ...] = MEMBER_SCENARIOS) -> dict[str, Any]:
    """The member-side scenarios on a swarm that trains (``MemberSwarm``), one after the other."""
    with netbed.open_bed() as bed, tempfile.TemporaryDirectory() as tmp, MemberSwarm(bed, Path(tmp)) as swarm:
        swarm.start()
        runs = {"network_caps": lambda: swarm.network_caps(seconds), "endpoint_squat": swarm.endpoint_squat,
                "dht_run_key_fill": lambda: swarm.dht_run_key_fill(seconds),
                "dht_eclipse": lambda: swarm.dht_eclipse(seconds),
                "dht_fill_eclipse": lambda: swarm.dht_attacks(seconds, fill=FILL_IDENTITIES, eclipse=ECLIPSE_NODES,
                                                              finds=FIND_WORKERS)}
        return {name: runs[name]() for name in scenarios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.doors", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seconds", type=float, default=30.0, help="how long the relay and port attacks last, and "
                   "the steps/s windows (unattacked, attacked) of network_caps")
    p.add_argument("--only", default="", help="comma-separated scenarios to run (default: all)")
    args = p.parse_args(argv)
    only = {x for x in args.only.split(",") if x}
    unknown = only - set(SCENARIOS) - set(MEMBER_SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}: {', '.join(SCENARIOS + MEMBER_SCENARIOS)}")
    reason = netbed.unavailable_reason()
    if reason:
        print(f"bench.doors needs network namespaces: {reason}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"scenarios": {}}
    if not only or only & set(SCENARIOS):
        result = run(args.seconds, [s for s in SCENARIOS if not only or s in only])
    if not only or only & set(MEMBER_SCENARIOS):
        result["scenarios"].update(run_members(args.seconds, [s for s in MEMBER_SCENARIOS if not only or s in only]))
    if args.json:
        print(json.dumps(result))
    else:
        for name, row in result["scenarios"].items():
            print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'attack'})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
