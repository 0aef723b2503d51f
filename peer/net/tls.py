"""Mutual TLS for the data plane: certificates bound to peer identities, and the set of peers we accept.

Why this shape:

* A peer's certificate is self-signed with its identity key (peer.identity.keys: an RSA key whose hash is the
  peer id). The peer id of a certificate is therefore computed from the certificate's own public key — nothing
  a certificate says about itself (names, serials) is trusted. TLS proves the other side holds that key.
* Every certificate names the same fixed server name (``SERVER_NAME``) and clients verify against it, so
  verification does not depend on the dialled address: it works through NAT, a relay or an HTTP CONNECT proxy,
  which see ciphertext only.
* Trust is a :class:`TrustStore`: the certificates of the peers this one accepts (peers with a live, verified
  advert in a swarm; the peers a coordinator's assignment names in a local run), replaceable at any time. The
  server re-reads it on every new handshake (``grpc.dynamic_ssl_server_credentials``), and the server checks on
  *every call* that the caller is still trusted, so a peer dropped from the set is refused on an open
  connection too. A client pins the certificate it expects at an endpoint when it knows it, else the whole set.
* A :class:`TlsContext` is one peer's key, certificate and trust store; ``TransportConfig.tls`` carries it.
  :func:`process_tls` is the default: an ephemeral identity per process that trusts itself, so that in-process
  servers and clients (tests, tools) talk over TLS without any set-up, while another process is refused.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import grpc
from cryptography.hazmat.primitives import serialization

from tasklet.peer.identity.certs import (
    SERVER_NAME,
    CertificateError,
    fingerprint,
    load_certificate,
    make_certificate,
    peer_id_of_certificate,
    pem_from_text,
    pem_to_text,
)
from tasklet.peer.identity.keys import Identity

logger = logging.getLogger(__name__)


class TrustStore:
    """The certificates of the peers this peer accepts, by peer id, in named groups that are replaced whole.

    Groups let independent sources keep their own part: ``"swarm"`` (live, verified adverts, replaced on each
    membership refresh), ``"assignment"`` (the peers the current assignment names), ``"bootstrap"`` (a
    coordinator named at start-up). A peer is trusted while any group names it. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, dict[str, bytes]] = {}  # group -> peer id -> PEM
        self._by_pem: dict[bytes, str] = {}  # PEM -> peer id, of every trusted certificate
        self.version = 0  # bumped on every change; the server re-reads the bundle when it moves

    def set_group(self, group: str, certificates: Iterable[bytes | str]) -> dict[str, bytes]:
        """Replace a group with these certificates (PEM, or one-line text; invalid ones are logged and left out);
        return them by peer id."""
        entries: dict[str, bytes] = {}
        for cert in certificates:
            try:
                pem = pem_from_text(cert) if isinstance(cert, str) else bytes(cert)  # PEM or the one-line form
                entries[peer_id_of_certificate(pem)] = load_certificate(pem).public_bytes(serialization.Encoding.PEM)
            except CertificateError as exc:
                logger.warning("trust group %s: certificate left out: %s", group, exc)
        with self._lock:
            if self._groups.get(group) == entries:
                return entries
            self._groups[group] = entries
            self._by_pem = {pem: pid for g in self._groups.values() for pid, pem in g.items()}
            self.version += 1
        return entries

    def add(self, group: str, certificates: Iterable[bytes | str]) -> None:
        """Add certificates to a group (keeping what it holds)."""
        with self._lock:
            current = list(self._groups.get(group, {}).values())
        self.set_group(group, [*current, *certificates])

    def peer_of(self, pem: bytes) -> str | None:
        """The peer id of a trusted certificate (exactly as presented), or None."""
        pid = self._by_pem.get(pem)
        if pid is None:  # gRPC may hand the PEM back with other line endings or without a final newline
            try:
                pid = self._by_pem.get(load_certificate(pem).public_bytes(serialization.Encoding.PEM))
            except CertificateError:
                return None
        return pid

    def certificate(self, peer_id: str) -> bytes | None:
        with self._lock:
            for g in self._groups.values():
                if peer_id in g:
                    return g[peer_id]
        return None

    def peers(self) -> set[str]:
        with self._lock:
            return {pid for g in self._groups.values() for pid in g}

    def bundle(self) -> bytes:
        """Every trusted certificate, concatenated (the root set of a TLS context)."""
        with self._lock:
            return b"".join(sorted(set(self._by_pem)))


