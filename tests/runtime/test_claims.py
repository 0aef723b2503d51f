"""What a member says about itself is checked before it is believed: reported numbers, the role a report may
come from, the progress record it ends up in (unit tests; the swarm-level cases are in
tests/runtime/test_byzantine_claims.py)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tasklet.peer.compute.data import Corpus
from tasklet.peer.compute.model import ModelConfig
from tasklet.peer.compute.stage import flat_digest
from tasklet.peer.net.client import PeerClient
from tasklet.peer.node.history import adopt_history
from tasklet.peer.node.leader_role import (
    MAX_RECORDED_STAGES,
    judge_claims,
    recorded_checkpoints,
    recorded_manifests,
    recorded_progress,
    signed_hashes,
)
from tasklet.peer.node.leadership import Leadership
from tasklet.peer.runtime import control as ctl
from tasklet.peer.runtime.assign import build_assignments
from tasklet.peer.runtime.checkpoints import MANIFEST, CheckpointError, CheckpointStore, store_copy
from tasklet.peer.runtime.lead.coordinator import MAX_LOSS, Coordinator, check_loss
from tasklet.peer.runtime.lead.driver import DriverConfig, RunDriver
from tasklet.peer.runtime.lead.machine import StepMachine
from tasklet.peer.runtime.lead.referee import MAX_TRACKED, Referee, Verdict
from tasklet.peer.runtime.spec import RunSpec
from tasklet.peer.runtime.stage.assignment import require_named_leader
from tasklet.peer.runtime.wire import make_key
from tasklet.peer.swarm.adverts import Advert, DeviceInfo
from tasklet.peer.swarm.charter import LeaderPolicy
from tasklet.peer.swarm.election import elect_leader
from tasklet.peer.swarm.membership import EndpointBinding, EndpointHints, PeerEntry
from tasklet.peer.swarm.progress import publishable
from tasklet.protocol import tasklet_pb2 as pb
from tasklet.protocol.codec import decode_tensor
from tasklet.protocol.errors import BadMessage, Forbidden, Refused
from tests.support.rosters import make_roster
from tests.support.scripted import ScriptedWorker
from tests.support.virtual_run import ENDPOINTS, VirtualRun
from tests.support.virtual_run import SPEC as STEP_SPEC

SPEC = RunSpec(run_id="claims", model=ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8), micro_batch=2,
               n_microbatches=4)
EPOCH = 1


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf, 1e308, -2 * MAX_LOSS])
def test_a_loss_that_is_not_a_usable_number_is_refused(loss: float) -> None:
    with pytest.raises(BadMessage, match="loss"):
        check_loss(loss, True, "peer")


def test_a_loss_from_a_stage_that_is_not_last_is_refused_and_a_plain_one_is_taken() -> None:
    with pytest.raises(Forbidden, match="last stage"):
        check_loss(3.2, False, "peer")
    check_loss(3.2, True, "peer")
    check_loss(0.0, True, "peer")


@pytest.fixture
def two_stage() -> Iterator[Coordinator]:
    """A coordinator whose plan is one pipeline of two scripted workers (stage 0 then stage 1)."""
    coordinator = Coordinator(SPEC, liveness_interval_s=0.2)
    coordinator.start()
    workers = [ScriptedWorker(), ScriptedWorker()]
    try:
        endpoints = [w.start() for w in workers]
        coordinator.assign(build_assignments(SPEC, [(0, 1), (1, 2)], [[0, 1]], endpoints, coordinator.endpoint,
                                             EPOCH))
        yield coordinator
    finally:
        coordinator.close()
        for w in workers:
            w.stop()


def test_the_coordinator_refuses_bad_losses_and_commits_from_the_wrong_stage_with_a_status(two_stage) -> None:
    coordinator = two_stage
    cases = [  # (message, stage that sends it, status)
        (ctl.Loss(0, 0, math.nan), 1, "INVALID_ARGUMENT"),
        (ctl.Loss(0, 0, 1e308), 1, "INVALID_ARGUMENT"),
        (ctl.Loss(0, 0, math.inf), 1, "INVALID_ARGUMENT"),
        (ctl.Loss(0, 0, 2.5), 0, "PERMISSION_DENIED"),  # the first stage of two computes no loss
    ]
    with PeerClient(coordinator.endpoint, sender="member") as client:
        for msg, stage, code in cases:
            env = ctl.encode(msg, SPEC.run_id, EPOCH, 0, stage=stage, replica=0)
            with pytest.raises(Refused) as err:
                client.push(env, timeout_s=10)
            assert err.value.code == code, (msg, err.value)
        for op in (ctl.Op.COMMIT, ctl.Op.LEASE):  # the pool serves only the head of a pipeline
            with pytest.raises(Refused) as err:
                client.fetch(ctl.pool_kind(op), make_key(SPEC.run_id, EPOCH, 0, 0, 1, 0), timeout_s=10)
            assert err.value.code == "PERMISSION_DENIED" and "first stage" in err.value.detail
        # the first stage is still served (no step runs: it is told to wait)
        reply = client.fetch(ctl.pool_kind(ctl.Op.LEASE), make_key(SPEC.run_id, EPOCH, 0, 0, 0, 0), timeout_s=10)
        assert ctl.pool_status(reply) is ctl.PoolStatus.WAIT
    assert coordinator.dead == frozenset()


def test_a_progress_record_with_unknown_or_absurd_numbers_still_serialises() -> None:
    payload = {"epoch": 2, "step": 5, "loss": math.nan, "step_s": math.inf,
               "history": {"from": 0, "loss": [4.1, math.nan, -math.inf], "step_s": [0.5, 0.4, 0.3]}}
    clean = publishable(payload)
    text = json.dumps(clean, allow_nan=False)  # what peer.swarm.records does with a payload
    assert json.loads(text) == {"epoch": 2, "step": 5, "loss": None, "step_s": None,
                                "history": {"from": 0, "loss": [4.1, None, None], "step_s": [0.5, 0.4, 0.3]}}


STAGES = [(0, 1), (1, 2)]


def _st(stage: int, trained: object, pending: object = None, layers: object = None) -> dict:
    return {"stage": stage, "replica": 0, "epoch": 3, "layers": list(STAGES[stage]) if layers is None else layers,
            "trained_steps": trained, "pending_apply": pending}


def test_a_takeover_claim_beyond_the_recorded_step_is_a_lie_and_moves_nothing() -> None:
    statuses = {"a": _st(0, 7), "b": _st(1, 7), "c": _st(1, 10**9), "d": _st(0, 7, layers=[0, 2]),
                "e": _st(0, "7"), "f": _st(1, -1)}
    judged = judge_claims(statuses, STAGES, recorded=7)
    assert judged.top == 7 and judged.pending == []
    assert set(judged.liars) == {"c", "d", "e", "f"}
    assert "recorded 7" in judged.liars["c"]


def test_a_takeover_finishes_a_half_applied_step_only_when_each_stage_majority_holds_it() -> None:
    # the previous leader died while telling the workers to apply step 7: some applied, the rest hold its gradient
    honest = {"a": _st(0, 8), "b": _st(0, 7, 7), "c": _st(1, 7, 7), "d": _st(1, 8)}
    judged = judge_claims(honest, STAGES, recorded=7)
    assert (judged.top, judged.pending, judged.liars) == (8, ["b", "c"], {})
    # one worker claiming step 8 cannot make the others apply a step their stage never averaged
    lone = {"a": _st(0, 7), "b": _st(0, 7), "c": _st(1, 7), "liar": _st(1, 8)}
    judged = judge_claims(lone, STAGES, recorded=7)
    assert (judged.top, judged.pending) == (7, [])
    # a roll-back never goes forward: claims below the record leave the step at the record
    assert judge_claims({"a": _st(0, 3), "b": _st(1, 3)}, STAGES, recorded=7).top == 7


def test_without_a_record_a_takeover_takes_the_step_most_claims_reach() -> None:
    statuses = {"a": _st(0, 5), "b": _st(0, 5), "c": _st(1, 5), "d": _st(1, 10**9)}
    judged = judge_claims(statuses, STAGES, recorded=None)
    assert judged.top == 5 and set(judged.liars) == {"d"}
    assert judge_claims({"a": {"trained_steps": None}}, STAGES, recorded=3).top is None


def test_a_takeover_claim_whose_parameters_differ_from_the_signed_record_is_a_lie() -> None:
    digests = {STAGES[0]: "a" * 32, STAGES[1]: "b" * 32}
    statuses = {"a": {**_st(0, 7), "params_hash": "a" * 32}, "b": {**_st(1, 7), "params_hash": "b" * 32},
                "poisoned": {**_st(1, 7), "params_hash": "c" * 32},  # holds other parameters at the recorded step
                "unhashed": {**_st(0, 7), "params_hash": None},  # cannot show what it holds: a laggard, no liar
                "ahead": {**_st(0, 8), "params_hash": "d" * 32}}  # past the record: no hash was recorded for it
    judged = judge_claims(statuses, STAGES, recorded=7, digests=digests)
    assert set(judged.liars) == {"poisoned"}
    assert "the leader recorded " + "b" * 32 in judged.liars["poisoned"]
    assert judged.top == 7, "one claim of step 8 in stage 0 of three is no majority"
    # no hash recorded for a stage: its claims are judged on the step alone, as before
    assert judge_claims(statuses, STAGES, recorded=7, digests={STAGES[0]: "a" * 32}).liars == {}


def test_the_signed_record_is_read_as_hostile() -> None:
    assert recorded_progress({"step": 4, "stage_hashes": [[0, 1, "a" * 32], [1, 2, "b" * 32]]}) == \
        (4, {(0, 1): "a" * 32, (1, 2): "b" * 32})
    junk = [[0, 1], [0, "1", "x"], [True, 1, "x"], [1, 2, ""], [1, 2, "x" * 65], "0,1,x", None, [2, 3, 7]]
    assert recorded_progress({"step": 4, "stage_hashes": junk}) == (4, {})
    assert recorded_progress({"step": 4, "stage_hashes": {"0": "x"}}) == (4, {})
    assert recorded_progress({"step": True, "stage_hashes": [[0, 1, "a"]]}) == (None, {})
    assert recorded_progress({"step": -1}) == (None, {}) and recorded_progress({}) == (None, {})
    many = [[i, i + 1, "a"] for i in range(10**4)]
    assert len(recorded_progress({"step": 1, "stage_hashes": many})[1]) == MAX_RECORDED_STAGES


def _ckpt_files(tmp_path: Path, step: int, meta_step: int | None = None) -> dict[str, bytes]:
    """The files of a self-consistent checkpoint copy of ``step`` (manifest, checksums and all)."""
    store = CheckpointStore(tmp_path / f"src-{step}-{meta_step}")
    n = 8
    states = {0: {"params": torch.full((n,), float(step)), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n),
                  "step": step}}
    store.write(step, states, {"run": SPEC.to_dict(), "stages": [[0, 2]],
                               "step": step if meta_step is None else meta_step})
    return store.read_files(step)


class CopyHolders:
    """The part of a coordinator a driver asks about checkpoint copies: peers answering what they hold."""

    def __init__(self, copies: dict[str, dict[str, bytes]], steps: dict[str, int]) -> None:
        self.copies, self.steps, self.fetched = copies, steps, []

    def checkpoint_step(self, endpoint: str) -> int:
        return self.steps[endpoint]

    def fetch_checkpoint(self, endpoint: str) -> tuple[int, dict[str, bytes]]:
        self.fetched.append(endpoint)
        return self.steps[endpoint], self.copies[endpoint]


def test_a_checkpoint_copy_beyond_the_recorded_step_is_not_believed(tmp_path: Path) -> None:
    holders = CopyHolders({"liar:1": _ckpt_files(tmp_path, 10**6), "honest:1": _ckpt_files(tmp_path, 4)},
                          {"liar:1": 10**6, "honest:1": 4})
    driver = RunDriver(SPEC, holders, lambda: {0: "liar:1", 1: "honest:1"},  # type: ignore[arg-type]
                       lambda d, s: ([(0, 2)], [d]), lambda *a: {}, DriverConfig(steps=10))
    driver.recovery.recorded_step = 5
    driver.recovery.checkpoint_manifests = {4: _manifest_hash(holders.copies["honest:1"])}
    assert driver.recovery.latest(ask_peers=True) == 4
    assert holders.fetched == ["honest:1"]  # the liar's copy was not even fetched
    # a roll-back from step 3 never goes forward, whatever peers hold
    driver.recovery.recorded_step = None
    holders.fetched.clear()
    assert driver.recovery.latest(ask_peers=True, at_most=3) is None and holders.fetched == []


def test_a_checkpoint_copy_whose_parameters_are_not_the_recorded_ones_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A self-consistent copy (manifest, checksums and all) of a step the leader recorded, but with other
    parameters than the stage hashes it signed for that step: not used, and never stored on the leader's disk."""
    forged, honest = _ckpt_files(tmp_path, 4), _ckpt_files(tmp_path, 3)
    holders = CopyHolders({"liar:1": forged, "honest:1": honest}, {"liar:1": 4, "honest:1": 3})
    store_dir = tmp_path / "leader"
    driver = RunDriver(SPEC, holders, lambda: {0: "liar:1", 1: "honest:1"},  # type: ignore[arg-type]
                       lambda d, s: ([(0, 2)], [d]), lambda *a: {}, DriverConfig(steps=10, checkpoint_dir=store_dir))
    driver.recovery.recorded_step = 5
    driver.recovery.checkpoint_digests = recorded_checkpoints(
        [[4, 0, 2, flat_digest(torch.full((8,), 4.5))], [3, 0, 2, flat_digest(torch.full((8,), 3.0))]])
    # the leader signed both layers: the parameters' hash, and the manifest (its checkpoint of step 4 was another)
    driver.recovery.checkpoint_manifests = {3: _manifest_hash(honest), 4: "0" * 64}
    loads = _count_torch_loads(monkeypatch)
    assert driver.recovery.latest(ask_peers=True) == 3, "step 4's copy holds other parameters"
    assert holders.fetched == ["liar:1", "honest:1"]
    assert loads == [1], "only the copy whose manifest the leader signed was deserialised"
    assert CheckpointStore(store_dir).newest_valid(at_most=10).step == 3, "the forged copy was not stored"
    # signed manifest but other parameters than the signed hash (a leader's own inconsistency): still refused
    driver.recovery.checkpoint_manifests = {4: _manifest_hash(forged)}
    driver.recovery.checkpoint_digests = recorded_checkpoints([[4, 0, 2, flat_digest(torch.full((8,), 4.5))]])
    assert driver.recovery.store_fetched(4, forged, "liar:1") is None


