"""The kinds every member writes are sharded by the writer's peer id, so no read of the run's keys exceeds p2pd's
4 MiB reply limit up to 10,000 peers (issue #51).

In-process: the arithmetic (the largest honest ``peers`` entry, the shards, the swarm size at which a reply would
pass 4 MiB, what a node holds at 10,000 peers) and the validator's refusal of an entry under another owner's
shard. Over real hivemind DHT nodes: 10,000 signed adverts of the largest honest size read back completely by a
fresh reader, every find reply for every shard measured under 4 MiB, an advert under a wrong shard refused, and
one identity's 64 large subkeys leaving every other shard's reply as it was.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial

import hivemind
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.identity.certs import make_certificate, pem_to_text
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import MAX_EXTRA_BYTES, Advert
from tasklet.peer.swarm.dht import DHTConfig, StorageBudget, start_dht, visible_maddrs
from tasklet.peer.swarm.membership import Membership
from tasklet.peer.swarm.records import (
    ENTRY_FRAMING_BYTES,
    MAX_ADVERT_VALUE_BYTES,
    MAX_FOUND_IDS,
    MAX_KEY_BYTES,
    MAX_KIND_BYTES,
    MAX_STORED_BYTES,
    MAX_SUBKEY_BYTES,
    P2PD_REPLY_BYTES,
    RECORD_TTL_S,
    REPLY_OVERHEAD_BYTES,
    SHARDED,
    SHARDS,
    RecordStore,
    RunRecordValidator,
    key_names,
    peers_at_limit,
    record_key,
    seal,
    shard_of,
    stored_name,
)
from tasklet.peer.timing import now

RUN, SECRET = "shards-run", "members only"
KEY = record_key(SECRET, RUN)
SWARM = 10_000  # the swarm size issue #51 asks every read to hold
SIGNATURE_TAG_BYTES = len(RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", b"x" * 344))  # RSA-2048
_OWNER_RE = re.compile(rb"\[owner:(ssh-rsa [A-Za-z0-9+/=]+)\]")


def _largest_advert(identity: Identity, index: int = 0) -> dict:
    """A ``peers`` payload as large as an honest peer's gets: its certificate, a 128-character device name, a
    relayed endpoint and a relay of its own, ``extra`` at the schema's 4 KiB and a full ``found`` list."""
    device = DeviceInfo("d" * 128, "cuda", 80 * 2**30, 989.5, True, False)
    host = f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}"
    pad = MAX_EXTRA_BYTES - len('{"compute_share":0.5,"pad":""}')
    advert = Advert(identity.peer_id, f"{identity.peer_id}@relay-{index}.example.org:4000", device, now() - 3600.0,
                    extra={"compute_share": 0.5, "pad": "x" * pad}, reachable=False, relay=f"{host}:4001",
                    cert=pem_to_text(make_certificate(identity)))
    found = [f"{(index * 7919 + i) % 2**80:020x}" for i in range(1, MAX_FOUND_IDS + 1)]
    return {"advert": advert.to_record(), "at": now(), "found": found}


def _entry_bytes(identity: Identity, payload: dict) -> int:
    """One ``peers`` entry as a find reply carries it: the msgpack'd subkey, the sealed envelope and hivemind's
    signature after it, and msgpack's framing of the entry."""
    subkey = MSGPackSerializer.dumps(identity.owner_tag)
    envelope = MSGPackSerializer.dumps({"p": payload, "mac": "0" * 64})
    return len(subkey) + len(envelope) + SIGNATURE_TAG_BYTES


# ---- the arithmetic ------------------------------------------------------------------------------------------


