"""The contribution record: what each peer identity did for the run, kept by the leader and signed with its progress.

Counted per peer id (the hash of the peer's key, so credit follows the identity file, not the machine):

* ``microbatches``: micro-batches of applied steps that the peer's pipeline committed, i.e. work that passed every
  check of the step (the exactly-once commit record, the norm and direction tests, the all-gather digest) and
  reached the model. A pipeline dropped from a step (a death, a culprit named, a lost speculative race) committed
  nothing in the commit record the step was applied with, so its members earn nothing for work the others redid.
  Every stage of a pipeline computes each of its micro-batches, so each member earns it: over all identities the
  record adds up to ``stages x`` the micro-batches the run applied (``total_microbatches``).
* ``steps``: applied steps in which the peer's pipeline committed at least one micro-batch.
* ``train_s``: the wall seconds of those steps; ``plans``: the plans that gave the peer a tasklet (uptime in plans).
* ``bytes_served``: the activations (to the next stage) and activation gradients (to the previous one) of those
  micro-batches, at their uncompressed size from the run's shapes: what the pipeline had to carry for the credited
  work, not a count of bytes on the wire (compression, retries and the replicas' gradient averaging are left out).
* ``excluded`` and ``last_exclusion``: how often the leader excluded the peer from a plan, and why the last time.

The leader publishes the record in every progress record (signed by its key, read only from the leader of the plan
followed: ``peer.swarm.progress``), and a new leader starts from the record its predecessor signed, so no worker
can write its own credit. Limits: the leader itself is believed (a lying leader can write any credit); a step
redone after a roll-back is credited again (the work was done twice); a step a dying leader half-applied and its
successor finished is not credited (nobody recorded its commit record). At most ``MAX_IDENTITIES`` identities are
kept: when a new one would pass the cap, the one with the least credit leaves and its micro-batches are counted in
``evicted_microbatches``, so the totals still add up.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MAX_IDENTITIES = 256  # identities kept in the record (~120 bytes each in the signed progress record)
MAX_COUNT = 2**53  # counts above this are no honest record's (a JSON number stays exact below it)
MAX_REASON = 120  # characters of an exclusion's reason kept
_PEER_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


@dataclass
class Credit:
    """One identity's contribution."""

    microbatches: int = 0
    steps: int = 0
    plans: int = 0
    train_s: float = 0.0
    excluded: int = 0
    last_exclusion: str | None = None
    last_step: int = -1  # the last step credited (-1: none), which identity a full record evicts first
    bytes_served: int = 0

    def weight(self) -> tuple[int, int]:
        return (self.microbatches, self.last_step)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT else None


