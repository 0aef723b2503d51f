"""Real `peer` processes on separate hosts (network namespaces, peer/emulation/netbed.py), started with the README's
internet commands: three public hosts, a home host with port forwarding, and two home hosts behind NAT that
nobody can dial (reached through the public peers' relays). Each run's saved parameters must equal plain
single-process training (max |difference| below 1e-5); a NAT'd peer killed mid-step is recovered from.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tasklet.peer.emulation.multihost import (
    BULK_PORT,
    DHT_PORT,
    GRPC_PORT,
    RELAY_PORT,
    BedPeers,
    max_error_vs_reference,
    readme_flags,
    write_config,
)
from tasklet.peer.emulation.netbed import (
    NetBed,
    port_forwarded,
    three_public,
    two_public_two_home,
)
from tasklet.peer.emulation.procs import PEER_COMMAND
from tests.support.waits import wait_for_text

pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.timeout(300)]
STEPS = 5
TOLERANCE = 1e-5
RELAY = ["--relay-port", str(RELAY_PORT)]


def _train(peers: BedPeers, tmp_path: Path, timeout_s: float = 200) -> float:
    codes = peers.wait_all(timeout_s)
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}; logs in {peers.log_dir}"
    err, run = max_error_vs_reference(tmp_path / "save", STEPS)
    assert len(run["loss"]) == STEPS
    return err


def test_three_public_hosts_train_with_the_readme_commands(bed: NetBed, tmp_path: Path) -> None:
    hosts = three_public(bed)
    cfg = write_config(tmp_path, STEPS, len(hosts), tmp_path / "save")
    with BedPeers(tmp_path / "logs") as peers:
        dht = peers.start(hosts[0], cfg, *readme_flags(hosts[0]))
        for host in hosts[1:]:
            peers.join(host, dht, *readme_flags(host))
        err = _train(peers, tmp_path)
        leader_log = peers.log("pub0")
    assert err < TOLERANCE, f"parameters {err:.2e} off single-process training"
    # One port: the leader serves its coordinator on its worker's gRPC server, no other gRPC server.
    servers = re.findall(r"peer server listening on (\S+)", leader_log)
    assert servers == [f"0.0.0.0:{GRPC_PORT}"], servers


def test_port_forwarded_home_host_trains(bed: NetBed, tmp_path: Path) -> None:
    pub, home = port_forwarded(bed, ports=(GRPC_PORT, DHT_PORT, BULK_PORT))
    nated = bed.add_home("home1")  # no forwarding and no --announce: the relay's dial-back finds out
    cfg = write_config(tmp_path, STEPS, 3, tmp_path / "save")
    with BedPeers(tmp_path / "logs") as peers:
        dht = peers.start(pub, cfg, *readme_flags(pub), *RELAY)
        peers.join(home, dht, *readme_flags(home))
        peers.join(nated, dht, *readme_flags(nated, announce=False))
        err = _train(peers, tmp_path)
        home_log, nated_log = peers.log("home0"), peers.log("home1")
    assert err < TOLERANCE
    assert f"dialled {home.addr}:{GRPC_PORT} back; publishing {home.addr}:{GRPC_PORT}" in home_log
    assert "behind NAT?); reached through relay" in nated_log  # (whether it gets a stage is the scheduler's choice)


def _paths_in(log: str) -> set[str]:
    return set(re.findall(r"link to \w+ \((\w+)\)", log))


def test_two_peers_behind_nat_train_through_relays(bed: NetBed, tmp_path: Path) -> None:
    pubs, homes = two_public_two_home(bed)
    cfg = write_config(tmp_path, STEPS, 4, tmp_path / "save", stages=2)
    with BedPeers(tmp_path / "logs") as peers:
        dht = peers.start(pubs[0], cfg, *readme_flags(pubs[0]), *RELAY)
        peers.join(pubs[1], dht, *readme_flags(pubs[1]), *RELAY)
        for home in homes:
            peers.join(home, dht, *readme_flags(home))  # exactly the README's command: nothing about NAT
        err = _train(peers, tmp_path)
        logs = {name: peers.log(name) for name in ("pub0", "pub1", "home0", "home1")}
    assert err < TOLERANCE
    for home in ("home0", "home1"):
        assert "behind NAT?); reached through relay" in logs[home]
        assert "assigned stage" in logs[home], f"{home} got no stage"
    # Public -> NAT'd peer registered with it: reversed; NAT'd -> NAT'd: relayed through a public peer.
    assert "reversed" in _paths_in(logs["pub0"]) | _paths_in(logs["pub1"])
    assert "relayed" in _paths_in(logs["home0"]) | _paths_in(logs["home1"])


def test_a_nated_peer_killed_mid_step_is_recovered(bed: NetBed, tmp_path: Path) -> None:
    pubs, homes = two_public_two_home(bed)
    steps = 10  # the kill comes within step 4; the recovered swarm trains the rest (a longer run adds only time)
    cfg = write_config(tmp_path, steps, 4, tmp_path / "save", stages=2)
    slow = ["--emulate-tflops", "0.0001"]  # about a second a step: time to kill inside one
    with BedPeers(tmp_path / "logs") as peers:
        dht = peers.start(pubs[0], cfg, *readme_flags(pubs[0]), *RELAY, *slow)
        peers.join(pubs[1], dht, *readme_flags(pubs[1]), *RELAY, *slow)
        for home in homes:
            peers.join(home, dht, *readme_flags(home), *slow)

        def wait_for_step(step: int) -> None:
            wait_for_text(lambda: peers.log("pub0"), f"step {step}:", 180, "pub0", 0.1, alive=peers.procs["pub0"])

        wait_for_step(1)  # `peer status` from another host of the bed, while the swarm trains
        status = subprocess.Popen(pubs[1].cmd(*PEER_COMMAND, "status", "--dht", dht), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
        wait_for_step(3)
        peers.kill("home1")  # within step 4 (a step takes about a second)
        out, err = status.communicate(timeout=120)
        codes = peers.wait_all(240)
        leader_log = peers.log("pub0")
    assert status.returncode == 0, err[-2000:]
    assert "nat:" in out and "reached" in out, out
    assert {k: v for k, v in codes.items() if k != "home1"} == {"pub0": 0, "pub1": 0, "home0": 0}, codes
    assert "declared dead" in leader_log
    err_max, run = max_error_vs_reference(tmp_path / "save", steps)
    assert len(run["loss"]) == steps
    assert err_max < TOLERANCE, f"{err_max:.2e}: a micro-batch was lost or counted twice"


@pytest.mark.light_processes  # three CLI calls, no bed, no swarm: lane 1 (tests/conftest.py)
def test_undialable_addresses_are_refused_at_start(tmp_path: Path) -> None:
    remote = "/ip4/198.51.100.7/tcp/31401/p2p/12D3KooWH4ecARXxDuWHreqMq8ALtetbyNfvoQLayNHeW39sAAea"
    cases = [
        (["join", "--dht", remote, "--host", "127.0.0.1", "--port", "31400"], "loopback"),
        (["join", "--dht", remote, "--host", "0.0.0.0", "--port", "31400", "--dht-port", "31401",
          "--announce", "0.0.0.0:31400"], "no address others can"),
        (["start", "--config", str(write_config(tmp_path, 1, 1, tmp_path / "s")), "--host", "0.0.0.0"],
         "--announce"),
    ]
    for args, expected in cases:
        done = subprocess.run([*PEER_COMMAND, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (args, done.stderr[-1500:])
        lines = [line for line in done.stderr.splitlines() if line.startswith("peer: error:")]
        assert len(lines) == 1 and expected in lines[0], done.stderr[-1500:]
