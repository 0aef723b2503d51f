"""What a volunteer's DHT node stores, in-process: only the run's keys, each kind in its schema (the validator),
and each key within its byte and entry budgets, in all, per owner and over every key (the storage)."""

from __future__ import annotations

import time

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.identity.certs import make_certificate, pem_to_text
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.dht import BudgetedStorage, KeyBudget, StorageBudget
from tasklet.peer.swarm.records import (
    MAX_ADVERT_VALUE_BYTES,
    MAX_KEY_BYTES,
    MAX_SUBKEYS_PER_OWNER,
    MAX_VALUE_BYTES,
    RECORD_TTL_S,
    RunRecordValidator,
    record_key,
    seal,
)
from tasklet.peer.swarm.shards import key_names
from tasklet.peer.timing import now

RUN = "budget-run"
KEY = record_key("open sesame", RUN)


def _key(name: str, run: str = RUN) -> bytes:
    return DHTID.generate(source=f"{run}:{name}").to_bytes()


def _record(name: str, writer: Identity | None, payload: dict, expires_at: float, key: bytes | None = KEY,
            suffix: bytes = b"", mac: str | None = "auto", run: str = RUN) -> DHTRecord:
    """A DHT entry as a hivemind node hands it to the validator (signature already stripped)."""
    owner = writer.peer_id if writer is not None else "x"
    if mac == "auto":
        mac = None if key is None else seal(key, RUN, name, owner, suffix, expires_at, payload)
    subkey = (writer.owner_tag if writer is not None else b"") + suffix
    value = MSGPackSerializer.dumps({"p": payload, "mac": mac})
    return DHTRecord(_key(name, run), MSGPackSerializer.dumps(subkey), value, expires_at)


def _advert(identity: Identity, **changes: object) -> dict:
    device = DeviceInfo("cpu", "cpu", 2**30, 0.1, True, False)
    advert = Advert(identity.peer_id, "127.0.0.1:4000", device, now(), cert=pem_to_text(make_certificate(identity)))
    return {"advert": {**advert.to_record(), **changes}, "at": now(), "found": []}


def test_only_the_run_s_keys_are_stored() -> None:
    guard = RunRecordValidator(RUN, KEY)
    writer, at = Identity.generate(), now()
    assert guard.validate(_record("plans", writer, {"a": 1}, at + 6))
    assert not guard.validate(_record("plans", writer, {"a": 1}, at + 6, run="another-run"))
    junk = DHTRecord(DHTID.generate(source="random key").to_bytes(), MSGPackSerializer.dumps(None), b"x" * 2**20,
                     at + 10**6)
    assert not guard.validate(junk)
    assert guard.refused == {"not a key of this run": 2}
    assert set(guard.storage_budget().keys) == {_key(stored) for name in RECORD_TTL_S for stored, _ in key_names(name)}


def test_the_validator_refuses_what_may_not_be_stored_under_the_run_keys() -> None:
    guard = RunRecordValidator(RUN, KEY)
    writer, at = Identity.generate(), now()
    assert guard.validate(_record("plans", writer, {"a": 1}, at + 6))
    for name in RECORD_TTL_S:
        assert not guard.validate(_record(name, None, {"a": 1}, at + 6)), f"untagged under {name}"
    assert not guard.validate(_record("plans", writer, {"a": 1}, at + 6, mac=None))
    assert not guard.validate(_record("plans", writer, {"a": 1}, at + 6, record_key("guess", RUN)))
    assert not guard.validate(_record("plans", writer, {"a": "x" * MAX_VALUE_BYTES}, at + 6))
    assert not guard.validate(_record("beat", writer, {"a": 1}, at + 10**6))
    assert not guard.validate(_record("plans", writer, {"a": 1}, at + RECORD_TTL_S["plans"] + 3600))
    assert guard.validate(_record("plans", writer, {"a": 1}, at + RECORD_TTL_S["plans"]))
    assert guard.validate(_record("plans", writer, {"e": 1}, at + 60, suffix=b"|epoch=1"))
    assert not guard.validate(_record("beat", writer, {"e": 1}, at + 60, suffix=b"|more"))  # one beat per writer
    assert guard.refused == {"no owner tag": len(RECORD_TTL_S), "no seal": 1, "bad seal": 1, "value too large": 1,
                             "expiry beyond the record's lifetime": 2, "a second subkey of this owner": 1}
    open_guard = RunRecordValidator(RUN, None)
    assert open_guard.validate(_record("beat", writer, {"a": 1}, at + 6, None))
    assert not open_guard.validate(_record("beat", None, {"a": 1}, at + 6, None))
    assert not open_guard.validate(_record("beat", writer, {"a": 1}, at + 6))  # a seal in an open swarm


