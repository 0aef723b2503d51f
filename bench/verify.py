"""Verified averaging: what the all-gather digest and the direction test cost a replica, per step.

``python -m bench.verify [--json] [--numel N ...] [--replicas D ...] [--repeats R]``

In one process, on this machine's CPU (one torch thread), for a stage of ``numel`` fp32 parameters averaged by
``D`` replicas: ``sum_s`` is what the owner's sum of its shard costs today (the baseline the checks add to),
``digest_s`` what one replica spends on the digest (projections of its own contribution to every shard, then of
every summed shard it checks: ``2 x numel x K`` multiply-adds with seeded Gaussian weights), ``direction_s``
what an owner spends on the direction test of its shard's ``D`` contributions, ``digest_bytes`` the size of one
digest message (one is sent to each other replica, one extra message round after the all-gather) and
``gradient_bytes`` the reduce-scatter + all-gather traffic of the same replica, for comparison. ``detected``:
whether a summed shard scaled by 1000, or a single value moved by one unit, fails the check (a steering owner is
caught in the step it steers: the check is deterministic, steps to exclusion = 1).
The spot checks of micro-batches (re-issuing a fraction of the work to another pipeline) are not built, so their
overhead and detection probability per step are not measured here.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from peer.compute.stage import shard_bounds
from peer.runtime.stage import checks
from peer.runtime.stage.exchange import digest_text


def _time(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(numel: int, replicas: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    grads = [torch.randn(numel) for _ in range(replicas)]
    bounds = shard_bounds(numel, replicas)
    lo, hi = bounds[0]
    contributions = [g[lo:hi] for g in grads]

    def owner_sum() -> torch.Tensor:
        total = contributions[0].clone()
        for c in contributions[1:]:
            total.add_(c)
        return total

    summed = [sum(g[a:b] for g in grads) for a, b in bounds]
    seeds = [checks.digest_seed((0, 0), j, s) for j, s in enumerate(summed)]

    def digest() -> list[tuple[list[float], list[float]]]:
        mine = [checks.shard_digest(grads[0][a:b], seed) for (a, b), seed in zip(bounds, seeds, strict=True)]
        for s, seed in zip(summed, seeds, strict=True):
            checks.shard_digest(s, seed)
        return mine

    def direction() -> None:
        total = owner_sum()
        for c in contributions:
            checks.unrelatedness(c, total - c)

    digests = [[checks.shard_digest(g[a:b], seed) for (a, b), seed in zip(bounds, seeds, strict=True)]
               for g in grads]

    def caught(change: str) -> bool:
        s = summed[1].clone()
        s = s * 1000.0 if change == "scale" else s.index_add_(0, torch.tensor([3]), torch.tensor([1.0]))
        seed = checks.digest_seed((0, 0), 1, s)
        parts = [checks.shard_digest(g[bounds[1][0]:bounds[1][1]], seed) for g in grads]
        return checks.sum_mismatch(s, seed, parts, 1) > 1.0

    return {
        "numel": numel, "replicas": replicas,
        "sum_s": _time(owner_sum, repeats),
        "digest_s": _time(digest, repeats),
        "direction_s": _time(direction, repeats),
        "digest_bytes": len(digest_text((seeds, digests[0])).encode()),
        "gradient_bytes": 2 * 4 * (numel - (hi - lo)),
        "detected": {"scale_1000": caught("scale"), "one_value": caught("one")},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--numel", type=int, nargs="+", default=[1_000_000, 4_000_000],
                        help="stage sizes in parameters (default: %(default)s)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="group sizes (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings (default: %(default)s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(n, d, args.repeats) for n in args.numel for d in args.replicas]
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    for r in rows:
        print(f"numel {r['numel']:>10,}  D {r['replicas']}  sum {r['sum_s'] * 1e3:8.2f} ms  digest "
              f"{r['digest_s'] * 1e3:8.2f} ms  direction {r['direction_s'] * 1e3:8.2f} ms  digest "
              f"{r['digest_bytes']} B (gradients {r['gradient_bytes']:,} B)  detected {r['detected']}")


if __name__ == "__main__":
    main()
