"""Four real `peer` processes on hosts of the network-namespace bed, and the facts their logs and `peer status`
give: shared by the partition, partition-heal and re-election tests.

A peer's log is cheap to read; a `peer status` costs seconds of a core on a loaded machine, so the waits read
logs and ask the status only for what only it shows. Partitions are nftables rules in the hosts.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tasklet.peer.emulation.multihost import BedPeers
from tasklet.peer.emulation.netbed import Host, NetBed
from tasklet.peer.emulation.procs import JOIN_LINE_PREFIX, PEER_COMMAND, child_env, poll_until, read_line
from tasklet.peer.emulation.reference_check import gap_to_reference
from tests.support.waits import wait_until

REPO = Path(__file__).resolve().parent.parent.parent
EMULATE_TFLOPS = "0.00005"  # 1.4 s a step with four replicas, 2.2 s with two: the runs outlast their partitions
TOLERANCE = 1e-5  # of a tensor's scale, against single-process training


class Swarm(BedPeers):
    """One `peer` process per bed host listening on the host's address, compute stretched to EMULATE_TFLOPS."""

    def spawn(self, host: Host, args: list[str]) -> subprocess.Popen[str]:
        return super().spawn(host, [*args, "--host", host.addr, "--dht-host", host.addr,
                                    "--emulate-tflops", EMULATE_TFLOPS])

    def form(self, hosts: list[Host], config: Path, join_args: list[str]) -> str:
        """`peer start` on the first host, then `peer join` (with ``join_args``) on the others one a second apart,
        so that the join order is the seniority; returns the first peer's DHT address."""
        starter = self.spawn(hosts[0], ["start", "--config", str(config)])
        line = read_line(starter, 120, JOIN_LINE_PREFIX)
        assert line, self.log(hosts[0].name)[-3000:]
        dht = line.split()[3]
        for host in hosts[1:]:
            self.spawn(host, ["join", "--dht", dht, *join_args])
            time.sleep(1.0)
        return dht

    def peer_id(self, name: str) -> str:
        found = re.search(r"peer (\w+) announced:", self.log(name))
        assert found, f"{name} did not announce itself:\n{self.log(name)[-2000:]}"
        return found.group(1)


def status(host: Host, dht: str) -> dict:
    """`peer status --json` run on ``host`` (so it sees that host's side of a partition)."""
    proc = subprocess.run(host.cmd(*PEER_COMMAND, "status", "--dht", dht, "--json"), capture_output=True,
                          text=True, timeout=90, cwd=REPO, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def wait_status(host: Host, dht: str, predicate: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
    """The first `peer status` on ``host`` that ``predicate`` accepts."""
    return poll_until(lambda: status(host, dht), predicate, timeout_s, what)


def in_plan(st: dict) -> set[str]:
    """The peers of a status's plan."""
    return {pid for pipe in st["plan"]["pipelines"] or [] for pid in pipe}


_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_STEP_LINE = re.compile(_STAMP + r" INFO tasklet.peer.node.leader_role: step (\d+):", re.M)
_PLAN_LINE = re.compile(_STAMP + r" INFO tasklet.peer.runtime.lead.driver: plan epoch \d+ .*"
                        r"pipelines (\[.*\]), continuing", re.M)


def time_of(stamp: str) -> float:
    """A log line's time stamp as seconds since the epoch."""
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1e3


def step_times(log: str) -> dict[int, float]:
    """Step -> wall-clock time the leader logged it done (the last time, if a step was redone)."""
    out = {}
    for stamp, step in _STEP_LINE.findall(log):
        out[int(step)] = time_of(stamp)
    return out


def steps_since(log: str, t: float) -> int:
    """Steps the leader logged done after wall-clock time ``t``."""
    return sum(1 for done in step_times(log).values() if done > t)


def plan_times(log: str) -> list[tuple[float, int]]:
    """(time, number of pipelines) of every plan the leader's driver made."""
    return [(time_of(stamp), len(json.loads(pipes))) for stamp, pipes in _PLAN_LINE.findall(log)]


def wait_for_training(swarm: Swarm, name: str, steps: int, timeout_s: float) -> None:
    """Until ``name``'s log says it led ``steps`` steps (a log is cheap to poll, unlike a `peer status`)."""
    wait_until(lambda: len(step_times(swarm.log(name))) >= steps, timeout_s, f"{steps} steps trained ({name}'s log)",
               0.5, detail=lambda: swarm.log(name))


def cut(bed: NetBed, side: list[Host], other: list[Host]) -> None:
    """Drop every packet between ``side`` and ``other`` (rules in the hosts of ``side``)."""
    addrs = "{ " + ", ".join(h.addr for h in other) + " }"
    for host in side:
        host.run("nft", "add", "table", "inet", "partition")
        host.run("nft", "add", "chain", "inet", "partition", "in", "{ type filter hook input priority 0 ; }")
        host.run("nft", "add", "chain", "inet", "partition", "out", "{ type filter hook output priority 0 ; }")
        host.run("nft", "add", "rule", "inet", "partition", "in", "ip", "saddr", addrs, "drop")
        host.run("nft", "add", "rule", "inet", "partition", "out", "ip", "daddr", addrs, "drop")


def heal(hosts: list[Host]) -> None:
    """Remove the rules :func:`cut` added."""
    for host in hosts:
        host.run("nft", "delete", "table", "inet", "partition")


def check_against_reference(save: Path, steps: int) -> float:
    """Max relative error of the saved parameters against single-process training (asserted < TOLERANCE)."""
    gap = gap_to_reference(save, steps)
    assert len(gap.run["loss"]) == steps
    assert gap.max_rel < TOLERANCE, f"{gap.max_rel:.2e} of a tensor's scale off single-process training"
    assert gap.loss_rel < TOLERANCE
    return gap.max_rel
