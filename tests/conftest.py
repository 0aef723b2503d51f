"""Test markers, attached by the fixtures a test uses, and the suite's shared fixtures.

* ``unit``: in-process, no child processes, no DHT, no sockets beyond loopback gRPC in the same process.
  ``bash scripts/test.sh -m unit`` runs these in about 2.5 min on 2 cores: the README's fast subset. A test
  that does not use the ``processes`` fixture cannot start a process (``tests/support/processes.py``).
* ``integration``: a test that uses ``processes`` (real processes, a real hivemind DHT, gRPC between processes,
  network namespaces: ``bed`` depends on it).
* ``slow``: a test that uses ``newcomer`` (a fresh clone and a fresh virtualenv: the README's first command,
  the Docker install steps).

A test can also carry a layer marker explicitly (``@pytest.mark.integration`` for a long in-process run); a test
with no layer marker from either is ``unit``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from peer.emulation.netbed import NetBed, open_bed, unavailable_reason
from tests.support.driver import workers_fixture
from tests.support.equivalence import reference_fixture
from tests.support.newcomer import newcomer_fixture
from tests.support.processes import FIXTURE as PROCESSES
from tests.support.processes import processes_fixture, refuse_processes

# the shared fixtures (tests/support), registered by being names of this module
__all__ = ["newcomer_fixture", "processes_fixture", "reference_fixture", "workers_fixture"]

# fixture -> the markers a test that uses it gets
FIXTURE_MARKERS: dict[str, tuple[str, ...]] = {
    "newcomer": ("slow", "integration"),
    PROCESSES: ("integration",),
}
LAYER_MARKERS = ("unit", "integration", "slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if PROCESSES in used and item.get_closest_marker("unit"):
            raise pytest.UsageError(f"{item.nodeid} is marked unit but uses the {PROCESSES!r} fixture")
        for name in dict.fromkeys(m for fixture, ms in FIXTURE_MARKERS.items() if fixture in used for m in ms):
            if not item.get_closest_marker(name):
                item.add_marker(getattr(pytest.mark, name))
        if not any(item.get_closest_marker(m) for m in LAYER_MARKERS):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _processes_only_where_declared(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse process creation in a test that does not use the ``processes`` fixture."""
    if PROCESSES not in request.fixturenames:
        refuse_processes(monkeypatch)


@pytest.fixture(name="bed")
def bed_fixture(processes: None) -> Iterator[NetBed]:
    """An empty bed for one test, torn down whatever happens; skips where namespaces cannot be made."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with open_bed() as bed:
        yield bed
