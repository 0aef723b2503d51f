"""Crash-safe checkpoint storage on one disk: what a leader writes and what ``--resume`` reads.

Layout of a checkpoint folder ``ROOT``::

    ROOT/step-NNNNNN/stage-S.pt      one stage's state (params, AdamW moments, step), torch.save
    ROOT/step-NNNNNN/run.json        the run config and the layer split
    ROOT/step-NNNNNN/manifest.json   sha256 and size of every other file; written last
    ROOT/latest                      "step-NNNNNN": the newest complete checkpoint

Why it is written this way. A power cut or a SIGKILL may stop the writer at any byte:

* A checkpoint is written into ``.tmp-*`` and renamed into place only when every file is written and
  fsynced, then the folder itself is fsynced: a ``step-*`` folder is complete or absent, never half there.
* ``latest`` is never rewritten in place: a temp file is written, fsynced and renamed over it, and the
  folder is fsynced, so after a crash it names either the old checkpoint or the new one.
* A disk can still damage a file later (bad sector, truncation by a full disk on a filesystem that lies
  about fsync): the manifest's checksums are verified on read, and a damaged checkpoint is skipped for the
  previous one, with a warning that names both (:meth:`CheckpointStore.newest_valid`).
* Only the newest ``keep`` checkpoints stay; older ones and leftovers of interrupted writes are removed
  after each successful write.

Reading trusts nothing: a manifest that lists a file outside its folder, a size that differs, or a checksum
that differs makes the checkpoint damaged, never loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tasklet.peer.runtime.choices import DEFAULT_KEEP
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.message import WireEnvelope

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RUN_META = "run.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder and what is wrong."""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint folder is incomplete or a file's checksum differs from its manifest."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def parse_step_name(name: str) -> int | None:
    """The step of a ``step-NNNNNN`` name; None for anything else."""
    if not name.startswith("step-"):
        return None
    digits = name.removeprefix("step-")
    return int(digits) if digits.isdigit() and len(digits) <= 12 else None


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX: the directory entry lives in the folder)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> str:
    """Write, flush and fsync ``data``; return its sha256."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Checkpoint:
    """A verified checkpoint read from disk."""

    step: int
    meta: dict[str, Any]
    states: dict[int, dict[str, Any]]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newer checkpoints passed over, and why


class CheckpointStore:
    """The checkpoints of one run in one folder (see the module docstring)."""

    def __init__(self, root: Path, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep: must be at least 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        # a step whose newest checkpoint at or before it is kept beyond ``keep`` (None: none): the one a roll-back
        # for a cheater's unverified work would go to (peer.runtime.lead.driver); one extra checkpoint at most
        self.pin: int | None = None

    def keep_for_rollback(self, step: int | None) -> None:
        """Keep the newest checkpoint at or before ``step`` beyond ``keep`` (None: keep none extra)."""
        self.pin = step

    # ------------------------------------------------------------------------------------------- writing
    def write(self, step: int, states: dict[int, dict[str, Any]], meta: dict[str, Any]) -> Path:
        """Write a complete checkpoint of ``step`` durably, point ``latest`` at it, prune; return its folder."""
        files = {f"stage-{stage}.pt": _torch_bytes(state) for stage, state in sorted(states.items())}
        files[RUN_META] = json.dumps(meta, indent=1).encode()
        return self.write_files(step, files)

    def write_files(self, step: int, files: dict[str, bytes]) -> Path:
        """Write already-serialised checkpoint files (a replica receives them this way) durably."""
        for name in files:
            _check_name(name)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{step_name(step)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        manifest = {"step": step, "files": {}}
        for name, data in sorted(files.items()):
            manifest["files"][name] = {"sha256": write_file_durably(tmp / name, data), "size": len(data)}
        write_file_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        return self.install(tmp, step)

    def install(self, tmp: Path, step: int) -> Path:
        """Rename a complete, fsynced folder (files and manifest) into place as the checkpoint of ``step``,
        point ``latest`` at it and prune; return its folder."""
        final = self.root / step_name(step)
        fsync_dir(tmp)
        if final.exists():  # a re-write of the same step (e.g. on exit right after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.root)
        self._point_latest(final.name)
        self.prune()
        return final

    def _point_latest(self, name: str) -> None:
        tmp = self.root / f".{LATEST}.tmp-{os.getpid()}"
        write_file_durably(tmp, (name + "\n").encode())
        os.replace(tmp, self.root / LATEST)
        fsync_dir(self.root)

    def prune(self) -> list[int]:
        """Keep the newest ``keep`` checkpoints and the newest at or before ``pin``; remove older ones and
        leftovers of interrupted writes."""
        removed = []
        steps = self.steps()
        pinned = max((s for s in steps if self.pin is not None and s <= self.pin), default=None)
        for step in steps[: -self.keep]:
            if step == pinned:
                continue
            shutil.rmtree(self.root / step_name(step), ignore_errors=True)
            removed.append(step)
        for leftover in self.root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if removed:
            log.info("checkpoints pruned to the newest %d%s (removed steps %s)", self.keep,
                     "" if pinned is None else f" and step {pinned} (a roll-back may need it)", removed)
        return removed

    # ------------------------------------------------------------------------------------------- reading
    def steps(self) -> list[int]:
        """Steps of the checkpoint folders present (complete or not), ascending."""
        if not self.root.is_dir():
            return []
        found = (parse_step_name(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(s for s in found if s is not None)

    def pointed(self) -> int | None:
        """The step ``latest`` names, if it names one."""
        try:
            name = (self.root / LATEST).read_text().strip()
        except OSError:
            return None
        step = parse_step_name(name)
        if step is None:
            log.warning("checkpoint pointer %s is malformed: %r", self.root / LATEST, name[:40])
        return step

    def read_files(self, step: int) -> dict[str, bytes]:
        """Every file of a checkpoint (manifest included), verified; raises CheckpointDamagedError."""
        folder = self.root / step_name(step)
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            listed = manifest["files"]
            if manifest.get("step") != step or not isinstance(listed, dict) or RUN_META not in listed:
                raise ValueError("manifest does not describe this step")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointDamagedError(f"{folder}: no readable manifest ({exc})") from None
        out: dict[str, bytes] = {MANIFEST: (folder / MANIFEST).read_bytes()}
        for name, entry in listed.items():
            try:
                _check_name(name)
                data = (folder / name).read_bytes()
            except (OSError, CheckpointError) as exc:
                raise CheckpointDamagedError(f"{folder}: {name}: {exc}") from None
            if not isinstance(entry, dict) or len(data) != entry.get("size"):
                raise CheckpointDamagedError(f"{folder}: {name} has {len(data)} bytes, the manifest says "
                                             f"{entry.get('size') if isinstance(entry, dict) else entry!r}")
            if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
                raise CheckpointDamagedError(f"{folder}: {name} does not match its checksum")
            out[name] = data
        return out

    def verify(self, step: int) -> None:
        """Check every file of a checkpoint against its manifest, streaming (no file is held in memory);
        raises CheckpointDamagedError."""
        folder = self.root / step_name(step)
        try:
            listed = _parse_manifest((folder / MANIFEST).read_bytes(), step)
        except (OSError, CheckpointError) as exc:
            raise CheckpointDamagedError(f"{folder}: no readable manifest ({exc})") from None
        for name, entry in listed.items():
            path = folder / name
            if not path.is_file() or path.stat().st_size != entry["size"] or sha256_of(path) != entry["sha256"]:
                raise CheckpointDamagedError(f"{folder}: {name} is missing, short or does not match its checksum")

    def newest_intact(self) -> int | None:
        """The step of the newest checkpoint whose files match their manifest (checked streaming, not loaded)."""
        pointed = self.pointed()
        candidates = sorted(set(self.steps()) | ({pointed} if pointed is not None else set()), reverse=True)
        for step in candidates:
            try:
                self.verify(step)
            except CheckpointDamagedError as exc:
                log.warning("checkpoint copy of step %d is damaged (%s)", step, exc)
                continue
            return step
        return None

    def load(self, step: int) -> Checkpoint:
        """A verified checkpoint; raises CheckpointDamagedError."""
        files = self.read_files(step)
        try:
            meta = json.loads(files[RUN_META])
            if meta.get("step") != step:  # a copy names its step twice (folder, metadata): both must agree
                raise ValueError(f"its metadata is of step {meta.get('step')!r}")
            n_stages = len(meta["stages"])
            states = {s: _torch_load(files[f"stage-{s}.pt"]) for s in range(n_stages)}
            wrong = {s: st.get("step") for s, st in states.items() if isinstance(st, dict) and st.get("step") != step}
            if wrong:  # a stage's own step counter must agree with the folder's
                raise ValueError(f"stage states of other steps: {wrong}")
        except Exception as exc:  # unpicklable, missing stage file, wrong layout: damaged, whatever the cause
            raise CheckpointDamagedError(f"{self.root / step_name(step)}: {exc}") from None
        return Checkpoint(step, meta, states)

    def newest_valid(self, at_most: int | None = None) -> Checkpoint | None:
        """The newest checkpoint whose every file verifies: ``latest`` first, then older folders, newest first;
        only of steps up to ``at_most`` when given (a roll-back, or the step the run recorded).

        Damaged ones are skipped with a warning that names the one used instead; None when none is usable.
        """
        pointed = self.pointed()
        candidates = sorted(set(self.steps()) | ({pointed} if pointed is not None else set()), reverse=True)
        if pointed is not None:  # latest is authoritative for "newest"; folders past it were never finished
            candidates = [pointed] + [s for s in candidates if s < pointed]
        if at_most is not None:
            candidates = [s for s in candidates if s <= at_most]
        skipped: list[tuple[int, str]] = []
        for step in candidates:
            try:
                ckpt = self.load(step)
            except CheckpointDamagedError as exc:
                skipped.append((step, str(exc)))
                continue
            ckpt.skipped = skipped
            for bad, why in skipped:
                log.warning("checkpoint of step %d is damaged (%s); using the previous one, of step %d",
                            bad, why, step)
            return ckpt
        for bad, why in skipped:
            log.warning("checkpoint of step %d is damaged (%s); no older checkpoint to use", bad, why)
        return None


def _check_name(name: str) -> None:
    """A checkpoint file name: one plain component (a manifest or a replica cannot point outside the folder)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or len(name) > 64:
        raise CheckpointError(f"invalid checkpoint file name {name[:70]!r}")