def _manifest_hash(files: dict[str, bytes]) -> str:
    return hashlib.sha256(files[MANIFEST]).hexdigest()


def _count_torch_loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the stage files deserialised (``torch.load`` as the checkpoint store calls it)."""
    import tasklet.peer.runtime.checkpoints as checkpoints

    count, real = [0], checkpoints._torch_load

    def counting(data: bytes) -> dict:
        count[0] += 1
        return real(data)

    monkeypatch.setattr(checkpoints, "_torch_load", counting)
    return count


def test_the_signed_checkpoint_hashes_round_trip_and_are_read_as_hostile() -> None:
    driver = RunDriver(SPEC, None, dict, lambda d, s: ([(0, 2)], [d]), lambda *a: {},  # type: ignore[arg-type]
                       DriverConfig(steps=10))
    driver.recovery.checkpoint_digests = {2: {(0, 1): "a" * 32, (1, 2): "b" * 32}, 4: {(0, 1): "c" * 32}}
    record = json.loads(json.dumps(signed_hashes(driver, 5)))  # through JSON, as the record is published
    assert record["stage_hashes"] is None, "no hashes agreed at step 5"
    assert recorded_checkpoints(record["checkpoint_hashes"]) == driver.recovery.checkpoint_digests
    driver.recovery.checkpoint_manifests = {2: "d" * 64, 4: "e" * 64}
    record = json.loads(json.dumps(signed_hashes(driver, 5)))
    assert recorded_manifests(record["checkpoint_manifests"]) == driver.recovery.checkpoint_manifests
    assert recorded_manifests([[2, "d" * 63], ["2", "d" * 64], [2], None, [2, "d" * 64, 1]]) == {}
    junk = [[2, 0, 1], [2, 0, 1, 5], ["2", 0, 1, "a"], [2, 0, 1, "x" * 65], None, "2,0,1,a"]
    assert recorded_checkpoints(junk) == {} and recorded_checkpoints({"2": []}) == {}


def test_a_copy_whose_metadata_names_another_step_does_not_verify(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "dest")
    with pytest.raises(CheckpointError, match="metadata is of step"):
        store_copy(store, 4, _ckpt_files(tmp_path, 4, meta_step=10**6))
    store_copy(store, 4, _ckpt_files(tmp_path, 4))
    assert store.newest_valid(at_most=3) is None and store.newest_valid(at_most=4).step == 4


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _topk_bomb(shape: list[int], block_size: int, k: int) -> pb.Tensor:
    """A TOPK tensor declaring ``shape`` and carrying ``k`` (index, value) pairs: a few hundred bytes."""
    idx = torch.arange(k, dtype=torch.int32).numpy().tobytes()
    vals = torch.ones(k, dtype=torch.float32).numpy().tobytes()
    return pb.Tensor(name="grad", dtype="float32", shape=shape, compression=pb.TOPK, block_size=block_size,
                     data=idx + vals)


@pytest.mark.parametrize("compression", [pb.TOPK, pb.INT4_BLOCKWISE, pb.INT2_BLOCKWISE])
def test_a_declared_shape_the_data_does_not_pay_for_is_refused_without_allocating(compression: int) -> None:
    msg = _topk_bomb([1 << 33], 1 << 20, 25)  # 200 bytes declaring 2^33 elements (32 GiB of float32)
    msg.compression = compression
    before = _rss_bytes()
    with pytest.raises(BadMessage):
        decode_tensor(msg, expect_dtype=torch.float32)
    assert _rss_bytes() - before < 64 << 20


def test_a_shard_declaring_more_than_its_stage_is_refused_before_allocating() -> None:
    run = VirtualRun(STEP_SPEC, Corpus.from_stdlib(max_bytes=1 << 16))
    run.begin(0)
    victim = run.nodes[ENDPOINTS[0]]
    assert victim.t is not None
    a = victim.t.assignment
    other = next(r for r, ep in enumerate(a.group) if ep != ENDPOINTS[0])
    # 2^26 elements (256 MiB decoded) in blocks of 2^20: the 64 entries top-k keeps for that shape, 512 bytes
    env = pb.Envelope(kind=pb.GRAD_SHARD, key=make_key(STEP_SPEC.run_id, a.epoch, 0, stage=a.stage, replica=other),
                      meta={"attempt": "0", "participants": "[0, 1]"}, sender=a.group[other])
    env.tensors.append(_topk_bomb([1 << 26], 1 << 20, 64))
    before = _rss_bytes()
    with pytest.raises(BadMessage, match="more than the limit"):
        victim.intake.grad_shard(env)
    assert _rss_bytes() - before < 64 << 20


def _entry(peer_id: str, endpoint: str) -> PeerEntry:
    device = DeviceInfo("emulated", "cpu", 2**33, 10.0, False, True)
    return PeerEntry(Advert(peer_id, endpoint, device, started_at=1.0), heartbeat_at=1.0, expires_at=100.0)


def test_an_endpoint_stays_with_its_first_advertiser_whatever_the_claimants_peer_id() -> None:
    binding = EndpointBinding()
    victim, other = _entry("peer-b", "10.0.0.1:5000"), _entry("peer-c", "10.0.0.2:5000")
    assert binding.filter([victim, other]) == [victim, other]
    # a member advertises the victim's endpoint: larger and smaller peer ids alike are ignored
    for thief in (_entry("peer-z", "10.0.0.1:5000"), _entry("peer-a", "10.0.0.1:5000")):
        assert binding.filter([victim, other, thief]) == [victim, other]
    # our own endpoint is always ours
    a, b = _entry("peer-a", "10.0.0.9:5000"), _entry("peer-b", "10.0.0.9:5000")
    assert EndpointBinding().filter([a, b], own=b.advert) == [b]
    # a holder that left releases its endpoint to the next advertiser
    assert binding.filter([other]) == [other]
    newcomer = _entry("peer-n", "10.0.0.1:5000")
    assert binding.filter([other, newcomer]) == [other, newcomer]


def test_a_fresh_reader_of_a_squatted_endpoint_still_sees_one_claimant_the_right_one() -> None:
    """A squatter advertises the leader's address: a reader that sees both at once (a joiner, a restarted peer,
    `peer status`) keeps the claimant the followed plan names, else the one more credited witnesses name, else
    the oldest advert; never none (which would blind a joiner to the leader)."""
    leader = PeerEntry(_entry("peer-l", "10.0.0.1:5000").advert, 1.0, 100.0)
    squatter = PeerEntry(Advert("peer-0", "10.0.0.1:5000", leader.advert.device, started_at=0.5), 1.0, 100.0)
    honest = [PeerEntry(_entry(f"peer-w{i}", f"10.0.1.{i}:5000").advert, 1.0, 100.0, found=frozenset({"peer-l"}))
              for i in range(2)]
    sybils = [PeerEntry(_entry(f"peer-s{i}", f"10.0.2.{i}:5000").advert, 1.0, 100.0, found=frozenset({"peer-0"}))
              for i in range(3)]
    everyone = [leader, squatter, *honest, *sybils]

    def holder(hints: EndpointHints | None) -> list[str]:
        kept = EndpointBinding().filter(everyone, hints=hints)
        return [e.advert.peer_id for e in kept if e.advert.endpoint == "10.0.0.1:5000"]

    assert holder(EndpointHints(plan_members=frozenset({"peer-l", "peer-w0"}))) == ["peer-l"]
    # no plan: three uncredited sybils outnumber two witnesses, but the leader's signed credit outweighs them
    assert holder(None) == ["peer-0"]
    assert holder(EndpointHints(credit={"peer-w0": 40, "peer-w1": 40, "peer-0": 10**6})) == ["peer-l"]
    # nobody names either: the older advert, and never nobody
    tie = EndpointBinding().filter([leader, squatter])
    assert [e.advert.peer_id for e in tie] == ["peer-0"]


def test_an_assignment_in_another_leaders_name_is_refused() -> None:
    a = build_assignments(SPEC, [(0, 2)], [[0]], ["10.0.0.1:1"], "10.0.0.9:1", EPOCH, leader="leader-id")["10.0.0.1:1"]
    with pytest.raises(Forbidden, match="leader-id"):
        require_named_leader(a, "member-id", "me")
    require_named_leader(a, "leader-id", "me")
    require_named_leader(a, "me", "me")  # the leader's own worker, from its own coordinator


class _Unelected:
    """The view and membership ``Leadership.may_assign`` reads before the view's first complete read."""

    def __init__(self, entries: list[PeerEntry], policy: LeaderPolicy | None = None) -> None:
        self.policy, self.entries = policy, entries

    def elected(self) -> None:
        return None

    def live_entries(self) -> list[PeerEntry]:
        return self.entries


