"""Membership benchmark: how fast adverts spread and how fast a swarm of N DHT nodes forms, on loopback.

Two figures:

* **Advert propagation**: one node re-announces its advert with a new sequence number; another node polls
  ``live_peers()`` until it sees it. Median and max over repeats. Each read is a full DHT traversal
  (``latest=True``), so this is store + traversal time, what a peer pays to notice a change.
* **Formation** for N nodes: from the moment the first DHT process is launched until every node's
  ``live_peers()`` lists all N adverts ("all see all"). Shown alongside: the part spent starting the DHT
  processes, the time until the *median* node sees all (without the stragglers), and the time until all
  nodes read the plan the elected leader published ("first plan"; a placeholder dict: the scheduler's run
  time is not part of this figure).

Every node is a real ``hivemind.DHT`` (its own process plus a libp2p daemon) on 127.0.0.1. On a 2-core
machine shared with other work the figures are dominated by CPU contention at N = 32; say so when quoting.

    python -m bench.membership [--quick] [--sizes 8 16 32] [--repeats 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import hivemind
from hivemind.utils import get_dht_time

from tasklet.peer.compute.device_probe import DeviceInfo
from tasklet.peer.identity.keys import Identity
from tasklet.peer.swarm.adverts import Advert
from tasklet.peer.swarm.dht import DHTConfig, start_dht, visible_maddrs
from tasklet.peer.swarm.election import elect_leader
from tasklet.peer.swarm.membership import Membership
from tasklet.peer.swarm.plans import PlanBoard

DEVICE = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)
POLL_S = 0.02  # propagation: one reader, poll fast for resolution
FORMATION_POLL_S = 0.5  # formation: N readers polling fast would eat the CPU the swarm needs (a daemon
# reads membership about once per heartbeat)


@dataclass
class Swarm:
    identities: list[Identity]
    dhts: list[hivemind.DHT]
    started_s: float  # seconds to get every DHT process ready

    def close(self) -> None:
        for dht in self.dhts:
            dht.shutdown()


def launch(count: int) -> Swarm:
    """Start ``count`` DHT nodes: the first bootstraps, the rest are launched together and join through it."""
    begin = time.perf_counter()
    identities = [Identity.generate() for _ in range(count)]
    dhts: list[hivemind.DHT] = []
    try:
        dhts.append(start_dht(DHTConfig(), identities[0]))
        bootstrap = visible_maddrs(dhts[0])
        for identity in identities[1:]:
            dht = hivemind.DHT(
                initial_peers=bootstrap,
                start=False,
                record_validators=[identity.signature_validator()],
                host_maddrs=DHTConfig().host_maddrs(),
            )
            dht.run_in_background(await_ready=False)
            dhts.append(dht)
        for dht in dhts:
            dht.wait_until_ready(timeout=120)
    except BaseException:
        for dht in dhts:
            dht.shutdown()
        raise
    return Swarm(identities, dhts, time.perf_counter() - begin)


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = POLL_S) -> float:
    """Seconds until ``condition()`` held (polling every ``poll_s``); TimeoutError after ``timeout_s``."""
    begin = time.perf_counter()
    while not condition():
        if time.perf_counter() - begin > timeout_s:
            raise TimeoutError(f"not reached within {timeout_s} s")
        time.sleep(poll_s)
    return time.perf_counter() - begin


def propagation(repeats: int, nodes: int = 4) -> list[float]:
    """Seconds from announce on node 1 to visibility on the last node, ``repeats`` times."""
    swarm = launch(nodes)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    writer = Membership(swarm.dhts[1], run_id, swarm.identities[1], heartbeat_s=30.0, ttl_s=120.0)
    reader = Membership(swarm.dhts[-1], run_id, swarm.identities[-1], heartbeat_s=30.0, ttl_s=120.0)
    started, peer_id = get_dht_time(), swarm.identities[1].peer_id
    samples = []
    try:
        for seq in range(repeats):
            advert = Advert(peer_id, "127.0.0.1:5000", DEVICE, started, extra={"seq": seq})
            begin = time.perf_counter()
            writer.announce(advert)
            wait_until(lambda s=seq: any(a.extra.get("seq") == s for a in reader.live_peers()), timeout_s=30)
            samples.append(time.perf_counter() - begin)
    finally:
        writer.leave()
        swarm.close()
    return samples


@dataclass
class Formation:
    nodes: int
    dht_start_s: float  # launch until every DHT process is ready
    median_node_s: float  # launch until the median node lists every advert (stragglers excluded)
    all_see_all_s: float  # launch until every node lists every advert
    first_plan_s: float  # launch until every node reads the elected leader's plan


def formation(count: int, heartbeat_s: float = 2.0, timeout_s: float = 180.0) -> Formation:
    """Times for a fresh swarm of ``count`` nodes; ``inf`` for a phase not reached within ``timeout_s``."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    begin = time.perf_counter()
    swarm = launch(count)
    members = [
        Membership(dht, run_id, identity, heartbeat_s=heartbeat_s)
        for dht, identity in zip(swarm.dhts, swarm.identities, strict=True)
    ]
    try:
        with ThreadPoolExecutor(max_workers=min(count, 16)) as pool:
            now = get_dht_time()
            adverts = [
                Advert(identity.peer_id, f"127.0.0.1:{5000 + k}", DEVICE, now + k)  # an endpoint is one peer's
                for k, identity in enumerate(swarm.identities)
            ]
            list(pool.map(lambda pair: pair[0].announce(pair[1]), zip(members, adverts, strict=True)))
            def sees_all(member: Membership) -> float:
                try:
                    return wait_until(lambda: len(member.live_peers()) == count, timeout_s, FORMATION_POLL_S)
                except TimeoutError:
                    return math.inf

            def sees_plan(board: PlanBoard) -> float:
                try:
                    return wait_until(lambda: board.latest() is not None, timeout_s, FORMATION_POLL_S)
                except TimeoutError:
                    return math.inf

            announced = time.perf_counter() - begin
            waits = list(pool.map(sees_all, members))
            all_see_all = time.perf_counter() - begin if max(waits) < math.inf else math.inf
            median_node = announced + statistics.median(waits)
            leader = elect_leader(members[0].live_entries())
            index = [i.peer_id for i in swarm.identities].index(leader)
            boards = [PlanBoard(dht, run_id, None) for dht in swarm.dhts]
            writer = PlanBoard(swarm.dhts[index], run_id, swarm.identities[index])
            writer.publish(writer.next_epoch(), leader, {"pipelines": [[f"p{i}" for i in range(count)]]})
            plan_waits = list(pool.map(sees_plan, boards))
            first_plan = time.perf_counter() - begin if max(plan_waits) < math.inf else math.inf
    finally:
        for membership in members:
            membership.stop_heartbeat()
        swarm.close()
    return Formation(count, swarm.started_s, median_node, all_see_all, first_plan)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.membership", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32], help="swarm sizes to form")
    parser.add_argument("--repeats", type=int, default=20, help="advert propagation samples")
    parser.add_argument("--quick", action="store_true", help="sizes 4 8, 5 repeats")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = [4, 8], 5
    if any(size < 2 for size in args.sizes) or args.repeats < 1:
        print("error: --sizes must be >= 2 and --repeats >= 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.ERROR)

    samples = propagation(args.repeats)
    formations = [formation(size) for size in args.sizes]
    result = {
        "propagation_s": {
            "median": statistics.median(samples),
            "max": max(samples),
            "repeats": len(samples),
        },
        "formation": [asdict(item) for item in formations],
    }
    if args.json:  # a phase not reached within the timeout reads as null
        for item in result["formation"]:
            item.update({key: None for key, value in item.items() if value == math.inf})
        print(json.dumps(result))
        return 0
    prop = result["propagation_s"]
    print(f"advert propagation (announce -> visible on another node, {prop['repeats']} repeats): "
          f"median {prop['median'] * 1e3:.0f} ms, max {prop['max'] * 1e3:.0f} ms")
    print()
    heads = ("nodes", "DHT start (s)", "median node (s)", "all see all (s)", "first plan (s)")
    print(f"{heads[0]:>5}  {heads[1]:>13}  {heads[2]:>15}  {heads[3]:>15}  {heads[4]:>14}")
    for item in formations:
        times = (
            f"{item.dht_start_s:>13.2f}  {item.median_node_s:>15.2f}  {item.all_see_all_s:>15.2f}  "
            f"{item.first_plan_s:>14.2f}"
        )
        print(f"{item.nodes:>5}  {times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
