"""`python -m bench.transport --json` runs end to end (quick mode) and prints the JSON the issue specifies.

Only the shape of the output is checked: the figures are benchmark results, not test assertions.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.usefixtures("processes")  # starts real processes (tests/support/processes.py)


def test_bench_transport_json_schema() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.transport", "--json", "--quick", "--links", "50@5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert set(out) == {
        "unshaped_gbps", "plaintext_gbps", "tls_cost_pct", "shaped",
        "raw_grpc_gbps", "fraction_of_raw", "raw_grpc_gbps_tls", "fraction_of_raw_tls",
    }
    assert out["unshaped_gbps"] > 0 and out["plaintext_gbps"] > 0  # over mutual TLS, and the plaintext baseline
    assert isinstance(out["tls_cost_pct"], float)
    # bare gRPC on the same machine in the same run, and ours as a fraction of it
    assert out["raw_grpc_gbps"] > 0 and out["raw_grpc_gbps_tls"] > 0
    assert out["fraction_of_raw"] > 0 and out["fraction_of_raw_tls"] > 0
    assert len(out["shaped"]) == 1
    row = out["shaped"][0]
    assert set(row) == {"rate_mbps", "achieved_mbps", "latency_ms", "achieved_latency_ms"}
    assert row["rate_mbps"] == 50 and row["latency_ms"] == 5
    assert row["achieved_mbps"] > 0 and row["achieved_latency_ms"] > 0
