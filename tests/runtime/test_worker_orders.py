"""A leader's orders are claims: a stage worker checks each against what it knows before acting on it.

* an assignment's run spec must be the peer's own signed one, field for field (a 1000x learning rate, spot
  checks turned off, another shape...), though the leader's file paths may differ (they are replaced);
* a stage must fit the peer's memory limit, judged before anything is allocated;
* every endpoint an order makes the worker dial must pass ``may_dial`` before any connection is attempted;
* checkpoint copies are kept per run, under the signed run id only, bounded in count, in size (the signed run's
  checkpoint) and by the disk's free-space floor, and removed when the run is done.

Workers here are real (gRPC on loopback); assignments are pushed as a leader pushes them, from this process.
"""

from __future__ import annotations

import logging
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tasklet.peer.compute.hf.resolve import resolve_model_cached
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.compute.stage import StageCompute, StageComputeConfig
from tasklet.peer.net.client import PeerClient
from tasklet.peer.net.tls import TlsContext
from tasklet.peer.runtime import checkpoints
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.bounds import checkpoint_bytes, model_numel, stage_memory_bytes, stage_numel
from tasklet.peer.runtime.checkpoints import CheckpointStore, copies_folder, copy_parts, prune_copies
from tasklet.peer.runtime.spec import Assignment, RunSpec
from tasklet.peer.runtime.stage import assignment as taking
from tasklet.peer.runtime.stage.assignment import order_endpoints, spec_differences
from tasklet.peer.runtime.stage.worker import StageWorker
from tasklet.protocol.errors import Refused, Rejected

SPEC = RunSpec(run_id="orders", model=ModelConfig(n_layers=3, d_model=16, n_heads=2, seq_len=8), micro_batch=2,
               n_microbatches=2, spot_check=0.25, probation_check=0.5, probation_microbatches=4).validate()
LAYERS = (1, 2)  # the middle stage of three: no corpus is needed to build it
COORDINATOR, PREV, NEXT = "127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[StageWorker]:
    """A worker of SPEC's run, as a daemon sets it up (its own signed spec preloaded), keeping copies."""
    torch.set_num_threads(1)
    w = StageWorker(checkpoint_copies=tmp_path / "copies")
    w.start()
    w.preload_corpus(None, SPEC)
    try:
        yield w
    finally:
        w.stop()


def assignment(w: StageWorker, epoch: int = 1, **changes: Any) -> Assignment:
    a = Assignment(epoch=epoch, stage=1, replica=0, n_stages=3, n_replicas=1, layers=LAYERS,
                   group=(w.server.endpoint,), coordinator=COORDINATOR, prev=PREV, next=NEXT)
    return replace(a, **changes)


def order(w: StageWorker, spec: RunSpec = SPEC, source: ctl.StateSource | None = None, **changes: Any) -> None:
    """Push an assignment to ``w`` as a leader does (this process is a controller of its own worker)."""
    msg = ctl.StageAssignment(spec, assignment(w, **changes), source or ctl.StateSource.init())
    client = PeerClient(w.server.endpoint, sender="leader")
    try:
        client.push(msg.to_envelope(), timeout_s=30)
    finally:
        client.close()


def refused(w: StageWorker, spec: RunSpec = SPEC, **kw: Any) -> str:
    with pytest.raises(Refused) as err:
        order(w, spec, **kw)
    assert err.value.code == "FAILED_PRECONDITION", err.value
    return err.value.detail


# ------------------------------------------------------------------------------------------- the signed spec
def test_a_matching_assignment_is_taken_even_with_the_leaders_own_paths(worker: StageWorker) -> None:
    order(worker, replace(SPEC, corpus="/leader/home/data.txt", tokenizer="/leader/tok"))
    assert worker.assignment is not None and worker.assignment.layers == LAYERS
    assert worker.spec == SPEC, "the peer's own paths replace the leader's"


