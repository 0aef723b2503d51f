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

Order: the in-process tests first, then the fresh clone's tests, then the other integration tests. With
pytest-xdist (``TASKLET_TEST_WORKERS``, 2 by default, ``--dist loadgroup``, see scripts/test.sh) they run in two
lanes, an ``xdist_group`` each, so one worker each. Lane 1: the in-process tests, then the fresh clone's (its
set-up, the README's first command, the install script), then the tests marked ``light_processes`` (a CLI, a
probe, a script; no swarm), then those marked ``exact_processes`` (processes whose every assertion holds at any
speed: results equal to a replay), then the ``container`` tests (the images' build, about 4 minutes cold, and
their swarms). Lane 2: every other test with processes, one at a time (two of its swarms at once on 2 cores only
wait on each other). Lane 2 sets the suite's time; the container tests moved to lane 1 because it sat idle for
most of the run while lane 2 took 38 minutes, and the exact tests because lane 2 still ran 10 minutes longer. In
one process, the fresh clone's set-up starts in the background when
the tests are collected (tests/support/newcomer.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasklet.peer.emulation.netbed import NetBed, open_bed, unavailable_reason
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
# xdist groups, one per worker (module docstring): lane 1 the in-process tests, then the fresh clone's; lane 2 every
# other test with processes, one at a time (two swarms at once on 2 cores only wait on each other, and the namespace
# bed and the container engine are machine-wide)
LANE1, LANE2 = "lane1", "lane2"
LIGHT = "light_processes"
EXACT = "exact_processes"  # processes, but no assertion depends on speed: lane 1, beside lane 2 (module docstring)
CONTAINER = "container"  # the image build and the container tests: lane 1, last (module docstring)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist registers it too; without xdist (-p no:xdist) the marks set below would warn as unknown. Here
    # and not in pyproject.toml, whose every change rebuilds the container images' dependency layer.
    config.addinivalue_line("markers", "xdist_group(name): the lane a test runs in (set here, not by hand)")
    config.addinivalue_line("markers", f"{LIGHT}: starts only short, light processes (a CLI, a probe, a script), "
                            "no swarm: runs in lane 1 after the fresh clone's tests, beside lane 2's swarms")
    config.addinivalue_line("markers", f"{EXACT}: starts processes but asserts nothing that depends on speed (results "
                            "equal to a replay): runs in lane 1 after the light ones, beside lane 2")


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
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    # the in-process tests first, then the fresh clone's tests (in one process its set-up runs in the background
    # beside the in-process tests: pytest_collection_finish), then the rest, each in its order
    items.sort(key=_order)


def _order(item: pytest.Item) -> int:
    if not _with_processes(item):
        return 0
    if "newcomer" in _fixtures(item):
        return 1
    for rank, marker in enumerate((LIGHT, EXACT, CONTAINER), start=2):
        if item.get_closest_marker(marker):
            return rank
    return 5


def _with_processes(item: pytest.Item) -> bool:
    return item.get_closest_marker("integration") is not None


def _group(item: pytest.Item) -> str:
    lane1 = (not _with_processes(item) or "newcomer" in _fixtures(item)
             or any(item.get_closest_marker(m) for m in (LIGHT, EXACT, CONTAINER)))
    return LANE1 if lane1 else LANE2


def _fixtures(item: pytest.Item) -> tuple[str, ...]:
    return tuple(getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)  # before xdist's worker sends the collected node ids
def pytest_collection_finish(session: pytest.Session) -> None:
    """xdist: the lanes of the selected tests (the in-process tests spread over the workers when they are all that
    is selected). One process: start the fresh clone's set-up now when a selected test will use it."""
    config, items = session.config, session.items
    if getattr(config, "workerinput", None) is not None:
        if any(_with_processes(item) for item in items):
            for item in items:
                _join_group(config, item, _group(item))
        return
    if config.getoption("numprocesses", default=0) or config.option.collectonly:
        return
    factory = getattr(config, "_tmp_path_factory", None)  # pytest's own tmp_path_factory (the fixture's)
    if factory is not None and any("newcomer" in _fixtures(item) for item in items):
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
