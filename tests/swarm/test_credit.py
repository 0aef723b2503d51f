"""The contribution record (peer.swarm.credit): what it counts, that it adds up, that a new leader continues it,
that hostile records are bounded and never crash a reader, and how status, `peer credits` and the dashboard show it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from tasklet.peer.node.leader_role import credit_step
from tasklet.peer.observe.snapshot import _credit
from tasklet.peer.runtime.lead.step import StepReport
from tasklet.peer.swarm.credit import MAX_IDENTITIES, MAX_REASON, CreditBook, credit_rows
from tasklet.peer.swarm.progress import FULL_ONLY, ProgressBoard
from tasklet.peer.swarm.status import SwarmStatus, credit_summary, format_credits, format_status

A, B, C, D = "QmAaaa", "QmBbbb", "QmCccc", "QmDddd"


def test_credit_adds_up_to_stages_times_the_microbatches_applied() -> None:
    book = CreditBook()
    pipelines = [[A, B], [C, D]]  # two pipelines of two stages
    book.plan(p for pipe in pipelines for p in pipe)
    book.step(0, 1.5, {0: 5, 1: 3}, pipelines)
    book.step(1, 2.0, {0: 8}, pipelines)  # pipeline 1 dropped from the step: it committed nothing
    rec = book.to_record()
    assert rec["total_microbatches"] == 16 and rec["steps"] == 2
    assert sum(p["microbatches"] for p in rec["peers"].values()) == 2 * 16
    assert rec["peers"][A]["microbatches"] == 13 and rec["peers"][A]["steps"] == 2
    assert rec["peers"][C]["microbatches"] == 3 and rec["peers"][C]["steps"] == 1
    assert rec["peers"][C]["train_s"] == 1.5 and rec["peers"][A]["train_s"] == 3.5
    assert all(p["plans"] == 1 for p in rec["peers"].values())
    assert list(rec["peers"])[:2] == [A, B]  # most credited first


def test_bytes_served_count_each_stage_hop_of_the_credited_microbatches() -> None:
    """A first stage sends activations forward, a last one gradients back, a middle one both; a record written
    before bytes were counted reads as zero."""
    book = CreditBook()
    book.step(0, 1.0, {0: 4, 1: 2}, [[A, B, C], [D, D]], activation_bytes=1000)  # D holds both stages of pipeline 1
    rec = book.to_record()["peers"]
    assert (rec[A]["bytes_served"], rec[B]["bytes_served"], rec[C]["bytes_served"]) == (4000, 8000, 4000)
    assert rec[D]["bytes_served"] == 2 * 2000
    old = {"microbatches": 1, "steps": 1, "plans": 1, "train_s": 1.0, "excluded": 0, "last_exclusion": None,
           "last_step": 0}
    assert CreditBook.from_record({"peers": {A: old}}).peers[A].bytes_served == 0


def test_a_pipeline_outside_the_commit_record_earns_nothing() -> None:
    """The step's report gives micro-batches only to the pipelines of the commit record it was applied with; a
    culprit's pipeline, dropped and redone by the others, is not among them (nor is an out-of-range index)."""
    book = CreditBook()
    report = StepReport(step=4, loss=1.0, seconds=2.0, microbatches_per_pipeline={0: 8}, applied=[0],
                        dropped_pipelines=[1], commits={mb: 0 for mb in range(8)})
    coordinator = SimpleNamespace(take_exclusions=lambda: [(3, C, "sent malformed data to x: steered shard")])
    credit_step(book, report, [[0, 1], [2, 3]], {0: A, 1: B, 2: C, 3: D}, coordinator)  # type: ignore[arg-type]
    rec = book.to_record()
    assert rec["peers"][A]["microbatches"] == 8 and rec["peers"][B]["microbatches"] == 8
    assert rec["peers"][C]["microbatches"] == 0 and D not in rec["peers"]
    assert rec["peers"][C]["excluded"] == 1 and "steered shard" in rec["peers"][C]["last_exclusion"]
    book.step(5, 1.0, {7: 8, -1: 8, 0: 0}, [[A, B]])
    assert book.to_record()["total_microbatches"] == 8