class CreditBook:
    """The leader's contribution record; ``to_record`` / ``from_record`` are its form in the progress record."""

    def __init__(self, max_identities: int = MAX_IDENTITIES) -> None:
        if max_identities < 1:
            raise ValueError(f"max_identities must be positive, got {max_identities}")
        self.max_identities = max_identities
        self.peers: dict[str, Credit] = {}
        self.total_microbatches = 0  # micro-batches of every applied step (each counted once, not per stage)
        self.steps = 0  # applied steps credited
        self.evicted_microbatches = 0  # credit of identities that left the record to keep it bounded
        self._excluded_in: set[tuple[int, str]] = set()  # (plan epoch, peer): an exclusion counted once per plan

    # ------------------------------------------------------------------------------------------- recording
    def _entry(self, peer: str) -> Credit | None:
        """The peer's entry, made if needed (evicting the least credited one when full); None for a bad id."""
        if not isinstance(peer, str) or not _PEER_ID.match(peer):
            return None
        entry = self.peers.get(peer)
        if entry is None:
            if len(self.peers) >= self.max_identities:
                gone = min(self.peers, key=lambda p: (self.peers[p].weight(), p))
                self.evicted_microbatches += self.peers.pop(gone).microbatches
            entry = self.peers[peer] = Credit()
        return entry

    def plan(self, members: Iterable[str]) -> None:
        """A plan gave each of ``members`` a tasklet."""
        for peer in set(members):
            entry = self._entry(peer)
            if entry is not None:
                entry.plans += 1

    def step(self, step: int, seconds: float, committed: Mapping[int, int], pipelines: Sequence[Sequence[str]],
             activation_bytes: int = 0) -> None:
        """Credit an applied step: ``committed`` maps each pipeline to the micro-batches it committed in the commit
        record the step was applied with; ``pipelines[r]`` are the peer ids of pipeline ``r``'s stages;
        ``activation_bytes``: one micro-batch's activation (and activation gradient) between two stages."""
        secs = seconds if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0 else 0.0
        for r, n in committed.items():
            if not (0 <= r < len(pipelines)) or n <= 0:
                continue
            self.total_microbatches += n
            for peer in set(pipelines[r]):
                entry = self._entry(peer)
                if entry is None:
                    continue
                entry.microbatches += n
                entry.steps += 1
                entry.train_s += secs
                entry.last_step = max(entry.last_step, step)
            last = len(pipelines[r]) - 1
            for s_index, peer in enumerate(pipelines[r]):  # forward to the next stage, backward to the previous
                entry = self.peers.get(peer) if isinstance(peer, str) else None
                if entry is not None:
                    entry.bytes_served += n * activation_bytes * ((s_index < last) + (s_index > 0))
        self.steps += 1

    def exclude(self, epoch: int, peer: str, reason: str) -> None:
        """The leader excluded ``peer`` from the plan of ``epoch`` (counted once per plan)."""
        if (epoch, peer) in self._excluded_in:
            return
        entry = self._entry(peer)
        if entry is None:
            return
        self._excluded_in.add((epoch, peer))
        entry.excluded += 1
        entry.last_exclusion = reason[:MAX_REASON]

    # ------------------------------------------------------------------------------------------- the record
    def to_record(self) -> dict[str, Any]:
        """The JSON form published in the progress record and written to run.json (most credited first)."""
        order = sorted(self.peers, key=lambda p: (-self.peers[p].microbatches, p))
        peers = {}
        for p in order:
            d = asdict(self.peers[p])
            d["train_s"] = round(d["train_s"], 3)
            peers[p] = d
        return {"peers": peers, "total_microbatches": self.total_microbatches, "steps": self.steps,
                "evicted_microbatches": self.evicted_microbatches, "max_identities": self.max_identities}

    @classmethod
    def from_record(cls, record: object, max_identities: int = MAX_IDENTITIES) -> CreditBook:
        """A book from a previous leader's record. It is signed by that leader, but a leader's record is still input:
        malformed entries are dropped, and at most ``max_identities`` (the most credited) are kept."""
        book = cls(max_identities)
        if not isinstance(record, dict):
            return book
        book.total_microbatches = _count(record.get("total_microbatches")) or 0
        book.steps = _count(record.get("steps")) or 0
        book.evicted_microbatches = _count(record.get("evicted_microbatches")) or 0
        peers = record.get("peers")
        if not isinstance(peers, dict):
            return book
        entries: dict[str, Credit] = {}
        for peer, raw in list(peers.items())[: 4 * max_identities]:
            entry = _parse_entry(raw)
            if isinstance(peer, str) and _PEER_ID.match(peer) and entry is not None:
                entries[peer] = entry
        kept = sorted(entries, key=lambda p: (entries[p].weight(), p), reverse=True)[:max_identities]
        book.evicted_microbatches += sum(entries[p].microbatches for p in entries if p not in set(kept))
        book.peers = {p: entries[p] for p in kept}
        return book


def _parse_entry(raw: object) -> Credit | None:
    if not isinstance(raw, dict):
        return None
    counts = [_count(raw.get(k)) for k in ("microbatches", "steps", "plans", "excluded")]
    served = _count(raw.get("bytes_served", 0))  # absent from a record written before it was counted
    train_s, last_step, why = raw.get("train_s"), raw.get("last_step"), raw.get("last_exclusion")
    if any(c is None for c in counts) or served is None:
        return None
    if isinstance(train_s, bool) or not isinstance(train_s, (int, float)) or not 0 <= train_s < 1e12:
        return None
    if isinstance(last_step, bool) or not isinstance(last_step, int) or not -1 <= last_step <= MAX_COUNT:
        return None
    mbs, steps, plans, excluded = counts
    return Credit(mbs, steps, plans, float(train_s), excluded,  # type: ignore[arg-type]
                  why[:MAX_REASON] if isinstance(why, str) else None, last_step, served)


def credit_rows(record: object, limit: int = MAX_IDENTITIES) -> list[dict[str, Any]]:
    """The record's entries as rows (peer id first), most credited first, checked like ``from_record``: what
    `peer status`, `peer credits` and the dashboard show."""
    book = CreditBook.from_record(record, limit)
    rows = [{"peer_id": p, **asdict(c)} for p, c in book.peers.items()]
    return sorted(rows, key=lambda r: (-r["microbatches"], r["peer_id"]))
