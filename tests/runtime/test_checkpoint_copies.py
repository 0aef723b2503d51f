"""Replicated checkpoints: the leader's host dies together with its disk and the other replica of a stage; a new
leader on another host resumes from the copy a peer holds, redoing the steps since (bench.leader_loss has the
scenario). Also: a copy is taken only from the leader, bounded, and verified."""

from __future__ import annotations

import logging

import pytest
import torch

from bench.leader_loss import SPEC, STAGES, run_leader_loss
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.config import TransportConfig
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.runtime import checkpoints
from tasklet.peer.runtime.checkpoints import (
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    CopyReceiver,
    copy_bound_bytes,
    copy_part_bound_bytes,
    copy_parts,
    fetch_copy_files,
    serve_copy,
)
from tasklet.peer.runtime.stage.worker import StageWorker
from tasklet.protocol.errors import TransportError


def test_leader_host_and_disk_lost_run_finishes_from_a_replicated_checkpoint(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        result = run_leader_loss(tmp_path, steps=5, die_after=3, checkpoint_every=2, copies=3)
    events = result.events
    assert events.fetched_copy is not None and events.fetched_copy["step"] == 2
    assert events.rollbacks == [{"from_step": 3, "to_step": 2, "redone": 1,
                                 "reason": "every replica of a stage is gone"}]
    assert "rolling back to the checkpoint of step 2, redoing 1 step(s)" in caplog.text
    assert "using the checkpoint copy of step 2 fetched from" in caplog.text
    assert all(state["step"] == 5 for state in result.states.values())
    assert result.max_param_rel_diff < 1e-5
    # the new leader keeps the fetched copy on its own disk, and copies its own checkpoints on
    assert CheckpointStore(tmp_path / "leader2").newest_valid() is not None


def test_copies_only_from_the_controller_bounded_and_verified(tmp_path) -> None:
    store = CheckpointStore(tmp_path / "src")
    folder = store.write(2, {0: {"params": torch.ones(4), "step": 2}},
                         {"run": SPEC.to_dict(), "stages": STAGES, "step": 2})
    files = store.read_files(2)
    stranger = TlsContext.generate()
    worker = StageWorker(peer_id="w", checkpoint_copies=tmp_path / "copies")
    worker.start()
    try:
        # no run yet: nothing is accepted (the bound is 0 before an assignment tells the run)
        begin = next(copy_parts(SPEC.run_id, 0, 2, files))
        with pytest.raises(TransportError):
            PeerClient(worker.server.endpoint, sender="x").push(begin, timeout_s=10)
        outsider = PeerClient(worker.server.endpoint, TransportConfig(tls=stranger), sender="x")
        with pytest.raises(TransportError):
            outsider.push(begin, timeout_s=10)
        outsider.close()
    finally:
        worker.stop()
    assert not (tmp_path / "copies").exists(), "nothing was stored"
    assert folder.exists()
    assert copy_bound_bytes(SPEC.model) < 10 << 20, "a tiny model's copies are bounded to a few MB"


def test_copies_travel_in_parts_under_a_small_chunk_limit(tmp_path, monkeypatch, caplog) -> None:
    """The whole scenario with 4 KiB parts: every push and every fetch is many bounded Envelopes."""
    monkeypatch.setattr(checkpoints, "COPY_CHUNK_BYTES", 4096)
    assert copy_part_bound_bytes() == 4096 + checkpoints.COPY_PART_SLACK_BYTES
    with caplog.at_level(logging.INFO):
        result = run_leader_loss(tmp_path, steps=4, die_after=3, checkpoint_every=2, copies=3)
    files = CheckpointStore(tmp_path / "leader2").read_files(2)
    assert max(len(d) for d in files.values()) > 4 * 4096, "the stage files span several parts"
    assert result.events.fetched_copy is not None and result.events.fetched_copy["step"] == 2
    assert result.max_param_rel_diff < 1e-5


def _files(tmp_path, size: int = 50_000) -> dict[str, bytes]:
    store = CheckpointStore(tmp_path / "src")
    store.write(2, {0: {"params": torch.arange(size // 4, dtype=torch.float32), "step": 2}},
                {"run": SPEC.to_dict(), "stages": [(0, 2)], "step": 2})
    return store.read_files(2)


def _receive_all(receiver: CopyReceiver, parts, store: CheckpointStore, bound: int = 1 << 30) -> int | None:
    done = None
    for part in parts:
        part.sender = "leader"
        done = receiver.receive(part, store, bound)
    return done


def test_a_short_damaged_oversized_or_disordered_copy_is_refused_and_nothing_is_kept(tmp_path) -> None:
    files = _files(tmp_path)
    good = list(copy_parts(SPEC.run_id, 0, 2, files, chunk_bytes=4096))
    store = CheckpointStore(tmp_path / "copies")
    receiver = CopyReceiver()
    assert _receive_all(receiver, good, store) == 2
    assert store.newest_intact() == 2 and store.read_files(2) == files

    def refused(parts, bound: int = 1 << 30) -> str:
        dest = CheckpointStore(tmp_path / f"bad-{len(list(tmp_path.iterdir()))}")
        with pytest.raises(CheckpointError) as exc:
            _receive_all(CopyReceiver(), parts, dest, bound)
        assert dest.steps() == [] and not any(dest.root.glob(".tmp-*")), "nothing is kept of a refused copy"
        return str(exc.value)

    assert "arrived" in refused(good[:-2] + good[-1:])  # a part missing: the copy is short
    flipped = [type(p)() for p in good]
    for src, dst in zip(good, flipped, strict=True):
        dst.CopyFrom(src)
    data = bytearray(flipped[3].tensors[0].data)
    data[0] ^= 0xFF
    flipped[3].tensors[0].data = bytes(data)
    assert "checksum" in refused(flipped)  # one byte changed on the way
    assert "out of order" in refused([*good[:2], good[3], good[2], *good[4:]])
    assert "over this peer's bound" in refused(good, bound=1000)
    assert "without its begin" in refused(good[1:])


def test_a_new_leader_fetches_in_ranges_and_refuses_a_damaged_copy(tmp_path) -> None:
    files = _files(tmp_path)
    store = CheckpointStore(tmp_path / "copies")
    _receive_all(CopyReceiver(), copy_parts(SPEC.run_id, 0, 2, files), store)
    asked: list[dict[str, str]] = []

    def fetch(meta: dict[str, str]):
        asked.append(meta)
        return serve_copy(store, SPEC.run_id, 0, meta)

    step, got = fetch_copy_files(fetch, chunk_bytes=4096)
    assert step == 2 and got == files
    assert len(asked) > 10 and all(int(m.get("length", 0)) <= 4096 for m in asked)
    with pytest.raises(CheckpointError, match="out of bounds"):
        serve_copy(store, SPEC.run_id, 0, {"file": "stage-0.pt", "step": "2", "offset": "0",
                                           "length": str(checkpoints.COPY_CHUNK_BYTES + 1)})
    with pytest.raises(CheckpointError):
        serve_copy(store, SPEC.run_id, 0, {"file": "../run.json", "step": "2", "offset": "0", "length": "1"})
    # the disk damages the copy later: the peer no longer offers it, and a fetcher refuses damaged bytes
    stage = store.root / "step-000002" / "stage-0.pt"
    stage.write_bytes(stage.read_bytes()[:-1] + b"x")
    assert store.newest_intact() is None
    with pytest.raises(CheckpointError):
        fetch_copy_files(fetch, chunk_bytes=4096)

    def lying(meta: dict[str, str]):
        env = serve_copy(good_store, SPEC.run_id, 0, meta)
        if "file" in meta and meta["file"] != MANIFEST:
            env.tensors[0].data = bytes(len(env.tensors[0].data))
        return env

    good_store = CheckpointStore(tmp_path / "copies2")
    _receive_all(CopyReceiver(), copy_parts(SPEC.run_id, 0, 2, files), good_store)
    with pytest.raises(CheckpointError, match="do not match the manifest"):
        fetch_copy_files(lying, chunk_bytes=4096)
