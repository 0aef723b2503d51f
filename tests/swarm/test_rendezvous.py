"""Reads and writes of the run's records through members' DHT nodes (peer.swarm.rendezvous): the choice of nodes
asked, and, against real DHT nodes on loopback, eight stranger nodes with ids next to a run key that swallow every
store there (an eclipse): a plain lookup between two members finds nothing, the run's record store finds it all."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.emulation.procs import child_env, read_line
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.dht import DHTConfig, start_dht, visible_maddrs
from tasklet.peer.swarm.records import RecordStore, RunRecordValidator, record_key, seal
from tasklet.peer.swarm.rendezvous import ASK_MEMBERS, QUIET_S, MemberNodes, member_nodes
from tasklet.peer.timing import now

RUN, SECRET = "eclipse-run", "members only"
PEER_A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER_B = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"


def test_a_read_asks_a_few_members_and_the_bootstrap_only_while_it_knows_none() -> None:
    nodes = MemberNodes([PEER_A, "own-id"], own="own-id")
    assert nodes.pick() == (PEER_A,)  # a fresh reader: the join line's node (never its own)
    members = [f"{PEER_B[:-4]}{i:04d}" for i in range(10)]
    nodes.update([*members, "own-id", ""])
    picks = {nodes.pick(random.Random(seed)) for seed in range(20)}
    assert all(len(p) == ASK_MEMBERS == len(set(p)) and set(p) <= set(members) for p in picks)
    assert len(picks) > 5  # spread over the members, so each member's node gathers the others' records


def test_a_node_that_did_not_answer_is_left_out_for_a_while() -> None:
    t = [0.0]
    nodes = MemberNodes([PEER_A], own="own-id", clock=lambda: t[0])
    members = [f"{PEER_B[:-4]}{i:04d}" for i in range(3)]
    nodes.update(members)
    nodes.failed(members[:2])
    assert {nodes.pick(random.Random(seed)) for seed in range(10)} == {(members[2],)}
    t[0] = QUIET_S + 1
    assert len(nodes.pick()) == ASK_MEMBERS


def test_an_advert_names_its_dht_node_only_as_a_peer_id() -> None:
    identity = Identity.generate()
    device = DeviceInfo("cpu", "cpu", 2**30, 0.1, True, False)
    advert = Advert(identity.peer_id, "127.0.0.1:4000", device, now(), dht=PEER_B)
    assert Advert.from_record(advert.to_record()).dht == PEER_B
    assert "dht" not in Advert(identity.peer_id, "127.0.0.1:4000", device, now()).to_record()
    for bad in ("", "0OIl" * 8, "x" * 65, 7, "/ip4/1.2.3.4/tcp/1"):
        with pytest.raises(ValueError, match="advert.dht"):
            Advert.from_record({**advert.to_record(), "dht": bad})


@pytest.mark.usefixtures("processes")
@pytest.mark.light_processes
@pytest.mark.timeout(180)
def test_stranger_nodes_next_to_a_key_hide_nothing_from_members() -> None:
    ids = [Identity.generate() for _ in range(2)]
    first = start_dht(DHTConfig(), ids[0], [RunRecordValidator(RUN, record_key(SECRET, RUN))])
    second = start_dht(DHTConfig(initial_peers=tuple(visible_maddrs(first))), ids[1],
                       [RunRecordValidator(RUN, record_key(SECRET, RUN))])
    attack = subprocess.Popen(
        [sys.executable, "-m", "tasklet.peer.emulation.doors_attack", "eclipse", visible_maddrs(first)[0], RUN,
         "--count", "8", "--keys", "plans", "--host", "127.0.0.1", "--seconds", "120"],
        stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        ready = read_line(attack, 90, "{")
        assert ready and json.loads(ready)["ready"] == 8
        time.sleep(3)  # both members meet the strangers (their lookups pass through them)
        # hivemind's own store and lookup, member to member: the strangers take the entry and the lookup of the
        # other member finds nothing (before any read of ours has gathered the key on the members' nodes)
        at, suffix, body = now() + 60, b"|epoch=0", {"epoch": 0}
        mac = seal(record_key(SECRET, RUN), RUN, "plans", ids[0].peer_id, suffix, at, body)
        assert first.store(f"{RUN}:plans", {"p": body, "mac": mac}, at, subkey=ids[0].owner_tag + suffix)
        plain = second.get(f"{RUN}:plans", latest=True)
        a, b = RecordStore(first, RUN, ids[0], SECRET), RecordStore(second, RUN, ids[1], SECRET)
        assert a.put("plans", {"epoch": 1}, now() + 60, suffix=b"|epoch=1")
        assert b.put("plans", {"epoch": 2}, now() + 60, suffix=b"|epoch=2")
        read = [store.get_all("plans") for store in (a, b)]
        assert member_nodes(second).pick() == (str(first.peer_id),)  # it knows no member yet: its join line's node
    finally:
        attack.terminate()
        out, _ = attack.communicate(timeout=60)
        second.shutdown()
        first.shutdown()
    swallowed = json.loads(out.strip().splitlines()[-1])
    print(f"eclipse: {swallowed}")
    assert swallowed["stores"] > 0  # the members' stores went to the strangers: they were the nearest nodes
    assert plain is None, plain
    # the writer keeps its own entries and pushes them to the join line's node; reads ask it: each member reads
    # both members' entries (and the one only hivemind stored, to the strangers, stays lost)
    for records in read:
        assert records is not None and sorted(r.payload["epoch"] for r in records) == [1, 2], records
