"""Equivalence invariant over real processes: 2 stages x 2 replicas as 4 worker processes on loopback, gRPC
between them, against plain single-process training of the same model on the same batches.

Every parameter must match within 1e-5 (relative to the tensor's largest entry: an entry whose summed
gradient nearly cancels sits near zero, and Adam scales its rounding noise to the tensor's scale), the
replicas of a stage must be bit-identical, and the loss curves must agree. Then the same with link emulation
(bandwidth and delay per directed pair) switched on: shaping changes timing, never results.
"""

from __future__ import annotations

import pytest

from tasklet.peer.emulation.local import LinkModel, train_plan
from tests.support.equivalence import PIPELINES, SPEC, STAGES, STEPS, check_equivalent

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)

def test_two_stages_two_replicas_over_grpc_match_single_process(reference) -> None:
    result = train_plan(SPEC, STAGES, PIPELINES, STEPS)
    check_equivalent(result, reference)


def test_equivalence_holds_with_link_emulation(reference) -> None:
    n = 4
    # 200 Mbit/s and 5 ms between pipeline neighbours' machines, 50 Mbit/s and 20 ms elsewhere
    bw = [[200e6 if abs(i - j) == 1 else 50e6 for j in range(n)] for i in range(n)]
    delay = [[0.005 if abs(i - j) == 1 else 0.020 for j in range(n)] for i in range(n)]
    result = train_plan(SPEC, STAGES, PIPELINES, STEPS, links=LinkModel(bw, delay))
    check_equivalent(result, reference)
    # the shaping really applied: a step cannot beat its critical path of delays (2 hops x 2 ways)
    assert min(result.step_seconds) > 2 * 0.005
