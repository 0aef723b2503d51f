"""Waiting in tests: poll a condition until it holds or a deadline passes, and say what was awaited.

One deadline-based loop for the whole suite, so that a test's wait reads as *what* it waits for and for how long,
and a timeout fails with both (and with the last value seen, or what the caller adds). Variants:

* :func:`wait_until` fails the test (``AssertionError``) when the deadline passes; it returns the seconds the
  condition took, for tests that report or bound that time.
* :func:`wait_for_value` returns the first truthy value the probe gave (which follower leads, say).
* :func:`wait_for_text` waits for a line in a log, failing at once if the process writing it exits.
* :func:`held_within` only waits: a bounded wait (a partition held "until X, at most T") whose caller's own
  assertions then say what was missing.

Waits on a `peer status` (seconds of a core per call, retried when one fails) are
``tasklet.peer.emulation.procs.poll_until``'s.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TAIL_CHARS = 3000  # of a log, in a failure message


def _poll(probe: Callable[[], T], timeout_s: float, interval_s: float, alive: subprocess.Popen | None,
          ) -> tuple[T, float, bool]:
    """(last value, seconds waited, whether it held): ``probe()`` until truthy, ``alive`` exits, or the deadline."""
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        value = probe()
        now = time.monotonic()
        if value:
            return value, now - start, True
        if now >= deadline or (alive is not None and alive.poll() is not None):
            return value, now - start, False
        time.sleep(min(interval_s, max(0.0, deadline - now)))


def _failure(what: str, timeout_s: float, waited_s: float, last: object, alive: subprocess.Popen | None,
             detail: Callable[[], str] | None) -> AssertionError:
    code = None if alive is None else alive.poll()
    if code is not None and waited_s < timeout_s:
        why = f"the process exited ({code}) after {waited_s:.1f} s"
    else:
        why = f"not within {timeout_s:g} s (waited {waited_s:.1f} s)"
    seen = "" if isinstance(last, bool) else f"; last seen: {last!r}"[:TAIL_CHARS]
    extra = f"\n{detail()[-TAIL_CHARS:]}" if detail is not None else ""
    return AssertionError(f"{what}: {why}{seen}{extra}")


def wait_for_value(probe: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.1, *,
                   detail: Callable[[], str] | None = None, alive: subprocess.Popen | None = None) -> T:
    """The first truthy ``probe()``, polled every ``interval_s``. After ``timeout_s`` (or once ``alive`` has
    exited) fails naming ``what``, the time waited, the last value seen (unless a bool) and ``detail()``'s tail."""
    value, waited_s, held = _poll(probe, timeout_s, interval_s, alive)
    if not held:
        raise _failure(what, timeout_s, waited_s, value, alive, detail)
    return value


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.1, *,
               detail: Callable[[], str] | None = None, alive: subprocess.Popen | None = None) -> float:
    """Seconds until ``predicate()`` held, polled every ``interval_s``; fails as :func:`wait_for_value` does."""
    start = time.monotonic()
    wait_for_value(predicate, timeout_s, what, interval_s, detail=detail, alive=alive)
    return time.monotonic() - start


def wait_for_text(read: Callable[[], str], needle: str, timeout_s: float, who: str, interval_s: float = 0.2, *,
                  alive: subprocess.Popen | None = None) -> float:
    """Seconds until ``needle`` is in ``read()`` (a log, read whole); fails with the log's tail, at once if
    ``alive`` (the process writing it) exits first."""
    return wait_until(lambda: needle in read(), timeout_s, f"{who} logs {needle!r}", interval_s, detail=read,
                      alive=alive)


def held_within(predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Whether ``predicate()`` held within ``timeout_s``; never fails: for a bounded wait whose caller's
    assertions say what was missing."""
    return _poll(predicate, timeout_s, interval_s, None)[2]
