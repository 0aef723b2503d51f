"""A 2 + 2 network partition of four real `peer` processes on four hosts of the network-namespace test bed.

The four hosts sit on one switch; nftables rules in every host drop all traffic between {pub0, pub1} and
{pub2, pub3} until the other side's leader has paused and the leader's side has trained 3 steps since the cut
(``PARTITION_S`` at most), then are removed. pub0 started the run and leads. Expected (issue #13,
quorum and fencing): the leader's side keeps training (it holds half of the previous plan's members,
the previous leader among them), the other side elects a leader of its own that pauses without a quorum
and trains nothing; after healing every peer follows the leader's plan again, the two returning peers get
work again, and the final parameters equal single-process training within 1e-5 (no micro-batch lost or
counted twice). The figures are printed (``-s`` shows them).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tasklet.peer.emulation.multihost import BedPeers
from tasklet.peer.emulation.netbed import Host, NetBed, open_bed, unavailable_reason
from tasklet.peer.emulation.procs import (
    JOIN_LINE_PREFIX,
    PEER_COMMAND,
    child_env,
    poll_until,
    read_line,
    write_small_config,
)
from tasklet.peer.emulation.reference_check import gap_to_reference

pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
STEPS = 18  # outlasts the partition (about 7 steps done when it heals) and the re-plan of all four after it
PARTITION_S = 90.0  # at most: the minority notices (~7 s), elects its own leader and pauses; the majority trains
# >= 3 steps (~15 s in all); then it heals
EMULATE_TFLOPS = "0.00005"  # 1.4 s a step with four replicas, 2.2 s with two: the run outlasts the partition


class Swarm(BedPeers):
    """One `peer` process per bed host listening on the host's address, compute stretched to EMULATE_TFLOPS."""

    def spawn(self, host: Host, args: list[str]) -> subprocess.Popen[str]:
        return super().spawn(host, [*args, "--host", host.addr, "--dht-host", host.addr,
                                    "--emulate-tflops", EMULATE_TFLOPS])

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


def wait_status(host: Host, dht: str, predicate, timeout_s: float, what: str) -> dict:
    return poll_until(lambda: status(host, dht), predicate, timeout_s, what)


def in_plan(st: dict) -> set[str]:
    return {pid for pipe in st["plan"]["pipelines"] or [] for pid in pipe}


_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_STEP_LINE = re.compile(_STAMP + r" INFO tasklet.peer.node.leader_role: step (\d+):", re.M)


def step_times(log: str) -> dict[int, float]:
    """Step -> wall-clock time the leader logged it done (the last time, if a step was redone)."""
    out = {}
    for stamp, step in _STEP_LINE.findall(log):
        out[int(step)] = _stamp(stamp)
    return out


def steps_since(log: str, t: float) -> int:
    """Steps the leader logged done after wall-clock time ``t``."""
    return sum(1 for done in step_times(log).values() if done > t)


