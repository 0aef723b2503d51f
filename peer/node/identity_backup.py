"""Backing up and restoring a peer's identity (``peer identity export`` / ``import``).

A peer's id is derived from its private key (``--identity FILE``), so whatever the swarm records about a peer
stays with that key: a reinstall that loses the file starts a stranger. The backup is a small text file that
names what it holds and lets a restore check it before writing anything::

    tasklet-identity 1
    peer_id <the id the key derives>
    sha256 <hex digest of the key bytes>
    key <the DER private key, base64>

The key is not encrypted: the backup is as secret as the identity file itself, and both are written readable
by their owner only (0600). A restore refuses a file that is not such a backup, whose digest or peer id does
not match its key, and an existing identity file of another peer unless forced.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tasklet.peer.identity.keys import Identity

MAGIC = "tasklet-identity 1"
MAX_BACKUP_BYTES = 64 * 1024  # an RSA key of any sane size, base64'd, is a few KiB


class BackupError(ValueError):
    """The backup or identity file cannot be used; the message says which and why."""


def _write_private(path: Path, data: bytes, force: bool, check: Callable[[Path], None] | None = None) -> None:
    """Write ``data`` to ``path`` readable only by its owner, atomically: a temporary file, checked by
    ``check`` (which raises to refuse it) before it is renamed over ``path``."""
    if path.exists() and not force:
        raise BackupError(f"{path} exists; use --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def export_identity(identity_file: str | Path, out: str | Path, force: bool = False) -> str:
    """Write a backup of the identity in ``identity_file`` to ``out``; returns its peer id."""
    try:
        identity = Identity.load(identity_file)
    except ValueError as exc:
        raise BackupError(str(exc)) from None
    key = Path(identity_file).read_bytes()
    text = "\n".join([MAGIC, f"peer_id {identity.peer_id}", f"sha256 {hashlib.sha256(key).hexdigest()}",
                      f"key {base64.b64encode(key).decode()}", ""])
    _write_private(Path(out), text.encode(), force)
    return identity.peer_id


def read_backup(path: str | Path) -> tuple[str, bytes]:
    """(peer id, key bytes) of a backup, checked: format, digest, an RSA private key deriving that peer id."""
    p = Path(path)
    try:
        with p.open("rb") as handle:
            raw = handle.read(MAX_BACKUP_BYTES + 1)
    except OSError as exc:
        raise BackupError(f"{p}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > MAX_BACKUP_BYTES:
        raise BackupError(f"{p}: larger than {MAX_BACKUP_BYTES} bytes: not an identity backup")
    try:
        lines = raw.decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise BackupError(f"{p}: not an identity backup (not text)") from None
    if len(lines) != 4 or lines[0] != MAGIC:
        raise BackupError(f"{p}: not an identity backup (expected {MAGIC!r} and three fields)")
    fields = {}
    for line, name in zip(lines[1:], ("peer_id", "sha256", "key"), strict=True):
        label, _, value = line.partition(" ")
        if label != name or not value:
            raise BackupError(f"{p}: field {name!r} is missing")
        fields[name] = value
    try:
        key = base64.b64decode(fields["key"], validate=True)
    except (binascii.Error, ValueError):
        raise BackupError(f"{p}: the key is not base64") from None
    if hashlib.sha256(key).hexdigest() != fields["sha256"]:
        raise BackupError(f"{p}: the key does not match its sha256 (damaged or edited)")
    try:
        parsed = serialization.load_der_private_key(key, password=None)
    except (ValueError, TypeError):
        raise BackupError(f"{p}: the key is not a DER private key") from None
    if not isinstance(parsed, rsa.RSAPrivateKey):
        raise BackupError(f"{p}: the key is a {type(parsed).__name__}, not an RSA private key")
    return fields["peer_id"], key


def import_identity(backup: str | Path, identity_file: str | Path, force: bool = False) -> str:
    """Restore a backup to ``identity_file``; returns the peer id. An existing file of the same peer is left
    as it is; one of another peer is replaced only with ``force``."""
    peer_id, key = read_backup(backup)
    target = Path(identity_file)
    if target.exists():
        try:
            current = Identity.load(target).peer_id
        except ValueError:
            current = None
        if current == peer_id:
            return peer_id
        if not force:
            held = f"peer {current}" if current else "something that is not an identity"
            raise BackupError(f"{target} holds {held}; use --force to replace it with peer {peer_id}")

    def derives_the_named_peer(written: Path) -> None:
        restored = Identity.load(written).peer_id
        if restored != peer_id:
            raise BackupError(f"{backup}: names peer {peer_id}, but its key is peer {restored}")

    _write_private(target, key, force=True, check=derives_the_named_peer)
    return peer_id
