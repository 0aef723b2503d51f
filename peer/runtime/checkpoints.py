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
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protocol import tasklet_pb2 as pb

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RUN_META = "run.json"
LATEST = "latest"
DEFAULT_KEEP = 3


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
        final = self.root / step_name(step)
        tmp = self.root / f".tmp-{step_name(step)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        manifest = {"step": step, "files": {}}
        for name, data in sorted(files.items()):
            manifest["files"][name] = {"sha256": write_file_durably(tmp / name, data), "size": len(data)}
        write_file_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
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
        """Keep the newest ``keep`` checkpoints; remove older ones and leftovers of interrupted writes."""
        removed = []
        for step in self.steps()[: -self.keep]:
            shutil.rmtree(self.root / step_name(step), ignore_errors=True)
            removed.append(step)
        for leftover in self.root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if removed:
            log.info("checkpoints pruned to the newest %d (removed steps %s)", self.keep, removed)
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

    def load(self, step: int) -> Checkpoint:
        """A verified checkpoint; raises CheckpointDamagedError."""
        files = self.read_files(step)
        try:
            meta = json.loads(files[RUN_META])
            n_stages = len(meta["stages"])
            states = {s: _torch_load(files[f"stage-{s}.pt"]) for s in range(n_stages)}
        except Exception as exc:  # unpicklable, missing stage file, wrong layout: damaged, whatever the cause
            raise CheckpointDamagedError(f"{self.root / step_name(step)}: {exc}") from None
        return Checkpoint(step, meta, states)

    def newest_valid(self) -> Checkpoint | None:
        """The newest checkpoint whose every file verifies: ``latest`` first, then older folders, newest first.

        Damaged ones are skipped with a warning that names the one used instead; None when none is usable.
        """
        pointed = self.pointed()
        candidates = sorted(set(self.steps()) | ({pointed} if pointed is not None else set()), reverse=True)
        if pointed is not None:  # latest is authoritative for "newest"; folders past it were never finished
            candidates = [pointed] + [s for s in candidates if s < pointed]
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
# A checkpoint travels between peers as one Envelope of Kind CHECKPOINT: every file (manifest included) as a
# uint8 tensor named after it, meta["step"]. The receiver stores it through write_files, then verifies it like
# any checkpoint on its own disk (load); a copy that does not verify is removed and refused.
MAX_FILES = 1024
UNKNOWN_MODEL_COPY_BYTES = 1 << 30  # as large as any Envelope a peer reassembles (peer.net.config)


def files_envelope(run_id: str, epoch: int, step: int, files: dict[str, bytes]) -> pb.Envelope:
    env = pb.Envelope(kind=pb.CHECKPOINT, key=pb.Key(run_id=run_id, epoch=epoch, step=step))
    env.meta["step"] = str(step)
    for name, data in sorted(files.items()):
        env.tensors.append(pb.Tensor(name=name, dtype="uint8", shape=[len(data)], data=data))
    return env


def files_from_envelope(env: pb.Envelope) -> tuple[int, dict[str, bytes]]:
    """The step and files of a CHECKPOINT envelope; names checked, nothing else trusted yet."""
    try:
        step = int(env.meta.get("step", ""))
    except ValueError:
        raise CheckpointError("a checkpoint copy without a step") from None
    if not 0 <= step < 10**12 or len(env.tensors) > MAX_FILES:
        raise CheckpointError(f"a checkpoint copy of step {step} with {len(env.tensors)} files")
    files: dict[str, bytes] = {}
    for t in env.tensors:
        _check_name(t.name)
        if t.dtype != "uint8" or list(t.shape) != [len(t.data)] or t.name in files:
            raise CheckpointError(f"checkpoint file {t.name!r}: not one uint8 vector of its bytes")
        files[t.name] = t.data
    if MANIFEST not in files:
        raise CheckpointError("a checkpoint copy without its manifest")
    return step, files


def store_copy(store: CheckpointStore, step: int, files: dict[str, bytes]) -> Path:
    """Store a received copy durably and verify it; a copy that does not verify is removed (and raises)."""
    payload = {name: data for name, data in files.items() if name != MANIFEST}
    folder = store.write_files(step, payload)
    received = json.loads(files[MANIFEST])
    written = json.loads((folder / MANIFEST).read_text())
    try:
        if received.get("files") != written.get("files"):
            raise CheckpointDamagedError(f"{folder}: the copy's files differ from the sender's manifest")
        store.load(step)
    except CheckpointDamagedError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
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
