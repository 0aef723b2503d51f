"""The kinds every member writes, spread over more DHT keys as the swarm grows (peer.swarm.shards): where a writer
stores, what the validator lets it store where, how a read goes level by level, the sizes at which a shard would
fill or a reply pass p2pd's limit; over the in-memory DHT a swarm grown to 10,000 largest adverts read back whole
with no key past its budget; and over real DHT nodes more of the largest adverts than one key holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from tasklet.peer.emulation.cpsim.memdht import LatencyModel, MemoryDHT
from tasklet.peer.emulation.cpsim.sim import SimIdentity
from tasklet.peer.emulation.doors_attack import padded_advert
from tasklet.peer.emulation.procs import child_env
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.dht import DHTConfig, start_dht, visible_maddrs
from tasklet.peer.swarm.records import (
    MAX_KEY_BYTES,
    RecordStore,
    RunRecordValidator,
    record_key,
    seal,
)
from tasklet.peer.swarm.shards import (
    CROWDED_ENTRIES,
    MAX_SHARDS,
    P2PD_REPLY_BYTES,
    crowded,
    level_suffix,
    next_shards,
    peers_at_limit,
    shard_name,
    shard_of,
    suffix_level,
    write_level,
)
from tasklet.peer.timing import now

RUN, SECRET = "shard-run", "members only"
LARGEST_ENTRY = 11_776  # bytes of the largest honest peers entry as it travels (subkey, sealed and signed value)


def test_a_writer_s_shard_and_suffix_follow_its_level_and_levels_double() -> None:
    for level in (1, 2, 4, 8, 16, 32, 64):
        assert suffix_level(level_suffix(level)) == level
        assert 0 <= shard_of(f"{level:020x}", level) < level
    for bad in (b"@", b"@3", b"@128", b"@0", b"@02x", b"x", b"@-2", b"@1"):
        assert suffix_level(bad) is None, bad
    assert list(next_shards(1)) == [1] and list(next_shards(4)) == [4, 5, 6, 7]
    assert list(next_shards(MAX_SHARDS)) == []
    assert shard_name("peers", 0) == "peers" and shard_name("peers", 9) == "peers/9"
    spread = {shard_of(f"{i:020x}", MAX_SHARDS) for i in range(2000)}
    assert len(spread) == MAX_SHARDS  # evenly spread: every shard gets writers
    writers = [f"{i:020x}" for i in range(1000)]
    assert write_level(writers[:CROWDED_ENTRIES]) == 1 and write_level(writers[:CROWDED_ENTRIES + 1]) == 2
    assert write_level(writers) in (8, 16) and not crowded(writers, write_level(writers))


def test_the_shards_hold_ten_thousand_of_the_largest_adverts_before_a_reply_could_pass_the_limit() -> None:
    full = peers_at_limit(LARGEST_ENTRY, MAX_KEY_BYTES)  # the fullest shard starts refusing honest adverts
    over = peers_at_limit(LARGEST_ENTRY, P2PD_REPLY_BYTES)  # a reply would pass 4 MiB, were there no budget
    single = peers_at_limit(LARGEST_ENTRY, P2PD_REPLY_BYTES, shards=1)
    print(f"largest adverts: a shard full at {full} peers, a reply over 4 MiB at {over}; one key: {single}")
    assert 10_000 <= full < over
    assert single < 400  # what one key held


def _entry(shard: int, writer: Identity, payload: dict, expires_at: float, suffix: bytes) -> DHTRecord:
    mac = seal(record_key(SECRET, RUN), RUN, "peers", writer.peer_id, suffix, expires_at, payload)
    return DHTRecord(DHTID.generate(source=f"{RUN}:{shard_name('peers', shard)}").to_bytes(),
                     MSGPackSerializer.dumps(writer.owner_tag + suffix),
                     MSGPackSerializer.dumps({"p": payload, "mac": mac}), expires_at)


def test_an_entry_is_stored_only_in_its_writer_s_shard_of_the_level_its_suffix_names() -> None:
    guard = RunRecordValidator(RUN, record_key(SECRET, RUN))
    writer, at = Identity.generate(), now() + 30
    payload = padded_advert(writer)
    for level in (1, 2, 8, 64):
        assert guard.validate(_entry(shard_of(writer.peer_id, level), writer, payload, at, level_suffix(level)))
    elsewhere = next(s for s in range(MAX_SHARDS) if s != shard_of(writer.peer_id, 64))
    assert not guard.validate(_entry(elsewhere, writer, payload, at, level_suffix(64)))
    assert not guard.validate(_entry(0, writer, payload, at, b"@3"))
    assert guard.refused == {"a shard of another writer": 1, "not a level suffix": 1}


class _Clock:
    """The in-memory DHT's clock: virtual seconds from the wall clock on, a tick further on each reading (so a
    store arrives before the next read)."""

    def __init__(self) -> None:
        self.at = now()

    def __call__(self) -> float:
        self.at += 1e-4
        return self.at


def _largest(peer_id: str) -> dict:
    """A stand-in for the largest honest peers entry (the in-memory DHT checks no schema): its size, its writer."""
    return {"advert": {"peer_id": peer_id, "pad": "x" * 8000}, "at": now(), "found": [f"{i:020x}" for i in range(100)]}


def _grow(size: int, batch: int, every_s: float = 20.0) -> tuple[MemoryDHT, _Clock, RecordStore, list[int]]:
    """Peers join ``batch`` every ``every_s`` (virtual): each round a reader reads ``peers`` (as a joiner or a
    heartbeat would) and every peer so far stores its largest advert, living 60 s, at the level that read reached
    (a heartbeat's re-store). Returns the DHT, its clock, the reader and the levels it reached."""
    clock = _Clock()
    dht = MemoryDHT(clock, LatencyModel(np.zeros((1, 1))), n_nodes=size)
    reader = RecordStore(dht.handle("reader", 0), RUN, SimIdentity(0, -1), None)
    writers: list[RecordStore] = []
    levels = []
    for start in range(0, size, batch):
        clock.at += every_s
        assert reader.read("peers") is not None
        levels.append(reader.levels["peers"])
        writers += [RecordStore(dht.handle(f"p{i}", 0), RUN, SimIdentity(0, i), None)
                    for i in range(start, min(size, start + batch))]
        for writer in writers:
            writer.levels["peers"] = levels[-1]
            assert writer.put("peers", _largest(writer.identity.peer_id), clock.at + 60)
    clock.at += 1.0
    return dht, clock, reader, levels


def test_a_swarm_grown_to_ten_thousand_largest_adverts_reads_back_whole_within_every_key_s_budget() -> None:
    dht, clock, reader, levels = _grow(10_000, 2000)
    records = reader.read("peers")
    assert records is not None and len({r.owner for r in records}) == 10_000
    assert reader.levels["peers"] == MAX_SHARDS and levels[0] == 1 and levels == sorted(levels)
    sizes = {key: sum(item.nbytes for item in entries.values() if item.expiration_time >= clock.at)
             for key, entries in dht._data.items()}  # noqa: SLF001 - what each key holds is the point
    print(f"levels as it grew: {levels}; the fullest shard: {max(sizes.values()) / 2**20:.2f} MiB")
    assert len(sizes) == MAX_SHARDS and max(sizes.values()) < MAX_KEY_BYTES


def test_a_swarm_that_shrinks_goes_back_to_one_key_and_a_joiner_sees_every_live_peer_on_the_way() -> None:
    dht, clock, reader, _ = _grow(3000, 1000)
    assert reader.levels["peers"] >= 16
    stay = [RecordStore(dht.handle(f"p{i}", 0), RUN, SimIdentity(0, i), None) for i in range(100)]
    seen = []
    for _ in range(5):  # 100 stay; the others' adverts expire within 60 s
        clock.at += 20.0
        assert stay[0].read("peers") is not None  # one read stands for each stayer's own: they read the same
        for writer in stay:
            writer.levels["peers"] = stay[0].levels["peers"]
            assert writer.put("peers", _largest(writer.identity.peer_id), clock.at + 60)
        joiner = RecordStore(dht.handle("joiner", 0), RUN, SimIdentity(1, 0), None)  # starts at one key
        records = joiner.read("peers")
        assert records is not None and {w.identity.peer_id for w in stay} <= {r.owner for r in records}
        seen.append((len(records), joiner.levels["peers"], joiner.ops.snapshot()["get:peers"]))
    print(f"after the shrink, a fresh joiner each round (peers, level, gets): {seen}")
    assert seen[-1] == (100, 1, 1)  # back to one key once the departed adverts expired


def test_a_follower_refused_at_a_level_the_swarm_left_reads_again_and_writes_where_readers_look() -> None:
    dht, clock, reader, _ = _grow(600, 600)
    full = f"{RUN}:peers"  # shard 0 is full: nothing more is stored there (a node's key budget)
    refuse = dht.store

    def store(caller: str, key: str, value: object, expiration_time: float, subkey: bytes) -> bool:
        return key != full and refuse(caller, key, value, expiration_time, subkey)

    dht.store = store  # type: ignore[method-assign]
    index = next(i for i in range(1000, 2000) if shard_of(SimIdentity(0, i).peer_id, 4) != 0)
    follower = RecordStore(dht.handle("follower", 0), RUN, SimIdentity(0, index), None)  # never read: level 1
    assert follower.put("peers", _largest(follower.identity.peer_id), clock.at + 60)
    assert follower.levels["peers"] >= 4 and follower.ops.snapshot()["store:peers"] == 2
    clock.at += 1.0  # the store arrives
    records = reader.read("peers")
    assert records is not None and follower.identity.peer_id in {r.owner for r in records}
    gets = follower.ops.snapshot()["get:peers"]
    dht.store = lambda *args: False  # type: ignore[assignment, method-assign]
    assert not follower.put("peers", _largest(follower.identity.peer_id), clock.at + 62)
    assert follower.ops.snapshot()["get:peers"] == gets  # no read again within LEVEL_REREAD_S


def test_a_small_swarm_reads_one_key() -> None:
    _, _, reader, levels = _grow(4, 4)
    gets = reader.ops.snapshot()
    records = reader.read("peers")
    assert records is not None and len(records) == 4 and reader.levels["peers"] == 1 and levels == [1]
    assert reader.ops.snapshot()["get:peers"] - gets["get:peers"] == 1


@pytest.mark.usefixtures("processes")
@pytest.mark.light_processes
@pytest.mark.timeout(240)
def test_more_of_the_largest_adverts_than_one_key_holds_are_stored_and_read_through_real_nodes(
        tmp_path: Path) -> None:
    ids = [Identity.generate() for _ in range(2)]
    first = start_dht(DHTConfig(), ids[0], [RunRecordValidator(RUN, record_key(SECRET, RUN))])
    second = start_dht(DHTConfig(initial_peers=tuple(visible_maddrs(first))), ids[1],
                       [RunRecordValidator(RUN, record_key(SECRET, RUN))])
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    reader = RecordStore(second, RUN, ids[1], SECRET)

    def crowd(count: int, level: int) -> dict:
        done = subprocess.run(
            [sys.executable, "-m", "tasklet.peer.emulation.doors_attack", "peers-crowd", visible_maddrs(first)[0],
             RUN, str(secret), "--count", str(count), "--level", str(level), "--seconds", "90"],
            stdout=subprocess.PIPE, text=True, env=child_env(), timeout=150, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    try:
        batch = CROWDED_ENTRIES + 22
        first_batch = crowd(batch, 1)  # more than a crowded shard: a reader goes one level on
        first_read = reader.get_all("peers")
        first_level = reader.levels["peers"]
        second_batch = crowd(batch, first_level)  # the next joiners write where the read stopped
        second_read = reader.get_all("peers")
    finally:
        second.shutdown()
        first.shutdown()
    print(f"stored: {first_batch['stored']}, then {second_batch['stored']}; levels {first_level}, "
          f"{reader.levels['peers']}")
    assert first_batch["stored"] == {"0": batch}, first_batch
    assert first_read is not None and len(first_read) == batch and first_level == 2
    assert sum(second_batch["stored"].values()) == batch and set(second_batch["stored"]) == {"0", "1"}
    # 300 of the largest adverts: 3.4 MiB, past what one key holds (3 MiB), every one read back
    assert second_read is not None and len({r.owner for r in second_read}) == 2 * batch
    assert 2 * batch * LARGEST_ENTRY > MAX_KEY_BYTES and reader.levels["peers"] == 4
