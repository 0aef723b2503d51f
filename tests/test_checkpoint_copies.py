"""Replicated checkpoints: the leader's host dies together with its disk and the other replica of a stage; a new
leader on another host resumes from the copy a peer holds, redoing the steps since (bench.leader_loss has the
scenario). Also: a copy is taken only from the leader, bounded, and verified."""

from __future__ import annotations

import logging

import pytest
import torch

from bench.leader_loss import SPEC, STAGES, run_leader_loss
from peer.net import PeerClient, TransportConfig
from peer.net.tls import TlsContext
from peer.runtime.checkpoints import CheckpointStore, copy_bound_bytes, files_envelope
from peer.runtime.worker import StageWorker
from protocol.errors import TransportError


def test_leader_host_and_disk_lost_run_finishes_from_a_replicated_checkpoint(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        result = run_leader_loss(tmp_path, steps=5, die_after=3, checkpoint_every=2, copies=3)
    events = result.events
    assert events.fetched_copy is not None and events.fetched_copy["step"] == 2
    assert events.rollbacks == [{"from_step": 3, "to_step": 2, "redone": 1}]
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
        with pytest.raises(TransportError):
            PeerClient(worker.server.endpoint, sender="x").push(files_envelope(SPEC.run_id, 0, 2, files),
                                                                 timeout_s=10)
        outsider = PeerClient(worker.server.endpoint, TransportConfig(tls=stranger), sender="x")
        with pytest.raises(TransportError):
            outsider.push(files_envelope(SPEC.run_id, 0, 2, files), timeout_s=10)
        outsider.close()
    finally:
        worker.stop()
    assert not (tmp_path / "copies").exists(), "nothing was stored"
    assert folder.exists()
    assert copy_bound_bytes(SPEC.model) < 10 << 20, "a tiny model's copies are bounded to a few MB"
