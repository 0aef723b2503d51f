"""`peer status` prints other peers' words (device names, regions, reasons): every control character arrives inert,
as a visible escape, so an advert cannot move the reader's cursor, retitle their terminal or forge a line."""

from __future__ import annotations

import json

import pytest

from tasklet.peer.swarm.status import SwarmStatus, format_credits, format_status, inert

pytestmark = pytest.mark.unit

HOSTILE = "RTX\x1b]0;pwned\x07 4090\x1b[2J\nrun: step 999, loss 0.0001 (done)\u202e"
LINKS = {"measured": 0, "pairs": 0, "median_bandwidth_mbps": None, "median_rtt_ms": None, "by_path": {}}


def _peer(device: str, region: str) -> dict:
    return {"peer_id": "a" * 40, "device": device, "tflops": 1.0, "emulated": False, "memory_gb": 8.0,
            "stage": 0, "replica": 0, "last_seen_s": 1.0, "endpoint": "127.0.0.2:1", "region": region,
            "reachable": True, "relay": None, "paths": ["direct"]}


def test_an_advert_with_escape_sequences_is_printed_inert() -> None:
    st = SwarmStatus([_peer(HOSTILE, HOSTILE)], {"epoch": 1, "leader": "b" * 40, "pipelines": [], "stages": []},
                     {"step": 3, "state": "training", "paused": {"since": 0.0, "reason": HOSTILE}}, LINKS)
    text = format_status(st)
    assert not any(not c.isprintable() for c in text.replace("\n", "")), "a control character reached the screen"
    assert "\\x1b[2J" in text and "\\x07" in text and "\\u202e" in text
    assert sum(line.startswith("run: ") for line in text.splitlines()) == 1, "a forged line"
    # the machine format keeps the value as it came, JSON-escaped (ASCII only)
    out = json.dumps(st.to_json())
    assert out.isascii() and json.loads(out)["peers"][0]["device"] == HOSTILE


def test_a_credit_table_with_a_hostile_exclusion_reason_is_printed_inert() -> None:
    row = {"peer_id": "c" * 40, "microbatches": 4, "steps": 2, "plans": 1, "train_s": 1.0, "bytes_served": 0,
           "excluded": 1, "last_exclusion": HOSTILE}
    summary = {"leader": "b" * 40, "step": 2, "peers": [row], "total_microbatches": 4, "steps": 2,
               "evicted_microbatches": 0}
    text = format_credits(summary)
    assert "\x1b" not in text and "\\x1b]0;pwned\\x07" in text and len(text.splitlines()) == 3


def test_inert_leaves_ordinary_names_alone() -> None:
    for name in ("NVIDIA GeForce RTX 4090", "Apple M3 Max (MPS)", "AMD Radeon RX 7900 XTX", "Zürich", "東京"):
        assert inert(name) == name
    assert inert("a\tb") == "a\\tb"
