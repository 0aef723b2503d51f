"""What a peer announces about itself (:class:`Advert`) and about its links (:class:`LinkReport`).

Both travel through the DHT as plain dicts and come back from peers we do not trust, so ``from_record``
checks every field (type, range, size) and raises a ``ValueError`` that names the first bad field; readers
log it and skip the record. ``bool`` is rejected where a number is expected (in Python ``True`` is an
``int``), NaN and infinities are rejected everywhere, and unknown fields are an error rather than silently
dropped: a record from a newer protocol is refused as a whole, never half-understood.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field

from tasklet.peer.compute.device_probe import DEVICE_KINDS, DeviceInfo
from tasklet.peer.identity.certs import CertificateError, peer_id_of_certificate, pem_from_text
from tasklet.peer.swarm.canonical import canonical_json

try:
    from tasklet.protocol import PROTOCOL_VERSION
except ImportError:  # the protocol package may not define it yet
    PROTOCOL_VERSION = 1

ROLES = ("worker", "client")
LINK_PATHS = ("direct", "reversed", "relayed", "punched")
MAX_EXTRA_BYTES = 4096
MAX_MEMORY_BYTES = 2**50  # 1 PiB: more than any single device
MAX_TFLOPS = 1e5  # 100 PFLOP/s: more than any single device
MAX_BANDWIDTH_BPS = 1e13  # 10 TB/s
MAX_RTT_S = 600.0
_PEER_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")

def _ip(value: object, what: str) -> str:
    """An IP address, written as ``ipaddress`` writes it; ValueError otherwise."""
    if not isinstance(value, str) or len(value) > 45:
        raise ValueError(f"{what}: not an IP address")
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{what}: not an IP address") from None


DHT_PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,64}$")  # a base58 libp2p peer id (an advert's ``dht``)


def check_dht_peer_id(value: object, what: str) -> str:
    """A libp2p peer id in base58 (what an advert's ``dht`` names); ValueError otherwise."""
    if not isinstance(value, str) or not DHT_PEER_ID_RE.match(value):
        raise ValueError(f"{what}: not a base58 peer id")
    return value


# ---- field checks: each returns the value or raises ValueError naming the field ----------------------------


def _fields(record: object, what: str, required: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(record, dict):
        raise ValueError(f"{what}: expected a dict, got {type(record).__name__}")
    missing = sorted(required - set(record))
    if missing:
        raise ValueError(f"{what}.{missing[0]}: missing")
    unknown = sorted(str(key) for key in set(record) - required - optional)
    if unknown:
        raise ValueError(f"{what}.{unknown[0]}: unknown field")
    return record


def _str(value: object, name: str, max_len: int, min_len: int = 0) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a string, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise ValueError(f"{name}: length {len(value)} outside {min_len}..{max_len}")
    return value


def _int(value: object, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} outside {low}..{high}")
    return value


def _float(value: object, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{name}: {value} outside {low:g}..{high:g}")
    return float(value)


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false, got {type(value).__name__}")
    return value


def _choice(value: object, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return value  # type: ignore[return-value]


def check_peer_id(value: object, name: str = "peer_id") -> str:
    value = _str(value, name, 64, 1)
    if not _PEER_ID_RE.match(value):
        raise ValueError(f"{name}: {value!r} may only hold letters, digits, '.', '_' and '-'")
    return value


def check_endpoint(value: object, name: str = "endpoint", relayed: bool = False) -> str:
    """``host:port`` with an IP address or DNS name; IPv6 in brackets (``[::1]:5000``). With ``relayed``, also
    ``PEERID@host:port``: a peer behind NAT reached through the relay at host:port (see peer.net.endpoint)."""
    value = _str(value, name, 300, 3)
    if relayed and "@" in value:
        peer, _, rest = value.partition("@")
        check_peer_id(peer, f"{name} peer")
        check_endpoint(rest, name)
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{name}: {value!r} is not host:port with a port in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as error:
            raise ValueError(f"{name}: {host!r} is not an IPv6 address") from error
        return value
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        if len(host) > 253 or not _HOSTNAME_RE.match(host):
            raise ValueError(f"{name}: {host!r} is neither an IP address nor a host name") from None
    return value


def device_from_record(record: object, name: str = "device") -> DeviceInfo:
    fields = {"name", "kind", "memory_bytes", "tflops", "measured", "emulated"}
    record = _fields(record, name, fields)
    return DeviceInfo(
        name=_str(record["name"], f"{name}.name", 128, 1),
        kind=_choice(record["kind"], f"{name}.kind", DEVICE_KINDS),
        memory_bytes=_int(record["memory_bytes"], f"{name}.memory_bytes", 0, MAX_MEMORY_BYTES),
        tflops=_float(record["tflops"], f"{name}.tflops", 0.0, MAX_TFLOPS),
        measured=_bool(record["measured"], f"{name}.measured"),
        emulated=_bool(record["emulated"], f"{name}.emulated"),
    )


def compute_share(extra: dict) -> float | None:
    """The share of its last applied step a peer's device spent computing, as its advert claims it (``extra``):
    a number in [0, 1], else None (a claim, shown, never planned with)."""
    value = extra.get("compute_share")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0:
        return float(value)
    return None


def check_extra(value: object, name: str = "extra") -> dict:
    """A small dict of JSON data with string keys (stage, throughput, ... whatever the daemon adds)."""
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a dict, got {type(value).__name__}")
    for key in value:
        _str(key, f"{name} key", 64, 1)
    try:
        size = len(canonical_json(value))
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    if size > MAX_EXTRA_BYTES:
        raise ValueError(f"{name}: {size} bytes encoded, more than {MAX_EXTRA_BYTES}")
    return value


# ---- records ---------------------------------------------------------------------------------------------


def _certificate(value: object, peer_id: object) -> str:
    """An advert's certificate: one whose key hashes to the advert's peer id (else it is not the signer's)."""
    if value == "":
        return ""
    if not isinstance(value, str) or len(value) > 4096:
        raise ValueError("advert.cert: a certificate in one-line form of at most 4096 characters")
    try:
        owner = peer_id_of_certificate(pem_from_text(value))
    except CertificateError as exc:
        raise ValueError(f"advert.cert: {exc}") from None
    if owner != peer_id:
        raise ValueError(f"advert.cert: the certificate's key is peer {owner}'s, not the advert's {peer_id}")
    return value


@dataclass(frozen=True)
class Advert:
    """A live peer: who it is, where to reach its gRPC server, what it computes with."""

    peer_id: str
    endpoint: str  # "host:port" of the peer's gRPC server
    device: DeviceInfo
    started_at: float  # DHT time the peer started; the oldest live worker leads (peer.swarm.election)
    protocol_version: int = PROTOCOL_VERSION
    role: str = "worker"  # "client" peers (``peer status``) read the swarm but take no work
    corpus: str = ""  # fingerprint of the training data the peer holds ("" = none / not needed)
    extra: dict = field(default_factory=dict)
    reachable: bool = True  # others can dial ``endpoint`` directly; False: it is "PEERID@RELAY:PORT"
    relay: str = ""  # "host:port" of the relay service this peer offers to peers behind NAT ("" = none)
    # the peer's TLS certificate (peer.net.tls one-line form): its key must be the advert signer's, so the
    # certificate is bound to the peer id; others accept this peer's gRPC connections while the advert lives
    cert: str = ""
    # a NAT'd peer's public address as a relay saw it ("" = none): the doors count its connections as a member's
    dials_from: str = ""
    # the libp2p peer id of the peer's DHT node ("" = none): readers of the run's records ask reachable members'
    # nodes directly, whatever nodes sit next to the keys (peer.swarm.rendezvous); finds from any member's node
    # draw on the members' budget of answers (peer.swarm.findgate)
    dht: str = ""

    def __post_init__(self) -> None:
        Advert.from_record(self.to_record())  # the same checks for adverts we make as for those we read

    def to_record(self) -> dict:
        optional = {"reachable": self.reachable} if not self.reachable else {}
        if self.relay:
            optional["relay"] = self.relay
        if self.cert:
            optional["cert"] = self.cert
        if self.dials_from:
            optional["dials_from"] = self.dials_from
        if self.dht:
            optional["dht"] = self.dht
        return {
            **optional,
            "peer_id": self.peer_id,
            "endpoint": self.endpoint,
            "device": self.device.to_dict(),
            "started_at": self.started_at,
            "protocol_version": self.protocol_version,
            "role": self.role,
            "corpus": self.corpus,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_record(cls, record: object) -> Advert:
        record = _fields(
            record,
            "advert",
            {"peer_id", "endpoint", "device", "started_at", "protocol_version", "role", "corpus", "extra"},
            {"reachable", "relay", "cert", "dials_from", "dht"},
        )
        advert = object.__new__(cls)  # bypass __post_init__: the checks are right here
        values = {
            "peer_id": check_peer_id(record["peer_id"], "advert.peer_id"),
            "endpoint": check_endpoint(record["endpoint"], "advert.endpoint", relayed=True),
            "device": device_from_record(record["device"], "advert.device"),
            "started_at": _float(record["started_at"], "advert.started_at", 0.0, 1e11),
            "protocol_version": _int(record["protocol_version"], "advert.protocol_version", 1, 2**31 - 1),
            "role": _choice(record["role"], "advert.role", ROLES),
            "corpus": _str(record["corpus"], "advert.corpus", 128),
            "extra": check_extra(record["extra"], "advert.extra"),
            "reachable": _bool(record.get("reachable", True), "advert.reachable"),
            "relay": check_endpoint(record["relay"], "advert.relay") if "relay" in record else "",
            "cert": _certificate(record.get("cert", ""), record["peer_id"]),
            "dials_from": _ip(record["dials_from"], "advert.dials_from") if "dials_from" in record else "",
            "dht": check_dht_peer_id(record["dht"], "advert.dht") if "dht" in record else "",
        }
        if values["reachable"] == ("@" in values["endpoint"]):
            raise ValueError("advert.reachable: a peer is reachable exactly when its endpoint is not relayed")
        for name, value in values.items():
            object.__setattr__(advert, name, value)
        return advert


@dataclass(frozen=True)
class LinkReport:
    """A link from ``src`` to ``dst`` as ``src`` sees it; ``measured`` False marks an estimate."""

    src: str
    dst: str
    rtt_s: float
    bandwidth_bps: float  # bits per second
    measured: bool
    at: float  # DHT time of the measurement
    path: str = "direct"  # how src reached dst: direct, reversed (dst dialled back), relayed, punched

    def __post_init__(self) -> None:
        LinkReport.from_record(self.to_record())

    def to_record(self) -> dict:
        return {
            **({"path": self.path} if self.path != "direct" else {}),
            "src": self.src,
            "dst": self.dst,
            "rtt_s": self.rtt_s,
            "bandwidth_bps": self.bandwidth_bps,
            "measured": self.measured,
            "at": self.at,
        }

    @classmethod
    def from_record(cls, record: object) -> LinkReport:
        record = _fields(record, "link", {"src", "dst", "rtt_s", "bandwidth_bps", "measured", "at"}, {"path"})
        report = object.__new__(cls)
        values = {
            "src": check_peer_id(record["src"], "link.src"),
            "dst": check_peer_id(record["dst"], "link.dst"),
            "rtt_s": _float(record["rtt_s"], "link.rtt_s", 0.0, MAX_RTT_S),
            "bandwidth_bps": _float(record["bandwidth_bps"], "link.bandwidth_bps", 0.0, MAX_BANDWIDTH_BPS),
            "measured": _bool(record["measured"], "link.measured"),
            "at": _float(record["at"], "link.at", 0.0, 1e11),
            "path": _choice(record.get("path", "direct"), "link.path", LINK_PATHS),
        }
        if values["src"] == values["dst"]:
            raise ValueError("link.dst: a link must join two different peers")
        for name, value in values.items():
            object.__setattr__(report, name, value)
        return report
