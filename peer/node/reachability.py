"""How others reach this peer's gRPC port: directly, or through a relay when nobody can dial it (NAT).

The daemon calls :func:`refuse_undialable` before it starts anything (a peer must never publish an address
nobody can dial: 0.0.0.0, or loopback in a swarm whose DHT is remote) and :func:`establish` once it has
joined the DHT and started its worker:

1. A peer with ``--relay-port`` runs a :class:`~peer.net.relay.RelayServer` for peers behind NAT, and any
   client in this process reaches a peer registered there through it (connection reversal).
2. A joiner asks a relay of the swarm to dial its announced port back at the address the relay sees it
   come from (``CHECK``, peer.net.relay). Open: it is reachable and publishes that address (``--announce``
   when it names the same host; otherwise the announced host was a container's or a LAN address that
   others do not see, and the seen one is published). Closed: it registers with up to :data:`MAX_RELAYS`
   relays and publishes ``PEERID@RELAY:PORT`` (peer.net.endpoint). With no relay in the swarm nothing can
   be checked, and the announced address is published as before.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tasklet.peer.identity.keys import Identity
from tasklet.peer.net.endpoint import set_local_relay, set_relay_credentials
from tasklet.peer.net.limits import descriptor_budget
from tasklet.peer.net.relay import RelayAgent, RelayLimits, RelayServer, check_reachable, connect_credentials

log = logging.getLogger(__name__)

MAX_RELAYS = 3  # relays a NAT'd peer registers with (its advert names the first that accepted it)
RELAY_WAIT_S = 10.0  # how long a joiner looks for a relay advert / waits for a registration
WILDCARDS = ("0.0.0.0", "::", "")


class ReachabilityError(RuntimeError):
    """This peer cannot be reached by the others; the message is one line for the user."""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _maddr_hosts(maddrs: list[str]) -> list[str]:
    """The IP addresses inside ``/ip4/HOST/tcp/...`` multiaddrs."""
    hosts = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            hosts.append(parts[2])
    return hosts


def refuse_undialable(host: str, announce: str | None, dht_peers: list[str], is_first: bool,
                      relay_port: int | None) -> None:
    """Raise ReachabilityError when this peer would publish an address that nobody can dial."""
    if announce:
        ahost = announce.rpartition(":")[0].strip("[]")
        if ahost in WILDCARDS:
            raise ReachabilityError(f"--announce {announce}: {ahost or 'an empty host'} is no address others can"
                                    " dial; announce this machine's public or LAN address")
    published = announce.rpartition(":")[0] if announce else host
    remote = [h for h in _maddr_hosts(dht_peers) if not _is_loopback(h)]
    if _is_loopback(published) and remote:
        raise ReachabilityError(
            f"this peer would publish the loopback address {published}, but the swarm's DHT at {remote[0]} is on "
            "another machine: listen with --host 0.0.0.0 (and --announce HOST:PORT if you know your address)")
    if host in WILDCARDS and not announce and (is_first or relay_port is not None):
        what = "--relay-port" if relay_port is not None else "the first peer"
        raise ReachabilityError(f"--host {host} without --announce: {what} must announce an address others can "
                                "dial (add --announce PUBLIC_IP:PORT)")


@dataclass
class Reach:
    """What the daemon publishes about reaching this peer, and the relay parts it runs."""

    endpoint: str
    reachable: bool = True
    relay_address: str = ""  # the relay service this peer offers ("" = none)
    dials_from: str = ""  # a NAT'd peer's address as the relay saw it: where its connections come from
    server: RelayServer | None = None
    agent: RelayAgent | None = None
    notes: list[str] = field(default_factory=list)

    def refresh(self) -> bool:
        """Follow the relays: when the relay the published endpoint names lost this peer's registration and
        another one holds it, publish that one instead. Returns whether ``endpoint`` changed."""
        if self.agent is None:
            return False
        held = self.agent.registered()
        current = self.endpoint.partition("@")[2]
        if not held or current in held:
            return False
        self.endpoint = f"{self.endpoint.partition('@')[0]}@{held[0]}"
        log.warning("relay %s lost this peer's registration; now reached through %s", current, held[0])
        return True

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.server is not None:
            set_local_relay(None)
            self.server.close()


RELAY_DESCRIPTOR_SHARE = 0.3  # of this process's descriptor budget the relay service may hold at most


def start_relay_service(host: str, relay_port: int, announce_host: str,
                        key: bytes | None = None) -> tuple[RelayServer, str]:
    """Run the relay service on ``host:relay_port``; (the server, the address others reach it at). ``key``: the
    swarm's relay key (peer.net.relay.relay_key; None in an open swarm). Its limits are cut to a share of
    this process's descriptors, so a flood of the relay cannot take the descriptors the rest of the peer needs."""
    limits = RelayLimits().within(int(descriptor_budget() * RELAY_DESCRIPTOR_SHARE))
    server = RelayServer(host, relay_port, limits, key=key)
    try:
        port = server.start()
    except OSError as exc:
        raise ReachabilityError(f"--relay-port {relay_port}: cannot listen ({exc.strerror or exc})") from None
    set_local_relay(server.lookup)
    return server, f"{announce_host}:{port}"


