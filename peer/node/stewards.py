"""`peer stewards`: the organiser names who may lead a running swarm, with its own key.

The organiser's key signs a ``stewards`` record (``peer.swarm.charter.sign_stewards``) that this command stores
through a short-lived DHT node of its own; the swarm's peers read it within a few heartbeats and keep it alive
under their own subkeys, as they keep the run record. Only a key whose run record is in the DHT may add stewards:
any other key's record would be ignored by every reader, and the command says so instead of storing it.
"""

from __future__ import annotations

import time

from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.charter import CharterError, sign_stewards, stewards_of
from tasklet.peer.swarm.dht import DHTConfig, start_dht
from tasklet.peer.swarm.membership import organisers_run
from tasklet.peer.swarm.records import RECORD_TTL_S, RecordStore, RunRecordValidator, record_key
from tasklet.peer.swarm.status import listen_host
from tasklet.peer.timing import now

READ_BACK_S = 30.0  # how long the command waits to read its record back from the swarm


class StewardsError(RuntimeError):
    """A one-line reason the stewards could not be added or listed."""


def add_stewards(dht_peers: list[str], run_id: str, secret: str | None, identity: Identity,
                 stewards: list[str]) -> tuple[int, tuple[str, ...]]:
    """Store a signed record adding ``stewards`` to run ``run_id``; (its revision, every steward added so far)."""
    guard = RunRecordValidator(run_id, None if secret is None else record_key(secret, run_id))
    config = DHTConfig(initial_peers=tuple(dht_peers), host=listen_host(dht_peers), client_mode=True)
    dht = start_dht(config, identity, [guard])
    try:
        store = RecordStore(dht, run_id, identity, secret)
        runs = store.get_all("run")
        if runs is None:
            raise StewardsError(f"could not read run {run_id!r} from the DHT in time; try again")
        if organisers_run(runs, run_id, identity.peer_id) is None:
            raise StewardsError(f"no run {run_id!r} signed by {identity.peer_id} is in this DHT: only the organiser's "
                                "key (`peer start --identity`) can name stewards (check --run, --secret, --identity)")
        existing = _revisions(store, run_id, identity.peer_id)
        revision = max(existing, default=0) + 1
        try:
            payload = sign_stewards(identity, run_id, list(stewards), revision)
        except (CharterError, ValueError) as exc:
            raise StewardsError(str(exc)) from None
        at = now()
        if not store.put("stewards", payload, at + RECORD_TTL_S["stewards"], suffix=b"/%d" % revision):
            raise StewardsError("the DHT refused or did not store the stewards record; try again")
        deadline = time.monotonic() + READ_BACK_S
        while time.monotonic() < deadline:
            seen = _revisions(store, run_id, identity.peer_id)
            if revision in seen:
                added = tuple(dict.fromkeys(p for r in sorted(seen) for p in seen[r]))
                return revision, added
            time.sleep(1.0)
        raise StewardsError(f"stored, but the record could not be read back within {READ_BACK_S:.0f} s")
    finally:
        dht.shutdown()


def _revisions(store: RecordStore, run_id: str, organiser: str) -> dict[int, tuple[str, ...]]:
    """The organiser's stewards records in the DHT, by revision (anything else ignored)."""
    out: dict[int, tuple[str, ...]] = {}
    for record in store.get_all("stewards") or []:
        try:
            out[int(record.payload["revision"])] = stewards_of(run_id, organiser, record.payload)
        except (CharterError, KeyError, TypeError, ValueError):
            continue
    return out
