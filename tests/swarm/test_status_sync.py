"""`peer status` and the dashboard say how the run's replicas synchronise (period, codec, overlap), read from
the run record and printed inert whatever the record holds."""

from __future__ import annotations

import json

import pytest

from tasklet.peer.observe.snapshot import SwarmSource, build_snapshot
from tasklet.peer.swarm.status import SwarmStatus, format_status, status_json, sync_line, sync_summary

pytestmark = pytest.mark.unit
LINKS = {"measured": 0, "pairs": 0, "median_bandwidth_mbps": None, "median_rtt_ms": None, "by_path": {}}
PLAN = {"epoch": 1, "leader": "org", "pipelines": [], "stages": []}


def test_sync_summary_of_exact_and_diloco_runs() -> None:
    assert sync_summary({"run": {"steps": 5}}) == {"period": 1, "codec": None, "overlap": False}
    diloco = sync_summary({"run": {"sync_period": 16, "pseudo_grad_compression": "topk2"}})
    assert diloco == {"period": 16, "codec": "topk2", "overlap": False}
    assert sync_line(diloco) == ("sync: DiLoCo, outer round every 16 steps, topk2 pseudo-gradients, "
                                 "not overlapped")
    assert sync_line({"period": 1, "codec": None, "overlap": False}) == "sync: exact gradient averaging every step"
    late = sync_summary({"run": {"sync_period": 16, "pseudo_grad_compression": "int8", "outer_overlap": True}})
    assert late == {"period": 16, "codec": "int8", "overlap": True}
    assert sync_line(late).endswith("int8 pseudo-gradients, landing one step late, behind compute")
    assert sync_summary({"run": {"outer_overlap": True}})["overlap"] is False  # exact training has no round


@pytest.mark.parametrize("config", [None, [], {"run": "x"}, {"run": {"sync_period": 0}},
                                    {"run": {"sync_period": True}}, {"run": {"sync_period": "4"}},
                                    {"run": {"sync_period": 4, "pseudo_grad_compression": 7}},
                                    {"run": {"sync_period": 4, "outer_overlap": "yes"}}])
def test_a_record_without_a_readable_sync_shows_none(config: object) -> None:
    assert sync_summary(config) is None


def test_status_screen_json_and_snapshot_carry_the_sync() -> None:
    sync = sync_summary({"run": {"sync_period": 8, "pseudo_grad_compression": "int8\x1b[2J"}})
    assert sync is not None
    st = SwarmStatus([], PLAN, {"step": 3, "state": "training"}, LINKS, None, sync)
    screen = format_status(st)
    assert "outer round every 8 steps, int8\\x1b[2J pseudo-gradients" in screen and "\x1b" not in screen
    assert json.loads(status_json(st))["sync"] == sync
    assert format_status(SwarmStatus([], PLAN, {}, LINKS)).count("sync:") == 0  # no record read yet: no line
    config = {"run": {"sync_period": 32, "pseudo_grad_compression": "int8"}}
    snap = build_snapshot(SwarmSource(list, list, lambda: None, lambda: {"state": "training"}, lambda: config), "r")
    assert snap["sync"] == {"period": 32, "codec": "int8", "overlap": False}