def test_the_shards_hold_ten_thousand_of_the_largest_honest_adverts() -> None:
    identity = Identity.generate()
    payload = _largest_advert(identity)
    Advert.from_record(payload["advert"])  # honest: the schema takes it
    entry = _entry_bytes(identity, payload)
    value = len(MSGPackSerializer.dumps({"p": payload, "mac": "0" * 64}))
    assert 10_000 < entry < 14_000 and value <= MAX_ADVERT_VALUE_BYTES, (entry, value)
    stored = peers_at_limit(entry, MAX_KEY_BYTES)  # where the storage starts refusing honest adverts
    reply = peers_at_limit(entry)  # where, without a key budget, a shard's reply would pass 4 MiB
    typical = peers_at_limit(3200)  # a typical advert: 2.2 KiB with its subkey and signature, 3.2 KiB
    print(f"largest honest entry {entry} B: {(MAX_KEY_BYTES - REPLY_OVERHEAD_BYTES) // entry} per shard, "
          f"{SHARDS} shards: {stored} peers before a shard is full, {reply} before a reply would pass 4 MiB; "
          f"typical: {typical}")
    assert SWARM <= stored < reply
    assert SHARDS * (MAX_KEY_BYTES // entry) >= SWARM * 1.4  # the even split, with 40 % for the fullest shard
    # the fullest shard is taken 4 standard deviations above the mean: check that against the real hash split
    ids = [Identity.generate().peer_id for _ in range(8)] + [f"{random.Random(i).getrandbits(80):020x}"
                                                              for i in range(SWARM)]
    fullest = max(Counter(shard_of(peer_id) for peer_id in ids).values())
    assert fullest * (entry + ENTRY_FRAMING_BYTES) + REPLY_OVERHEAD_BYTES < MAX_KEY_BYTES, fullest
    # the limits themselves: whatever is stored, one key's reply stays under p2pd's limit
    assert MAX_KEY_BYTES + 4096 * ENTRY_FRAMING_BYTES + REPLY_OVERHEAD_BYTES < P2PD_REPLY_BYTES
    # and the schema's own bound on a peers entry (16 KiB, a 2 KiB subkey) still leaves 10,000 peers room
    assert peers_at_limit(MAX_ADVERT_VALUE_BYTES + SIGNATURE_TAG_BYTES + MAX_SUBKEY_BYTES) >= SWARM


def test_peers_at_limit_grows_with_the_shards_and_shrinks_with_the_entry() -> None:
    assert peers_at_limit(12_000, shards=1) == (P2PD_REPLY_BYTES - REPLY_OVERHEAD_BYTES) // 12_032 + 1
    assert peers_at_limit(12_000, shards=32) < peers_at_limit(12_000) < peers_at_limit(12_000, shards=128)
    assert peers_at_limit(3_000) > 4 * peers_at_limit(12_000) * 0.9
    one_key = peers_at_limit(2_200, shards=1)  # before sharding: the whole swarm's adverts in one reply
    assert 1_500 < one_key < 2_000, one_key


def test_what_a_node_holds_at_ten_thousand_peers_fits_its_budget() -> None:
    """Each key lives on hivemind's 5 nodes nearest to it (XOR): place the run's keys among 10,000 random node
    ids and count, for the node that holds most, its shards of each sharded kind."""
    rng = random.Random(51)
    nodes = sorted(rng.getrandbits(160) for _ in range(SWARM))
    held: dict[int, Counter[str]] = {}
    for name in RECORD_TTL_S:
        for stored in key_names(name):
            key = DHTID.generate(source=f"{RUN}:{stored}")
            for node in sorted(nodes, key=lambda n, k=key: n ^ k)[:5]:
                held.setdefault(node, Counter())[name] += 1
    most_of_a_kind = max(max(c[name] for c in held.values()) for name in SHARDED)
    most_keys = max(sum(c.values()) for c in held.values())
    print(f"{len(held)} of {SWARM} nodes hold a key; at most {most_keys} keys, {most_of_a_kind} shards of one kind")
    assert most_of_a_kind * MAX_KEY_BYTES <= MAX_KIND_BYTES  # every shard it holds may be full
    assert most_keys * MAX_KEY_BYTES <= MAX_STORED_BYTES


# ---- the validator ---------------------------------------------------------------------------------------------


def _record(stored: str, writer: Identity, payload: dict, expires_at: float, name: str = "peers",
            suffix: bytes = b"") -> DHTRecord:
    mac = seal(KEY, RUN, name, writer.peer_id, suffix, expires_at, payload)
    return DHTRecord(DHTID.generate(source=f"{RUN}:{stored}").to_bytes(),
                     MSGPackSerializer.dumps(writer.owner_tag + suffix),
                     MSGPackSerializer.dumps({"p": payload, "mac": mac}), expires_at)


def test_an_entry_under_another_owner_s_shard_is_refused() -> None:
    guard = RunRecordValidator(RUN, KEY)
    writer, at = Identity.generate(), now()
    own, other = shard_of(writer.peer_id), (shard_of(writer.peer_id) + 1) % SHARDS
    payloads = {"peers": _largest_advert(writer), "links": {"links": [], "at": at},
                "run": {"config": {}, "created_at": at}, "stewards": {"revision": 1}}
    for name in sorted(SHARDED):
        suffix = b"/1" if name == "stewards" else b""
        assert guard.validate(_record(f"{name}/{own}", writer, payloads[name], at + 30, name, suffix)), name
        assert not guard.validate(_record(f"{name}/{other}", writer, payloads[name], at + 30, name, suffix)), name
        assert not guard.validate(_record(name, writer, payloads[name], at + 30, name, suffix)), name  # unsharded
    assert guard.refused == {"a shard of another owner": 4, "not a key of this run": 4}
    # every earlier refusal still holds in the writer's own shard
    assert not guard.validate(_record(f"peers/{own}", writer, {**payloads["peers"], "x": 1}, at + 30))
    assert not guard.validate(_record(f"peers/{own}", writer, payloads["peers"], at + 30, suffix=b"|2"))
    assert not guard.validate(_record(f"peers/{own}", writer, payloads["peers"], at + 10**6))
    assert guard.refused["peers: not exactly advert, at and found"] == 1
    assert guard.refused["a second subkey of this owner"] == 1
    assert guard.refused["expiry beyond the record's lifetime"] == 1
    assert stored_name("peers", writer.peer_id) == f"peers/{own}" and stored_name("plans", writer.peer_id) == "plans"


# ---- over real DHT nodes -----------------------------------------------------------------------------------------


def _identities(n: int) -> list[Identity]:
    """``n`` distinct RSA-2048 identities in seconds: keys made of pairs from a pool of 1024-bit primes (valid
    keys hivemind signs and verifies with; sharing primes makes them worthless outside a test)."""
    pool: list[int] = []
    while len(pool) * (len(pool) - 1) // 2 < n:
        numbers = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_numbers()
        pool += [numbers.p, numbers.q]
    out = []
    for p, q in itertools.islice(itertools.combinations(pool, 2), n):
        d = pow(65537, -1, math.lcm(p - 1, q - 1))
        numbers = rsa.RSAPrivateNumbers(p, q, d, d % (p - 1), d % (q - 1), pow(q, -1, p),
                                        rsa.RSAPublicNumbers(65537, p * q))
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key._private_key = numbers.private_key(unsafe_skip_rsa_key_validation=True)
        out.append(Identity(key))
    return out


class _ManyKeysSigner(RSASignatureValidator):
    """hivemind's signature validator holding many identities' keys: signs each record with its owner's key (one
    writer process standing in for 10,000 peers, each of which signs its own advert)."""

    def __init__(self, identities: list[Identity]) -> None:
        super().__init__(identities[0].private_key)
        self._keys = {identity.public_key: identity.private_key for identity in identities}

    def sign_value(self, record: DHTRecord) -> bytes:
        match = _OWNER_RE.search(record.subkey)
        key = None if match is None else self._keys.get(match.group(1))
        if key is None:
            return record.value
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", key.sign(self._serialize_record(record)))


class _EveryShardValidator(RunRecordValidator):
    """The run's validator with a node budget for every key full: these three nodes stand for the replicas of all
    64 shards, which in a swarm of 10,000 are different nodes (each holds one to three of them)."""

    def storage_budget(self) -> StorageBudget:
        budget = super().storage_budget()
        return StorageBudget(budget.keys, sum(b.max_bytes for b in budget.keys.values()))


async def _store_batch(_dht: hivemind.DHT, node: hivemind.DHTNode, items: list[tuple]) -> int:
    """Runs in the writer's DHT process: store (key, subkey, envelope, expiry) items at once; how many were
    stored on at least one node."""
    keys, subkeys, values, expiries = (list(column) for column in zip(*items, strict=True))
    done = await node.store_many(keys, values, expiries, subkeys=subkeys)
    return sum(bool(ok) for ok in done.values())


async def _reply_bytes(_dht: hivemind.DHT, node: hivemind.DHTNode, keys: list[str]) -> dict[str, tuple[int, int]]:
    """Runs in a replica's DHT process: for each key, the size of the find reply this node sends when asked for
    that key, and of the value in it (the entries; the rest is the responder and its nearest peers)."""
    out = {}
    for key in keys:
        request = dht_pb2.FindRequest(keys=[DHTID.generate(source=key).to_bytes()])
        reply = await node.protocol.rpc_find(request, None)
        out[key] = (reply.ByteSize(), len(reply.results[0].value))
    return out


class Swarm:
    """Three replicas of the run's keys (our validator and budgeted storage), a writer holding every identity's
    key, and the adverts stored."""

    def __init__(self, n: int) -> None:
        started = time.monotonic()
        self.identities = _identities(n + 1)
        self.attacker = self.identities.pop()
        self.payloads = [_largest_advert(identity, i) for i, identity in enumerate(self.identities)]
        self.made_s = time.monotonic() - started
        self.replicas: list[hivemind.DHT] = []
        for _ in range(3):
            initial = tuple(visible_maddrs(self.replicas[0])) if self.replicas else ()
            self.replicas.append(start_dht(DHTConfig(initial_peers=initial), Identity.generate(),
                                           [_EveryShardValidator(RUN, KEY)]))
        self.maddrs = tuple(visible_maddrs(self.replicas[0]))
        self.writer = hivemind.DHT(initial_peers=list(self.maddrs), client_mode=True, start=True,
                                   record_validators=[_ManyKeysSigner([*self.identities, self.attacker])])
        self.keys = RecordStore(self.writer, RUN, None, SECRET)
        started = time.monotonic()
        expires = now() + RECORD_TTL_S["peers"]
        # the first through the record store, as a member's membership writes; the rest in batches
        for identity, payload in zip(self.identities[:16], self.payloads[:16], strict=True):
            assert RecordStore(self.writer, RUN, identity, SECRET, timeout_s=30.0).put("peers", payload, expires)
        items = [self.item(identity, payload, expires)
                 for identity, payload in zip(self.identities[16:], self.payloads[16:], strict=True)]
        self.stored = 16
        for at in range(0, len(items), 128):  # a store request stays well under the 4 MiB limit too
            self.stored += self.writer.run_coroutine(partial(_store_batch, items=items[at:at + 128]))
        self.store_s = time.monotonic() - started

    def item(self, identity: Identity, payload: dict, expires: float, stored: str | None = None,
             suffix: bytes = b"", name: str = "peers") -> tuple:
        """A sealed (key, subkey, envelope, expiry) of ``identity``, under its own shard unless ``stored``."""
        mac = seal(KEY, RUN, name, identity.peer_id, suffix, expires, payload)
        key = self.keys.key_of(name, identity.peer_id) if stored is None else self.keys.key(stored)
        return key, identity.owner_tag + suffix, {"p": payload, "mac": mac}, expires

    def replies(self, name: str = "peers") -> list[dict[str, tuple[int, int]]]:
        """Each replica's find reply size, and its value's, for each shard key of ``name``."""
        keys = self.keys.keys(name)
        return [dht.run_coroutine(partial(_reply_bytes, keys=keys)) for dht in self.replicas]

    def close(self) -> None:
        self.writer.shutdown()
        for dht in reversed(self.replicas):
            dht.shutdown()


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    made = Swarm(SWARM)
    try:
        yield made
    finally:
        made.close()


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(600)
def test_ten_thousand_largest_adverts_are_read_back_with_every_reply_under_4_mib(swarm: Swarm) -> None:
    assert swarm.stored == SWARM
    replies = swarm.replies()
    biggest = max(size for r in replies for size, _ in r.values())
    per_shard = Counter(shard_of(identity.peer_id) for identity in swarm.identities)
    reader_identity = Identity.generate()
    reader_dht = start_dht(DHTConfig(initial_peers=swarm.maddrs), reader_identity, [RunRecordValidator(RUN, KEY)])
    try:
        started = time.monotonic()
        reader = Membership(reader_dht, RUN, reader_identity, SECRET, timeout_s=240.0)
        entries = reader.live_entries()
        read_s = time.monotonic() - started
        ops = reader.store.ops.snapshot()
    finally:
        reader_dht.shutdown()
    print(f"{SWARM} identities and adverts made in {swarm.made_s:.0f} s, stored in {swarm.store_s:.0f} s, read in "
          f"{read_s:.0f} s; {min(per_shard.values())}-{max(per_shard.values())} per shard; largest find reply "
          f"{biggest / 2**20:.2f} MiB")
    assert all(len(r) == SHARDS for r in replies)
    assert biggest < P2PD_REPLY_BYTES and biggest < MAX_KEY_BYTES + 4096 * ENTRY_FRAMING_BYTES
    assert biggest > max(per_shard.values()) * 10_000  # the replies carry the adverts (not empty)
    assert sorted(e.advert.peer_id for e in entries) == sorted(i.peer_id for i in swarm.identities)
    assert ops["get:peers"] == SHARDS and ops["rows:peers"] == SWARM  # one get per shard, every advert once


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(300)
def test_an_advert_under_a_wrong_shard_is_not_stored(swarm: Swarm) -> None:
    identity = swarm.attacker
    wrong = f"peers/{(shard_of(identity.peer_id) + 1) % SHARDS}"
    expires = now() + 30
    stored = swarm.writer.run_coroutine(partial(_store_batch, items=[
        swarm.item(identity, _largest_advert(identity, SWARM), expires, stored=wrong)]))
    assert stored == 0
    found = RecordStore(swarm.replicas[1], RUN, None, SECRET, timeout_s=60.0).get_all("peers")
    assert found is not None and identity.peer_id not in {record.owner for record in found}


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(300)
def test_one_identity_s_64_large_subkeys_leave_every_other_shard_s_reply_as_it_was(swarm: Swarm) -> None:
    """A member (it has the secret: its entries are sealed) stores 64 subkeys of 255 KiB under every shard of
    ``peers`` and of ``stewards`` (the sharded kind that takes several subkeys of one owner)."""
    before = {name: swarm.replies(name) for name in ("peers", "stewards")}
    identity, expires = swarm.attacker, now() + 60
    own = shard_of(identity.peer_id)
    payload = {"pad": "x" * (255 << 10)}
    stored = 0
    for name, shard in itertools.product(("peers", "stewards"), range(SHARDS)):
        items = [swarm.item(identity, payload, expires, stored=f"{name}/{shard}", suffix=b"/%d" % i, name=name)
                 for i in range(64)]
        stored += sum(swarm.writer.run_coroutine(partial(_store_batch, items=items[at:at + 8]))
                      for at in range(0, len(items), 8))
    after = {name: swarm.replies(name) for name in ("peers", "stewards")}
    def values(replies: list[dict[str, tuple[int, int]]]) -> list[dict[str, int]]:
        return [{key: value for key, (_, value) in r.items()} for r in replies]

    assert stored == 1  # one entry under its own stewards shard: the owner's bytes take no second of 255 KiB
    assert values(after["peers"]) == values(before["peers"])  # not one shard's entries changed, its own included
    own_key = swarm.keys.key(f"stewards/{own}")
    for b, a in zip(values(before["stewards"]), values(after["stewards"]), strict=True):
        assert {key for key, n in a.items() if n != b[key]} == {own_key}
        assert a[own_key] < (256 << 10) + 4096
    assert max(size for r in after["peers"] + after["stewards"] for size, _ in r.values()) < P2PD_REPLY_BYTES
