"""A peer's long-lived identity: an RSA key, and the peer id derived from it.

Records in the DHT are protected with hivemind's ``RSASignatureValidator``: a record whose key or subkey
contains ``[owner:<ssh public key>]`` must carry a signature by the matching private key, and every DHT node
refuses to store or return one that does not. A peer writes its records under a subkey that starts with its
owner tag, so nobody else can write there, and readers derive the writer's peer id from that same tag. The
peer id is therefore a function of the public key (a SHA-256 prefix): an advert cannot claim an id that is
not its signer's.

The key lives in an ``--identity FILE`` (DER, created with 0600 permissions) so a peer that restarts keeps
its id; without a file the key is ephemeral.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import struct
from collections import OrderedDict
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

logger = logging.getLogger(__name__)

PEER_ID_HEX_CHARS = 20  # 80 bits: collisions need ~2**40 peers
VERIFIED_CACHE_ENTRIES = 8192  # signed records whose signature a DHT node remembers having verified
_OWNER_TAG_RE = re.compile(rb"^\[owner:(ssh-rsa [A-Za-z0-9+/=]+)\]")


def peer_id_from_public_key(public_key: bytes) -> str:
    """The peer id of an OpenSSH-encoded RSA public key: the first 80 bits of its SHA-256, in hex."""
    return hashlib.sha256(public_key).hexdigest()[:PEER_ID_HEX_CHARS]


def owner_tag(public_key: bytes) -> bytes:
    """The ``[owner:...]`` marker that makes hivemind require the owner's signature on a record."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", public_key)


def split_owner_subkey(subkey: object) -> tuple[str, bytes] | None:
    """``(peer_id, rest)`` of a subkey that starts with an owner tag; None for any other subkey."""
    if not isinstance(subkey, bytes):
        return None
    match = _OWNER_TAG_RE.match(subkey)
    if match is None:
        return None
    return peer_id_from_public_key(match.group(1)), subkey[match.end() :]


class Identity:
    """An RSA private key with the derived public key, owner tag and peer id."""

    def __init__(self, private_key: RSAPrivateKey):
        self.private_key = private_key
        self.public_key: bytes = private_key.get_public_key().to_bytes()
        self.owner_tag: bytes = owner_tag(self.public_key)
        self.peer_id: str = peer_id_from_public_key(self.public_key)

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"

    @classmethod
    def generate(cls) -> Identity:
        return cls(RSAPrivateKey())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Identity:
        """Read a key written by :meth:`save`; a clear ValueError if the file is not one."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ValueError(f"identity file {path}: cannot read it ({error.strerror})") from error
        try:
            key = serialization.load_der_private_key(data, password=None)
        except (ValueError, TypeError) as error:
            raise ValueError(f"identity file {path}: not a DER-encoded RSA private key") from error
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"identity file {path}: holds a {type(key).__name__}, not an RSA private key")
        if os.name == "posix" and stat.S_IMODE(path.stat().st_mode) & 0o077:
            logger.warning("identity file %s is readable by other users; chmod 600 it", path)
        private_key = RSAPrivateKey.__new__(RSAPrivateKey)
        private_key.__setstate__({"_private_key": data})  # hivemind's own unpickling path
        return cls(private_key)

    def save(self, path: str | os.PathLike) -> None:
        """Write the key to a new file readable only by its owner (refuses to overwrite)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as error:
            raise ValueError(f"identity file {path}: already exists") from error
        with os.fdopen(fd, "wb") as handle:
            handle.write(self.private_key.to_bytes())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike | None) -> Identity:
        """The identity in ``path``, created there if missing; an ephemeral one when ``path`` is None."""
        if path is None:
            return cls.generate()
        if Path(path).exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        logger.info("created identity %s in %s", identity.peer_id, path)
        return identity

    def signature_validator(self) -> RSASignatureValidator:
        """The validator to give ``hivemind.DHT(record_validators=...)`` so our records get signed."""
        return CachingSignatureValidator(self.private_key)


class CachingSignatureValidator(RSASignatureValidator):
    """hivemind's signature check, remembering the records it has verified.

    A DHT node verifies every signed entry of every value a lookup returns: a run's ``peers`` record holds
    one advert per live peer and every heartbeat's store and get visits several nodes, so each node checked
    the same unchanged adverts again and again (the largest share of a DHT process's CPU in a 32-peer swarm,
    by py-spy). The outcome of a check is a function of the record's bytes (key, subkey, value with its
    signature, expiry), so a record identical to one already verified is accepted without a new RSA check; a
    record that differs in any byte is verified. Only successes are remembered, at most
    ``VERIFIED_CACHE_ENTRIES`` (least recently used dropped).
    """

    def __init__(self, private_key: RSAPrivateKey | None = None, max_entries: int = VERIFIED_CACHE_ENTRIES) -> None:
        super().__init__(private_key)
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._max_entries = max_entries

    def validate(self, record: DHTRecord) -> bool:
        digest = _record_digest(record)
        if digest in self._verified:
            self._verified.move_to_end(digest)
            return True
        if not super().validate(record):
            return False
        self._verified[digest] = None
        if len(self._verified) > self._max_entries:
            self._verified.popitem(last=False)
        return True


def _record_digest(record: DHTRecord) -> bytes:
    """SHA-256 over every byte the signature check depends on, each part length-prefixed."""
    h = hashlib.sha256()
    for part in (record.key, record.subkey, record.value):
        h.update(struct.pack("!Q", len(part)))
        h.update(part)
    h.update(struct.pack("!d", float(record.expiration_time)))
    return h.digest()