def _gate(entries: list[PeerEntry], me: str, policy: LeaderPolicy | None = None) -> Leadership:
    fake = _Unelected(entries, policy)
    return Leadership(me, 10, 1.0, None, fake, fake)  # type: ignore[arg-type]


def test_before_a_leader_is_elected_an_assignment_is_taken_only_from_the_leader_the_worker_derives() -> None:
    entries = [_entry("peer-a", "10.0.0.1:1"), _entry("peer-b", "10.0.0.2:1"), _entry("peer-c", "10.0.0.3:1")]
    leader = elect_leader(entries)
    others = [e.advert.peer_id for e in entries if e.advert.peer_id != leader]
    gate = _gate(entries, me=others[-1])
    assert gate.may_assign(leader)
    assert not any(gate.may_assign(pid) for pid in others)
    # a read that misses this peer's own advert elects nobody: no assignment is taken on it
    assert not _gate(entries[:1], me="peer-z").may_assign(entries[0].advert.peer_id)
    # under the organiser's policy only its steward's assignment is taken, whoever the testimony favours
    stewards = _gate(entries, me="peer-c", policy=LeaderPolicy.from_record("peer-b", None))
    assert stewards.may_assign("peer-b") and not stewards.may_assign(leader if leader != "peer-b" else "peer-a")


