"""What a peer's endpoint string says and how a client reaches it.

Grammar (the strings travel in adverts, assignments and link reports):

* ``HOST:PORT`` — the peer's gRPC server, dialled directly;
* ``HOST:PORT/ROUTE`` — a server mounted on that port under ROUTE (the leader's coordinator: ``/coordinator``);
* ``PEERID@RELAYHOST:RELAYPORT[/ROUTE]`` — a peer nobody can dial (behind NAT): the client opens an HTTP
  CONNECT tunnel through the relay at RELAYHOST:RELAYPORT, which has the peer dial back and splices the two
  connections (see peer.net.relay). The bytes inside are the same gRPC as on a direct connection.

A process that itself runs a relay at which the peer is registered uses that relay instead of the one in
the string (connection reversal: the peer dials *us*, a direct network path); ``set_local_relay`` installs
the hook.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_PEER_RE = re.compile(r"^[0-9a-f]{8,64}$")
_ROUTE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RELAY_AUTHORITY_SUFFIX = ".tasklet:1"  # CONNECT <peer id>.tasklet:1 (never resolved: gRPC sends it as is)
PATH_DIRECT, PATH_REVERSED, PATH_RELAYED = "direct", "reversed", "relayed"


class EndpointError(ValueError):
    """An endpoint string that fits none of the forms above."""


@dataclass(frozen=True)
class Endpoint:
    """A parsed endpoint: ``address`` is HOST:PORT (the relay's when ``peer`` is set)."""

    address: str
    route: str = ""
    peer: str = ""  # the peer behind the relay at ``address``; empty for a direct endpoint

    @property
    def relayed(self) -> bool:
        return bool(self.peer)

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def __str__(self) -> str:
        base = f"{self.peer}@{self.address}" if self.peer else self.address
        return f"{base}/{self.route}" if self.route else base


def parse_endpoint(text: str) -> Endpoint:
    """Parse one endpoint string; EndpointError names what is wrong."""
    if not isinstance(text, str) or not text or len(text) > 300:
        raise EndpointError(f"endpoint {text!r}: expected HOST:PORT, HOST:PORT/ROUTE or PEERID@HOST:PORT")
    base, _, route = text.partition("/")
    if route and not _ROUTE_RE.match(route):
        raise EndpointError(f"endpoint {text!r}: bad route {route!r}")
    peer, at, address = base.rpartition("@")
    if at and not _PEER_RE.match(peer):
        raise EndpointError(f"endpoint {text!r}: {peer!r} is not a peer id")
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise EndpointError(f"endpoint {text!r}: expected HOST:PORT with a port in 1..65535")
    return Endpoint(address, route, peer)


def with_route(endpoint: str, route: str) -> str:
    """``endpoint`` with ``/route`` (replacing any route it had)."""
    ep = parse_endpoint(endpoint)
    return str(Endpoint(ep.address, route, ep.peer))


# A relay running in this process: peer id -> its address if that peer is registered there, else None.
_local_relay: Callable[[str], str | None] | None = None


def set_local_relay(lookup: Callable[[str], str | None] | None) -> None:
    """Install (or remove, with None) this process's relay: clients reach its registered peers through it."""
    global _local_relay
    _local_relay = lookup


# The credentials this process's clients present to a relay's CONNECT (peer.net.relay.connect_credentials);
# None: none (an open swarm's relay asks for none).
_relay_credentials: str | None = None


def set_relay_credentials(credentials: str | None) -> None:
    """Install (or remove) the ``user:password`` this process's clients send in a relay CONNECT's
    Proxy-Authorization: a sealed swarm's relay splices only members' connections."""
    global _relay_credentials
    _relay_credentials = credentials


def proxy_url(proxy: str) -> str:
    """The ``grpc.http_proxy`` value for a relay at ``proxy`` (HOST:PORT), with this process's credentials."""
    creds = _relay_credentials
    return f"http://{creds}@{proxy}" if creds else f"http://{proxy}"


def dial_plan(endpoint: str) -> tuple[str, str, str | None, str]:
    """(gRPC target, service route, HTTP proxy address or None, path kind) for a client of ``endpoint``.

    A string that is no endpoint is handed to gRPC as it is: its calls then fail as unreachable, like any
    address nobody answers at (callers probe endpoints of peers that may have left)."""
    try:
        ep = parse_endpoint(endpoint)
    except EndpointError:
        return endpoint, "", None, PATH_DIRECT
    if not ep.relayed:
        return ep.address, ep.route, None, PATH_DIRECT
    lookup = _local_relay
    local = lookup(ep.peer) if lookup is not None else None
    target = ep.peer + RELAY_AUTHORITY_SUFFIX
    if local is not None:
        return target, ep.route, local, PATH_REVERSED
    return target, ep.route, ep.address, PATH_RELAYED