def test_a_peers_entry_is_exactly_its_writer_s_advert_or_tombstone() -> None:
    guard = RunRecordValidator(RUN, KEY)
    writer, other, at = Identity.generate(), Identity.generate(), now()
    assert guard.validate(_record("peers", writer, _advert(writer), at + 6))
    assert guard.validate(_record("peers", writer, {"left": True, "at": at}, at + 6))
    bad = {
        "extra field": {**_advert(writer), "more": 1},
        "missing found": {k: v for k, v in _advert(writer).items() if k != "found"},
        "another's advert": _advert(other),
        "bad advert": _advert(writer, endpoint="not an endpoint"),
        "unknown advert field": _advert(writer, colour="red"),
        "found not ids": {**_advert(writer), "found": [1, 2]},
        "found too long": {**_advert(writer), "found": ["a" * 20] * 257},
        "left false": {"left": False, "at": at},
        "at not a number": {"left": True, "at": "now"},
        "padding": _advert(writer, extra={"pad": "x" * 4000}) | {"found": ["b" * 64] * 256},
    }
    for what, payload in bad.items():
        assert not guard.validate(_record("peers", writer, payload, at + 6)), what
    assert len(MSGPackSerializer.dumps({"p": _advert(writer), "mac": "0" * 64})) < MAX_ADVERT_VALUE_BYTES // 4


def _budgeted(max_bytes: int = 10_000, owner_bytes: int = 4_000, entries: int = 8, owner_entries: int = 3,
              total: int = 12_000) -> tuple[BudgetedStorage, list[DHTID]]:
    keys = [_key("plans"), _key("links")]
    budget = KeyBudget(max_bytes=max_bytes, max_entries=entries, owner_bytes=owner_bytes, owner_entries=owner_entries)
    return BudgetedStorage(StorageBudget({k: budget for k in keys}, total)), [DHTID.from_bytes(k) for k in keys]


def test_the_storage_keeps_each_key_within_its_budget_in_all_and_per_owner() -> None:
    storage, (plans, links) = _budgeted()
    owners = [Identity.generate().owner_tag for _ in range(5)]
    at = get_dht_time()
    assert not storage.store(plans, b"plain", at + 60)
    assert not storage.store_subkey(DHTID.generate(source="foreign"), owners[0], b"x", at + 60)
    assert not storage.store_subkey(plans, b"untagged", b"x", at + 60)
    value = b"v" * 1000  # + a subkey of about 400 bytes
    assert all(storage.store_subkey(plans, owners[0] + b"%d" % i, value, at + 60) for i in range(2))
    assert not storage.store_subkey(plans, owners[0] + b"2", value * 2, at + 60)  # its owner's bytes
    assert storage.store_subkey(plans, owners[0] + b"2", b"v", at + 60)
    assert not storage.store_subkey(plans, owners[0] + b"3", b"v", at + 60)  # its owner's entries
    assert storage.store_subkey(plans, owners[0] + b"1", b"w" * 1500, at + 61)  # a later expiry replaces
    assert not storage.store_subkey(plans, owners[0] + b"1", b"w" * 1000, at + 61)  # an equal one does not
    for owner in owners[1:3]:
        assert storage.store_subkey(plans, owner, value * 2, at + 60)
    assert not storage.store_subkey(plans, owners[3], value * 2, at + 60)  # the key's bytes
    used = storage._usage[plans]
    assert used.bytes == sum(len(k) + len(v) for k, (v, _) in storage.get(plans).value.items()) <= 10_000
    assert storage.store_subkey(links, owners[4], value * 2, at + 60)
    assert not storage.store_subkey(links, owners[3], value * 2, at + 60)  # every key together
    assert storage.total_bytes <= 12_000
    assert set(storage.refused) == {"plain value", "not a key of this node's run", "no owner tag", "owner bytes",
                                    "owner entries", "key bytes", "total bytes"}


