"""The outer round's pseudo-gradient codecs: CPU seconds per element, for the scheduler's codec term.

    python -m bench.codec            # a table
    python -m bench.codec --json     # {"threads": [1, T], "rows": [{"codec": C, "block": B, "elements": N,
                                     #   "threads": t, "ns_per_element": X, "min_ns_per_element": Y}, ...],
                                     #  "model_ns_per_element": {"int8": M, "topk": T, ...}}

What is measured: one encode and one decode (``peer.runtime.outer.roundtrip``: ``protocol.codec`` in and out,
with its checks) of a float32 vector, on one torch thread (as a worker's control thread runs the codec on host
copies of its stage's parameters) and on all the host's threads. Codecs: int8 (blocks of 64); a member's
sparse pseudo-gradient as top-k (one kept entry per 64, a global selection) and as topk2 / topk4 (each block
of 64's largest entry in 2 / 4 bits); and the all-gather's summed shard of ``MEMBERS`` members' topk2
contributions, which goes as an exact top-k (the block :func:`allgather_codec` picks). Median and minimum of
several trials per size. ``model_ns_per_element`` is what ``scheduler.compression.CODEC_S_PER_ELEMENT``
charges per element of a stage, printed beside the measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from tasklet.peer.runtime.outer import allgather_codec, roundtrip
from tasklet.scheduler.compression import CODEC_S_PER_ELEMENT

SIZES = (50_000, 1_000_000, 16_000_000)
QUICK_SIZES = (20_000,)
MEMBERS = 8  # the all-gather's summed shard is this many members' contributions
GATHER = f"sparse sum all-gather ({MEMBERS} members)"


def cases(n: int) -> list[tuple[str, str, int]]:
    """(label, codec, block) measured at ``n`` elements."""
    gathered, block = allgather_codec("topk2", n, MEMBERS)
    return [("int8", "int8", 64), ("topk", "topk", 64), ("topk2", "topk2", 64), ("topk4", "topk4", 64),
            (GATHER, gathered, block)]


def sample(n: int, label: str) -> torch.Tensor:
    """What the codec sees: a dense pseudo-gradient, or the sum of ``MEMBERS`` topk2 contributions."""
    gen = torch.Generator().manual_seed(n)
    if label != GATHER:
        return torch.randn(n, generator=gen)
    return sum((roundtrip(torch.randn(n, generator=gen), "topk2") for _ in range(MEMBERS)), torch.zeros(n))


def measure(x: torch.Tensor, codec: str, block: int, trials: int) -> tuple[float, float]:
    """(median, min) seconds of one encode + decode of ``x``."""
    roundtrip(x, codec, block)  # warm: allocations, first-call dispatch
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        roundtrip(x, codec, block)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def run(sizes: tuple[int, ...] = SIZES, trials: int = 7, thread_counts: tuple[int, ...] | None = None
        ) -> dict[str, Any]:
    threads = torch.get_num_threads()
    counts = thread_counts or tuple(sorted({1, threads}))
    rows = []
    try:
        for n in sizes:
            for label, codec, block in cases(n):
                x = sample(n, label)
                for t in counts:
                    torch.set_num_threads(t)
                    med, low = measure(x, codec, block, trials if n <= 1_000_000 else max(3, trials // 2))
                    rows.append({"codec": label, "block": block, "elements": n, "threads": t,
                                 "ns_per_element": med / n * 1e9, "min_ns_per_element": low / n * 1e9})
    finally:
        torch.set_num_threads(threads)
    return {"threads": list(counts), "rows": rows,
            "model_ns_per_element": {k: v * 1e9 for k, v in CODEC_S_PER_ELEMENT.items()}}


def table(result: dict[str, Any]) -> str:
    lines = ["| codec | block | elements | threads | ns per element (median) | min |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['codec']} | {r['block']} | {r['elements']:,} | {r.get('threads', 1)} | "
              f"{r['ns_per_element']:.1f} | {r['min_ns_per_element']:.1f} |" for r in result["rows"]]
    model = ", ".join(f"{k} {v:.0f} ns" for k, v in result["model_ns_per_element"].items())
    return "\n".join(lines + ["", f"the scheduler charges per element: {model}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    parser.add_argument("--quick", action="store_true", help="one small size, few trials (seconds; for tests)")
    parser.add_argument("--threads", type=int, nargs="+", metavar="N",
                        help="torch thread counts to measure at (default: 1 and all of this host's)")
    args = parser.parse_args(argv)
    if args.threads and min(args.threads) < 1:
        parser.error("--threads: counts must be at least 1")
    counts = tuple(args.threads) if args.threads else None
    result = run(QUICK_SIZES, trials=3, thread_counts=counts) if args.quick else run(thread_counts=counts)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
