"""Owner-signed, secret-sealed records of one run in the hivemind DHT.

Every record of a run lives under the key ``f"{run_id}:{name}"`` (``peers``, ``links``, ``plans``, ``run``,
``progress``) with a subkey ``owner_tag + suffix``: hivemind's ``RSASignatureValidator`` makes every DHT node
require the owner's signature over (key, subkey, value, expiry), so nobody can write under somebody else's
subkey or give an old record a new expiry, and readers take the writer's peer id from the tag (see
``peer.identity.keys``).

A swarm may also have a join secret. The secret itself never travels and is never stored: not in a record,
not in a log line. Each peer derives a record key from it,

    record_key = HMAC-SHA256(secret, "tasklet record key" | run_id)

and every record carries

    mac = HMAC-SHA256(record_key, run_id | key name | writer peer id | subkey suffix | expiry | canonical JSON)

so writing any record proves knowledge of the secret without revealing it, and readers drop every record
whose MAC does not verify: a peer without the secret is simply not seen (and sees nobody). The MAC binds
the writer and the expiry, so a sealed record copied out of the DHT cannot be re-stored under another
peer's subkey, another key or a fresh expiry (a replay); binding the key name and suffix stops it from
being moved to another key. Canonical JSON (sorted keys, no spaces, finite floats) is the same bytes on
every peer because the payload went through msgpack and back, which preserves str/int/float/bool/None/
list/dict exactly (and the expiry is the same float64 on every node).

Reading never trusts the network: a record that is not a well-formed envelope, whose MAC is wrong or
missing, or that is too large is skipped with a log line; the payload of a record whose MAC fails is never
returned; a read looks at no more than :data:`MAX_ENTRIES_READ` entries of a key. The caller's own schema
check comes after.

Storing does not trust it either. :class:`RunRecordValidator`, in every DHT node of ours, refuses any key that
is not one of the run's (a volunteer's DHT stores nothing else), and under the run's keys (before hivemind
stores anything) an entry without an owner tag (hivemind's own signature check passes an untagged one), one
whose MAC does not verify (a sealed swarm), a value over its kind's size (``peers``: 16 KiB), a second subkey
of one owner where a writer has one entry (``peers``, ``links``, ``run``, ``progress``, ``beat``), a ``peers``
entry that is not exactly the writer's own advert (or tombstone), and an expiry beyond the lifetime of its kind.
The node's storage (``peer.swarm.dht.BudgetedStorage``) then holds each key within a byte and entry budget, in
all and per owner, and all keys within :data:`MAX_STORED_BYTES`; once the daemon knows who the organiser lets lead,
the leader's kinds (:data:`STEWARD_KINDS`) take entries of those writers only. A key's budget is what one find reply can
carry (:data:`MAX_KEY_BYTES`): a ``peers`` entry of a typical peer is 2.2 KiB (7.6 KiB once its ``found`` list
names 256 peers), so a single ``peers`` key holds about 1,400 such peers (400 with full ``found`` lists); past
that, new adverts are refused and the ones stored stay readable, where before every read failed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from tasklet.peer.identity.keys import Identity, split_owner_subkey
from tasklet.peer.swarm import rendezvous
from tasklet.peer.swarm.canonical import canonical_json
from tasklet.peer.swarm.dht import DHT_OPS, DhtOps, KeyBudget, StorageBudget
from tasklet.peer.swarm.shards import (
    MAX_SHARDS,
    SHARDED,
    crowded,
    key_names,
    level_suffix,
    next_shards,
    shard_name,
    shard_of,
    suffix_level,
    write_level,
)
from tasklet.peer.timing import (
    ADVERT_TTL_HEARTBEATS,
    DHT_CALL_TIMEOUT_S,
    MAX_CLOCK_SKEW_S,
    MAX_HEARTBEAT_S,
    PLAN_TTL_S,
    PROGRESS_TTL_S,
    RUN_RECORD_MIN_TTL_S,
    now,
)

logger = logging.getLogger(__name__)

LEVEL_REREAD_S = 30.0  # a refused store of a sharded kind reads the kind again at most this often
INNER_TIMEOUT_SHARE = 0.95  # of a call's deadline, what its lookups and member nodes have inside the DHT process
# (a lookup cut off earlier than a plain get's, e.g. one waiting on the nodes of a partition's other side, missed
# adverts a plain get found)
MAX_PAYLOAD_BYTES = 256 * 1024
MAX_VALUE_BYTES = MAX_PAYLOAD_BYTES + 1024  # a stored envelope: the payload, its MAC and msgpack framing
MAX_SUBKEY_BYTES = 2048  # an owner tag (an RSA public key) and a short suffix
MAX_ENTRIES_READ = 4096  # a read looks at no more entries of one key than this (see RunRecordValidator)
MAX_SUBKEYS_PER_KEY = 4096  # live entries a DHT node of ours holds under one key of the run
MAX_SUBKEYS_PER_OWNER = 64  # of those, from one writer (plans: one per epoch within a plan's lifetime)
MAX_ADVERT_VALUE_BYTES = 16 * 1024  # a peers entry: the largest honest one is 11 KiB (full extra and found lists)
MAX_FOUND_IDS = 256  # peer ids in a peers entry's found list (peer.swarm.membership.MAX_FOUND)
SIGNATURE_BYTES = 512  # hivemind's "[signature:...]" after a stored value (an RSA-2048 signature: 356 bytes)
# Every key's entries travel in one find reply, which p2pd caps at 4 MiB (persistentConnMaxMsgSize): a key holds
# at most 3 MiB of subkeys and signed values, so with msgpack's framing (about 25 bytes an entry, 100 KiB for
# 4,096 entries) and the 8 nearest peers a reply stays under 3.2 MiB, whatever is stored.
MAX_KEY_BYTES = 3 * 1024 * 1024
# A node stores the keys it is among the nearest to. In a swarm of five nodes or fewer every node holds every key,
# and such a swarm's records are small; at 10,000 peers (64 shards of each sharded kind on hivemind's 5 replicas
# among 10,000 nodes) a node holds a given shard with odds of 3 %, three shards of one kind almost never.
MAX_KIND_BYTES = 3 * MAX_KEY_BYTES  # one sharded kind's keys together, on one node (no kind starves another)
MAX_STORED_BYTES = 36 * 1024 * 1024  # every key of the run together (two kinds of 9 MiB, five keys of 3 MiB: 33)
EXPIRY_SLACK_S = 30.0 + MAX_CLOCK_SKEW_S  # a writer's clock and the moment of its store may run ahead this much
_ADVERT_TTL_MAX = ADVERT_TTL_HEARTBEATS * MAX_HEARTBEAT_S
# the longest lifetime each kind of record is stored with (peer.swarm.membership, plans, progress)
RECORD_TTL_S = {
    "peers": _ADVERT_TTL_MAX,
    "links": max(_ADVERT_TTL_MAX, 30.0),
    "run": max(_ADVERT_TTL_MAX, RUN_RECORD_MIN_TTL_S),
    "plans": PLAN_TTL_S,
    "progress": PROGRESS_TTL_S,
    "beat": PROGRESS_TTL_S,
    "stewards": max(_ADVERT_TTL_MAX, RUN_RECORD_MIN_TTL_S),  # the organiser's additions (peer.swarm.charter)
}
# the largest value (as stored, before hivemind's signature) of each kind of record
RECORD_VALUE_BYTES = {name: MAX_ADVERT_VALUE_BYTES if name == "peers" else MAX_VALUE_BYTES for name in RECORD_TTL_S}
# the kinds a writer stores exactly one entry of: its subkey is its owner tag with no suffix
ONE_SUBKEY_PER_OWNER = frozenset({"peers", "links", "run", "progress", "beat"})
# the kinds only a leader (or the organiser) writes: where the organiser names who may lead, nobody else stores them
STEWARD_KINDS = frozenset({"plans", "progress", "beat", "stewards"})
_ENVELOPE_FIELDS = {"p", "mac"}


class MacStatus(Enum):
    OK = "ok"  # verifies with our secret, or neither side has a secret
    MISSING = "missing"  # we have a secret, the record has no MAC
    BAD = "bad"  # the record has a MAC that does not verify (wrong secret, or we have none)


@dataclass(frozen=True)
class SignedRecord:
    """One record as read: the writer's peer id (from its signed owner tag) and the payload.

    ``payload`` is ``{}`` unless ``mac_status`` is OK: what fails the MAC is never handed on.
    """

    owner: str
    suffix: bytes
    payload: dict
    expires_at: float
    mac_status: MacStatus


def record_key(secret: str, run_id: str) -> bytes:
    """The key that seals this run's records, derived from the join secret (which itself is never sent)."""
    return hmac.new(secret.encode(), b"tasklet record key\x00" + run_id.encode(), hashlib.sha256).digest()


