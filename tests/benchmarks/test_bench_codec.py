"""`python -m bench.codec --json` prints per-codec CPU rates and the scheduler's charge beside them."""

from __future__ import annotations

import json
import math

import pytest

from bench import codec
from tasklet.peer.runtime.outer import allgather_codec
from tasklet.scheduler.compression import CODEC_S_PER_ELEMENT


def test_codec_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert codec.main(["--json", "--quick", "--threads", "1", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["threads"] == [1, 2]
    n = codec.QUICK_SIZES[0]
    rows = {(r["codec"], r["threads"]): r for r in out["rows"]}
    labels = {"int8", "topk", "topk2", "topk4", codec.GATHER}
    assert set(rows) == {(label, t) for label in labels for t in (1, 2)}
    assert rows[(codec.GATHER, 1)]["block"] == allgather_codec("topk2", n, codec.MEMBERS)[1]
    for r in rows.values():
        assert r["elements"] == n
        assert math.isfinite(r["ns_per_element"]) and 0 < r["min_ns_per_element"] <= r["ns_per_element"]
    assert out["model_ns_per_element"] == pytest.approx({k: v * 1e9 for k, v in CODEC_S_PER_ELEMENT.items()})
    gathered = codec.sample(n, codec.GATHER)  # the sum of MEMBERS sparse contributions: at most that many a block
    assert 0 < int((gathered != 0).sum()) <= codec.MEMBERS * math.ceil(n / 64)


def test_codec_bench_table() -> None:
    text = codec.table({"rows": [{"codec": "int8", "block": 64, "elements": 1000, "threads": 2,
                                  "ns_per_element": 7.25, "min_ns_per_element": 6.0}],
                        "model_ns_per_element": {"int8": 25.0}})
    assert "| int8 | 64 | 1,000 | 2 | 7.2 | 6.0 |" in text and "int8 25 ns" in text
