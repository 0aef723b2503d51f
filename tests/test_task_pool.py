"""The task pool's exactly-once book-keeping (pure logic, no processes)."""

from __future__ import annotations

import pytest

from peer.runtime.pool import CommitResult, TaskPool


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