def seal(key: bytes, run_id: str, name: str, writer: str, suffix: bytes, expires_at: float, payload: dict) -> str:
    """A record's MAC: binds run, key name, writer, suffix, expiry and payload (see the module docstring)."""
    parts = [run_id.encode(), name.encode(), writer.encode(), suffix, repr(float(expires_at)).encode()]
    message = b"\x00".join([b"tasklet record v2", *parts, canonical_json(payload)])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def open_envelope(value: object) -> tuple[dict, str | None]:
    """(payload, mac) of a stored ``{p, mac}`` envelope; ValueError for anything else or a payload too large."""
    if not isinstance(value, dict) or set(value) != _ENVELOPE_FIELDS:
        raise ValueError("not a {p, mac} envelope")
    payload, mac = value["p"], value["mac"]
    if not isinstance(payload, dict):
        raise ValueError("payload is not a dict")
    if mac is not None and not (isinstance(mac, str) and len(mac) == 64):
        raise ValueError("mac is not a 64-character hex string")
    if len(canonical_json(payload)) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload larger than {MAX_PAYLOAD_BYTES} bytes")
    return payload, mac


class RecordStore:
    """Reads and writes the records of one run for one identity.

    ``identity`` may be None for a read-only store. ``dht`` must have been started with
    ``identity.signature_validator()`` among its record validators (``peer.swarm.dht.start_dht`` does
    that), otherwise other nodes refuse our records as unsigned.
    Every DHT call waits at most ``timeout_s``.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        identity: Identity | None,
        secret: str | None,
        timeout_s: float = DHT_CALL_TIMEOUT_S,
    ):
        if not run_id or not isinstance(run_id, str) or len(run_id) > 128:
            raise ValueError(f"run_id must be a non-empty string of at most 128 characters, got {run_id!r}")
        if secret is not None and not secret:
            raise ValueError("secret must be a non-empty string or None")
        self.dht, self.run_id, self.identity, self.timeout_s = dht, run_id, identity, timeout_s
        self._record_key = None if secret is None else record_key(secret, run_id)
        self.ops = DhtOps()  # this store's gets and stores (also counted in the process-wide DHT_OPS)
        self.levels: dict[str, int] = {}  # sharded kind -> the level this writer writes it at (peer.swarm.shards)
        self.depths: dict[str, int] = {}  # sharded kind -> the level the next read of it starts at
        self._read_at: dict[str, float] = {}  # sharded kind -> when this store last read it (monotonic)

    def __repr__(self) -> str:  # never shows the record key
        return f"RecordStore(run_id={self.run_id!r}, sealed={self._record_key is not None})"

    def key(self, name: str) -> str:
        return f"{self.run_id}:{name}"

    def mac(self, name: str, writer: str, suffix: bytes, expires_at: float, payload: dict) -> str | None:
        """The record's MAC (None in an open swarm): binds run, key name, writer, suffix, expiry and payload."""
        if self._record_key is None:
            return None
        return seal(self._record_key, self.run_id, name, writer, suffix, expires_at, payload)

    def put(self, name: str, payload: dict, expires_at: float, suffix: bytes = b"") -> bool:
        """Store ``payload`` under our own subkey; False when the DHT refused or did not answer in time.

        The DHT keeps, per subkey, the value with the latest expiration: a put whose ``expires_at`` is not
        later than what is stored is refused (returns False).
        """
        if self.identity is None:
            raise ValueError("this record store is read-only (no identity to sign with)")
        encoded = canonical_json(payload)  # raises before anything is sent
        if len(encoded) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"{name} record is {len(encoded)} bytes, more than {MAX_PAYLOAD_BYTES}")
        expires_at = float(expires_at)
        if name not in SHARDED:
            return self._store(self.identity, name, self.key(name), suffix, payload, expires_at)
        if suffix:
            raise ValueError(f"{name}: one entry per writer, no suffix")
        level = self.levels.get(name, 1)
        if self._store_at_level(self.identity, name, level, payload, expires_at):
            return True
        # a writer that reads no adverts (a follower) may write at a level the swarm has left: a refused store
        # reads the kind again (at most every LEVEL_REREAD_S) and goes where that read says, once
        if time.monotonic() - self._read_at.get(name, float("-inf")) < LEVEL_REREAD_S or self.read(name) is None:
            return False
        moved = self.levels.get(name, 1)
        return moved != level and self._store_at_level(self.identity, name, moved, payload, expires_at)

    def _store_at_level(self, identity: Identity, name: str, level: int, payload: dict, expires_at: float) -> bool:
        """Store a sharded kind's entry in this writer's shard of ``level`` (peer.swarm.shards)."""
        key = self.key(shard_name(name, shard_of(identity.peer_id, level)))
        return self._store(identity, name, key, level_suffix(level), payload, expires_at)

    def _store(self, identity: Identity, name: str, key: str, suffix: bytes, payload: dict,
               expires_at: float) -> bool:
        envelope = {"p": payload, "mac": self.mac(name, identity.peer_id, suffix, expires_at, payload)}
        self._count("store", name)
        future = rendezvous.store(self.dht, key, identity.owner_tag + suffix, envelope, expires_at,
                                  INNER_TIMEOUT_SHARE * self.timeout_s)
        try:
            return bool(future.result(timeout=self.timeout_s))
        except TimeoutError:
            future.cancel()
            logger.warning("storing %s timed out after %.1f s", key, self.timeout_s)
            return False
        except Exception as error:  # the DHT process reports its own failures; the caller retries
            logger.warning("storing %s failed: %s: %s", key, type(error).__name__, error)
            return False

    def read(self, name: str, include_expired: bool = False) -> list[SignedRecord] | None:
        """Every well-formed, unexpired record under ``name`` with its MAC status (the payload only where the
        MAC verifies); None if the DHT timed out. ``include_expired`` keeps records that are expired by our own
        clock but still held by the DHT (the clock check at join compares clocks with them).

        A sharded kind (peer.swarm.shards) is read level by level within the one deadline, the shards of a level
        together; the level reached is where this store's writer then writes it. A writer's entries in several
        shards (it moved a level) count once, the latest. None only when no shard answered."""
        deadline = time.monotonic() + self.timeout_s
        at = float("-inf") if include_expired else now()
        level = self.depths.get(name, 1) if name in SHARDED else 1
        shards, answered, deepest = list(range(level)), False, 1
        records: list[SignedRecord] = []
        while shards:
            found = self._read_keys(name, shards, deadline)
            answered = answered or any(entries is not None for entries in found)
            for shard, entries in zip(shards, found, strict=True):
                records.extend(self._parse(self.key(shard_name(name, shard)), name, entries or {}, at))
            if name not in SHARDED or level >= MAX_SHARDS:
                break
            deepest = max([deepest, *(suffix_level(r.suffix) or 1 for r in records)])
            if deepest <= level and not crowded({r.owner for r in records}, level):
                break
            shards, level = list(next_shards(level)), 2 * level
        if not answered:
            return None
        if name in SHARDED:
            self._read_at[name] = time.monotonic()
            records = _latest_per_writer(records)
            self.levels[name] = write_level(r.owner for r in records)
            self.depths[name] = max(self.levels[name], deepest)
        self._count("rows", name, len(records))
        return records

    def _read_keys(self, name: str, shards: list[int], deadline: float) -> list[dict | None]:
        """The entries under each shard's key (one get each, issued together): None where it did not answer."""
        keys = [self.key(shard_name(name, shard)) for shard in shards]
        self._count("get", name, len(keys))
        futures = [rendezvous.read(self.dht, key, INNER_TIMEOUT_SHARE * self.timeout_s) for key in keys]
        out: list[dict | None] = []
        for key, future in zip(keys, futures, strict=True):
            try:
                found = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                future.cancel()
                logger.warning("reading %s timed out after %.1f s", key, self.timeout_s)
                out.append(None)
                continue
            except Exception as error:  # e.g. hivemind's storage heap comparing a str subkey with a bytes one
                logger.warning("reading %s failed: %s: %s", key, type(error).__name__, error)
                out.append(None)
                continue
            out.append(found or {})
        return out

    def _count(self, kind: str, name: str, n: int = 1) -> None:
        self.ops.add(kind, name, n)
        DHT_OPS.add(kind, name, n)

    def _parse(self, key: str, name: str, entries: dict, at: float) -> Iterator[SignedRecord]:
        for seen, (subkey, item) in enumerate(entries.items()):
            if seen >= MAX_ENTRIES_READ:
                logger.warning("%s holds more than %d entries; the rest are not read", key,
                               MAX_ENTRIES_READ)
                return
            owner = split_owner_subkey(subkey)
            if owner is None:
                logger.debug("%s: skipping a record without an owner tag", key)
                continue
            peer_id, suffix = owner
            expires_at = float(item.expiration_time)
            if expires_at < at:
                continue
            try:
                payload, mac = open_envelope(item.value)
                status = self._check_mac(name, peer_id, suffix, expires_at, payload, mac)
            except ValueError as error:
                logger.warning("%s: ignoring a malformed record from %s: %s", key, peer_id, error)
                continue
            yield SignedRecord(peer_id, suffix, payload if status is MacStatus.OK else {}, expires_at, status)

    def _check_mac(
        self, name: str, writer: str, suffix: bytes, expires_at: float, payload: dict, mac: str | None
    ) -> MacStatus:
        if self._record_key is None:
            return MacStatus.OK if mac is None else MacStatus.BAD
        if mac is None:
            return MacStatus.MISSING
        expected = self.mac(name, writer, suffix, expires_at, payload)
        return MacStatus.OK if hmac.compare_digest(expected or "", mac) else MacStatus.BAD

    def get_all(self, name: str) -> list[SignedRecord] | None:
        """The records under ``name`` that this swarm accepts (MAC checked); None if the DHT timed out."""
        records = self.read(name)
        if records is None:
            return None
        accepted = [rec for rec in records if rec.mac_status is MacStatus.OK]
        if len(accepted) < len(records):
            logger.debug("%s: dropped %d records with a missing or wrong join-secret MAC",
                         self.key(name), len(records) - len(accepted))
        return accepted


