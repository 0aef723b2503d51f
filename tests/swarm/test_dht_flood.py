"""A stranger's store flood against real DHT nodes of ours: a plain hivemind node bootstrapped from the join line
(no key, no secret) stores 256 values of 1 MiB under random keys; the volunteers' DHT processes store none of it,
stay within a bounded resident size, and the run's own records are still stored and read between them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasklet.peer.emulation.doors_attack import descendants, dht_foreign_flood, padded_advert
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.dht import DHTConfig, start_dht, visible_maddrs
from tasklet.peer.swarm.records import RecordStore, RunRecordValidator, record_key
from tasklet.peer.timing import now

# two DHT processes and a flooding client, no swarm: lane 1 (tests/conftest.py)
pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.timeout(120), pytest.mark.light_processes]
RUN, SECRET = "flood-run", "members only"


def _private_mib(pid: int) -> float:
    """The resident memory a process holds itself (private pages): a DHT process forked from a test worker that
    already holds a GiB counts those pages in its RSS without having allocated them."""
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total / 2**20


def _rss_mib(pid: int) -> tuple[float, float]:
    """Private resident MiB of a DHT process, and of it with its p2pd child."""
    return _private_mib(pid), sum(_private_mib(p) for p in (pid, *descendants(pid)))


def test_a_foreign_store_flood_is_not_stored_and_the_run_s_records_still_are() -> None:
    ids = [Identity.generate() for _ in range(2)]
    guards = [RunRecordValidator(RUN, record_key(SECRET, RUN)) for _ in ids]
    first = start_dht(DHTConfig(), ids[0], [guards[0]])
    second = start_dht(DHTConfig(initial_peers=tuple(visible_maddrs(first))), ids[1], [guards[1]])
    try:
        before = [_rss_mib(d.pid) for d in (first, second)]
        flood = dht_foreign_flood(visible_maddrs(first)[0], count=256, value_bytes=1 << 20, seconds=60.0)
        after = [_rss_mib(d.pid) for d in (first, second)]
        writer, reader = RecordStore(first, RUN, ids[0], SECRET), RecordStore(second, RUN, ids[1], SECRET)
        assert writer.put("plans", {"epoch": 1}, now() + 60, suffix=b"|epoch=1")
        assert writer.put("peers", padded_advert(ids[0]), now() + 30)  # the largest advert the schema takes
        got, adverts = reader.get_all("plans"), reader.get_all("peers")
    finally:
        second.shutdown()
        first.shutdown()
    print(f"flood {flood}; DHT processes' resident MiB before {before}, after {after}")
    assert flood["tried"] == 256 and flood["stored"] == 0, flood
    # unguarded, the same flood took a DHT process from 0.2 to 2-3.6 GiB; p2pd's Go heap keeps ~100 MiB of buffers
    assert all(a[0] - b[0] < 32 and a[1] < 512 for a, b in zip(after, before, strict=True)), (before, after)
    assert got is not None and [r.payload for r in got] == [{"epoch": 1}], got
    assert adverts is not None and [r.owner for r in adverts] == [ids[0].peer_id], adverts
