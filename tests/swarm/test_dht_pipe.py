"""The command pipe to a real DHT process holds under load: eight threads store at once while the DHT's loop is
busy, so the pipe fills and each command goes in several writes. Unguarded (hivemind's pipe written by every
thread at once, read non-blocking) the DHT process read a broken command and died; a leader's DHT died this way
under a member's fill of the run's keys (docs/security.md)."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest

from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.dht import DHTConfig, start_dht

# one DHT process, no swarm: lane 1 (tests/conftest.py)
pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.timeout(120), pytest.mark.light_processes]
THREADS, STORES, VALUE_BYTES = 8, 20, 20_000  # 3.2 MB of commands, fifty times a pipe's 64 KiB


async def _hold_loop(_dht: object, _node: object, seconds: float) -> None:
    time.sleep(seconds)  # blocks the DHT's event loop: commands pile up in the pipe meanwhile


def test_commands_from_many_threads_into_a_full_pipe_reach_the_dht_whole() -> None:
    dht = start_dht(DHTConfig(), Identity.generate())
    errors: list[BaseException] = []

    def store(i: int) -> None:
        try:
            for j in range(STORES):
                dht.store(f"key{i}", b"x" * VALUE_BYTES, time.time() + 60, subkey=b"s%d" % j, return_future=True)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    try:
        dht.run_coroutine(partial(_hold_loop, seconds=1.5), return_future=True)
        threads = [threading.Thread(target=store, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[:1]
        dht.run_coroutine(partial(_hold_loop, seconds=0.0), return_future=True).result(timeout=20)
        assert dht.is_alive()
    finally:
        dht.shutdown()