def _latest_per_writer(records: list[SignedRecord]) -> list[SignedRecord]:
    """A sharded kind's records, one per writer (the latest; one that moved a level left an older one behind),
    without the level suffix, which only says where the entry was stored."""
    latest: dict[str, SignedRecord] = {}
    for record in records:
        old = latest.get(record.owner)
        if old is None or record.expires_at > old.expires_at:
            latest[record.owner] = record
    return [dataclasses.replace(record, suffix=b"") for record in latest.values()]


class RunRecordValidator(RecordValidatorBase):
    """What a DHT node of ours accepts: the records of one run, each in its kind's schema (module docstring).

    hivemind runs it after its signature validator (``priority`` below that one's 10), on the value with the
    signature stripped, both when a node asks us to store an entry and on the entries a lookup of ours returns
    (one refused entry drops that node's whole answer for the key). It is stateless, so a lookup's answer is
    judged the same whatever this node has seen: what depends on what is already stored (the byte and count
    budgets of :data:`STORAGE_BUDGET`) is enforced by the node's storage (``peer.swarm.dht.BudgetedStorage``),
    on stores only. Picklable: it travels to the DHT's child process with the record key, never the secret.
    """

    def __init__(self, run_id: str, key: bytes | None) -> None:
        self.run_id, self._key = run_id, key
        # DHT key -> (kind, shard): every shard of a sharded kind (peer.swarm.shards), shard 0 for the others
        self._names: dict[bytes, tuple[str, int]] = {
            DHTID.generate(source=f"{run_id}:{stored}").to_bytes(): (name, shard)
            for name in RECORD_TTL_S
            for stored, shard in key_names(name)
        }
        self.refused: dict[str, int] = {}

    @property
    def priority(self) -> int:
        return 5

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False

    def storage_budget(self) -> StorageBudget:
        """The budgets ``peer.swarm.dht.start_dht`` gives this node's storage: only this run's keys."""
        return StorageBudget(
            keys={key: _key_budget(name) for key, (name, _) in self._names.items()},
            total_bytes=MAX_STORED_BYTES,
            steward_keys=frozenset(key for key, (name, _) in self._names.items() if name in STEWARD_KINDS),
            group_bytes={name: MAX_KIND_BYTES for name in SHARDED},
        )

    def validate(self, record: DHTRecord) -> bool:
        found = self._names.get(record.key)
        reason = "not a key of this run" if found is None else self._refusal(*found, record)
        if reason:
            self.refused[reason] = self.refused.get(reason, 0) + 1
            logger.debug("%s:%s: refused a record: %s", self.run_id, found, reason)
            return False
        return True

    def _refusal(self, name: str, shard: int, record: DHTRecord) -> str:
        """Why ``record`` may not be stored under kind ``name``'s ``shard`` ("" when it may)."""
        if len(record.subkey) > MAX_SUBKEY_BYTES:
            return "subkey too large"
        if len(record.value) > RECORD_VALUE_BYTES[name]:
            return "value too large"
        if record.expiration_time > now() + RECORD_TTL_S[name] + EXPIRY_SLACK_S:
            return "expiry beyond the record's lifetime"
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:
            return "subkey does not decode"
        owner = split_owner_subkey(subkey)
        if owner is None:
            return "no owner tag"
        writer, suffix = owner
        if name in SHARDED:  # its suffix names the level it was written at, its key that level's shard of it
            level = suffix_level(suffix)
            if level is None:
                return "not a level suffix"
            if shard != shard_of(writer, level):
                return "a shard of another writer"
        elif name in ONE_SUBKEY_PER_OWNER and suffix:
            return "a second subkey of this owner"
        try:
            payload, mac = open_envelope(MSGPackSerializer.loads(record.value))
        except Exception:  # msgpack's own errors, ValueError of the envelope
            return "not a record envelope"
        if self._key is not None:
            if mac is None:
                return "no seal"
            expected = seal(self._key, self.run_id, name, writer, suffix, record.expiration_time, payload)
            if not hmac.compare_digest(expected, mac):
                return "bad seal"
        elif mac is not None:
            return "a seal in an open swarm"
        return peers_schema_refusal(payload, writer) if name == "peers" else ""