def test_an_exclusion_counts_once_per_plan_and_its_reason_is_bounded() -> None:
    book = CreditBook()
    book.exclude(3, A, "ping failed")
    book.exclude(3, A, "ping failed again")
    book.exclude(4, A, "x" * 10_000)
    entry = book.to_record()["peers"][A]
    assert entry["excluded"] == 2 and len(entry["last_exclusion"]) == MAX_REASON


def test_a_new_leader_continues_the_record_it_adopts() -> None:
    old = CreditBook()
    old.plan([A, B])
    old.step(0, 1.0, {0: 4, 1: 4}, [[A], [B]])
    signed = json.loads(json.dumps(old.to_record()))  # as published and read back
    new = CreditBook.from_record(signed)
    assert new.to_record() == old.to_record()
    new.step(1, 1.0, {0: 8}, [[C]])  # the old leader's peers are gone; their credit stays
    rec = new.to_record()
    assert rec["peers"][A]["microbatches"] == 4 and rec["peers"][C]["microbatches"] == 8
    assert rec["total_microbatches"] == 16 == sum(p["microbatches"] for p in rec["peers"].values())


def test_the_record_is_bounded_and_evicted_credit_still_adds_up() -> None:
    book = CreditBook(max_identities=4)
    for k in range(10):
        book.step(k, 1.0, {0: k + 1}, [[f"Qm{k}"]])
    rec = book.to_record()
    assert len(rec["peers"]) == 4 and set(rec["peers"]) == {"Qm6", "Qm7", "Qm8", "Qm9"}
    assert sum(p["microbatches"] for p in rec["peers"].values()) + rec["evicted_microbatches"] == \
        rec["total_microbatches"] == 55
    full = CreditBook()
    for k in range(2 * MAX_IDENTITIES):
        full.plan([f"Qm{'x' * 40}{k:05d}"])
        full.exclude(0, f"Qm{'x' * 40}{k:05d}", "r" * 500)
    size = len(json.dumps(full.to_record()))
    assert len(full.peers) == MAX_IDENTITIES and size < 100_000, size  # the full record's limit is 257 KiB


def hostile_records() -> list[Any]:
    good = {"microbatches": 1, "steps": 1, "plans": 1, "train_s": 1.0, "excluded": 0, "last_exclusion": None,
            "last_step": 0}
    return [
        None, 7, "credit", [], {"peers": []}, {"peers": {A: "x"}},
        {"total_microbatches": -5, "steps": True, "evicted_microbatches": 1e308, "peers": {}},
        {"peers": {A: {**good, "microbatches": -1}}},
        {"peers": {A: {**good, "microbatches": True}}},
        {"peers": {A: {**good, "microbatches": 2**60}}},
        {"peers": {A: {**good, "train_s": float("nan")}}},
        {"peers": {A: {**good, "train_s": "1"}}},
        {"peers": {A: {**good, "last_step": -7}}},
        {"peers": {A: {**good, "bytes_served": -1}}},
        {"peers": {A: {**good, "bytes_served": 1.5}}},
        {"peers": {A: {**good, "last_exclusion": 5}, "bad id with spaces": good, "x" * 500: good, "": good}},
        {"peers": {f"Qm{k}": good for k in range(5000)}},
    ]


def test_hostile_records_are_refused_entry_by_entry_and_never_crash_a_reader() -> None:
    for record in hostile_records():
        book = CreditBook.from_record(record)
        rec = book.to_record()
        json.dumps(rec, allow_nan=False)
        assert len(rec["peers"]) <= MAX_IDENTITIES
        assert all(isinstance(v, int) and 0 <= v <= 2**53 for v in
                   (rec["total_microbatches"], rec["steps"], rec["evicted_microbatches"]))
        for peer, entry in rec["peers"].items():
            assert 0 < len(peer) <= 128 and " " not in peer
            assert entry["microbatches"] >= 0
            assert entry["last_exclusion"] is None or isinstance(entry["last_exclusion"], str)
        rows = credit_rows(record)
        assert len(rows) == len(rec["peers"])
        summary = credit_summary({"credit": record, "leader": A, "step": 3})
        format_credits(summary)
        format_credits(summary, me=A)
        _credit(record)
    assert len(CreditBook.from_record(hostile_records()[-1]).peers) == MAX_IDENTITIES
    assert CreditBook.from_record({"peers": {A: {"microbatches": -1}}}).peers == {}


