"""Test markers, applied by where a test lives so a new test file gets one without ceremony.

* ``unit``: in-process, no child processes, no DHT, no sockets beyond loopback gRPC in the same process.
  ``bash scripts/test.sh -m unit`` runs these in about 1.5 min on 2 cores: the README's fast subset.
* ``integration``: real processes, a real hivemind DHT, real gRPC between processes, network namespaces.
* ``slow``: a fresh clone and a fresh virtualenv (the README's first command, the Docker install steps).

A test can also carry a marker explicitly (``@pytest.mark.integration``); an explicit marker wins.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from peer.emulation.netbed import NetBed, open_bed, unavailable_reason

# Files whose tests start real processes, a DHT or several gRPC peers talking to each other.
INTEGRATION_FILES = {
    "test_device.py",
    "test_docker.py",
    "test_docs.py",
    "test_equivalence.py",
    "test_fault_tolerance.py",
    "test_headline.py",
    "test_launcher.py",
    "test_leader.py",
    "test_membership.py",
    "test_membership_bench.py",
    "test_membership_dht.py",
    "test_peer_cli.py",
    "test_scheduler_cli.py",
    "test_swarm_daemon.py",
    "test_transport_bench.py",
}

LAYER_MARKERS = ("unit", "integration", "slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(m) for m in LAYER_MARKERS):
            continue
        if "newcomer" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.integration)
        elif Path(str(item.fspath)).name in INTEGRATION_FILES:
            item.add_marker(pytest.mark.integration)
        else:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(name="bed")
def bed_fixture() -> Iterator[NetBed]:
    """An empty bed for one test, torn down whatever happens; skips where namespaces cannot be made."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with open_bed() as bed:
        yield bed