def _torch_bytes(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _torch_load(data: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(data), weights_only=True)


# ----------------------------------------------------------------------------------------------- replication
# A checkpoint travels between peers in parts, each an Envelope of Kind CHECKPOINT of at most COPY_CHUNK_BYTES of
# file data, so a checkpoint of any size fits every per-Kind bound (a whole 1 GiB+ checkpoint in one Envelope did
# not). Pushed by the leader (meta["part"]):
#   "begin"  the manifest (one uint8 tensor named manifest.json): names, sizes, sha256 of every file. The receiver
#            checks it against its bound and its free disk, and opens a staging folder.
#   "data"   meta["file"], meta["offset"]: the next bytes of one file, in order; hashed as they are written.
#   "end"    every file must be complete and match its checksum; the folder is then installed like a checkpoint
#            written locally (fsync, rename, ``latest``, prune). A short or damaged copy is refused and removed.
# Fetched by a new leader (FetchRequest meta): "probe" (which step), "manifest" (the manifest of that step), and
# "file"/"offset"/"length"/"step" (a range of one file); the fetcher checks sizes and checksums against the
# manifest before it uses the copy (fetch_copy_files).
# A worker keeps each run's copies in their own folder (copies_folder), at most ``keep`` of them (the newest), each
# no larger than the run's checkpoint (peer.runtime.bounds.checkpoint_bytes) and leaving the disk above its floor
# (disk_floor_bytes); prune_copies removes a finished run's. A copy's files are checked against its manifest's
# sizes and checksums before anything deserialises them (CheckpointStore.read_files, fetch_copy_files), and then
# only with torch's weights-only loader.
MAX_FILES = 1024
COPY_CHUNK_BYTES = 16 << 20  # file bytes per part; a receiver accepts parts of at most this (+ envelope slack)
COPY_PART_SLACK_BYTES = 64 * 1024  # an Envelope's key, names and meta on top of its data
MANIFEST_MAX_BYTES = 1 << 20
UNKNOWN_MODEL_COPY_BYTES = 1 << 40  # no size from the model (Hugging Face config): only the free disk bounds it
# A copy must leave the receiver's disk at least this free: the larger of a fixed floor and a share of the disk,
# so a leader's copies never fill a member's disk (the owner's other files, logs and our own state need room).
DISK_FLOOR_BYTES = 1 << 30
DISK_FLOOR_FRACTION = 0.05
COPIES_KEEP = 2  # copies of a run a worker keeps when its swarm's checkpoint_keep is not given


def copy_part_bound_bytes() -> int:
    """The largest CHECKPOINT Envelope a worker accepts: one part (see above)."""
    return COPY_CHUNK_BYTES + COPY_PART_SLACK_BYTES


def _part_envelope(run_id: str, epoch: int, step: int, part: str, name: str = "",
                   data: bytes | memoryview = b"", **meta: int | str) -> WireEnvelope:
    """One part; its file bytes are sent from ``data`` as is (protocol.message: copied once, into the chunks)."""
    env = WireEnvelope(pb.Envelope(kind=pb.CHECKPOINT, key=pb.Key(run_id=run_id, epoch=epoch, step=step)))
    env.meta["step"], env.meta["part"] = str(step), part
    for key, value in meta.items():
        env.meta[key] = str(value)
    if name:
        env.add_bytes(name, data)
    return env


def copy_parts(run_id: str, epoch: int, step: int, files: dict[str, bytes],
               chunk_bytes: int | None = None) -> Iterator[WireEnvelope]:
    """The Envelopes that push a checkpoint (its verified files, manifest included) as a copy, in order; each
    part's data is a view of ``files`` (no copy), which must not change until the parts are sent."""
    chunk = chunk_bytes or COPY_CHUNK_BYTES
    if MANIFEST not in files:
        raise CheckpointError("a checkpoint without its manifest cannot be copied")
    yield _part_envelope(run_id, epoch, step, "begin", MANIFEST, files[MANIFEST])
    for name, data in sorted(files.items()):
        if name == MANIFEST:
            continue
        view = memoryview(data)
        for offset in range(0, max(len(data), 1), chunk):
            yield _part_envelope(run_id, epoch, step, "data", name, view[offset:offset + chunk], file=name,
                                 offset=offset)
    yield _part_envelope(run_id, epoch, step, "end")


def _parse_manifest(data: bytes, step: int) -> dict[str, dict[str, Any]]:
    """The files a manifest lists (name -> {size, sha256}), every entry checked; raises CheckpointError."""
    try:
        manifest = json.loads(data)
        listed = manifest["files"]
        ok = manifest.get("step") == step and isinstance(listed, dict) and RUN_META in listed
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok or len(data) > MANIFEST_MAX_BYTES or len(listed) > MAX_FILES:
        raise CheckpointError(f"the manifest of step {step} is malformed or does not describe that step")
    for name, entry in listed.items():
        _check_name(name)
        if name == MANIFEST or not isinstance(entry, dict) or not isinstance(entry.get("size"), int) \
                or not 0 <= entry["size"] < 1 << 50 or not isinstance(entry.get("sha256"), str):
            raise CheckpointError(f"manifest entry {name[:70]!r} is malformed")
    return listed


@dataclass
class _Incoming:
    """A copy being received: its manifest, staging folder, and the bytes and hash of each file so far."""

    sender: str
    step: int
    listed: dict[str, dict[str, Any]]
    manifest: bytes
    folder: Path
    received: dict[str, int] = field(default_factory=dict)
    hashes: dict[str, Any] = field(default_factory=dict)


class CopyReceiver:
    """A worker's side of pushed copies: one copy in flight at a time (a newer "begin" replaces it), staged on
    disk part by part so memory stays one part, installed only when complete and verified."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._incoming: _Incoming | None = None

    def receive(self, env: pb.Envelope, store: CheckpointStore, bound_bytes: int) -> int | None:
        """Take one part; the step when it completed a copy (installed in ``store``), else None. Raises
        CheckpointError for anything out of order, over the bound, short or damaged (the copy is dropped)."""
        try:
            step = int(env.meta.get("step", ""))
        except ValueError:
            raise CheckpointError("a checkpoint part without a step") from None
        part = env.meta.get("part", "")
        if not 0 <= step < 10**12 or part not in ("begin", "data", "end"):
            raise CheckpointError(f"a checkpoint part {part[:20]!r} of step {step}")
        with self._lock:
            try:
                if part == "begin":
                    self._begin(env, step, store, bound_bytes)
                    return None
                incoming = self._incoming
                if incoming is None or incoming.sender != env.sender or incoming.step != step:
                    raise CheckpointError(f"a {part} part of step {step} without its begin")
                if part == "data":
                    self._data(incoming, env)
                    return None
                self._end(incoming, store)
                return step
            except CheckpointError:
                self._drop()
                raise

    def _begin(self, env: pb.Envelope, step: int, store: CheckpointStore, bound_bytes: int) -> None:
        self._drop()
        if len(env.tensors) != 1 or env.tensors[0].name != MANIFEST:
            raise CheckpointError("a begin part carries exactly the manifest")
        data = bytes(env.tensors[0].data)
        listed = _parse_manifest(data, step)
        total = sum(entry["size"] for entry in listed.values())
        if total > bound_bytes:
            raise CheckpointError(f"a copy of {total} bytes is over this peer's bound of {bound_bytes}")
        store.root.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(store.root)
        floor = disk_floor_bytes(usage.total)
        if usage.free - total < floor:
            raise CheckpointError(f"a copy of {total} bytes would leave {usage.free - total} bytes of this peer's "
                                  f"disk free, under its floor of {floor}")
        folder = store.root / f".tmp-recv-{step_name(step)}-{os.getpid()}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        self._incoming = _Incoming(env.sender, step, listed, data, folder)

    @staticmethod
    def _data(incoming: _Incoming, env: pb.Envelope) -> None:
        name = env.meta.get("file", "")
        try:
            offset = int(env.meta.get("offset", ""))
        except ValueError:
            raise CheckpointError("a data part without an offset") from None
        if name not in incoming.listed or len(env.tensors) != 1 or env.tensors[0].name != name:
            raise CheckpointError(f"a data part for {name[:70]!r}, which the manifest does not list")
        data = env.tensors[0].data
        have = incoming.received.get(name, 0)
        if offset != have or have + len(data) > incoming.listed[name]["size"]:
            raise CheckpointError(f"{name}: bytes {offset}..{offset + len(data)} out of order or past its size")
        with open(incoming.folder / name, "ab") as f:
            f.write(data)
        incoming.hashes.setdefault(name, hashlib.sha256()).update(data)
        incoming.received[name] = have + len(data)

    @staticmethod
    def _end(incoming: _Incoming, store: CheckpointStore) -> None:
        for name, entry in incoming.listed.items():
            got = incoming.received.get(name, 0)
            if got != entry["size"]:
                raise CheckpointError(f"{name}: {got} of its {entry['size']} bytes arrived")
            digest = incoming.hashes.get(name, hashlib.sha256()).hexdigest()
            if digest != entry["sha256"]:
                raise CheckpointError(f"{name} does not match the sender's checksum")
            path = incoming.folder / name
            path.touch()
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        write_file_durably(incoming.folder / MANIFEST, incoming.manifest)
        store.install(incoming.folder, incoming.step)

    def abandon(self) -> None:
        """Drop the copy in flight, if any (its run is done and its folder is about to go)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._incoming is not None:
            shutil.rmtree(self._incoming.folder, ignore_errors=True)
            self._incoming = None


def disk_floor_bytes(disk_total: int) -> int:
    """The free bytes a received copy must leave on a disk of ``disk_total`` bytes (see DISK_FLOOR_BYTES)."""
    return max(DISK_FLOOR_BYTES, int(disk_total * DISK_FLOOR_FRACTION))


_PLAIN_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def copies_folder(root: Path, run_id: str) -> Path:
    """The folder under ``root`` holding one run's checkpoint copies: ``root/<run_id>`` for a run id that is one
    plain path component; any other run id (slashes, dots only, spaces...) is named by its hash, behind a ``~``
    that no plain run id has, so a run id can neither point outside ``root`` nor share another run's folder."""
    if _PLAIN_RUN_ID.fullmatch(run_id):  # never "." or "..": it starts with a letter or digit
        return Path(root) / run_id
    return Path(root) / ("~" + hashlib.sha256(run_id.encode()).hexdigest()[:32])


def prune_copies(root: Path, run_id: str) -> bool:
    """Remove every checkpoint copy of ``run_id`` kept under ``root`` (the run is done: no future leader of it
    needs them); whether there was anything to remove."""
    folder = copies_folder(root, run_id)
    if not folder.exists():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    log.info("removed the checkpoint copies of run %r (%s)", run_id, folder)
    return True


def serve_copy(store: CheckpointStore, run_id: str, epoch: int, meta: Mapping[str, str]) -> WireEnvelope:
    """A worker's answer to a new leader's CHECKPOINT fetch (see the section comment); raises CheckpointError."""
    if "file" not in meta:
        step = store.newest_intact()
        if step is None:
            raise CheckpointError(f"this peer holds no intact checkpoint copy of run {run_id!r}")
        if meta.get("manifest") == "1":
            return _part_envelope(run_id, epoch, step, "manifest", MANIFEST,
                                  (store.root / step_name(step) / MANIFEST).read_bytes())
        return _part_envelope(run_id, epoch, step, "probe")
    name = meta.get("file", "")
    try:
        step, offset, length = int(meta.get("step", "")), int(meta.get("offset", "")), int(meta.get("length", ""))
    except ValueError:
        raise CheckpointError("a range fetch needs integer step, offset and length") from None
    _check_name(name)
    folder = store.root / step_name(step)
    listed = _parse_manifest((folder / MANIFEST).read_bytes(), step) if (folder / MANIFEST).is_file() else {}
    if name not in listed:
        raise CheckpointError(f"no file {name!r} in a copy of step {step} here")
    if not 0 <= offset <= listed[name]["size"] or not 0 < length <= COPY_CHUNK_BYTES:
        raise CheckpointError(f"range {offset}+{length} of {name} is out of bounds")
    with open(folder / name, "rb") as f:
        f.seek(offset)
        data = f.read(min(length, listed[name]["size"] - offset))
    return _part_envelope(run_id, epoch, step, "data", name, data, file=name, offset=offset)


def fetch_copy_files(fetch: Callable[[dict[str, str]], pb.Envelope], bound_bytes: int = UNKNOWN_MODEL_COPY_BYTES,
                     chunk_bytes: int | None = None) -> tuple[int, dict[str, bytes]]:
    """A new leader's side: the step and files (manifest included) of the newest copy a peer holds, fetched in
    ranges of at most ``chunk_bytes``. ``fetch(meta)`` performs one CHECKPOINT fetch. Every file's size and
    checksum are checked against the manifest; raises CheckpointError (a short or damaged copy)."""
    chunk = min(chunk_bytes or COPY_CHUNK_BYTES, COPY_CHUNK_BYTES)
    head = fetch({"manifest": "1"})
    try:
        step = int(head.meta.get("step", ""))
    except ValueError:
        raise CheckpointError("a manifest answer without a step") from None
    if len(head.tensors) != 1 or head.tensors[0].name != MANIFEST:
        raise CheckpointError("a manifest answer without the manifest")
    manifest = bytes(head.tensors[0].data)
    listed = _parse_manifest(manifest, step)
    if sum(entry["size"] for entry in listed.values()) > bound_bytes:
        raise CheckpointError(f"the copy of step {step} is larger than {bound_bytes} bytes")
    files = {MANIFEST: manifest}
    for name, entry in sorted(listed.items()):
        buf = bytearray()
        while len(buf) < entry["size"]:
            part = fetch({"file": name, "step": str(step), "offset": str(len(buf)), "length": str(chunk)})
            data = part.tensors[0].data if len(part.tensors) == 1 and part.tensors[0].name == name else b""
            if not data or len(data) > chunk:
                raise CheckpointError(f"{name}: a range answer of {len(data)} bytes at offset {len(buf)}")
            buf += data
        if len(buf) != entry["size"] or hashlib.sha256(buf).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{name}: the fetched bytes do not match the manifest")
        files[name] = bytes(buf)
    return step, files


def store_copy(store: CheckpointStore, step: int, files: dict[str, bytes]) -> Path:
    """Store a received copy durably and verify it; a copy that does not verify is removed (and raises).

    Verified without deserialising: every file against the sender's manifest, the metadata's step (JSON); the
    stage files are loaded only by whoever uses the copy, after checking the manifest against a signed hash."""
    payload = {name: data for name, data in files.items() if name != MANIFEST}
    folder = store.write_files(step, payload)
    try:
        received = json.loads(files[MANIFEST])
        written = json.loads((folder / MANIFEST).read_text())
        if not isinstance(received, dict) or received.get("files") != written.get("files"):
            raise CheckpointDamagedError(f"{folder}: the copy's files differ from the sender's manifest")
        store.verify(step)
        meta = json.loads(files.get(RUN_META, b"null"))
        if not isinstance(meta, dict) or meta.get("step") != step:
            raise CheckpointDamagedError(f"{folder}: its metadata is of step "
                                         f"{meta.get('step') if isinstance(meta, dict) else None!r}")
    except (CheckpointDamagedError, ValueError, KeyError) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(exc, CheckpointDamagedError):
            raise
        raise CheckpointDamagedError(f"{folder}: unreadable manifest or metadata ({exc})") from None
    return folder


def copy_bound_bytes(model: Any) -> int:
    """The largest checkpoint copy a peer accepts for a run of ``model``: parameters and two AdamW moments of a
    GPT-shaped model of that size (fp32), with a quarter of room and 1 MiB for the manifest and metadata."""
    d = int(getattr(model, "d_model", 0) or 0)
    layers = int(getattr(model, "n_layers", 0) or 0)
    vocab = int(getattr(model, "vocab_size", 0) or 0)
    seq = int(getattr(model, "seq_len", 0) or 0)
    ratio = int(getattr(model, "mlp_ratio", 4) or 4)
    if not d or not layers:  # a model described otherwise (Hugging Face config): the transport's envelope cap
        return UNKNOWN_MODEL_COPY_BYTES
    params = layers * (4 + 2 * ratio) * d * d + 2 * vocab * d + seq * d + 16 * layers * d
    return int(params * 3 * 4 * 1.25) + (1 << 20)