def test_a_step_the_dead_leader_applied_but_never_recorded_is_kept_without_a_loss() -> None:
    record = {"step": 2, "history": {"from": 0, "loss": [4.5, None], "step_s": [1.0, 1.1]}}
    history, missing = adopt_history(record, 3)  # takeover one step past the record
    assert sorted(history) == [0, 1, 2]
    assert history[0] == (4.5, 1.0) and history[1] == (None, 1.1) and history[2][0] is None
    assert sorted(missing) == [1, 2] and "died before publishing" in missing[2]


# ------------------------------------------------------------------------------------ the bad-peer referee
def test_a_lone_report_excludes_nobody_where_others_saw_the_same_data_and_a_second_reporter_sidelines() -> None:
    ref = Referee()
    v = ref.report("a", "b", witnesses=2, step=0)
    assert v.exclude == () and v.set_aside == ("a",), v
    v = ref.report("c", "b", witnesses=2, step=0)
    assert v.exclude == () and v.sideline == ("b",) and v.kept == ("a",) and "named by 2 peers" in v.reason
    assert not ref.lone.get("a") and not ref.lone.get("c")  # corroborated: neither accusation was false
    assert ref.report("a", "a", witnesses=2, step=0) == Verdict(reason="a peer cannot report itself")


def test_a_reporter_whose_accusations_are_contradicted_twice_is_then_ignored() -> None:
    ref = Referee()
    # a pipeline neighbour: nobody else could see the data, so the accused is sidelined, nothing rolled back
    v = ref.report("liar", "h1", witnesses=1, step=3)
    assert v.exclude == () and v.sideline == ("h1",)
    assert ref.vindicate({"h1", "x"}, step=2) == Verdict()  # work from before the accusation proves nothing
    assert ref.vindicate({"h1", "x"}, step=9).exclude == ()  # h1's work passed the others' checks: one contradiction
    assert ref.report("liar", "h2", witnesses=2, step=10).set_aside == ("liar",)
    v = ref.vindicate({"h2"}, step=10)
    assert v.exclude == () and "passed every other witness" in v.reason and ref.false_reporters == {"liar"}
    assert ref.report("liar", "h3", witnesses=1, step=11) == Verdict(
        reason="liar made false reports before; its report is ignored")
    # the contradicted accusations no longer corroborate anyone else's
    assert ref.report("other", "h1", witnesses=1, step=12).sideline == ("h1",)
    assert ref.named_by["h1"] == {"other"}


