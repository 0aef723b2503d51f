"""The doors as a stranger with a rented network and as a member would attack them, with real `peer` processes in
the network-namespace bed, on one swarm that trains (bench.doors.MemberSwarm, shared by the tests):

* four addresses of one /24 hold connections to the leader's gRPC port and its relay, reopening what is cut: they
  get one network's share of each, nobody deposes the leader, the run keeps at least half its steps/s, and a NAT'd
  member (a stranger at the door, like the attacker) still joins and trains;
* a member advertises the leader's endpoint as its own (with the oldest start a record allows): a joiner started
  after the squat ignores the squatter, follows the real leader and trains, and a fresh `peer status` lists the
  leader at its endpoint;
* a member with 64 free identities fills every key of the run (its largest advert under ``peers``, 250 KiB under
  each other key, 64 ``plans`` subkeys from one), then, while the fill lives, eight stranger DHT nodes sit next to
  the ``peers`` key taking every store: the leader's keys take none of the fill, a NAT'd joiner trains within 60 s,
  a fresh `peer status` lists every honest peer, and the run keeps half its steps/s.

The eclipse alone, and with a stranger's find flood on top, run in bench.doors on this bed; the eclipse against
real DHT nodes on loopback is tests/swarm/test_rendezvous.py, the finds' byte budgets tests/swarm/test_findgate.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.doors import ECLIPSE_NODES, FILL_IDENTITIES, HOLD_GRPC, HOLD_RELAY, MemberSwarm
from tasklet.peer.emulation.netbed import open_bed, unavailable_reason
from tasklet.peer.net.config import FRONT_DESCRIPTORS, GRPC_DESCRIPTOR_SHARE, SOURCE_SHARE
from tasklet.peer.net.limits import RESERVED_DESCRIPTORS, ConnectionCap
from tasklet.peer.net.relay import RelayLimits

pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.timeout(600)]
WINDOW_S = 12.0  # each steps/s window (unattacked, under attack): about a dozen steps
JOIN_S = 120.0


@pytest.fixture(name="swarm", scope="module")
def swarm_fixture(processes: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemberSwarm]:
    """Two public members training, a stranger's host with four addresses of one /24; torn down at the end."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    folder: Path = tmp_path_factory.mktemp("doors-member")
    with open_bed() as bed, MemberSwarm(bed, folder) as swarm:
        swarm.start()
        yield swarm


def _grpc_cap(fd_limit: int) -> ConnectionCap:
    """The caps of the gRPC port of a peer with ``fd_limit`` descriptors (peer.net.config.TransportConfig)."""
    total = max(16, int(max(64, fd_limit - RESERVED_DESCRIPTORS) * GRPC_DESCRIPTOR_SHARE) // FRONT_DESCRIPTORS)
    return ConnectionCap(total, max(1, int(total * SOURCE_SHARE)))


def test_a_rented_network_on_the_leaders_doors_deposes_nobody_and_a_nated_member_joins(swarm: MemberSwarm) -> None:
    got = swarm.network_caps(WINDOW_S, JOIN_S)
    print(f"network_caps: {got}")
    grpc = got["attack"]["grpc"]
    relay = got["attack"]["relay"]
    # the attack was real: the stranger asked for more than the strangers' share of the port (what a NAT'd member
    # needs a place in) and more than all the relay's request slots, and held what one network may
    cap = _grpc_cap(got["victim_fd_limit"])
    assert HOLD_GRPC * len(swarm.block) > cap.stranger_total
    # one network: an eighth of the strangers' quarter (holding the whole quarter, it made a NAT'd member wait
    # 23 s instead of 8 for its place at the leader's port)
    assert 0 < max(grpc["peak_held"].values()) <= cap.stranger_total // 8, grpc
    assert 0 < max(relay["peak_held"].values()) <= RelayLimits().max_handshakes_per_source, relay
    assert HOLD_RELAY * len(swarm.block) >= RelayLimits().max_pending_handshakes
    assert got["leadership_changes"] == [], got["leadership_changes"]
    assert got["steps_per_s_unattacked"] > 0.1, got
    assert got["steps_per_s_attacked"] >= got["steps_per_s_unattacked"] / 2, got
    assert got["joiner_reached_s"] is not None, swarm.peers.log(got["joiner"])[-3000:]
    assert got["joiner_trains_s"] is not None, swarm.peers.log(got["joiner"])[-3000:]


def test_a_squatted_endpoint_hides_the_leader_from_no_fresh_reader(swarm: MemberSwarm) -> None:
    got = swarm.endpoint_squat(JOIN_S)
    print(f"endpoint_squat: {got}")
    assert got["squatter"] and got["squatter_adverts_stored"], got
    assert got["joiner_ignored_squatter"], swarm.peers.log(got["joiner"])[-3000:]
    assert got["joiner_trains_s"] is not None, swarm.peers.log(got["joiner"])[-3000:]
    assert got["status_error"] is None, got["status_error"]
    assert got["status_lists_leader"] and not got["status_lists_squatter"], got
    assert got["leadership_changes"] == [], got["leadership_changes"]


def test_free_identities_filling_the_run_s_keys_then_stranger_nodes_next_to_them_keep_no_joiner_out(
        swarm: MemberSwarm) -> None:
    got = swarm.dht_attacks(WINDOW_S, fill=FILL_IDENTITIES, eclipse=ECLIPSE_NODES, status_on=("pub1",))
    print(f"dht_fill_eclipse: {got}")
    # the strangers were real: they sat next to `peers`, and the run's stores went to them
    assert got["stranger_nodes_ready"] == ECLIPSE_NODES and got["eclipse"]["stores"] > 0, got
    fill = got["fill"]
    assert fill and fill["identities"] == FILL_IDENTITIES, got
    # the attack was real: every free identity's advert is a member's, and the other keys took what their budget
    # lets one key take (with a budget per owner only, the leader's keys filled up the same way)
    assert fill["peers"] == FILL_IDENTITIES and fill["links"] > 0 and fill["run"] > 0, fill
    assert fill["plans"] == fill["beat"] == fill["progress"] == fill["stewards"] == 0, fill
    assert got["joiner_trains_s"] is not None and got["joiner_trains_s"] <= 60, swarm.peers.log(got["joiner"])[-3000:]
    assert got["status_errors"] == {}, got["status_errors"]
    assert all(got["status_lists_every_honest_peer"].values()), got
    assert got["leadership_changes"] == [], got["leadership_changes"]
    assert got["steps_per_s_attacked"] >= got["steps_per_s_unattacked"] / 2, got