WRONG = {
    "a 1000x learning rate": (replace(SPEC, optim=replace(SPEC.optim, lr=SPEC.optim.lr * 1000)), "optim.lr"),
    "spot checks off": (replace(SPEC, spot_check=0.0), "spot_check"),
    "probation off": (replace(SPEC, probation_microbatches=0), "probation_microbatches"),
    "outlier check off": (replace(SPEC, grad_outlier_factor=0.0), "grad_outlier_factor"),
    "direction check off": (replace(SPEC, grad_direction_z=0.0), "grad_direction_z"),
    "a wider model": (replace(SPEC, model=replace(SPEC.model, d_model=32)), "model.d_model"),
    "another seed": (replace(SPEC, seed=7), "seed"),
    "a larger batch": (replace(SPEC, n_microbatches=64), "n_microbatches"),
    "other numerics": (replace(SPEC, precision="bf16"), "precision"),
    "DiLoCo instead of exact averaging": (replace(SPEC, sync_period=4), "sync_period"),
    "compressed activations": (replace(SPEC, compression="int8"), "compression"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_an_assignment_whose_spec_is_not_the_signed_one_is_refused(worker: StageWorker, case: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    spec, field = WRONG[case]
    with caplog.at_level(logging.WARNING):
        detail = refused(worker, spec)
    assert f"{field} " in detail and "signed run" in detail, detail
    assert "\n" not in detail
    assert worker.assignment is None and worker.compute is None, "nothing was built"
    assert "refused an assignment" in caplog.text and field in caplog.text


def test_a_refused_spec_leaves_the_current_plan_untouched(worker: StageWorker) -> None:
    order(worker, epoch=1)
    compute = worker.compute
    lying = replace(SPEC, optim=replace(SPEC.optim, lr=SPEC.optim.lr * 1000))
    detail = refused(worker, lying, epoch=2)
    assert SPEC.optim.lr == 0.001 and "optim.lr 1.0 (signed 0.001)" in detail, detail
    assert worker.assignment is not None and worker.assignment.epoch == 1 and worker.compute is compute


def test_without_a_signed_spec_an_in_process_worker_takes_the_spec_as_sent(worker: StageWorker) -> None:
    worker.preload_corpus(None, None)
    order(worker, replace(SPEC, spot_check=0.0))
    assert worker.spec is not None and worker.spec.spot_check == 0.0


def test_spec_differences_name_every_field_and_ignore_the_wire_form() -> None:
    assert spec_differences(SPEC, SPEC) == []
    as_listed = replace(SPEC, optim=replace(SPEC.optim, betas=list(SPEC.optim.betas)))  # type: ignore[arg-type]
    assert spec_differences(as_listed, SPEC) == []
    differ = spec_differences(replace(SPEC, seed=1, optim=replace(SPEC.optim, weight_decay=0.5)), SPEC)
    assert [d.split()[0] for d in differ] == ["optim.weight_decay", "seed"]


# --------------------------------------------------------------------------------------------- memory limit
def test_a_stage_over_the_memory_limit_is_refused_before_anything_is_allocated(
        worker: StageWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    need = stage_memory_bytes(SPEC, LAYERS, in_flight=2)  # stage 1 of 3 holds two micro-batches under 1F1B
    assert need > 0
    built: list[Any] = []
    real = taking.StageCompute
    monkeypatch.setattr(taking, "StageCompute", lambda cfg: built.append(cfg) or real(cfg))
    worker.limit_memory(int(need / 1.5))  # the model's stage is 1.5x what this peer may hold
    detail = refused(worker)
    assert "memory limit" in detail and "stage 1" in detail, detail
    assert built == [] and worker.compute is None
    worker.limit_memory(int(need) + 1)
    order(worker)
    assert len(built) == 1 and worker.compute is not None


def test_the_memory_limit_is_a_constructor_option() -> None:
    w = StageWorker(memory_limit_bytes=123)
    try:
        assert w.memory_limit_bytes == 123 and w.taker.memory_limit_bytes == 123
    finally:
        w.stop()


# ----------------------------------------------------------------------------------------------- dialling
@pytest.fixture
def canary() -> Iterator[tuple[socket.socket, str]]:
    """A plain TCP listener on loopback: any dial to its endpoint lands in its backlog."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    try:
        yield sock, f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def dialled(sock: socket.socket) -> bool:
    time.sleep(0.3)  # a dial in flight reaches the backlog well within this
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def test_a_fetch_from_an_endpoint_may_dial_refuses_never_connects(worker: StageWorker, canary) -> None:
    sock, endpoint = canary
    asked: list[tuple[str, str]] = []
    stranger = TlsContext.generate()

    def may_dial(ep: str, peer: str) -> bool:
        asked.append((ep, peer))
        return ep != endpoint

    worker.set_policies(may_dial=may_dial)
    detail = refused(worker, source=ctl.StateSource.fetch(endpoint, 0), peers={endpoint: stranger.certificate_text})
    assert endpoint in detail and "state source" in detail and "before dialling" in detail, detail
    assert (endpoint, stranger.peer_id) in asked, "the hook is given the peer id the order's certificate names"
    assert not dialled(sock)
    assert worker.compute is None


def test_without_the_hook_the_same_fetch_does_dial_the_canary(worker: StageWorker, canary,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The canary catches a dial: the refusal above is what kept it silent."""
    sock, endpoint = canary
    monkeypatch.setattr(taking, "FETCH_STATE_RETRY_S", 0.0)
    monkeypatch.setattr(taking, "WORKER_FETCH_STATE_TIMEOUT_S", 1.0)
    detail = refused(worker, source=ctl.StateSource.fetch(endpoint, 0))
    assert "could not fetch" in detail, detail
    assert dialled(sock)


@pytest.mark.parametrize("role", ["coordinator", "upstream neighbour", "downstream neighbour"])
def test_an_assignment_naming_an_endpoint_may_dial_refuses_is_refused(worker: StageWorker, role: str) -> None:
    bad = {"coordinator": COORDINATOR, "upstream neighbour": PREV, "downstream neighbour": NEXT}[role]
    worker.set_policies(may_dial=lambda ep, peer: ep != bad)
    detail = refused(worker)
    assert bad in detail and role in detail, detail
    assert worker.assignment is None


def test_a_matching_assignment_passes_every_check(worker: StageWorker) -> None:
    asked: list[str] = []
    worker.set_policies(may_dial=lambda ep, peer: asked.append(ep) or True)
    worker.limit_memory(int(stage_memory_bytes(SPEC, LAYERS, in_flight=2)) + 1)
    order(worker)
    assert worker.assignment is not None
    assert sorted(asked) == sorted([COORDINATOR, PREV, NEXT]), "every endpoint it dials, never its own"


def test_order_endpoints_cover_replicas_and_the_source_but_not_this_worker() -> None:
    a = Assignment(epoch=1, stage=0, replica=1, n_stages=2, n_replicas=3, layers=(0, 2),
                   group=("a:1", "me:1", "c:1"), coordinator="me:1", next="d:1")
    got = order_endpoints(SPEC, a, ctl.StateSource.fetch("c:1", 3))
    assert got == [("d:1", "the downstream neighbour"), ("a:1", "replica 0 of this stage"),
                   ("c:1", "replica 2 of this stage")]


def test_a_resync_source_may_dial_refuses_is_never_dialled(worker: StageWorker, canary) -> None:
    sock, endpoint = canary
    order(worker)
    worker.set_policies(may_dial=lambda ep, peer: ep != endpoint)
    compute = StageCompute(StageComputeConfig(model=SPEC.model, first_layer=1, last_layer=2))
    assert worker.assignment is not None
    with pytest.raises(Rejected, match="before dialling"):
        worker.taker.load_from(compute, endpoint, SPEC, worker.assignment, 0)
    assert not dialled(sock)


# --------------------------------------------------------------------------------------- checkpoint copies
def checkpoint_files(tmp_path: Path, step: int, numel: int = 1000) -> dict[str, bytes]:
    store = CheckpointStore(tmp_path / f"leader-{step}-{numel}")
    store.write(step, {0: {"params": torch.zeros(numel), "step": step}},
                {"run": SPEC.to_dict(), "stages": [list(LAYERS)], "step": step})
    return store.read_files(step)


def push_copy(w: StageWorker, files: dict[str, bytes], step: int, run_id: str = SPEC.run_id) -> None:
    client = PeerClient(w.server.endpoint, sender="leader")
    try:
        for part in copy_parts(run_id, 1, step, files):
            client.push(part, timeout_s=30)
    finally:
        client.close()


def test_copies_are_kept_per_run_and_only_the_newest_few(tmp_path: Path, worker: StageWorker) -> None:
    order(worker)
    assert worker.copy_keep == checkpoints.COPIES_KEEP == 2
    for step in (2, 4, 6):
        push_copy(worker, checkpoint_files(tmp_path, step), step)
    store = CheckpointStore(tmp_path / "copies" / SPEC.run_id)
    assert store.steps() == [4, 6] and store.newest_intact() == 6
    assert worker.prune_copies(SPEC.run_id) is True
    assert not (tmp_path / "copies" / SPEC.run_id).exists()
    assert worker.prune_copies(SPEC.run_id) is False


def test_a_copy_under_another_run_id_is_refused(tmp_path: Path, worker: StageWorker) -> None:
    order(worker)
    with pytest.raises(Refused) as err:
        push_copy(worker, checkpoint_files(tmp_path, 2), 2, run_id="another-run")
    assert err.value.code == "FAILED_PRECONDITION" and "this peer trains 'orders'" in err.value.detail
    assert not (tmp_path / "copies").exists() or not any((tmp_path / "copies").iterdir())


def test_a_copy_larger_than_the_signed_runs_checkpoint_is_refused(tmp_path: Path, worker: StageWorker) -> None:
    order(worker)
    bound = checkpoint_bytes(SPEC)
    with pytest.raises(Refused) as err:
        push_copy(worker, checkpoint_files(tmp_path, 2, numel=bound // 4), 2)
    assert "over this peer's bound" in err.value.detail, err.value.detail
    assert CheckpointStore(tmp_path / "copies" / SPEC.run_id).steps() == []


def test_a_copy_that_would_take_the_disk_under_its_floor_is_refused(tmp_path: Path, worker: StageWorker,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    order(worker)
    files = checkpoint_files(tmp_path, 2)
    monkeypatch.setattr(checkpoints, "DISK_FLOOR_BYTES", shutil.disk_usage(tmp_path).free)
    with pytest.raises(Refused) as err:
        push_copy(worker, files, 2)
    assert "under its floor" in err.value.detail, err.value.detail
    store = CheckpointStore(tmp_path / "copies" / SPEC.run_id)
    assert store.steps() == [] and not any(store.root.glob(".tmp-*"))
    monkeypatch.setattr(checkpoints, "DISK_FLOOR_BYTES", 0)
    monkeypatch.setattr(checkpoints, "DISK_FLOOR_FRACTION", 0.0)
    push_copy(worker, files, 2)
    assert store.steps() == [2]


def test_the_disk_floor_is_the_larger_of_a_fixed_floor_and_a_share() -> None:
    assert checkpoints.disk_floor_bytes(10 << 30) == 1 << 30
    assert checkpoints.disk_floor_bytes(1 << 40) == int((1 << 40) * 0.05)


def test_copy_folders_never_leave_the_root_nor_collide(tmp_path: Path) -> None:
    assert copies_folder(tmp_path, "orders") == tmp_path / "orders"
    odd = [copies_folder(tmp_path, r) for r in ("../escape", "..", "a/b", "a b", "~x")]
    assert all(p.parent == tmp_path and p.name.startswith("~") for p in odd)
    assert len(set(odd)) == len(odd)
    (tmp_path / "other").mkdir()
    assert prune_copies(tmp_path, "orders") is False and (tmp_path / "other").exists()


def test_the_copy_bound_follows_the_signed_spec() -> None:
    for model in (SPEC.model, ModelConfig(n_layers=2, d_model=24, n_heads=3, seq_len=16, mlp_ratio=2)):
        assert model_numel(model) == stage_numel(model, (0, model.n_layers))
    wider = replace(SPEC, model=replace(SPEC.model, d_model=32))
    assert checkpoint_bytes(wider) > checkpoint_bytes(SPEC) > 3 * 4 * model_numel(SPEC.model)
    hf = resolve_model_cached("tiny-llama", seq_len=16)
    assert checkpoint_bytes(RunSpec(model=hf)) > 3 * 4 * model_numel(hf)
