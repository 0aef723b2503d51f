"""A local Hugging Face checkpoint folder (safetensors, sharded or not), read one stage at a time.

Why it is written this way: a stage of an 8B model is a few hundred MB, the whole checkpoint is 16 GB. A stage
therefore opens only the shards that hold its tensors and reads only those tensors (``safe_open`` maps the file
and copies out the tensors asked for). :class:`Checkpoint` records the files it opened and the tensors it read,
so a test can check exactly that.

The fingerprint every peer compares before joining is a hash of the *index* — each shard's name, size and
safetensors header (tensor names, dtypes, shapes, offsets) — not of the weights: reading 16 GB to join a run
would be absurd, and the header changes with any re-save.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from tasklet.peer.compute.hf.layout import ModelSourceError

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def has_weights(folder: Path) -> bool:
    return (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()


def _read_header(path: Path) -> dict:
    try:
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ModelSourceError(f"{path}: header: file too short for safetensors")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_HEADER_BYTES:
                raise ModelSourceError(f"{path}: header: {size} bytes is not a safetensors header")
            return json.loads(fh.read(size))
    except FileNotFoundError:
        raise ModelSourceError(f"{path}: missing (listed in the checkpoint index)") from None
    except (OSError, ValueError) as exc:
        if isinstance(exc, ModelSourceError):
            raise
        raise ModelSourceError(f"{path}: header: not a safetensors file ({exc})") from None


class Checkpoint:
    """The tensors of a checkpoint folder by name, and which file holds each (no weight read at construction)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                doc = json.loads(index.read_text())
            except (OSError, ValueError) as exc:
                raise ModelSourceError(f"{index}: not valid JSON ({exc})") from None
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelSourceError(f"{index}: weight_map: missing or empty")
            self.weight_map = {str(k): str(v) for k, v in weight_map.items()}
            for shard in sorted(set(self.weight_map.values())):
                if "/" in shard or shard.startswith("."):
                    raise ModelSourceError(f"{index}: weight_map: shard name {shard!r} is not a file name")
                if not (self.folder / shard).is_file():
                    raise ModelSourceError(f"{self.folder / shard}: missing shard (listed in {index} weight_map)")
        elif (self.folder / SINGLE_FILE).is_file():
            header = _read_header(self.folder / SINGLE_FILE)
            self.weight_map = {k: SINGLE_FILE for k in header if k != "__metadata__"}
        else:
            raise ModelSourceError(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE} in the checkpoint folder")
        self.opened_files: list[str] = []
        self.read_names: list[str] = []

    def fingerprint(self) -> str:
        """sha256 over every shard's name, size and header (see the module docstring)."""
        h = hashlib.sha256()
        for shard in sorted(set(self.weight_map.values())):
            path = self.folder / shard
            header = _read_header(path)
            h.update(f"{shard}\0{path.stat().st_size}\0".encode())
            h.update(json.dumps(header, sort_keys=True).encode())
        return h.hexdigest()

    def resolve(self, name: str, prefix: str) -> str | None:
        """The checkpoint's name of a model tensor: as is, or without the base prefix (GPT-2 hub checkpoints
        save ``h.0.attn...`` instead of ``transformer.h.0.attn...``)."""
        if name in self.weight_map:
            return name
        bare = name.removeprefix(prefix + ".")
        return bare if bare in self.weight_map else None

    def read(self, names: dict[str, str]) -> dict[str, torch.Tensor]:
        """Read ``{model name: checkpoint name}``, opening each needed shard once; records what it touched."""
        by_file: dict[str, list[tuple[str, str]]] = {}
        for model_name, ckpt_name in names.items():
            by_file.setdefault(self.weight_map[ckpt_name], []).append((model_name, ckpt_name))
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(by_file):
            path = self.folder / shard
            self.opened_files.append(shard)
            try:
                with safe_open(str(path), framework="pt", device="cpu") as fh:
                    for model_name, ckpt_name in by_file[shard]:
                        out[model_name] = fh.get_tensor(ckpt_name)
                        self.read_names.append(ckpt_name)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ModelSourceError(f"{path}: cannot read tensors ({exc})") from None
        log.info("checkpoint %s: read %d tensor(s) from %d file(s)", self.folder, len(out), len(by_file))
        return out


def model_fingerprint(config: dict, checkpoint: Checkpoint | None) -> str:
    """sha256 of the model config (sorted JSON) and, when there is one, of the checkpoint's index."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    if checkpoint is not None:
        h.update(checkpoint.fingerprint().encode())
    return h.hexdigest()
