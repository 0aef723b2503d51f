"""Reads and writes of the run's records through members' DHT nodes (peer.swarm.rendezvous): the choice of nodes
asked, and, against real DHT nodes on loopback, eight stranger nodes with ids next to a run key that swallow every
store there (an eclipse): a plain lookup between two members finds nothing, the run's record store finds it all."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import pytest
from hivemind.p2p import PeerID

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.emulation.procs import child_env, read_line
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.dht import DHTConfig, start_dht, visible_maddrs
from tasklet.peer.swarm.records import RecordStore, RunRecordValidator, record_key, seal
from tasklet.peer.swarm.rendezvous import (
    ASK_MEMBERS,
    MEMBER_GRACE_S,
    QUIET_S,
    MemberNodes,
    _lookup_and_finds,
    _store,
    member_nodes,
)
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



class _SlowNode:
    """A DHT node's coroutines as the rendezvous calls them, each answering after a set delay (None: never)."""

    def __init__(self, lookup_s: float, find_s: dict[str, float | None], store_s: float = 0.0) -> None:
        self.lookup_s, self.find_s, self.store_s = lookup_s, find_s, store_s
        self.stored = False
        self.protocol = self
        self.record_validator = None

    async def get(self, key: str, latest: bool) -> None:
        await asyncio.sleep(self.lookup_s)

    async def call_find(self, peer: str, keys: list) -> dict:
        delay = self.find_s[peer]
        await asyncio.sleep(3600 if delay is None else delay)
        return {"answered-by": peer}

    async def store(self, *args: object, **kwargs: object) -> bool:
        await asyncio.sleep(self.store_s)
        self.stored = True
        return True

    async def call_store(self, peer: PeerID, *args: object) -> list[bool] | None:
        delay = self.find_s[peer.to_base58()]
        await asyncio.sleep(3600 if delay is None else delay)
        return [True]


def test_a_read_waits_for_unreachable_members_only_a_grace_after_the_lookup() -> None:
    node = _SlowNode(0.05, {"near": 0.01, "late": 0.3, "cut-off": None})
    took, answers = asyncio.run(_timed(node, 30.0))
    assert answers == [{"answered-by": "near"}, {"answered-by": "late"}, None]
    # not the 30 s deadline: the lookup's 0.05 s and then at most the grace for the node that never answers
    assert MEMBER_GRACE_S - 0.1 < took < MEMBER_GRACE_S + 1.0, took
    # a lookup that takes (nearly) the whole deadline leaves the members no grace past it: the caller's own
    # deadline is only a little longer, and a read that overran it was lost whole
    node.lookup_s = 0.4
    took, answers = asyncio.run(_timed(node, 0.5))
    assert answers[:2] == [{"answered-by": "near"}, {"answered-by": "late"}] and took < 0.5 + 0.2, took


async def _timed(node: _SlowNode, timeout_s: float) -> tuple[float, list]:
    started = time.monotonic()
    _, answers = await _lookup_and_finds(node, "k", None, ["near", "late", "cut-off"], timeout_s)  # type: ignore[arg-type]
    return time.monotonic() - started, answers


def test_hivemind_s_own_store_goes_on_past_the_deadline() -> None:
    node = _SlowNode(0.0, {}, store_s=0.5)

    async def run() -> tuple[bool, bool]:
        kept, _ = await _store(None, node, "k", b"sub", {"v": 1}, 0.0, (), timeout_s=0.1)  # type: ignore[arg-type]
        at_deadline = node.stored
        await asyncio.sleep(0.8)
        return at_deadline, node.stored

    class _Storage:
        def store(self, *args: object, **kwargs: object) -> bool:
            return False  # this node is not where the entry is kept

    node.storage = _Storage()  # type: ignore[attr-defined]
    node.serializer = type("S", (), {"dumps": staticmethod(lambda v: repr(v).encode())})  # type: ignore[attr-defined]
    at_deadline, later = asyncio.run(run())
    assert not at_deadline and later  # a cancelled traversal would have stored it nowhere


def test_a_write_waits_for_no_member_s_node_and_a_silent_one_is_reported_later() -> None:
    node = _SlowNode(0.0, {PEER_A: None, PEER_B: 0.01})
    node.storage = type("K", (), {"store": lambda *a, **k: True})()  # type: ignore[attr-defined]
    node.serializer = type("S", (), {"dumps": staticmethod(lambda v: repr(v).encode())})  # type: ignore[attr-defined]

    async def run() -> tuple[float, list, list]:
        started = time.monotonic()
        kept, first = await _store(None, node, "k", b"sub", {"v": 1}, 0.0, (PEER_A, PEER_B), 0.3)  # type: ignore[arg-type]
        took = time.monotonic() - started
        await asyncio.sleep(0.5)  # PEER_A's push runs out its deadline meanwhile
        _, later = await _store(None, node, "k", b"sub", {"v": 2}, 0.0, (), 0.3)  # type: ignore[arg-type]
        return took, first, later

    took, first, later = asyncio.run(run())
    assert took < 0.2 and first == [] and later == [PEER_A], (took, first, later)


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
