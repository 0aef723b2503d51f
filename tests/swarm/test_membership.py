"""Membership over real hivemind DHT processes on loopback: adverts, departure, expiry, secrets, signatures.

Four DHT nodes (each its own process with its own libp2p daemon) are shared by the module; each test uses
its own run id, so tests do not see each other's records. Short heartbeats keep the file fast.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from hivemind.utils import get_dht_time

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert, LinkReport
from tasklet.peer.swarm.charter import CharterError, run_organiser
from tasklet.peer.swarm.dht import DHTConfig, start_dht, visible_maddrs
from tasklet.peer.swarm.membership import (
    Membership,
    OrganiserError,
    SwarmSecretError,
    organisers_run,
    verify_swarm_secret,
)
from tests.support.waits import wait_until

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

HEARTBEAT_S = 0.5
TTL_S = 1.5
DEVICE = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)


class Node:
    def __init__(self, identity: Identity, initial: tuple[str, ...] = ()):
        self.identity = identity
        self.dht = start_dht(DHTConfig(initial_peers=initial), identity)

    def membership(self, run_id: str, secret: str | None = None, **kwargs) -> Membership:
        return Membership(
            self.dht, run_id, self.identity, secret, heartbeat_s=HEARTBEAT_S, ttl_s=TTL_S, **kwargs
        )

    def advert(self, port: int, started_at: float | None = None, **kwargs) -> Advert:
        started = get_dht_time() if started_at is None else started_at
        return Advert(self.identity.peer_id, f"127.0.0.1:{port}", DEVICE, started, **kwargs)


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Node]]:
    """Four DHT nodes; the first bootstraps, the others join through it."""
    started: list[Node] = []
    try:
        started.append(Node(Identity.generate()))
        bootstrap = tuple(visible_maddrs(started[0].dht))
        for _ in range(3):
            started.append(Node(Identity.generate(), bootstrap))
        yield started
    finally:
        for node in started:
            node.dht.shutdown()


@pytest.fixture
def run_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def members() -> Iterator[list[Membership]]:
    """Memberships a test creates; all leave at teardown, so no heartbeat thread outlives its test."""
    created: list[Membership] = []
    try:
        yield created
    finally:
        for membership in created:
            membership.leave()


def ids(membership: Membership) -> set[str]:
    return {advert.peer_id for advert in membership.live_peers()}


def test_adverts_appear_on_all_peers(nodes, run_id, members):
    members.extend(node.membership(run_id) for node in nodes)
    for port, (node, membership) in enumerate(zip(nodes, members, strict=True), start=5000):
        assert membership.announce(node.advert(port, extra={"stage": port - 5000}))
    everyone = {node.identity.peer_id for node in nodes}
    for membership in members:
        wait_until(lambda m=membership: ids(m) == everyone, 10, "every membership sees everyone")
    adverts = {advert.peer_id: advert for advert in members[0].live_peers()}
    for port, node in enumerate(nodes, start=5000):
        advert = adverts[node.identity.peer_id]
        assert advert.endpoint == f"127.0.0.1:{port}" and advert.extra == {"stage": port - 5000}
        assert advert.device == DEVICE
    entries = members[1].live_entries()
    assert all(0 <= entry.last_seen_s() < TTL_S and entry.expires_at > get_dht_time() for entry in entries)


def test_heartbeat_keeps_advert_alive_and_announce_updates_it(nodes, run_id, members):
    mine, other = nodes[0].membership(run_id), nodes[1].membership(run_id)
    members.extend([mine, other])
    mine.announce(nodes[0].advert(6000))
    time.sleep(3 * TTL_S)  # far past one ttl: only the heartbeat can keep it there
    assert ids(other) == {nodes[0].identity.peer_id}
    mine.announce(nodes[0].advert(6001))
    wait_until(lambda: other.live_peers()[0].endpoint == "127.0.0.1:6001", 5, "the new endpoint")


def test_leave_is_noticed_long_before_the_advert_would_expire(nodes, run_id, members):
    slow = Membership(nodes[0].dht, run_id, nodes[0].identity, None, heartbeat_s=1.0, ttl_s=60.0)
    watcher = nodes[2].membership(run_id)
    members.extend([slow, watcher])
    slow.announce(nodes[0].advert(6100))
    wait_until(lambda: ids(watcher) == {nodes[0].identity.peer_id}, 5, "the watcher sees the advert")
    slow.leave()
    # The advert would live 60 s; the tombstone removes it at the next read.
    wait_until(lambda: not ids(watcher), 5, "the tombstone removes the advert")
    # Rejoining with the same identity works: the new advert expires later than the tombstone.
    slow.announce(nodes[0].advert(6101))
    wait_until(lambda: ids(watcher) == {nodes[0].identity.peer_id}, 5, "the watcher sees the advert")


def test_peer_whose_heartbeat_stops_expires(nodes, run_id, members):
    doomed = Node(Identity.generate(), tuple(visible_maddrs(nodes[0].dht)))
    try:
        membership = doomed.membership(run_id)
        watcher = nodes[3].membership(run_id)
        members.append(watcher)
        membership.announce(doomed.advert(6200))
        wait_until(lambda: ids(watcher) == {doomed.identity.peer_id}, 5, "the watcher sees the doomed peer")
        membership.stop_heartbeat()  # the process "dies": no more heartbeats, no departure
        doomed.dht.shutdown()
        gone_after = wait_until(lambda: not ids(watcher), TTL_S + HEARTBEAT_S + 5, "the dead peer's advert expires")
        assert gone_after > 0  # it did not vanish before its advert expired
    finally:
        doomed.dht.shutdown()


def test_malformed_records_are_ignored(nodes, run_id, members):
    good = nodes[0].membership(run_id)
    reader = nodes[1].membership(run_id)
    members.extend([good, reader])
    good.announce(nodes[0].advert(6300))
    forger = nodes[2]
    tag = forger.identity.owner_tag
    # Distinct expiries: hivemind's storage heap compares subkeys on equal expiry, and str < bytes raises.
    expiries = iter(get_dht_time() + 30 + 0.01 * i for i in range(10))
    bad_advert = forger.advert(6301).to_record()
    bad_advert["device"]["tflops"] = "very fast"
    someone_else = forger.advert(6302).to_record()
    someone_else["peer_id"] = nodes[0].identity.peer_id  # claims to be another peer
    dht, key = forger.dht, f"{run_id}:peers"
    assert dht.store(key, {"p": {"advert": bad_advert, "at": 1.0}, "mac": None}, next(expiries), subkey=tag)
    impostor = {"p": {"advert": someone_else, "at": 1.0}, "mac": None}
    assert dht.store(key, impostor, next(expiries), subkey=tag + b"x")
    assert dht.store(key, "not an envelope", next(expiries), subkey=tag + b"y")
    assert dht.store(key, {"p": {"advert": [1, 2]}, "mac": None}, next(expiries), subkey=tag + b"z")
    assert dht.store(key, {"p": {}, "mac": "zz"}, next(expiries), subkey=tag + b"w")
    assert dht.store(key, {"advert": bad_advert}, next(expiries), subkey="no-owner-tag")
    link_key = f"{run_id}:links"
    forged_link = LinkReport(nodes[0].identity.peer_id, forger.identity.peer_id, 0.1, 1e6, True, 1.0)
    links = {"p": {"links": [forged_link.to_record(), {"src": 1}], "at": 1.0}, "mac": None}
    assert dht.store(link_key, links, next(expiries), subkey=tag)
    run = {"p": {"config": "nope", "created_at": 0.0}, "mac": None}
    assert dht.store(f"{run_id}:run", run, next(expiries), subkey=tag)
    # Readers survive all of it and see only the honest peer, no links, no run.
    assert [advert.peer_id for advert in reader.live_peers()] == [nodes[0].identity.peer_id]
    assert reader.links() == []
    assert reader.get_run() is None


def test_links_are_reported_and_read_back(nodes, run_id, members):
    a, b = nodes[0].membership(run_id), nodes[1].membership(run_id)
    members.extend([a, b])
    a_id, b_id = nodes[0].identity.peer_id, nodes[1].identity.peer_id
    report = LinkReport(a_id, b_id, 0.02, 5e8, True, get_dht_time())
    estimate = LinkReport(a_id, nodes[2].identity.peer_id, 0.1, 1e8, False, get_dht_time())
    with pytest.raises(ValueError, match="link.src"):
        a.report_links([LinkReport(b_id, a_id, 0.02, 5e8, True, get_dht_time())])
    assert a.report_links([report, estimate])
    assert b.links() == sorted([report, estimate], key=lambda r: (r.src, r.dst))


def test_the_run_is_the_organisers_and_a_forged_earlier_record_is_ignored(nodes, run_id, members):
    first, second, reader, forger = (node.membership(run_id) for node in nodes[:4])
    members.extend([first, second, reader, forger])
    assert reader.get_run() is None
    published = first.publish_run({"model": {"n_layers": 4}, "steps": 10})
    organiser = nodes[0].identity.peer_id
    assert reader.get_run() == {"model": {"n_layers": 4}, "steps": 10}  # the only organiser in the DHT
    record = reader.get_run_record()
    assert record.organiser == organiser and record.created_at == published.created_at
    second.adopt_run(record)  # kept alive under the second peer's subkey, with the organiser's signature
    forger.publish_run({"model": "forged"}, created_at=published.created_at - 1000)  # earlier, signed by itself
    records = reader.store.get_all("run")
    assert len(records) == 3
    assert organisers_run(records, run_id, organiser).config == {"model": {"n_layers": 4}, "steps": 10}
    with pytest.raises(OrganiserError, match="2 organisers"):
        organisers_run(records, run_id, None)
    assert verify_swarm_secret(nodes[2].dht, run_id, None, organiser=organiser).organiser == organiser
    assert reader.get_run() == {"model": {"n_layers": 4}, "steps": 10}  # a display: the run most members keep
    # a record that claims the organiser's signature over another config does not verify
    tampered = {"config": {"model": "forged"}, "created_at": published.created_at, "organiser": published.seal}
    with pytest.raises(CharterError, match="does not verify"):
        run_organiser(run_id, tampered)


def test_wrong_secret_makes_records_invisible_and_check_fails(nodes, run_id, members):
    insiders = [nodes[0].membership(run_id, "open sesame"), nodes[1].membership(run_id, "open sesame")]
    outsider = nodes[2].membership(run_id, "guess")
    no_secret = nodes[3].membership(run_id, None)
    members.extend([*insiders, outsider, no_secret])
    insiders[0].publish_run({"model": "m"})
    everyone = [*insiders, outsider, no_secret]
    for node, membership, port in zip(nodes, everyone, range(6400, 6404), strict=True):
        membership.announce(node.advert(port))
    insider_ids = {nodes[0].identity.peer_id, nodes[1].identity.peer_id}
    wait_until(lambda: ids(insiders[1]) == insider_ids, 5, "the insiders see each other")
    time.sleep(2 * HEARTBEAT_S)  # give the outsiders' adverts time to spread, so absence means something
    assert ids(insiders[0]) == insider_ids  # neither outsider is seen
    assert ids(outsider) == {nodes[2].identity.peer_id}  # the outsider sees only itself
    assert ids(no_secret) == {nodes[3].identity.peer_id}
    assert verify_swarm_secret(nodes[2].dht, run_id, "open sesame").config == {"model": "m"}
    with pytest.raises(SwarmSecretError, match="wrong join secret"):
        verify_swarm_secret(nodes[2].dht, run_id, "guess")
    with pytest.raises(SwarmSecretError, match="requires a join secret"):
        verify_swarm_secret(nodes[3].dht, run_id, None)
    open_run = f"{run_id}-open"
    opener = nodes[0].membership(open_run)
    members.append(opener)
    opener.publish_run({"model": "m"})
    with pytest.raises(SwarmSecretError, match="has no join secret"):
        verify_swarm_secret(nodes[1].dht, open_run, "unexpected")
    assert verify_swarm_secret(nodes[1].dht, f"{run_id}-nobody", "x") is None


def test_another_peer_cannot_overwrite_my_advert(nodes, run_id, members):
    owner = Membership(nodes[0].dht, run_id, nodes[0].identity, None, heartbeat_s=10.0, ttl_s=60.0)
    reader = nodes[3].membership(run_id)
    members.extend([owner, reader])
    owner.announce(nodes[0].advert(6500))
    wait_until(lambda: ids(reader) == {nodes[0].identity.peer_id}, 5, "the reader sees the owner")
    forged = nodes[0].advert(6666).to_record()  # same peer id, the forger's endpoint
    envelope = {"p": {"advert": forged, "at": get_dht_time()}, "mac": None}
    # The forger's DHT signs with the forger's key, which does not match the owner tag in the subkey.
    # Its expiry (90 s) is later than the owner's (60 s), so an unsigned-check DHT would take it.
    nodes[1].dht.store(f"{run_id}:peers", envelope, get_dht_time() + 90, subkey=nodes[0].identity.owner_tag)
    adverts = reader.live_peers()
    assert [advert.endpoint for advert in adverts] == ["127.0.0.1:6500"]