def test_an_accusation_corroborated_later_is_never_counted_against_its_reporter() -> None:
    ref = Referee()
    ref.report("a", "cheat", witnesses=1, step=0)
    ref.report("b", "cheat", witnesses=1, step=1)
    assert ref.vindicate({"cheat"}, step=5) == Verdict() and ref.contradicted == {}


def test_the_referee_tracks_a_bounded_number_of_identities() -> None:
    ref = Referee()
    for k in range(MAX_TRACKED + 50):
        ref.report(f"r{k}", f"v{k}", witnesses=2, step=k)
    assert len(ref.named_by) == MAX_TRACKED and len(ref.lone) <= MAX_TRACKED
    assert ref.report("late", "new", witnesses=1, step=0).exclude == ()


@pytest.fixture
def three_pipelines() -> Iterator[Coordinator]:
    """A coordinator over 2 stages x 3 pipelines of scripted workers (no step running)."""
    coordinator = Coordinator(SPEC, liveness_interval_s=30)
    coordinator.start()
    workers = [ScriptedWorker() for _ in range(6)]
    try:
        endpoints = [w.start() for w in workers]
        coordinator.assign(build_assignments(SPEC, [(0, 1), (1, 2)], [[0, 1], [2, 3], [4, 5]], endpoints,
                                             coordinator.endpoint, EPOCH))
        yield coordinator
    finally:
        coordinator.close()
        for w in workers:
            w.stop()


