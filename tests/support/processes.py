"""The ``processes`` fixture: a test that starts real processes says so by using it, and only such a test may.

A test that uses ``processes`` (directly, through another fixture, or with
``pytestmark = pytest.mark.usefixtures("processes")``) is an ``integration`` test (``tests/conftest.py``
marks it). Every other test runs with process creation refused (:func:`refuse_processes`): the fast
``-m unit`` subset stays in-process because a test that forks fails at once and says which fixture to use,
not because somebody kept a list of file names up to date.
"""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest

FIXTURE = "processes"


class ProcessInUnitTestError(RuntimeError):
    """A test that does not use the ``processes`` fixture tried to start a process."""


def _refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise ProcessInUnitTestError(
        f"this test starts a process but does not use the {FIXTURE!r} fixture: add it to the test's arguments "
        f"(or `pytestmark = pytest.mark.usefixtures({FIXTURE!r})`), which also marks the test `integration`"
    )


def refuse_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way this interpreter starts a process raise: fork, subprocess, multiprocessing's spawn."""
    monkeypatch.setattr(os, "fork", _refuse)
    monkeypatch.setattr(os, "posix_spawn", _refuse)
    monkeypatch.setattr(os, "posix_spawnp", _refuse)
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", _refuse)


@pytest.fixture(scope="session", name=FIXTURE)
def processes_fixture() -> Iterator[None]:
    """Allows the tests that use it (and the fixtures that depend on it) to start real processes."""
    yield None