def test_expired_entries_give_their_budget_back() -> None:
    storage, (plans, _) = _budgeted(entries=3, owner_entries=3)
    owner = Identity.generate().owner_tag
    at = get_dht_time()
    assert storage.store_subkey(plans, owner + b"0", b"v", at + 0.3)
    assert all(storage.store_subkey(plans, owner + b"%d" % i, b"v", at + 60) for i in (1, 2))
    assert not storage.store_subkey(plans, owner + b"3", b"v", at + 60)
    time.sleep(1.1)  # the first expires, and the prune (once a second) runs again
    assert storage.store_subkey(plans, owner + b"3", b"v", get_dht_time() + 60)
    assert len(storage._usage[plans].entries) == 3


def test_re_stores_of_one_entry_do_not_grow_the_storage() -> None:
    storage, (plans, _) = _budgeted()
    owner = Identity.generate().owner_tag
    at = get_dht_time()
    for i in range(5000):
        assert storage.store_subkey(plans, owner, b"v", at + 60 + i * 1e-3)
    assert len(storage.expiration_heap) < 200 and len(storage.get(plans).value.expiration_heap) < 200


def test_the_run_s_budget_holds_a_reply_under_p2pd_s_limit() -> None:
    budget = RunRecordValidator(RUN, KEY).storage_budget()
    framing = 25 * 4096 + 8 * 80 + 1024  # msgpack per entry, the nearest peers, protobuf
    assert all(b.max_bytes + framing < 4 * 2**20 for b in budget.keys.values())
    # a writer of a sharded kind holds two entries of a key while it moves a level (peer.swarm.shards)
    assert budget.keys[_key("peers")].owner_entries == 2 and budget.keys[_key("run")].owner_entries == 1
    assert budget.keys[_key("plans")].owner_entries == 64
    assert MAX_SUBKEYS_PER_OWNER * budget.keys[_key("plans")].owner_entries >= 64
    # the total never binds before a key's or a sharded kind's own budget: one kind cannot starve another
    ungrouped = sum(1 for b in budget.keys.values() if not b.group)
    assert budget.total_bytes >= ungrouped * MAX_KEY_BYTES + sum(budget.group_bytes.values())
    assert set(budget.group_bytes) == {b.group for b in budget.keys.values() if b.group} == {"peers", "links"}


def test_the_schema_s_found_bound_is_membership_s() -> None:
    from tasklet.peer.swarm.membership import MAX_FOUND
    from tasklet.peer.swarm.records import MAX_FOUND_IDS

    assert MAX_FOUND_IDS == MAX_FOUND


def test_once_the_writers_are_known_only_they_store_the_leader_s_keys() -> None:
    """Free identities with the join secret could fill a leader's key until no plan is stored: once the daemon
    knows whom the organiser lets lead, the steward keys take their entries only, and drop what others stored."""
    keys = [_key("plans"), _key("peers")]
    budget = KeyBudget(max_bytes=10_000, max_entries=8, owner_bytes=4_000, owner_entries=3)
    storage = BudgetedStorage(StorageBudget({k: budget for k in keys}, 20_000, steward_keys=frozenset(keys[:1])))
    plans, peers = (DHTID.from_bytes(k) for k in keys)
    steward, member = Identity.generate(), Identity.generate()
    at = get_dht_time()
    assert storage.store_subkey(plans, member.owner_tag + b"0", b"v" * 500, at + 60)  # nobody named yet: any owner
    assert storage.store_subkey(plans, steward.owner_tag + b"0", b"v" * 500, at + 60)
    before = storage.total_bytes
    assert storage.restrict(frozenset({steward.peer_id})) == 1
    assert {k for k, _ in storage.get(plans).value.items()} == {steward.owner_tag + b"0"}
    assert storage.total_bytes < before and storage._usage[plans].owner_entries == {steward.peer_id: 1}
    assert not storage.store_subkey(plans, member.owner_tag + b"1", b"v", at + 60)
    assert storage.refused["not a steward of this run"] == 1
    assert storage.store_subkey(plans, steward.owner_tag + b"1", b"v", at + 60)
    assert storage.store_subkey(peers, member.owner_tag, b"v", at + 60)  # a member's own kinds stay open to it
    assert storage.restrict(None) == 0  # a swarm that elects: any owner again
    assert storage.store_subkey(plans, member.owner_tag + b"1", b"v", at + 60)


def test_the_leader_s_kinds_are_the_run_s_steward_keys() -> None:
    from tasklet.peer.swarm.records import STEWARD_KINDS

    budget = RunRecordValidator(RUN, KEY).storage_budget()
    assert budget.steward_keys == {_key(name) for name in STEWARD_KINDS}
    assert {"plans", "beat", "progress", "stewards"} == STEWARD_KINDS