def test_the_coordinator_sidelines_on_reports_and_rolls_nothing_back(three_pipelines: Coordinator) -> None:
    coordinator = three_pipelines

    def report(stage: int, replica: int, accused: tuple[int, int]) -> None:
        env = ctl.encode(ctl.BadPeer(accused[0], accused[1], "", "refused"), SPEC.run_id, EPOCH, 0, stage=stage,
                         replica=replica)
        with PeerClient(coordinator.endpoint, sender="member") as client:
            client.push(env, timeout_s=10)

    accused = coordinator.roster.endpoint_of(1, 1)
    report(1, 0, (1, 1))  # a replica of its group, while another replica checked the same shards
    report(1, 2, (1, 1))  # the third replica of the group names it too: corroborated, still testimony
    report(0, 2, (1, 2))  # its upstream neighbour, the only worker that receives its activation gradients
    assert coordinator.dead == {accused, coordinator.roster.endpoint_of(1, 2)}  # left out of the plan, a ban each
    assert coordinator.verification.take_rollback() is None, "testimony rolls nothing back"
    assert coordinator.referee.named_by[accused] == {coordinator.roster.endpoint_of(1, 0),
                                                     coordinator.roster.endpoint_of(1, 2)}


def test_a_set_aside_takes_effect_after_its_grace_unless_corroboration_keeps_the_pipeline() -> None:
    machine = StepMachine(0, make_roster(3), 4, now=0.0, timeout_s=100.0, lease_timeout_s=50.0)
    machine.start()
    machine.set_aside(1, at=2.0)
    machine.set_aside(2, at=2.0)
    machine.set_aside(7, at=0.0)  # no such pipeline: ignored
    machine.tick(1.0)
    assert machine.intact() == [0, 1, 2]
    machine.keep(2)  # another reporter corroborated pipeline 2's report within the grace
    machine.tick(2.5)
    assert machine.intact() == [0, 2] and machine.state.dropped == {1}
    machine.keep(1)  # too late: a dropped pipeline stays out of the step
    assert machine.intact() == [0, 2]
