"""The doors under attack, with real `peer` processes in the network-namespace bed: while a stranger's host
trickles bytes at the relay, registers 256 fresh keys, floods CONNECTs at the NAT'd peer's id, holds hundreds of
connections to the leader's gRPC, bulk-lane and metrics ports and floods every DHT key of the run with untagged
subkeys and oversized values, a NAT'd member (secret from a file) joins, registers with the relay within 10 s,
`peer status` lists every peer and the run trains to single-process parameters. The victim's descriptors and
threads are read from /proc before, at the peak and after.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasklet.peer.emulation.doors_attack import PeakSampler, proc_usage
from tasklet.peer.emulation.multihost import (
    BULK_PORT,
    GRPC_PORT,
    RELAY_PORT,
    BedPeers,
    max_error_vs_reference,
    readme_flags,
    write_config,
)
from tasklet.peer.emulation.netbed import NetBed
from tasklet.peer.emulation.procs import PEER_COMMAND
from tasklet.peer.identity.keys import Identity
from tests.support.waits import wait_for_text

pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.timeout(400)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 4
METRICS_PORT = 31404
ATTACK_S = 30.0


def _attack(host, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(host.cmd(sys.executable, "-m", "tasklet.peer.emulation.doors_attack", *args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_nated_member_joins_and_the_run_trains_while_every_door_is_attacked(bed: NetBed, tmp_path: Path) -> None:
    pub0, pub1 = bed.add_public("pub0"), bed.add_public("pub1")
    evil = bed.add_public("evil", own_network=True)  # the relay counts request slots per network: not the homes'
    home = bed.add_home("home0")
    secret = tmp_path / "secret"
    secret.write_text("doors are for members\n")
    secret.chmod(0o600)
    ids = {}
    for name in ("pub0", "pub1", "home0"):  # known identities: `peer status` must list each of them
        ids[name] = Identity.generate()
        ids[name].save(tmp_path / f"{name}.key")
    nated = ids["home0"]
    cfg = write_config(tmp_path, STEPS, 3, tmp_path / "save", stages=2)
    member = ["--secret-file", str(secret)]

    def who(name: str) -> list[str]:
        return ["--identity", str(tmp_path / f"{name}.key")]

    with BedPeers(tmp_path / "logs") as peers:
        dht = peers.start(pub0, cfg, *readme_flags(pub0), "--relay-port", str(RELAY_PORT),
                          "--metrics-port", str(METRICS_PORT), *member, *who("pub0"))
        victim = peers.procs["pub0"].pid
        before = proc_usage(victim)
        relay = f"{pub0.addr}:{RELAY_PORT}"
        ports = [f"{pub0.addr}:{p}" for p in (GRPC_PORT, BULK_PORT, METRICS_PORT)]
        with PeakSampler({"pub0": victim}) as sampler:
            attacks = {
                "relay": _attack(evil, "relay", relay, nated.peer_id, "--seconds", str(ATTACK_S)),
                "ports": _attack(evil, "ports", *ports, "--count", "300", "--seconds", str(ATTACK_S - 10)),
                "dht": _attack(evil, "dht", dht, "tasklet", "--untagged", "300", "--oversized", "2", "--seconds",
                               str(ATTACK_S)),
            }
            time.sleep(8)  # the floods are under way
            joined_at = time.monotonic()
            peers.join(home, dht, *readme_flags(home, announce=False), *member, *who("home0"))
            wait_for_text(lambda: peers.log("home0"), "reached through relay", 60, "home0", alive=peers.procs["home0"])
            join_s = time.monotonic() - joined_at
            status = subprocess.run(pub1.cmd(*PEER_COMMAND, "status", "--dht", dht, *member), capture_output=True,
                                    text=True, cwd=REPO, timeout=120)
            results = {name: _result(proc) for name, proc in attacks.items()}
        peak = sampler.peak["pub0"]
        after = proc_usage(victim)
        peers.join(pub1, dht, *readme_flags(pub1), *member, *who("pub1"))  # the third peer: training starts
        codes = peers.wait_all(200)
        logs = {name: peers.log(name) for name in ("pub0", "pub1", "home0")}
    print(f"victim before {before}, peak {peak}, after {after}; NAT'd join {join_s:.1f} s; attacks {results}")
    assert join_s < 60, f"the NAT'd member needed {join_s:.0f} s to join"
    phases = json.loads(re.search(r"start-up phases (\{.*\})", logs["home0"]).group(1))
    assert phases["reach"] < 10.0, f"reachability (check and relay registration) took {phases['reach']} s"
    assert status.returncode == 0, status.stderr[-2000:]
    assert ids["pub0"].peer_id[:12] in status.stdout and nated.peer_id[:12] in status.stdout, status.stdout
    assert codes == {"pub0": 0, "pub1": 0, "home0": 0}, f"exit codes {codes}; logs in {peers.log_dir}"
    err, run = max_error_vs_reference(tmp_path / "save", STEPS)
    assert len(run["loss"]) == STEPS and err < 1e-5, err
    # what the stranger got: no registration (denied, or closed at its source's slot cap), no tunnel, no record
    regs, connects = results["relay"]["register_answers"], results["relay"]["connect_answers"]
    assert sum(regs.values()) == 256 and set(regs) <= {"DENIED not", "closed"}, regs
    assert set(connects) <= {"407", "closed"}, connects
    assert results["dht"]["stored"] == {"untagged": 0, "oversized": 0} and results["dht"]["tried"]["untagged"], results
    # every held connection was cut: the metrics port at its per-source cap, the others at their handshake deadline
    assert all(n == 0 for n in results["ports"]["open_at_end"].values()), results["ports"]
    assert peak["fds"] < peak["fd_limit"], peak
    assert after["fds"] < before["fds"] + 64 and after["threads"] < before["threads"] + 32, (before, after)
