"""`peer identity export` / `import`: a backup restores the same peer id, owner-only; a damaged, edited, foreign or
oversized backup is refused before anything is written, and another peer's identity is replaced only on request."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tasklet.peer.identity.keys import Identity
from tasklet.peer.node.identity_backup import (
    MAX_BACKUP_BYTES,
    BackupError,
    export_identity,
    import_identity,
    read_backup,
)


@pytest.fixture(name="key")
def key_fixture(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "tasklet.peer.key"
    return path, Identity.load_or_create(path).peer_id


def test_round_trip(tmp_path: Path, key: tuple[Path, str]) -> None:
    path, peer_id = key
    backup = tmp_path / "backup.txt"
    assert export_identity(path, backup) == peer_id
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    restored = tmp_path / "new" / "tasklet.peer.key"
    assert import_identity(backup, restored) == peer_id
    assert stat.S_IMODE(restored.stat().st_mode) == 0o600
    assert Identity.load(restored).peer_id == peer_id and restored.read_bytes() == path.read_bytes()
    assert import_identity(backup, restored) == peer_id  # the same peer already there: nothing to do
    with pytest.raises(BackupError, match="exists"):
        export_identity(path, backup)
    assert export_identity(path, backup, force=True) == peer_id


def _edit(backup: Path, old: str, new: str) -> None:
    backup.write_text(backup.read_text().replace(old, new, 1))


def test_damaged_and_foreign_backups_are_refused(tmp_path: Path, key: tuple[Path, str]) -> None:
    path, peer_id = key
    backup = tmp_path / "backup.txt"
    export_identity(path, backup)
    good = backup.read_text()
    key_b64 = good.splitlines()[3].split()[1]
    cases = {
        "not an identity backup": "hello\n",
        "sha256": good.replace(key_b64[10:14], "AAAA" if key_b64[10:14] != "AAAA" else "BBBB", 1),
        "missing": good.replace("sha256 ", "sha512 ", 1),
        "base64": good.replace(key_b64, key_b64[:-4] + "!!!!", 1),
    }
    target = tmp_path / "restored.key"
    for needle, text in cases.items():
        backup.write_text(text)
        with pytest.raises(BackupError, match=needle):
            import_identity(backup, target)
        assert not target.exists()
    other = Identity.generate().peer_id  # names another peer than its key derives
    backup.write_text(good.replace(f"peer_id {peer_id}", f"peer_id {other}", 1))
    with pytest.raises(BackupError, match="but its key is"):
        import_identity(backup, target)
    assert not target.exists() and not list(tmp_path.glob(".*.tmp"))
    backup.write_bytes(b"x" * (MAX_BACKUP_BYTES + 1))
    with pytest.raises(BackupError, match="larger than"):
        read_backup(backup)


def test_another_peers_identity_is_replaced_only_when_forced(tmp_path: Path, key: tuple[Path, str]) -> None:
    path, peer_id = key
    backup = tmp_path / "backup.txt"
    export_identity(path, backup)
    other = tmp_path / "other.key"
    other_id = Identity.load_or_create(other).peer_id
    with pytest.raises(BackupError, match=f"holds peer {other_id}"):
        import_identity(backup, other)
    assert Identity.load(other).peer_id == other_id
    assert import_identity(backup, other, force=True) == peer_id
    assert Identity.load(other).peer_id == peer_id
