"""The gradient exchange on its own: reduce-scatter + all-gather averagings among in-process replicas.

Each replica is a thread with its own :class:`GradientExchange`, and "sending" a shard is a direct call into the
receiver's mailbox — exactly what the worker's gRPC handlers do once a message is validated, minus the network.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch

from tasklet.peer.runtime.stage.exchange import ExchangeTimeoutError, GradientExchange
from tasklet.peer.runtime.stage.gradient_checks import ExchangeAbortedError, Tag
from tasklet.protocol.errors import BadMessage

NUMEL = 11  # not a multiple of 2 or 3: shards of unequal size

def run_attempt(
    boxes: dict[int, GradientExchange],
    grads: dict[int, torch.Tensor],
    microbatches: dict[int, list[int]],
    n_microbatches: int,
    tag: Tag = (0, 1),
    senders: Sequence[int] | None = None,
    timeout_s: float = 10.0,
) -> dict[int, torch.Tensor | BaseException]:
    """One attempt's averaging among ``boxes`` (participants = their keys); ``senders``: who actually takes part."""
    participants = sorted(boxes)
    senders = participants if senders is None else list(senders)
    out: dict[int, torch.Tensor | BaseException] = {}

    def replica(me: int) -> None:
        box = boxes[me]
        try:
            for r in participants:
                lo, hi = box.shard_of(participants, r)
                boxes[r].put_contribution(tag, participants, me, grads[me][lo:hi].clone(), microbatches[me])
            mine = box.shard_sum(tag, participants, n_microbatches, timeout_s)
            for r in participants:
                boxes[r].put_reduced(tag, participants, me, mine.clone())
            out[me] = box.gather(tag, participants, timeout_s)
        except BaseException as exc:  # collected for the test to look at
            out[me] = exc

    threads = [threading.Thread(target=replica, args=(me,)) for me in senders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 5)
    return out

def make(n: int) -> tuple[dict[int, GradientExchange], dict[int, torch.Tensor]]:
    gen = torch.Generator().manual_seed(n)
    boxes = {r: GradientExchange(r, NUMEL) for r in range(n)}
    grads = {r: torch.randn(NUMEL, generator=gen) for r in range(n)}
    return boxes, grads

@pytest.mark.parametrize("n", [2, 3])
def test_round_sums_in_participant_order_and_every_replica_agrees(n: int) -> None:
    boxes, grads = make(n)
    mbs = {r: list(range(r, 6, n)) for r in range(n)}  # 6 micro-batches split among the replicas
    out = run_attempt(boxes, grads, mbs, n_microbatches=6)
    expected = grads[0].clone()
    for r in range(1, n):
        expected = expected.add_(grads[r])
    for r in range(n):
        got = out[r]
        assert isinstance(got, torch.Tensor), got
        assert torch.equal(got, expected), f"replica {r} holds a different sum"
    # averaging is the sum over n_microbatches, applied by StageCompute: check it is the mean of the grads
    assert torch.allclose(out[0] / n, torch.stack(list(grads.values())).mean(0), atol=1e-6)

def test_a_microbatch_counted_twice_is_refused_where_the_sum_happens() -> None:
    boxes, grads = make(2)
    out = run_attempt(boxes, grads, {0: [0, 1], 1: [1, 2]}, n_microbatches=3, timeout_s=2.0)
    errors = [e for e in out.values() if isinstance(e, BadMessage)]
    assert errors and all(e.field == "microbatches" for e in errors)
    assert "exactly once" in str(errors[0])

def test_missing_participant_times_out_naming_what_arrived() -> None:
    boxes, grads = make(3)
    out = run_attempt(boxes, grads, {0: [0], 1: [1], 2: [2]}, n_microbatches=3, senders=[0, 1], timeout_s=0.5)
    for r in (0, 1):
        err = out[r]
        assert isinstance(err, ExchangeTimeoutError), err
        assert "2/3 gradient shards" in str(err)

def test_new_round_aborts_a_round_waiting_on_a_dead_participant() -> None:
    boxes, grads = make(3)
    result: dict[int, torch.Tensor | BaseException] = {}
    waiter = threading.Thread(
        target=lambda: result.update(
            run_attempt(boxes, grads, {0: [0], 1: [1], 2: [2]}, n_microbatches=3, senders=[0, 1], timeout_s=30.0)
        )
    )
    waiter.start()
    time.sleep(0.3)  # let both block in reduce (an abort that comes earlier must release them all the same)
    for r in (0, 1):  # the coordinator restarts the step as attempt 2 without replica 2
        boxes[r].abort_before((0, 2))
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "an aborted attempt must release its waiters at once"
    assert all(isinstance(result[r], ExchangeAbortedError) for r in (0, 1)), result
    # the next attempt, with the survivors only, completes and covers every micro-batch once
    survivors = {r: boxes[r] for r in (0, 1)}
    out = run_attempt(survivors, grads, {0: [0, 2], 1: [1]}, n_microbatches=3, tag=(0, 2))
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], grads[0] + grads[1])  # type: ignore[operator]

