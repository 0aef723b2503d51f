"""The DHT find gate (peer.swarm.findgate): each asker and each class of asker (members' nodes, everyone else) draw
on their own byte budgets; against real DHT nodes on loopback, a stranger asking a member's node for a filled key
as fast as it can gets what its budget allows while a member still reads it; a client-mode node with the run's
budgets starts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tasklet.peer.emulation.procs import child_env, read_line
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.dht import OTHERS_ANSWER_BYTES, DHTConfig, start_dht, visible_maddrs
from tasklet.peer.swarm.findgate import MAX_ASKERS, FindGate, GateLimits, MiB, gate_members
from tasklet.peer.swarm.records import RecordStore, RunRecordValidator, record_key

RUN, SECRET = "gate-run", "members only"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_each_asker_and_each_class_draw_on_their_own_budgets() -> None:
    clock = Clock()
    limits = GateLimits(member_bytes_per_s=4 * MiB, member_burst_bytes=8 * MiB, members_bytes_per_s=10 * MiB,
                        members_burst_bytes=20 * MiB, other_bytes_per_s=1 * MiB, other_burst_bytes=2 * MiB,
                        others_bytes_per_s=2 * MiB, others_burst_bytes=3 * MiB)
    gate = FindGate(limits, clock)
    gate.set_members(["member", "member2"])
    # one busy stranger gets its own 2 MiB, and leaves the rest of the strangers' 3 MiB to another asker
    assert [gate.allow("busy", "key", MiB) for _ in range(3)] == [True, True, False]
    assert gate.allow("joiner", "key", MiB) and not gate.allow("third", "key", MiB)  # the class's 3 MiB are gone
    assert gate.allow("member", "key", 8 * MiB)  # the members' budget is not the strangers'
    assert not gate.allow("member", "key", MiB) and gate.allow("member2", "key", 8 * MiB)
    assert not gate.allow("member3", "key", MiB)  # not a member: the strangers' class, spent
    clock.t = 1.0  # a second: each bucket refills at its rate, the strangers' class by 2 MiB
    assert gate.allow("busy", "key", MiB) and gate.allow("joiner", "key", MiB) and not gate.allow("x", "key", MiB)
    assert gate.stats() == {"to_members": 2, "to_others": 5, "refused_members": 1, "refused_others": 4}


def test_the_gate_remembers_a_bounded_number_of_askers() -> None:
    gate = FindGate(GateLimits(other_bytes_per_s=1e12, other_burst_bytes=1e12), Clock())
    for i in range(MAX_ASKERS + 100):
        assert gate.allow(f"id{i}", "peers", 1)
    assert len(gate._askers) == MAX_ASKERS  # noqa: SLF001 - the bound is the point
    assert gate.allow("id0", "peers", 1)  # the oldest were forgotten


@pytest.mark.usefixtures("processes")
@pytest.mark.light_processes
@pytest.mark.timeout(180)
def test_a_stranger_asking_for_a_filled_key_gets_its_budget_and_a_member_still_reads(tmp_path: Path) -> None:
    ids = [Identity.generate() for _ in range(2)]
    validators = [RunRecordValidator(RUN, record_key(SECRET, RUN))]
    first = start_dht(DHTConfig(), ids[0], validators)
    second = start_dht(DHTConfig(initial_peers=tuple(visible_maddrs(first))), ids[1],
                       [RunRecordValidator(RUN, record_key(SECRET, RUN))])
    seconds, limits = 6.0, GateLimits()
    try:
        gate_members(first, [str(second.peer_id)]).result(10)
        secret = tmp_path / "secret"
        secret.write_text(SECRET)
        fill = subprocess.run(  # a member's 8 free identities fill `links` (2 MiB)
            [sys.executable, "-m", "tasklet.peer.emulation.doors_attack", "dht-fill", visible_maddrs(first)[0], RUN,
             str(secret), "--count", "8", "--seconds", "40"],
            stdout=subprocess.PIPE, text=True, env=child_env(), timeout=90, check=True)
        filled = json.loads(fill.stdout.strip().splitlines()[-1])["links"]
        assert filled >= 6, fill.stdout
        attack = subprocess.Popen(
            [sys.executable, "-m", "tasklet.peer.emulation.doors_attack", "dht-finds", visible_maddrs(first)[0],
             RUN, "--keys", "links", "--count", "4", "--seconds", str(seconds)],
            stdout=subprocess.PIPE, text=True, env=child_env())
        reads: list[int] = []
        member = RecordStore(second, RUN, ids[1], SECRET)

        def read_while_attacked() -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                got = member.get_all("links")
                reads.append(-1 if got is None else len(got))
                time.sleep(0.5)

        reader = threading.Thread(target=read_while_attacked)
        time.sleep(2.0)  # the attacker's node is up and asking
        reader.start()
        reader.join(60)
        line = read_line(attack, 60, "{")
        attack.wait(30)
        stats = gate_members(first, [str(second.peer_id)]).result(10)
    finally:
        second.shutdown()
        first.shutdown()
    got = json.loads(line or "{}")
    print(f"stranger's finds: {got}; member's reads: {reads}; gate: {stats}")
    assert got["finds"] > 50, got  # it asked as fast as it could
    # what one asker's bucket allows over the attack
    allowed = limits.other_burst_bytes + seconds * limits.other_bytes_per_s
    assert 0 < got["value_bytes"] <= allowed, got
    # and each answer carried the key's smallest entries only, not the whole filled key (2 MiB)
    assert got["value_bytes"] <= got["with_value"] * OTHERS_ANSWER_BYTES, got
    assert stats["refused_others"] > 0, stats
    assert reads and all(n >= filled for n in reads), reads  # every read of the member found every entry


@pytest.mark.usefixtures("processes")
@pytest.mark.light_processes
@pytest.mark.timeout(120)
def test_a_client_mode_node_with_the_run_s_budgets_starts_and_reads() -> None:
    """`peer stewards add` joins as a client with the run's guard: no find handler to gate, and it still starts."""
    member = start_dht(DHTConfig(), Identity.generate(), [RunRecordValidator(RUN, record_key(SECRET, RUN))])
    try:
        client = start_dht(DHTConfig(initial_peers=tuple(visible_maddrs(member)), client_mode=True),
                           Identity.generate(), [RunRecordValidator(RUN, record_key(SECRET, RUN))])
        try:
            assert RecordStore(client, RUN, None, SECRET).get_all("run") == []
        finally:
            client.shutdown()
    finally:
        member.shutdown()
