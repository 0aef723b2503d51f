"""The outer round's pseudo-gradient codec: CPU seconds per element, for the scheduler's codec term.

    python -m bench.codec            # a table
    python -m bench.codec --json     # {"threads": 1, "rows": [{"codec": C, "block": B, "elements": N,
                                     #   "ns_per_element": X, "min_ns_per_element": Y}, ...],
                                     #  "model_ns_per_element": {"int8": M, "topk": T}}

What is measured: one encode and one decode (``peer.runtime.outer.roundtrip``: ``protocol.codec`` in and out,
with its checks) of a float32 vector, on one torch thread, as a worker runs the codec on host copies of its
stage's parameters. Codecs: int8 (blocks of 64), top-k as a member's pseudo-gradient goes (one kept entry per
block of 64) and as an all-gather's summed shard goes (the block :func:`allgather_codec` picks for 8 members:
8 kept per 64). Median and minimum of several trials per size. ``model_ns_per_element`` is what
``scheduler.compression.CODEC_S_PER_ELEMENT`` charges, printed beside the measurement.
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
MEMBERS = 8  # the all-gather's top-k block is the one for this many members


def cases(n: int) -> list[tuple[str, str, int]]:
    """(label, codec, block) measured at ``n`` elements."""
    gathered, block = allgather_codec("topk", n, MEMBERS)
    return [("int8", "int8", 64), ("topk", "topk", 64), (f"topk all-gather ({MEMBERS} members)", gathered, block)]


def measure(n: int, codec: str, block: int, trials: int) -> tuple[float, float]:
    """(median, min) seconds of one encode + decode of ``n`` float32 elements."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    roundtrip(x, codec, block)  # warm: allocations, first-call dispatch
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        roundtrip(x, codec, block)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def run(sizes: tuple[int, ...] = SIZES, trials: int = 7) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        for n in sizes:
            for label, codec, block in cases(n):
                med, low = measure(n, codec, block, trials if n <= 1_000_000 else max(3, trials // 2))
                rows.append({"codec": label, "block": block, "elements": n, "ns_per_element": med / n * 1e9,
                             "min_ns_per_element": low / n * 1e9})
    finally:
        torch.set_num_threads(threads)
    return {"threads": 1, "rows": rows,
            "model_ns_per_element": {k: v * 1e9 for k, v in CODEC_S_PER_ELEMENT.items()}}


def table(result: dict[str, Any]) -> str:
    lines = ["| codec | block | elements | ns per element (median) | min |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['codec']} | {r['block']} | {r['elements']:,} | {r['ns_per_element']:.1f} | "
              f"{r['min_ns_per_element']:.1f} |" for r in result["rows"]]
    model = ", ".join(f"{k} {v:.0f} ns" for k, v in result["model_ns_per_element"].items())
    return "\n".join(lines + ["", f"the scheduler charges per element: {model}"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    parser.add_argument("--quick", action="store_true", help="one small size, few trials (seconds; for tests)")
    args = parser.parse_args(argv)
    result = run(QUICK_SIZES, trials=3) if args.quick else run()
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