@dataclass(eq=False)
class TlsContext:
    """One peer's key, certificate and trust store: builds gRPC server and channel credentials."""

    identity: Identity
    trust: TrustStore = field(default_factory=TrustStore)

    def __post_init__(self) -> None:
        self.certificate: bytes = make_certificate(self.identity)
        self.private_key_pem: bytes = self.identity.private_key._private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self.fingerprint = fingerprint(self.certificate)
        self.certificate_text = pem_to_text(self.certificate)
        self.trust.add("self", [self.certificate])  # a peer always accepts itself (its in-process clients)
        self._ssl_lock = threading.Lock()
        self._ssl_server: tuple[int, ssl.SSLContext] | None = None

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @classmethod
    def generate(cls) -> TlsContext:
        return cls(Identity.generate())

    def trust_only(self, certificates: Iterable[bytes | str], group: str = "bootstrap") -> TlsContext:
        """Add certificates to the trust store (returns self, for chaining)."""
        self.trust.add(group, certificates)
        return self

    # --- server -------------------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS that re-reads the trust store on each new handshake (peers that join later are accepted)."""
        seen = [self.trust.version]

        def config() -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration(
                [(self.private_key_pem, self.certificate)], root_certificates=self.trust.bundle()
            )

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            if self.trust.version == seen[0]:
                return None
            seen[0] = self.trust.version
            return config()

        return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=True)

    def caller(self, context: grpc.ServicerContext) -> str | None:
        """The peer id of the caller of a call, if its certificate is trusted now; None otherwise."""
        certs = context.auth_context().get("x509_pem_cert")
        if not certs:
            return None
        return self.trust.peer_of(certs[0])

    # --- client -------------------------------------------------------------------------------------------
    def channel_credentials(self, server_certificate: bytes | None = None) -> grpc.ChannelCredentials:
        """Present our certificate; accept only ``server_certificate`` if given, else any trusted peer."""
        roots = server_certificate if server_certificate else self.trust.bundle()
        return grpc.ssl_channel_credentials(
            root_certificates=roots, private_key=self.private_key_pem, certificate_chain=self.certificate
        )

    def channel(self, target: str, options: Iterable[tuple[str, object]] = ()) -> grpc.Channel:
        """A mutual-TLS channel to any trusted peer at ``target`` (for tools and tests that speak raw gRPC)."""
        return grpc.secure_channel(target, self.channel_credentials(), options=[*options, *self.channel_options()])

    # --- the bulk lane (peer.net.bulk_server / bulk_client): the same mutual TLS through Python's ssl ------
    def ssl_server_context(self) -> ssl.SSLContext:
        """A server context requiring a client certificate among the trusted ones (rebuilt when trust moves; the
        lane still checks the caller on every request, as the gRPC server does on every call)."""
        with self._ssl_lock:
            if self._ssl_server is None or self._ssl_server[0] != self.trust.version:
                version = self.trust.version
                ctx = self._ssl_context(ssl.PROTOCOL_TLS_SERVER, self.trust.bundle())
                ctx.num_tickets = 0  # no resumption (every connection proves its key); no records to skip
                self._ssl_server = (version, ctx)
            return self._ssl_server[1]

    def ssl_client_context(self, server_certificate: bytes | None = None) -> ssl.SSLContext:
        """A client context presenting our certificate; accepts only ``server_certificate`` if given, else any
        trusted peer, checked against the fixed peer name (as ``channel_credentials``)."""
        ctx = self._ssl_context(ssl.PROTOCOL_TLS_CLIENT, server_certificate or self.trust.bundle())
        ctx.check_hostname = True
        return ctx

    def _ssl_context(self, protocol: int, roots: bytes) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=roots.decode())
        # Python's ssl loads a key only from a file: a private directory (mode 0700), removed at once.
        with tempfile.TemporaryDirectory(prefix="tasklet-tls-") as folder:
            path = os.path.join(folder, "identity.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(self.private_key_pem + self.certificate)
            ctx.load_cert_chain(path)
        return ctx

    def peer_of_socket(self, sock: ssl.SSLSocket) -> str | None:
        """The peer id of the other side of a TLS socket, if its certificate is trusted now; None otherwise."""
        der = sock.getpeercert(binary_form=True)
        return None if not der else self.trust.peer_of(ssl.DER_cert_to_PEM_cert(der).encode())

    @staticmethod
    def channel_options() -> list[tuple[str, str]]:
        """Verify the server against the fixed peer name, whatever address (or relay) was dialled."""
        return [("grpc.ssl_target_name_override", SERVER_NAME), ("grpc.default_authority", SERVER_NAME)]


_PROCESS_TLS: TlsContext | None = None
_PROCESS_LOCK = threading.Lock()


def process_tls() -> TlsContext:
    """This process's default TLS context: an ephemeral identity trusting itself (see the module docstring)."""
    global _PROCESS_TLS
    with _PROCESS_LOCK:
        if _PROCESS_TLS is None:
            _PROCESS_TLS = TlsContext.generate()
        return _PROCESS_TLS


def peer_ids(certificates: Mapping[str, str]) -> dict[str, str]:
    """endpoint -> peer id for a map endpoint -> certificate text (as assignments carry); bad ones left out."""
    out: dict[str, str] = {}
    for endpoint, text in certificates.items():
        try:
            out[endpoint] = peer_id_of_certificate(pem_from_text(text))
        except CertificateError as exc:
            logger.warning("certificate for %s ignored: %s", endpoint, exc)
    return out
