"""The `peer` command as a user meets it: clear one-line errors for what a user can get wrong.

Real processes (``python -m tasklet.peer.cli``), a real hivemind DHT on loopback. Each error must come back within a
bounded time as one line and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tasklet.peer.emulation.procs import PEER_COMMAND, PeerProcesses, write_small_config

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)
# a CLI call each, no swarm: lane 1 (tests/conftest.py). In lane 2: the wrong secret's test (it starts a peer) and
# the unreachable peer's (its 10 s DHT wait under an 18 s bound: in lane 1 it would run beside lane 2's swarms)
light = pytest.mark.light_processes


def run_peer(args: list[str], timeout: float = 60.0) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run([*PEER_COMMAND, *args], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr.strip(), time.monotonic() - started


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    last = err.splitlines()[-1] if err else ""
    assert last.startswith("peer: error:"), err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    for needle in needles:
        assert needle in last, last


@light
def test_bad_dht_address_fails_fast() -> None:
    rc, err, took = run_peer(["join", "--dht", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWNotARealPeerIdAtAll"])
    assert_one_line_error(rc, err, "--dht")
    assert took < 10 + 8, f"took {took:.1f} s (10 s budget plus interpreter start-up)"


def test_unreachable_dht_peer_fails_fast() -> None:
    rc, err, took = run_peer(["join", "--dht",
                              "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWAQmExmkvhZx2rF1W9rhDe9CC4KUZ7jeQcieDvkVCAsSG"])
    assert_one_line_error(rc, err, "DHT")
    assert took < 10 + 8


@light
def test_missing_config_field(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nrun_id = "x"\n')
    rc, err, _ = run_peer(["start", "--config", str(cfg)])
    assert_one_line_error(rc, err, "[run] steps is missing")


@light
def test_bad_config_value(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nrun_id = "x"\nsteps = 3\n[model]\nn_heads = 5\n')
    rc, err, _ = run_peer(["start", "--config", str(cfg)])
    assert_one_line_error(rc, err, "n_heads")


@light
def test_port_in_use(tmp_path: Path) -> None:
    cfg = write_small_config(tmp_path, steps=1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, err, _ = run_peer(["start", "--config", str(cfg), "--port", str(port)])
    assert_one_line_error(rc, err, f"127.0.0.1:{port}")


@light  # a waiting starter and two refused joiners, mostly waiting out the run-record wait
def test_wrong_join_secret_is_refused(tmp_path: Path) -> None:
    cfg = write_small_config(tmp_path, steps=1000, secret="open-sesame", min_peers=2)
    with PeerProcesses(tmp_path, emulate_tflops=0.001) as procs:
        addr = procs.start(cfg)
        # both joiners at once: each waits out the run-record wait before it can say why (JOINER_RUN_WAIT_S)
        with ThreadPoolExecutor(2) as pool:
            wrong = pool.submit(run_peer, ["join", "--dht", addr, "--secret", "wrong", "--host", "127.0.0.9"])
            none = pool.submit(run_peer, ["join", "--dht", addr, "--host", "127.0.0.10"])
            for rc, err, _ in (wrong.result(), none.result()):
                assert_one_line_error(rc, err, "secret")


@light
def test_help_explains_every_flag_with_its_default() -> None:
    for command in ["start", "join", "status", "swarm", "init"]:
        proc = subprocess.run([*PEER_COMMAND, command, "--help"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0
        assert "usage: peer " + command in proc.stdout
    out = subprocess.run([*PEER_COMMAND, "join", "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ["--dht", "--host", "--port", "--announce", "--identity", "--secret", "--emulate-tflops"]:
        assert flag in out
    assert out.count("default") >= 8


@light
@pytest.mark.parametrize("args", [["swarm", "--peers", "0", "--scenario", "x"],
                                  ["swarm", "--peers", "2", "--scenario", "no_such_scenario"]])
def test_swarm_bad_arguments(args: list[str]) -> None:
    rc, err, _ = run_peer(args)
    assert_one_line_error(rc, err)


@light
def test_bulk_port_flag_and_its_default_with_an_announced_address() -> None:
    """--bulk-port takes a port or 'off'; with --announce and no --bulk-port the lane is off (an announced address
    forwards the user's chosen ports, never one picked at start), with a chosen port it is on."""
    from tasklet.peer.cli import build_parser
    from tasklet.peer.node.daemon import bulk_lane_port

    parse = build_parser().parse_args
    base = ["join", "--dht", "/ip4/127.0.0.1/tcp/1/p2p/X"]
    assert parse(base).bulk_port == 0
    assert parse([*base, "--bulk-port", "off"]).bulk_port is None
    assert parse([*base, "--bulk-port", "31403"]).bulk_port == 31403
    with pytest.raises(SystemExit):
        parse([*base, "--bulk-port", "70000"])
    assert bulk_lane_port(None, 0) == 0  # a free port, found by peers over gRPC
    assert bulk_lane_port("198.51.100.23:31400", 0) is None
    assert bulk_lane_port("198.51.100.23:31400", 31403) == 31403
    assert bulk_lane_port(None, None) is None