def peers_schema_refusal(payload: dict, writer: str) -> str:
    """Why ``payload`` is not a ``peers`` entry of ``writer`` ("" when it is): exactly ``{advert, at, found}``
    with the writer's own well-formed advert, or a tombstone ``{left: true, at}``."""
    from tasklet.peer.swarm.adverts import Advert, check_peer_id  # imports what it needs, not this module

    at = payload.get("at")
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        return "peers: at is not a number"
    if set(payload) == {"left", "at"}:
        return "" if payload["left"] is True else "peers: left is not true"
    if set(payload) != {"advert", "at", "found"}:
        return "peers: not exactly advert, at and found"
    found = payload["found"]
    try:
        advert = Advert.from_record(payload["advert"])
        if not isinstance(found, list) or len(found) > MAX_FOUND_IDS:
            raise ValueError(f"found: not a list of at most {MAX_FOUND_IDS}")
        for item in found:
            check_peer_id(item, "found[]")
    except ValueError as error:
        return f"peers: {error}"
    return "" if advert.peer_id == writer else "peers: an advert of another peer"


def _key_budget(name: str) -> KeyBudget:
    """A key's budget: the reply limit in all; one owner gets its kind's one entry, or an eighth of the key; the
    shards of a sharded kind share :data:`MAX_KIND_BYTES` on one node."""
    single, sharded = name in ONE_SUBKEY_PER_OWNER, name in SHARDED  # a writer moving a level: two entries a while
    entry = RECORD_VALUE_BYTES[name] + SIGNATURE_BYTES + MAX_SUBKEY_BYTES
    return KeyBudget(
        max_bytes=MAX_KEY_BYTES,
        max_entries=MAX_SUBKEYS_PER_KEY,
        owner_bytes=entry * (2 if sharded else 1) if single else MAX_KEY_BYTES // 8,
        owner_entries=(2 if sharded else 1) if single else MAX_SUBKEYS_PER_OWNER,
        group=name if name in SHARDED else "",
    )
