"""File descriptors of this process and connection caps on its listening ports.

A peer listens on several ports (gRPC, the bulk lane, the relay, the dashboard, the metrics endpoint), and
every connection a stranger opens costs a descriptor before anything else is checked; at the common soft
limit of 1,024 a flood of ~50 connections a second reaches it within seconds, and then the peer cannot open
its own files, sockets or DHT connections. So :func:`raise_nofile` lifts the soft limit to the hard one at
start (where the system allows it), :func:`descriptor_budget` is what the caps of the listeners are derived
from, and :class:`ConnectionCap` is the per-source and total admission each listener takes a connection
through before it reads a byte.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)

# One source, for every per-source cap: addresses are cheap in blocks (a home or cloud customer gets a whole IPv6
# /56 or /64, a small provider rents IPv4 /24s), so a stranger is counted by the block it sends from. Loopback
# addresses are each a host of their own (the local emulation gives each peer one); no stranger sends from them.
IPV4_PREFIX = 24
IPV6_PREFIX = 56
STRANGER_SHARE = 0.25  # of a port that knows its members' addresses, what all other sources together may hold
# of that share, what one stranger network may hold: several addresses of one block (a rented /24, an IPv6 /56)
# cannot take the whole share from the NAT'd members who dial from their own home networks
STRANGER_NETWORKS = 8
NOFILE_TARGET = 65536  # what raise_nofile asks for (capped by the hard limit)
RESERVED_DESCRIPTORS = 256  # never handed to listeners: the process's own files, DHT, clients, CUDA


def _rlimit() -> tuple[int, int]:
    try:
        import resource
    except ImportError:  # not on this platform
        return 1024, 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def raise_nofile(target: int = NOFILE_TARGET) -> int:
    """Raise the soft RLIMIT_NOFILE towards ``target`` (at most the hard limit); return the soft limit now."""
    soft, hard = _rlimit()
    want = target if hard < 0 else min(target, hard)  # RLIM_INFINITY is -1
    if want > soft:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ImportError, ValueError, OSError) as exc:
            log.info("cannot raise the open-file limit from %d to %d: %s", soft, want, exc)
    return soft


def descriptor_budget() -> int:
    """Descriptors this process may let its listeners hold, all together: the soft limit less a reserve."""
    soft, _ = _rlimit()
    return max(64, soft - RESERVED_DESCRIPTORS)


def network_of(address: str) -> str:
    """The source a per-source cap counts ``address`` under: its IPv4 /24 or IPv6 /56 (an IPv4-mapped IPv6
    address as IPv4), a loopback address alone; anything unparsable as itself."""
    plain = _plain(address)
    try:
        ip = ipaddress.ip_address(plain)
    except ValueError:
        return plain
    if ip.is_loopback:
        return str(ip)
    prefix = IPV4_PREFIX if isinstance(ip, ipaddress.IPv4Address) else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


class ConnectionCap:
    """Admission of connections to one listening port: at most ``per_source`` at once from one source and
    ``total`` from all. A source is a network (:func:`network_of`); once the port knows its members' addresses
    (``set_members``: the hosts of live sealed adverts), a member's address is a source of its own and every
    other source together may hold at most ``STRANGER_SHARE`` of ``total``, so strangers from any number of
    networks cannot take the port from the swarm, and one stranger network at most ``1 / STRANGER_NETWORKS`` of
    that share, so that one network cannot take it from the members behind NAT (who dial from addresses no advert
    names and are strangers here). ``admit(address)`` returns False for one over a cap (the
    listener closes it at once, before reading); each admitted one is given back with ``release(address)``.
    Thread-safe."""

    def __init__(self, total: int, per_source: int, stranger_share: float = STRANGER_SHARE) -> None:
        if total < 1 or per_source < 1:
            raise ValueError(f"caps must be >= 1, got total={total}, per_source={per_source}")
        self.total, self.per_source = total, per_source
        self.stranger_total = max(1, int(total * stranger_share))
        self.per_stranger_network = max(1, min(per_source, self.stranger_total // STRANGER_NETWORKS))
        self._lock = threading.Lock()
        self._members: frozenset[str] | None = None  # _lock; None: not known, every source counts alike
        self._held: dict[str, int] = {}  # _lock: per source key
        self._admitted: dict[str, list[tuple[str, bool]]] = {}  # _lock: address -> (key, member) per connection
        self._count = 0  # _lock
        self._strangers = 0  # _lock
        self.refused = 0

    def set_members(self, addresses: Iterable[str]) -> None:
        """The addresses of the swarm's live members (replaced whole)."""
        members = frozenset(_plain(a) for a in addresses)
        with self._lock:
            self._members = members

    def _key(self, address: str) -> tuple[str, bool]:
        plain = _plain(address)
        if self._members is not None and plain in self._members:
            return plain, True
        return network_of(plain), False

    def admit(self, address: str) -> bool:
        with self._lock:
            key, member = self._key(address)
            held = self._held.get(key, 0)
            known = self._members is not None
            crowded = known and not member and (self._strangers >= self.stranger_total
                                                or held >= self.per_stranger_network)
            if self._count >= self.total or held >= self.per_source or crowded:
                self.refused += 1
                return False
            self._held[key] = held + 1
            self._count += 1
            self._strangers += 0 if member else 1
            # released as what it was admitted as, whatever the member set says by then
            self._admitted.setdefault(address, []).append((key, member))
            return True

    def release(self, address: str) -> None:
        with self._lock:
            admitted = self._admitted.get(address)
            if not admitted:
                return
            key, member = admitted.pop()
            if not admitted:
                del self._admitted[address]
            held = self._held.get(key, 0) - 1
            if held > 0:
                self._held[key] = held
            else:
                self._held.pop(key, None)
            self._count = max(0, self._count - 1)
            if not member:
                self._strangers = max(0, self._strangers - 1)

    @property
    def held(self) -> int:
        with self._lock:
            return self._count


def _plain(address: str) -> str:
    """An address as a peer names it and as sockets report it alike (no brackets, no zone, IPv4-mapped as IPv4)."""
    text = address.strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return text
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)
