"""Peer certificates: a self-signed certificate per identity key, and the peer id a certificate stands for.

The peer id of a certificate is computed from its own public key; nothing a certificate says about itself (names,
serials) is trusted. Below both the transport (``peer.net.tls`` builds TLS on these certificates) and the control
plane (``peer.swarm.adverts`` checks the certificate an advert carries), so that neither imports the other.
"""

from __future__ import annotations

import base64
import datetime
import hashlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tasklet.peer.identity.keys import Identity, peer_id_from_public_key

SERVER_NAME = "tasklet-peer"  # the one DNS name every peer certificate carries; clients check exactly this
MAX_CERT_PEM_BYTES = 4096  # an RSA-2048 certificate is about 1.1 KB; anything much larger is not ours
_VALID_FROM = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
_VALID_UNTIL = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)


class CertificateError(ValueError):
    """A certificate that cannot be a peer's (unparsable, not RSA, too large)."""


def make_certificate(identity: Identity) -> bytes:
    """A self-signed certificate (PEM) for the identity's key; its peer id is the hash of that key.

    Deterministic for a given key (fixed validity, serial from the peer id, PKCS#1 v1.5 signature), so a peer
    that restarts with its --identity file presents the same certificate and fingerprint. ``CA:FALSE``: it is
    trusted as itself (a self-signed leaf in the trust store), never as an issuer of certificates for other keys.
    """
    key = identity.private_key._private_key  # hivemind's RSAPrivateKey wraps a cryptography key
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.peer_id)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(int(identity.peer_id, 16) or 1)
        .not_valid_before(_VALID_FROM)
        .not_valid_after(_VALID_UNTIL)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def load_certificate(pem: bytes | str) -> x509.Certificate:
    data = pem.encode() if isinstance(pem, str) else bytes(pem)
    if len(data) > MAX_CERT_PEM_BYTES:
        raise CertificateError(f"certificate of {len(data)} bytes exceeds {MAX_CERT_PEM_BYTES}")
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise CertificateError(f"not a PEM certificate ({exc})") from None


def fingerprint(pem: bytes | str) -> str:
    """SHA-256 of the certificate's DER encoding, hex: what a signed advert names."""
    return hashlib.sha256(load_certificate(pem).public_bytes(serialization.Encoding.DER)).hexdigest()


def peer_id_of_certificate(pem: bytes | str) -> str:
    """The peer id the certificate's public key stands for (the same hash as peer.identity.keys's)."""
    public = load_certificate(pem).public_key()
    if not isinstance(public, rsa.RSAPublicKey):
        raise CertificateError(f"certificate holds a {type(public).__name__}, peers use RSA keys")
    ssh = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return peer_id_from_public_key(ssh)


def pem_to_text(pem: bytes) -> str:
    """Compact one-line form of a certificate (base64 DER) for adverts, assignments and command lines."""
    return base64.b64encode(load_certificate(pem).public_bytes(serialization.Encoding.DER)).decode()


def pem_from_text(text: str) -> bytes:
    """Inverse of :func:`pem_to_text`; also accepts PEM text as is."""
    if text.startswith("-----BEGIN"):
        load_certificate(text)
        return text.encode()
    try:
        der = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise CertificateError(f"not base64 ({exc})") from None
    if len(der) > MAX_CERT_PEM_BYTES:
        raise CertificateError(f"certificate of {len(der)} bytes exceeds {MAX_CERT_PEM_BYTES}")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise CertificateError(f"not a DER certificate ({exc})") from None
    return cert.public_bytes(serialization.Encoding.PEM)
