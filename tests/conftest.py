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

With ``TASKLET_TEST_WORKERS=N`` (pytest-xdist, ``--dist loadgroup``, see scripts/test.sh), tests that share a
machine-wide resource run on one worker, in one ``xdist_group``: the network-namespace bed (fixed subnet, stale
beds swept when a bed opens) and the container engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from peer.emulation.netbed import NetBed, open_bed, unavailable_reason
from tests.support.driver import workers_fixture
from tests.support.equivalence import reference_fixture
from tests.support.newcomer import newcomer_fixture, prepare_in_background, stop_background
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
# a test module naming one of these shares a machine-wide resource: its tests run on one worker, one at a time
SHARED_RESOURCES = {"containers": ("podman", "container"), "netbed": ("netbed", "open_bed", "bed: NetBed")}


@cache
def _shared_resource(module: Path) -> str | None:
    text = module.read_text(encoding="utf-8", errors="replace")
    return next((group for group, words in SHARED_RESOURCES.items() if any(w in text for w in words)), None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks set here
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
        group = _shared_resource(Path(str(item.fspath))) if item.get_closest_marker("integration") else None
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            _join_group(config, item, group)
    # the in-process tests first (in their order, then the others in theirs): the fresh clone's set-up runs
    # beside them (pytest_collection_finish), and a broken build fails in the first minutes
    items.sort(key=lambda item: 0 if item.get_closest_marker("unit") else 1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the fresh clone's set-up now when a selected test will use it, in one process only (no xdist)."""
    config = session.config
    if getattr(config, "workerinput", None) is not None or config.getoption("numprocesses", default=0) or \
            config.option.collectonly:
        return
    factory = getattr(config, "_tmp_path_factory", None)  # pytest's own tmp_path_factory (the fixture's)
    if factory is not None and any("newcomer" in getattr(item, "fixturenames", ()) for item in session.items):
        prepare_in_background(factory.getbasetemp() / "newcomer")


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_background()  # a set-up the session did not wait for (stopped early, or the test deselected later)


def _join_group(config: pytest.Config, item: pytest.Item, group: str) -> None:
    """On an xdist worker with ``--dist loadgroup``: the ``@group`` suffix of the item's node id, which is what
    xdist's scheduler groups by. xdist 3.8 writes it to ``Node._nodeid``, which pytest 9 no longer reads, so its
    groups are silently ignored there; set here the way this pytest stores node ids."""
    if getattr(config, "workerinput", None) is None or not config.getvalue("loadgroup") or "@" in item.nodeid:
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # pytest 8: xdist's own suffix works
        return
    item._id = coerce_node_id(f"{item.nodeid}@{group}")


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
