"""The forking launcher of bench.formation: daemons forked from one pre-imported process form a real swarm.

Three `peer` daemons (one `peer start`, two `peer join`) forked by ``bench.launcher.ForkedPeers`` must each be a
process of its own (own session, own identity, own DHT and gRPC server), agree on a plan, train the run's one
step and leave by themselves; closing the launcher must leave no process of theirs behind.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from bench.launcher import ForkedPeers
from tasklet.peer.emulation.procs import write_small_config

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

ANNOUNCED = re.compile(r"peer (\w+) announced: .* gRPC at ([\d.]+:\d+)")


def _groups_alive(groups: list[int]) -> list[int]:
    """Pids of live (not zombie) processes in these process groups."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) in groups and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def test_forked_daemons_form_a_swarm_train_and_leave(tmp_path: Path) -> None:
    config = write_small_config(tmp_path, steps=1, min_peers=3, stages=2, heartbeat_s=1.0)
    with ForkedPeers(tmp_path / "logs", emulate_tflops=0.001) as peers:
        addr = peers.start(config, timeout_s=90)
        assert addr.startswith("/ip4/127.0.0.1/tcp/")
        assert peers.join_line.startswith("peer join --dht ")
        for i in (1, 2):
            peers.join(addr, i)
        deadline = time.monotonic() + 150
        while peers.alive() and time.monotonic() < deadline:  # the run is one step: everyone leaves when done
            time.sleep(0.5)
        logs = [peers.log_text(i) for i in range(3)]
        assert peers.alive() == 0, "the peers did not finish the run:\n" + "\n".join(x[-3000:] for x in logs)
        assert sorted(peers.exits.values()) == [0, 0, 0]
        groups = peers.groups()
        pids = list(peers.pids.values())
    # every child led its own session (its DHT process and p2pd with it) and had its own identity and server
    assert len(set(pids)) == 3 and peers.zygote.pid not in pids
    announced = [ANNOUNCED.search(text) for text in logs]
    assert all(announced), logs
    assert len({m.group(1) for m in announced}) == 3  # fresh identities after fork
    assert [m.group(2).split(":")[0] for m in announced] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert sum("plan epoch 1 (start)" in text for text in logs) == 1  # exactly one leader planned
    assert sum("run finished: 1 steps" in text for text in logs) == 1
    assert peers.zygote.poll() is not None
    assert _groups_alive(groups) == []


def test_closing_the_launcher_ends_running_daemons(tmp_path: Path) -> None:
    """A swarm that never forms (it waits for 5 peers) is ended with everything it started by close()."""
    config = write_small_config(tmp_path, steps=1, min_peers=5, heartbeat_s=1.0)
    peers = ForkedPeers(tmp_path / "logs", emulate_tflops=0.001)
    try:
        addr = peers.start(config, timeout_s=90)
        peers.join(addr, 1)
        time.sleep(1.0)
        groups = peers.groups()
        assert len(_groups_alive(groups)) >= 3  # the zygote, two daemons (and their DHT processes, p2pd)
    finally:
        peers.close(grace_s=10)
    assert _groups_alive(groups) == []
