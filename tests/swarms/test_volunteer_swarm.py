"""A volunteer's tools against one small real swarm (three `peer` processes on loopback, one stage, three
replicas): `peer doctor --json` with and without --dht; a peer joined with --max-upload whose measured upload
stays under its cap; and `peer pause` / `peer resume` on another peer during training: the swarm re-plans
without it and with it again, it is not banned, and the run's parameters equal single-process training."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tasklet.peer.emulation.procs import PEER_COMMAND, PeerProcesses, poll_until, write_small_config
from tasklet.peer.emulation.reference_check import gap_to_reference

pytestmark = pytest.mark.usefixtures("processes")

STEPS = 14  # the capped peer makes a step ~2-3 s: pause and resume take ~8 steps, from step 1 or 2
CAP_MBPS = 1.0  # low enough that the capped peer's gradient shards (~2 Mbit a step) are held to it
KEYS = ["device", "memory", "disk", "ports", "reachability", "clock", "links", "verdict"]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _sent_bytes(url: str) -> tuple[float, float]:
    """(bytes the transport sent in all, the daemon's step) from its /metrics."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    sent, step = 0.0, 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tasklet_net_sent_bytes_total":
                sent += s.value
            elif s.name == "tasklet_step":
                step = s.value
    return sent, step


def _peer(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PEER_COMMAND, *args], capture_output=True, text=True, timeout=timeout)


def _doctor(*args: str) -> dict:
    proc = _peer("doctor", "--json", "--measure-seconds", "0.2", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _status(addr: str) -> dict:
    proc = _peer("status", "--dht", addr, "--json", timeout=60)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def _planned(st: dict) -> set[str]:
    return {pid for row in (st.get("plan") or {}).get("pipelines") or [] for pid in row}


def test_doctor_upload_cap_and_pause_on_a_live_swarm(tmp_path: Path) -> None:
    local = _doctor("--config", str(write_small_config(tmp_path, steps=1)))
    assert list(local) == KEYS and local["device"]["kind"] == "cpu" and local["verdict"]["ok"]
    assert local["reachability"]["checked"] is False

    save = tmp_path / "result"
    cfg = write_small_config(tmp_path, steps=STEPS, min_peers=3, stages=1,
                             extra=f"save_dir = {json.dumps(str(save))}\n")
    metrics = _free_port("127.0.0.3")
    url = f"http://127.0.0.3:{metrics}/metrics"
    state = tmp_path / "state"
    with PeerProcesses(tmp_path, emulate_tflops=0.001) as procs:
        addr = procs.start(cfg, "--relay-port", str(_free_port("127.0.0.2")))
        procs.join(addr, 1, "--max-upload", str(CAP_MBPS), "--metrics-port", str(metrics))
        procs.join(addr, 2, "--state-dir", str(state))
        deadline = time.monotonic() + 180
        step = 0.0
        while time.monotonic() < deadline and step < 1:
            time.sleep(1.0)
            try:
                _, step = _sent_bytes(url)
            except OSError:
                continue
        assert step >= 1, "the swarm did not train a step"
        t0, (s0, step0) = time.monotonic(), _sent_bytes(url)
        swarm = _doctor("--dht", addr)  # the doctor against the running swarm

        paused_id = next(state.glob("control-*.sock")).stem.removeprefix("control-")
        assert paused_id in _planned(_status(addr))
        done = _peer("pause", "--state-dir", str(state), timeout=30)
        assert done.returncode == 0 and done.stdout.strip() == "peer paused", done.stderr
        without = poll_until(lambda: _status(addr), lambda s: bool(_planned(s)) and paused_id not in _planned(s),
                             120, "a plan without the paused peer")
        assert len(_planned(without)) == 2 and (without["step"] or 0) < STEPS
        done = _peer("resume", "--state-dir", str(state), timeout=30)
        assert done.returncode == 0 and done.stdout.strip() == "peer running", done.stderr
        resumed_at = time.monotonic()
        back = poll_until(lambda: _status(addr), lambda s: paused_id in _planned(s), 120,
                          "a plan with the resumed peer")
        back_s = time.monotonic() - resumed_at
        assert back["plan"]["epoch"] > without["plan"]["epoch"]
        s1, step1 = _sent_bytes(url)
        took = time.monotonic() - t0
        rate_mbps = (s1 - s0) * 8 / took / 1e6
        print(f"capped peer sent {rate_mbps:.3f} Mbit/s over {took:.1f} s ({step1 - step0:.0f} steps), cap "
              f"{CAP_MBPS}; the resumed peer was planned again {back_s:.1f} s after `peer resume`")
        assert step1 > step0 and s1 > s0, "the capped peer kept training and sending"
        assert rate_mbps <= CAP_MBPS, f"{rate_mbps:.3f} Mbit/s sent under a {CAP_MBPS} Mbit/s cap"
        for proc in procs.procs:
            assert proc.wait(timeout=400) == 0, "a peer failed"
        logs = [procs.log_text(i) for i in range(3)]
    assert "paused by the owner" in logs[2] and "resumed by the owner" in logs[2]
    assert "left the swarm: re-planning without them" in logs[0]
    assert "is back; it may be planned again" not in logs[0], "the paused peer was banned as dead"
    gap = gap_to_reference(save, STEPS)
    assert len(gap.run["loss"]) == STEPS
    assert gap.max_abs < 1e-5 and gap.loss_rel < 1e-5, f"{gap.max_abs:.2e} off single-process training"

    assert list(swarm) == KEYS
    r = swarm["reachability"]
    assert r["checked"] and r["open"] and r["path"] == "direct" and r["seen_as"].startswith("127.")
    c = swarm["clock"]
    assert c["checked"] and c["peers"] == 3 and c["ok"] and abs(c["offset_s"]) <= 1.0 + c["bound_s"]
    assert len(swarm["links"]) == 3
    for link in swarm["links"]:  # a peer reached through the relay has no address to connect to
        if "@" in link["endpoint"]:
            assert link["ok"] is None
            continue
        assert link["ok"] and link["connect_ms"] > 0
        # measured through the doctor's client advert; the capped peer's probe is throttled by its download cap
        assert link["bandwidth_mbps"] is not None and link["bandwidth_mbps"] > 0, link
    assert any(link["ok"] for link in swarm["links"])
    v = swarm["verdict"]
    assert v["ok"] and v["config"] == "run 'tasklet' from the DHT" and v["split"] == "the run's plan"