def establish(identity: Identity, host: str, port: int, announce: str | None, relay_port: int | None,
              relays: Callable[[], list[str] | None], is_first: bool, key: bytes | None = None) -> Reach:
    """Decide how this peer is reached (see the module docstring); ``relays()`` lists the swarm's relays (None
    while it sees no other peer). ``key``: the swarm's relay key (peer.net.relay.relay_key, from the join
    secret): relays then register and splice only members, and this process's clients prove membership."""
    set_relay_credentials(None if key is None else connect_credentials(key))
    announced_host = announce.rpartition(":")[0] if announce else ("" if host in WILDCARDS else host)
    endpoint = announce or (f"{host}:{port}" if announced_host else "")
    reach = Reach(endpoint)
    if relay_port is not None:
        reach.server, reach.relay_address = start_relay_service(host, relay_port, announced_host, key)
    if is_first or reach.server is not None:
        return reach  # nobody to ask yet / a relay must be reachable itself (checked by whoever uses it)
    found = _wait_for_relays(relays, RELAY_WAIT_S if not endpoint else 3.0, settle=bool(endpoint))
    if not found:
        if not endpoint:
            raise ReachabilityError(
                "--host 0.0.0.0 without --announce needs a relay in the swarm to learn this peer's address, and "
                "no peer offers one (--relay-port); add --announce PUBLIC_IP:PORT")
        log.info("no relay in the swarm: publishing %s unchecked", endpoint)
        return reach
    check_port = int(announce.rpartition(":")[2]) if announce else port
    try:
        is_open, seen_ip = check_reachable(found[0], check_port)
    except (OSError, ValueError) as exc:
        log.warning("reachability check through relay %s failed (%s); publishing %s", found[0], exc, endpoint)
        if not endpoint:
            raise ReachabilityError(f"cannot reach relay {found[0]} to learn this peer's address: {exc}") from None
        return reach
    if is_open:
        reach.endpoint = endpoint if announced_host == seen_ip else f"{seen_ip}:{check_port}"
        if endpoint and reach.endpoint != endpoint:
            log.warning("reachability: others see this peer as %s, not the announced %s (a container's or LAN "
                        "address?); publishing %s", seen_ip, announced_host, reach.endpoint)
        log.info("reachability: relay %s dialled %s:%d back; publishing %s", found[0], seen_ip, check_port,
                 reach.endpoint)
        return reach
    local_target = f"127.0.0.1:{port}" if host in WILDCARDS else f"{host}:{port}"
    agent = RelayAgent(identity, found[:MAX_RELAYS], local_target, key=key)
    agent.start()
    registered = agent.wait_registered(RELAY_WAIT_S)
    if not registered:
        agent.close()
        raise ReachabilityError(f"nobody can dial this peer at {seen_ip}:{check_port} and no relay accepted it "
                                f"({', '.join(found[:MAX_RELAYS])})")
    reach.agent, reach.reachable, reach.dials_from = agent, False, seen_ip
    reach.endpoint = f"{identity.peer_id}@{registered[0]}"
    log.info("reachability: nobody can dial %s:%d (behind NAT?); reached through relay %s", seen_ip, check_port,
             registered[0])
    return reach


def _wait_for_relays(relays: Callable[[], list[str] | None], timeout_s: float, settle: bool = False) -> list[str]:
    """The relays of the swarm; ``relays()`` returns None while it sees no other peer (its view is not complete
    yet). With ``settle`` (a peer that has an address to publish anyway) a complete view without a relay ends the
    wait at once: every joiner waiting the whole timeout slowed a large swarm's formation."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = relays()
        if found or (settle and found is not None) or time.monotonic() >= deadline:
            found = found or []
            random.shuffle(found)  # spread NAT'd peers over the relays
            return found
        time.sleep(0.5)
