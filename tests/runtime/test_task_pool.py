"""The task pool's exactly-once book-keeping (pure logic, no processes)."""

from __future__ import annotations

import pytest

from tasklet.peer.runtime.lead.pool import CommitResult, TaskPool


class FakeClock:
    """A clock the test moves by hand, so lease expiry is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_leases_lowest_free_first_and_completes() -> None:
    pool = TaskPool(step=0, n_microbatches=4)
    assert [pool.lease(0), pool.lease(1), pool.lease(0), pool.lease(1)] == [0, 1, 2, 3]
    assert pool.lease(0) is None
    for mb, pipe in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        assert not pool.complete()
        assert pool.commit(mb, pipe) is CommitResult.COMMITTED
    assert pool.complete()
    assert pool.assignment() == {0: 0, 1: 1, 2: 0, 3: 1}


def test_duplicate_and_stale_commits_are_refused() -> None:
    pool = TaskPool(step=0, n_microbatches=2)
    mb = pool.lease(0)
    assert pool.commit(mb, 1) is CommitResult.STALE  # leased to pipeline 0, not 1
    assert pool.commit(mb, 0) is CommitResult.COMMITTED
    assert pool.commit(mb, 0) is CommitResult.DUPLICATE
    assert pool.commit(1, 0) is CommitResult.STALE  # never leased


def test_failed_pipeline_returns_leased_and_committed_work() -> None:
    pool = TaskPool(step=3, n_microbatches=4)
    a, b = pool.lease(0), pool.lease(1)
    c = pool.lease(0)
    assert pool.commit(a, 0) is CommitResult.COMMITTED
    assert pool.fail_pipeline(0) == sorted([a, c])
    assert pool.lease(0) is None  # a failed pipeline gets nothing more this step
    assert pool.commit(c, 0) is CommitResult.STALE  # a late reply from the dead pipeline
    got = sorted(x for x in (pool.lease(1), pool.lease(1), pool.lease(1)) if x is not None)
    assert got == sorted([a, c, 3])
    for mb in [b, *got]:
        assert pool.commit(mb, 1) is CommitResult.COMMITTED
    assert pool.complete()
    assert set(pool.assignment().values()) == {1}
    assert pool.requeued == 2


def test_expired_lease_fails_its_pipeline() -> None:
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=3, lease_timeout_s=5.0, clock=clock)
    pool.lease(0)
    pool.lease(1)
    clock.now = 4.0
    assert pool.expire() == []
    clock.now = 6.0
    assert pool.expire() == [0, 1]
    assert pool.lease(0) is None and pool.lease(1) is None, "an expired pipeline gets nothing more"
    assert pool.requeued == 2


@pytest.mark.parametrize("n, timeout", [(0, 1.0), (4, 0.0)])
def test_bad_arguments_name_the_field(n: int, timeout: float) -> None:
    with pytest.raises(ValueError, match="n_microbatches|lease_timeout_s"):
        TaskPool(step=0, n_microbatches=n, lease_timeout_s=timeout)


def test_idle_pipeline_gets_a_speculative_copy_and_the_first_commit_wins() -> None:
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=2, lease_timeout_s=100.0, clock=clock)
    assert pool.lease(0) == 0 and pool.lease(1) == 1
    assert pool.commit(1, 1) is CommitResult.COMMITTED
    assert pool.lease(1, speculate_after_s=5.0) is None, "not held long enough to be a straggler"
    clock.now = 6.0
    assert pool.lease(1, speculate_after_s=5.0) == 0 and pool.is_speculative(0, 1)
    assert pool.lease(1, speculate_after_s=5.0) is None, "at most one copy of each micro-batch"
    assert pool.commit(0, 1) is CommitResult.COMMITTED, "the copy commits first: it wins"
    assert pool.losers() == [0], "the original holder has micro-batch 0 in its sum: it must be failed"
    assert pool.commit(0, 0) is CommitResult.DUPLICATE
    assert pool.fail_pipeline(0) == [] and pool.complete() and pool.assignment() == {0: 1, 1: 1}
    assert pool.speculated == pool.speculation_won == 1


def test_original_commit_beats_the_copy_and_a_failed_original_hands_over_to_the_copies() -> None:
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=3, lease_timeout_s=100.0, clock=clock)
    assert [pool.lease(0), pool.lease(0), pool.lease(1)] == [0, 1, 2]
    assert pool.commit(2, 1) is CommitResult.COMMITTED
    clock.now = 10.0
    assert pool.lease(1, speculate_after_s=5.0) == 0
    assert pool.commit(0, 0) is CommitResult.COMMITTED, "the original wins"
    assert pool.commit(0, 1) is CommitResult.DUPLICATE and pool.losers() == []
    assert pool.lease(1, speculate_after_s=5.0) == 1, "pipeline 0 was overdue in this step: it stays so"
    assert pool.fail_pipeline(0) == [], "pipeline 0 dies: its committed 0 goes to the backup, its 1 to the copy"
    assert pool.assignment() == {0: 1, 2: 1} and pool.backups_used == 1
    assert pool.commit(1, 1) is CommitResult.COMMITTED, "the copy of micro-batch 1 carried on as its lease"
    assert pool.complete() and pool.assignment() == {0: 1, 1: 1, 2: 1}


def test_a_backup_is_used_only_before_the_reduce_starts() -> None:
    # 2 pipelines, pipeline 0 slow: both its micro-batches are copied; its first finishes before the copy (the
    # copy becomes a backup), its second after (the copy wins and fails pipeline 0). Without the backup its
    # committed micro-batch would be redone.
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=4, lease_timeout_s=100.0, clock=clock)
    assert [pool.lease(0), pool.lease(0), pool.lease(1), pool.lease(1)] == [0, 1, 2, 3]
    clock.now = 0.3
    assert pool.commit(2, 1) is CommitResult.COMMITTED and pool.commit(3, 1) is CommitResult.COMMITTED
    clock.now = 1.0
    assert pool.lease(1, speculate_after_s=0.5) == 0 and pool.lease(1, speculate_after_s=0.5) == 1
    assert pool.commit(0, 0) is CommitResult.COMMITTED, "the original of 0 wins"
    assert pool.commit(0, 1) is CommitResult.DUPLICATE, "its copy is a backup now"
    assert pool.commit(1, 1) is CommitResult.COMMITTED and pool.losers() == [0], "the copy of 1 wins"
    assert pool.fail_pipeline(0) == [] and pool.requeued == 0 and pool.backups_used == 1
    assert pool.complete() and pool.assignment() == {0: 1, 1: 1, 2: 1, 3: 1}
    # the same, but the reduce had started (its stages settled what they held apart): redone
    late = TaskPool(step=0, n_microbatches=3, lease_timeout_s=100.0, clock=clock)
    assert [late.lease(0), late.lease(1), late.lease(2)] == [0, 1, 2]
    clock.now = 2.0
    assert late.commit(1, 1) is CommitResult.COMMITTED and late.commit(2, 2) is CommitResult.COMMITTED
    clock.now = 5.0
    assert late.lease(1, speculate_after_s=0.5) == 0
    assert late.commit(0, 0) is CommitResult.COMMITTED and late.commit(0, 1) is CommitResult.DUPLICATE
    late.end_speculation()
    assert late.fail_pipeline(0) == [0] and late.backups_used == 0
    assert late.lease(1) is None and late.lease(2) == 0, "pipeline 1 forwarded it once: pipeline 2 redoes it"


def test_a_pipeline_never_gets_again_a_micro_batch_it_already_held_in_the_step() -> None:
    # its stages forwarded it once (a copy that lost the race) and refuse it as a repeat: leasing it to that
    # pipeline again would hang until speculation or the lease's deadline failed the pipeline's whole share
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=3, lease_timeout_s=100.0, clock=clock)
    assert [pool.lease(0), pool.lease(1), pool.lease(2)] == [0, 1, 2]
    assert pool.commit(1, 1) is CommitResult.COMMITTED and pool.commit(2, 2) is CommitResult.COMMITTED
    clock.now = 10.0
    assert pool.lease(1, speculate_after_s=5.0) == 0 and pool.is_speculative(0, 1)
    assert pool.commit(0, 0) is CommitResult.COMMITTED and pool.commit(0, 1) is CommitResult.DUPLICATE
    assert pool.lease(1, speculate_after_s=5.0) is None, "no second copy of what it already held"
    pool.end_speculation()  # the reduce started: pipeline 1's stages dropped the copy they held apart
    assert pool.fail_pipeline(0) == [0], "pipeline 0 dies: its micro-batch 0 goes back to the pool"
    assert pool.lease(1) is None, "pipeline 1 already forwarded micro-batch 0 in this step"
    assert pool.lease(2) == 0, "another pipeline takes it"
    assert pool.commit(0, 2) is CommitResult.COMMITTED and pool.complete()
    assert pool.assignment() == {0: 2, 1: 1, 2: 2}
    assert pool.unleasable({0, 1, 2}) == []
    # the last pipeline standing does not get it either (its stages would refuse it and the lease would hang
    # until its deadline): the pool says no live pipeline can take it, and the coordinator re-plans at once
    alone = TaskPool(step=0, n_microbatches=2, lease_timeout_s=100.0, clock=clock)
    assert [alone.lease(0), alone.lease(1)] == [0, 1]
    clock.now = 20.0
    assert alone.commit(1, 1) is CommitResult.COMMITTED and alone.lease(1, speculate_after_s=5.0) == 0
    assert alone.commit(0, 0) is CommitResult.COMMITTED and alone.commit(0, 1) is CommitResult.DUPLICATE
    alone.end_speculation()
    assert alone.fail_pipeline(0) == [0]
    assert alone.lease(1) is None and alone.unleasable({0, 1}) == [0]
    assert alone.unleasable({0, 1, 2}) == [], "a pipeline that has not held it could still take it"


def test_a_slow_head_makes_its_pipeline_overdue_a_healthy_queued_micro_batch_does_not() -> None:
    # 3 pipelines lease 2 micro-batches each at once (a window of 2); pipeline 0's head is slow. The second
    # micro-batch of a healthy pipeline waits behind its first: counted from its head time, it is not late.
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=7, lease_timeout_s=100.0, clock=clock)
    assert [pool.lease(p) for p in (0, 0, 1, 1, 2, 2)] == [0, 1, 2, 3, 4, 5]
    clock.now = 0.4
    assert pool.commit(2, 1) is CommitResult.COMMITTED and pool.commit(4, 2) is CommitResult.COMMITTED
    assert pool.head_latencies == pytest.approx([0.4, 0.4])
    clock.now = 0.5
    assert pool.lease(1, speculate_after_s=0.8) == 6, "the free micro-batch goes to a healthy pipeline"
    clock.now = 0.9
    assert pool.lease(1, speculate_after_s=0.8) is None, "pipeline 1 holds 2 micro-batches: a copy would lose the race"
    assert pool.overdue == {0}, "pipeline 1's micro-batch 3 has been its head 0.5 s only: not late"
    assert pool.lease(2, speculate_after_s=0.8) == 0, "behind one micro-batch: pipeline 0's oldest, copied first"
    assert pool.lease(2, speculate_after_s=0.8) is None, "it holds 2 now"
    assert all(pool.commit(mb, p) is CommitResult.COMMITTED for mb, p in ((3, 1), (5, 2), (6, 1)))
    assert pool.lease(1, speculate_after_s=0.8) == 1, "the one queued behind its slow head is copied too"
    assert pool.speculated == 2
    clock.now = 1.2
    assert pool.commit(0, 2) is CommitResult.COMMITTED and pool.commit(1, 1) is CommitResult.COMMITTED
    assert pool.losers() == [0] and pool.fail_pipeline(0) == [] and pool.complete()


def test_an_overdue_pipeline_gets_no_new_micro_batch_while_another_is_left() -> None:
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=4, lease_timeout_s=100.0, clock=clock)
    assert [pool.lease(0), pool.lease(1)] == [0, 1]
    clock.now = 0.3
    assert pool.commit(1, 1) is CommitResult.COMMITTED
    clock.now = 1.0
    assert pool.lease(0, speculate_after_s=0.5) is None, "its head is late: nothing more behind it"
    assert pool.commit(0, 0) is CommitResult.COMMITTED
    assert pool.lease(0, speculate_after_s=0.5) is None, "its late head committed at last: still slow this step"
    assert [pool.lease(1, speculate_after_s=0.5) for _ in range(3)] == [2, 3, None]
    alone = TaskPool(step=0, n_microbatches=2, lease_timeout_s=100.0, clock=clock)
    assert alone.lease(0) == 0
    clock.now = 5.0
    assert alone.lease(0, speculate_after_s=0.5) == 1, "the only pipeline is still served"


def test_a_pipeline_known_slow_is_not_copied_for_being_as_slow_as_known() -> None:
    clock = FakeClock()
    # pacing figures: pipeline 0 is 2x slower than the others (the median is 1.0)
    pool = TaskPool(step=0, n_microbatches=3, lease_timeout_s=100.0, clock=clock,
                    service_s={0: 2.0, 1: 1.0, 2: 1.0})
    assert pool.lease(1) == 0 and pool.lease(2) == 1 and pool.lease(0) == 2
    clock.now = 1.0
    assert pool.commit(0, 1) is CommitResult.COMMITTED and pool.commit(1, 2) is CommitResult.COMMITTED
    clock.now = 3.0
    assert pool.lease(1, speculate_after_s=2.0) is None, "3 s is within 2 x 2 s for the known-slow pipeline"
    clock.now = 4.5
    assert pool.lease(1, speculate_after_s=2.0) == 2, "over 2 x 2 s: copied"


def test_a_late_loss_makes_a_pipeline_overdue_before_its_head_is_late() -> None:
    # 3 pipelines of 2 stages lease 2 micro-batches each; the losses of pipelines 1 and 2 arrive at 0.2 s (their
    # forwards crossed every stage), pipeline 0's does not: by 0.3 s it is overdue on the forward signal, while
    # its head (0.3 s) is still far within the 1.0 s commit signal.
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=6, lease_timeout_s=100.0, clock=clock)
    assert [pool.lease(p) for p in (0, 0, 1, 1, 2, 2)] == [0, 1, 2, 3, 4, 5]
    clock.now = 0.2
    pool.progress(2, 1)
    pool.progress(4, 2)
    pool.progress(0, 2)  # not pipeline 2's: no sign of anything (and no latency measured)
    assert pool.forward_latencies == pytest.approx([0.2, 0.2])
    clock.now = 0.3
    assert pool.commit(2, 1) is CommitResult.COMMITTED
    assert pool.lease(1, speculate_after_s=1.0) is None and pool.overdue == set(), "the commit signal waits"
    assert pool.lease(1, speculate_after_s=1.0, forward_after_s=0.25) == 0, "its loss is late: copied"
    assert pool.overdue == {0}, "pipeline 2's second micro-batch waits from its first loss (0.1 s): not late"
    assert pool.lease(2, speculate_after_s=1.0, forward_after_s=0.25) is None, "pipeline 2 holds 2"
    clock.now = 0.35
    pool.progress(0, 1)  # the copy's loss: the copier moves
    pool.progress(3, 1)
    assert pool.overdue == {0} and len(pool.forward_latencies) == 3


def test_a_late_pipeline_with_nothing_committed_is_given_up_while_free_work_is_left() -> None:
    # 2 pipelines: pipeline 0 has committed nothing when its head is late, and free micro-batches are left for
    # pipeline 1 anyway: its micro-batches go back to the pool now (no copy whose win would later make pipeline
    # 0's commits of the meantime be redone)
    clock = FakeClock()
    late = TaskPool(step=0, n_microbatches=6, lease_timeout_s=100.0, clock=clock)
    assert [late.lease(0), late.lease(1), late.lease(0), late.lease(1)] == [0, 1, 2, 3]
    clock.now = 0.4
    assert late.commit(1, 1) is CommitResult.COMMITTED and late.lease(1, speculate_after_s=0.5) == 4
    assert late.losers() == []
    clock.now = 0.6
    assert late.lease(1, speculate_after_s=0.5) == 5
    assert late.losers() == [0] and late.abandoned == {0}
    assert late.fail_pipeline(0) == [0, 2] and late.lease(1) == 0
    # nothing free is left: its micro-batches are copied instead (the others have nothing else to do)
    full = TaskPool(step=0, n_microbatches=4, lease_timeout_s=100.0, clock=clock)
    clock.now = 0.0
    assert [full.lease(0), full.lease(1), full.lease(0), full.lease(1)] == [0, 1, 2, 3]
    clock.now = 0.4
    assert full.commit(1, 1) is CommitResult.COMMITTED
    clock.now = 0.6
    assert full.lease(1, speculate_after_s=0.5) == 0 and full.is_speculative(0, 1) and full.losers() == []
    # one that committed something is copied, not given up (its commits would be redone)
    done = TaskPool(step=0, n_microbatches=6, lease_timeout_s=100.0, clock=clock)
    clock.now = 0.0
    assert [done.lease(0), done.lease(1), done.lease(0), done.lease(1)] == [0, 1, 2, 3]
    clock.now = 0.1
    assert all(done.commit(mb, p) is CommitResult.COMMITTED for mb, p in ((0, 0), (1, 1), (3, 1)))
    clock.now = 0.9
    assert done.lease(1, speculate_after_s=0.5) == 4 and done.losers() == [] and done.overdue == {0}


def test_a_known_slow_pipeline_neither_copies_nor_takes_over_a_late_healthy_one() -> None:
    # pacing figures: pipeline 0 is 2.5x slower than pipeline 1 (a straggler kept for lack of a spare). Pipeline
    # 1 is late once: it still gets the free work (the only other pipeline is known slower), it is not given
    # up, and pipeline 0 copies none of its work.
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=3, lease_timeout_s=100.0, clock=clock, service_s={0: 0.5, 1: 0.2})
    assert pool.lease(1) == 0 and pool.lease(0) == 1
    clock.now = 0.4
    assert pool.commit(1, 0) is CommitResult.COMMITTED
    clock.now = 2.0
    assert pool.lease(1, speculate_after_s=0.5) == 2 and pool.overdue == {1}
    assert pool.losers() == [], "not given up in favour of a pipeline known 2.5x slower"
    assert pool.lease(0, speculate_after_s=0.5) is None and pool.speculated == 0, "no copy of a faster pipeline"
    assert all(pool.commit(mb, 1) is CommitResult.COMMITTED for mb in (0, 2)) and pool.complete()


def test_pipelines_a_few_per_cent_apart_copy_each_others_work() -> None:
    # measured 0.19 s and 0.18 s per micro-batch: jitter, not a known straggler; the slightly slower pipeline
    # still copies the overdue one's work
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=3, lease_timeout_s=100.0, clock=clock, service_s={0: 0.18, 1: 0.19})
    assert pool.lease(0) == 0 and pool.lease(1) == 1 and pool.lease(0) == 2
    clock.now = 0.3
    assert pool.commit(1, 1) is CommitResult.COMMITTED
    clock.now = 1.0
    assert pool.lease(1, speculate_after_s=0.5) == 0 and pool.is_speculative(0, 1)


def test_an_idle_pool_counts_only_while_free_work_has_a_taker_and_nothing_is_in_flight() -> None:
    clock = FakeClock()
    pool = TaskPool(step=0, n_microbatches=2, clock=clock)
    clock.now = 3.0
    assert pool.idle_s({0, 1}) == 3.0, "nothing leased since the step began"
    assert pool.lease(0) == 0
    clock.now = 10.0
    assert pool.idle_s({0, 1}) == 0.0, "a lease is in flight"
    assert pool.commit(0, 0) is CommitResult.COMMITTED
    clock.now = 12.0
    assert pool.idle_s({0, 1}) == 2.0, "counted from the last commit"
    assert pool.idle_s(set()) == 0.0, "no pipeline could take the free work: not a stall of the pool's making"
    assert pool.lease(1) == 1 and pool.fail_pipeline(1) == [1]
    clock.now = 13.0
    assert pool.idle_s({0, 1}) == 1.0, "counted from the requeue; pipeline 1 failed, pipeline 0 can take it"
    pool.hold(1, 0)
    assert pool.idle_s({0, 1}) == 0.0, "every live pipeline held the free micro-batch: unleasable's case"