def test_status_json_table_and_me_show_the_signed_record() -> None:
    book = CreditBook()
    book.step(0, 1.0, {0: 6, 1: 2}, [[A], [B]])
    progress = {"step": 1, "leader": C, "credit": book.to_record(), "state": "training"}
    peers = [{"peer_id": p, "device": "cpu", "tflops": 1.0, "emulated": False, "stage": 0, "replica": r,
              "last_seen_s": 0.5, "region": None, "reachable": True, "paths": [], "credit_microbatches": n}
             for r, (p, n) in enumerate([(A, 6), (B, 2)])]
    st = SwarmStatus(peers, {"epoch": 1, "leader": C, "pipelines": [[A], [B]], "stages": [[0, 2]]}, progress,
                     {"measured": 0, "pairs": 2, "median_bandwidth_mbps": None, "median_rtt_ms": None, "by_path": {}})
    out = st.to_json()["credit"]
    assert out["leader"] == C and out["total_microbatches"] == 8
    assert [(r["peer_id"], r["microbatches"]) for r in out["peers"]] == [(A, 6), (B, 2)]
    screen = format_status(st)
    assert "credit" in screen.splitlines()[-4] and f"{A[:12]}" in screen
    table = format_credits(out)
    assert "75.0%" in table and "25.0%" in table and "8 micro-batches in 1 applied steps" in table
    mine = format_credits(out, me=B)
    assert B in mine and A not in mine.split("\n", 1)[1]
    assert "no credit in the record" in format_credits(out, me=D)


def test_the_dashboard_snapshot_carries_checked_rows() -> None:
    book = CreditBook()
    book.step(0, 1.0, {0: 3}, [[A]])
    rows = _credit({**book.to_record(), "peers": {**book.to_record()["peers"], "<script>": {"microbatches": 1}}})
    assert rows == [{"peer_id": A, "microbatches": 3, "steps": 1, "plans": 0, "train_s": 1.0, "bytes_served": 0,
                     "excluded": 0, "last_exclusion": None}]


def test_the_beat_leaves_the_credit_to_the_full_record() -> None:
    """Workers read the beat every heartbeat: it must not grow with the swarm."""
    stored: dict[str, dict[str, Any]] = {}
    board = ProgressBoard.__new__(ProgressBoard)
    board.store = SimpleNamespace(identity=SimpleNamespace(peer_id=A),  # type: ignore[assignment]
                                  put=lambda name, value, expiry: stored.__setitem__(name, value) or True)
    board.ttl_s, board._last, board._full = 60.0, {}, None
    assert board.publish({"epoch": 1, "step": 2, "history": {"loss": [1.0]}, "credit": CreditBook().to_record()})
    assert "credit" in FULL_ONLY and "credit" not in stored["beat"] and "history" not in stored["beat"]
    assert stored["progress"]["credit"]["steps"] == 0


def test_a_new_leader_reads_its_predecessors_record_again_until_a_lookup_finds_it() -> None:
    """One lookup right after a leader's death can miss its record: the new leader's first records would carry
    no credit, and its takeover no signed step. It reads again (and never takes an older record after a newer)."""
    record = {"epoch": 2, "step": 3, "leader": A, "at": 1.0, "credit": CreditBook().to_record()}
    answers = [[], None, [SimpleNamespace(owner=A, payload=record)]]  # nothing, a timeout, then the record
    board = ProgressBoard.__new__(ProgressBoard)
    board.store = SimpleNamespace(get_all=lambda name: answers.pop(0) if answers else [])  # type: ignore[assignment]
    board._seen = {}
    assert board.read_patiently(B, 0.0, lambda s: False) is None and answers, "no patience: one lookup"
    answers.insert(0, [])
    waits: list[float] = []
    found = board.read_patiently(A, 10.0, lambda s: waits.append(s) or False)
    assert found == record and len(waits) == 2, (found, waits)
    assert board.read_patiently(A, 10.0, lambda s: False) == record, "a miss later keeps what was read"
    answers.append([SimpleNamespace(owner=A, payload={**record, "step": 2})])
    assert board.read_patiently(A, 10.0, lambda s: False) == record, "never an older record"
    assert board.read_patiently(B, 10.0, lambda s: True) is None, "a stop ends the wait"