def test_shard_arriving_before_the_replica_is_told_to_reduce_is_kept() -> None:
    _, grads = make(2)
    box, parts = GradientExchange(0, NUMEL), [0, 1]
    lo, hi = box.shard_of(parts, 0)
    box.put_contribution((4, 1), parts, 1, grads[1][lo:hi].clone(), [1])  # replica 1 was faster
    box.put_contribution((4, 1), parts, 0, grads[0][lo:hi].clone(), [0])  # replica 0 is told to reduce
    assert torch.equal(box.shard_sum((4, 1), parts, 2, timeout_s=1.0), grads[0][lo:hi] + grads[1][lo:hi])

BAD: dict[str, tuple[Callable[[GradientExchange], None], str]] = {
    "wrong size": (lambda b: b.put_contribution((0, 1), [0, 1], 1, torch.zeros(3), [0]), "tensors.grad"),
    "wrong dtype": (lambda b: b.put_contribution((0, 1), [0, 1], 1, torch.zeros(6, dtype=torch.float64), [0]),
                    "tensors.grad"),
    "not a participant": (lambda b: b.put_contribution((0, 1), [0, 1], 5, torch.zeros(6), [0]), "key.replica"),
    "unsorted participants": (lambda b: b.put_contribution((0, 1), [1, 0], 1, torch.zeros(6), [0]),
                              "meta.participants"),
    "receiver not among them": (lambda b: b.put_reduced((0, 1), [1, 2], 1, torch.zeros(6)), "meta.participants"),
}

@pytest.mark.parametrize("case", list(BAD))
def test_malformed_shard_is_refused_naming_the_field(case: str) -> None:
    box = GradientExchange(0, NUMEL)
    put, field = BAD[case]
    with pytest.raises(BadMessage) as err:
        put(box)
    assert err.value.field == field

def test_duplicate_and_inconsistent_messages_are_refused() -> None:
    box = GradientExchange(0, NUMEL)
    lo, hi = box.shard_of([0, 1], 0)
    box.put_contribution((0, 1), [0, 1], 1, torch.zeros(hi - lo), [0])
    with pytest.raises(BadMessage, match="already sent"):
        box.put_contribution((0, 1), [0, 1], 1, torch.zeros(hi - lo), [0])
    with pytest.raises(BadMessage, match="participants"):  # same attempt, other participants
        box.put_contribution((0, 1), [0, 1, 2], 2, torch.zeros(4), [0])

def test_a_sparse_shard_of_two_honest_replicas_passes_and_a_scaled_one_does_not() -> None:
    """Two participants: the owner's part of a token-embedding shard is almost zero (its micro-batches' tokens
    hit other rows), the other's is of honest size. The owner's whole gradient floors the comparison, so the honest
    part passes; the same part x1e6 is refused, naming its sender, never the owner."""
    from tasklet.peer.runtime.stage.gradient_checks import OutlierContributionError

    n, participants, tag = 64, [0, 1], (3, 1)
    owner = GradientExchange(0, n)
    lo, hi = owner.shard_of(participants, 0)
    own = torch.zeros(n)
    own[hi:] = torch.randn(n - hi, generator=torch.Generator().manual_seed(1))  # its weight lands on shard 1
    own[lo] = 1e-4
    other = torch.randn(hi - lo, generator=torch.Generator().manual_seed(2))
    assert float(other.norm()) > 1000 * 1e-4, "without the floor this part would be an outlier of the owner's"
    owner.put_contribution(tag, participants, 0, own[lo:hi].clone(), [0, 1], whole_norm=float(own.norm()))
    owner.put_contribution(tag, participants, 1, other.clone(), [2, 3])
    summed = owner.shard_sum(tag, participants, 4, 1.0)
    assert torch.equal(summed, own[lo:hi] + other)

    scaled = GradientExchange(0, n)
    scaled.put_contribution(tag, participants, 0, own[lo:hi].clone(), [0, 1], whole_norm=float(own.norm()))
    scaled.put_contribution(tag, participants, 1, other * 1e6, [2, 3])
    with pytest.raises(OutlierContributionError) as info:
        scaled.shard_sum(tag, participants, 4, 1.0)
    assert info.value.replicas == [1] and "whole gradient" in str(info.value)


@pytest.mark.parametrize(("times", "refused"), [(174.0, False), (999.0, False), (1001.0, True)])
def test_an_honest_spike_passes_and_only_a_size_beyond_k_is_refused(times: float, refused: bool) -> None:
    """The default k (1000) against a one-micro-batch contribution ``times`` the owner's whole gradient per
    micro-batch (its three micro-batches): 174 x is the largest honest spike bench.gradient_tails measured."""
    from tasklet.peer.runtime.stage.gradient_checks import OutlierContributionError

    participants, tag = [0, 1], (3, 1)
    box = GradientExchange(0, NUMEL)
    lo, hi = box.shard_of(participants, 0)
    own = torch.ones(hi - lo)
    whole = 3.0 * float(own.norm())  # its whole gradient: its part's norm per micro-batch, three micro-batches
    spike = own * times  # one micro-batch
    box.put_contribution(tag, participants, 0, own.clone(), [0, 1, 2], whole_norm=whole)
    box.put_contribution(tag, participants, 1, spike, [3])
    if refused:
        with pytest.raises(OutlierContributionError, match="exceeds 1000 x"):
            box.shard_sum(tag, participants, 4, 1.0)
    else:
        assert torch.equal(box.shard_sum(tag, participants, 4, 1.0), own + spike)
