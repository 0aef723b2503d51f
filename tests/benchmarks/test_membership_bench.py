"""The membership benchmark runs end to end on a tiny swarm and prints well-formed JSON (figures unchecked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# starts real processes (tests/support/processes.py)
pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.light_processes]


def test_bench_membership_json_on_a_tiny_swarm():
    result = subprocess.run(
        [sys.executable, "-m", "bench.membership", "--sizes", "3", "--repeats", "2", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    report = json.loads(result.stdout)
    assert report["propagation_s"]["repeats"] == 2
    assert report["propagation_s"]["max"] >= report["propagation_s"]["median"] > 0
    (formation,) = report["formation"]
    assert formation["nodes"] == 3
    # Each phase includes the one before it.
    assert 0 < formation["dht_start_s"] <= formation["all_see_all_s"] <= formation["first_plan_s"]


def test_bench_membership_rejects_bad_sizes():
    result = subprocess.run(
        [sys.executable, "-m", "bench.membership", "--sizes", "1"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "error: --sizes" in result.stderr