def wait_until(check: Callable[[], bool], timeout_s: float) -> None:
    """Return once ``check()`` holds (a fact of the peers' logs) or ``timeout_s`` has passed: the caller's
    assertions then say what was missing. Cheap to poll, unlike a `peer status` (seconds of a core each)."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.5)


_PLAN_LINE = re.compile(_STAMP + r" INFO tasklet.peer.runtime.lead.driver: plan epoch \d+ .*"
                        r"pipelines (\[.*\]), continuing", re.M)


def _stamp(stamp: str) -> float:
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1e3


def plan_times(log: str) -> list[tuple[float, int]]:
    """(time, number of pipelines) of every plan the leader's driver made."""
    return [(_stamp(stamp), len(json.loads(pipes))) for stamp, pipes in _PLAN_LINE.findall(log)]


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
    for host in hosts:
        host.run("nft", "delete", "table", "inet", "partition")


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"network namespaces: {unavailable_reason()}")
def test_partition_2_plus_2_minority_pauses_and_rejoins(tmp_path: Path) -> None:
    save = tmp_path / "result"
    cfg = write_small_config(tmp_path, steps=STEPS, min_peers=4, stages=1, leaders="any",
                             extra=f"save_dir = {json.dumps(str(save))}\n")
    swarm = Swarm(tmp_path)
    with open_bed() as bed:
        hosts = [bed.add_public(f"pub{i}") for i in range(4)]
        majority, minority = hosts[:2], hosts[2:]
        try:
            starter = swarm.spawn(hosts[0], ["start", "--config", str(cfg)])
            line = read_line(starter, 120, JOIN_LINE_PREFIX)
            assert line, swarm.log("pub0")[-3000:]
            dht0 = line.split()[3]
            for host in hosts[1:]:
                swarm.spawn(host, ["join", "--dht", dht0, "--config", str(cfg)])  # its own save_dir
                time.sleep(1.0)  # join one after the other: the order is the seniority
            # four peers training (from the leader's log: `peer status` costs seconds on a loaded machine)
            deadline = time.monotonic() + 240
            while len(step_times(swarm.log("pub0"))) < 3:
                assert time.monotonic() < deadline, f"no training within 240 s:\n{swarm.log('pub0')[-3000:]}"
                time.sleep(0.5)
            ids = {h.addr: swarm.peer_id(h.name) for h in hosts}
            leader, epoch_before = ids[hosts[0].addr], 1
            assert "driver: plan epoch 1 (start)" in swarm.log("pub0")
            assert f"this peer ({leader}) leads the swarm" in swarm.log("pub0")

            cut(bed, majority, minority)
            cut(bed, minority, majority)
            t_cut = time.time()
            # until the minority's leader paused and the leader's side trained 3 steps (both logged, with the time)
            wait_until(lambda: ("paused, only 2 of the 4 members" in swarm.log("pub2") + swarm.log("pub3")
                                    and steps_since(swarm.log("pub0"), t_cut) >= 3), PARTITION_S)
            heal(hosts)
            t_heal = time.time()
            partition_s = t_heal - t_cut

            # the leader's side trained on (its log has a line per step, with the time)
            steps = step_times(swarm.log("pub0"))
            major_steps = sum(1 for t in steps.values() if t_cut < t < t_heal)
            assert major_steps >= 3, f"the leader's side trained {major_steps} steps in {partition_s:.1f} s"
            # the minority elected a leader of its own, which paused: no plan, no step there
            minority_logs = swarm.log("pub2") + swarm.log("pub3")
            assert "paused, only 2 of the 4 members" in minority_logs
            assert "tasklet.peer.runtime.lead.driver: plan epoch" not in minority_logs
            assert "tasklet.peer.runtime.lead.coordinator: step" not in minority_logs

            # the leader's log says when it planned all four again; then `peer status` shows it
            wait_until(lambda: any(t > t_heal and n == 4 for t, n in plan_times(swarm.log("pub0"))), 120)
            st = wait_status(hosts[0], dht0, lambda s: len(in_plan(s)) == 4, 120, "all four peers in one plan")
            rejoin_s = time.time() - t_heal
            replanned_s = min(t for t, n in plan_times(swarm.log("pub0")) if t > t_heal and n == 4) - t_heal
            assert st["plan"]["leader"] == leader and st["plan"]["epoch"] > epoch_before
            assert "leadership moved to " + leader in swarm.log("pub2") + swarm.log("pub3")  # its leader stepped down
            for name, proc in swarm.procs.items():
                assert proc.wait(timeout=600) == 0, f"{name} failed:\n{swarm.log(name)[-3000:]}"
            assert "run finished" in swarm.log("pub0")
            assert all("the run is done" in swarm.log(h.name) for h in hosts[1:])
            for host in minority:  # work again after the partition: a second assignment, from the same leader
                assert swarm.log(host.name).count("tasklet.peer.runtime.stage.worker: assigned stage") >= 2
        finally:
            swarm.close()
    error = check_against_reference(save)
    print(f"\npartition figures: the leader's side trained {major_steps} steps during the {partition_s:.1f} s "
          f"partition, the minority 0; the leader planned all four again {replanned_s:.1f} s after healing "
          f"(its log), `peer status` showed them on one plan (epoch {st['plan']['epoch']}) after {rejoin_s:.1f} s; "
          f"final parameters within "
          f"{error:.2e} of single-process training")


def check_against_reference(save: Path, steps: int = STEPS) -> float:
    """Max relative error of the saved parameters against single-process training (asserted < 1e-5)."""
    gap = gap_to_reference(save, steps)
    assert len(gap.run["loss"]) == steps
    assert gap.max_rel < 1e-5, f"{gap.max_rel:.2e} of a tensor's scale off single-process training"
    assert gap.loss_rel < 1e-5
    return gap.max_rel
