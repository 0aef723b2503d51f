"""The swarm dashboard: a live local swarm seen through `peer dashboard` and a daemon's --dashboard-port, the
page rendered by real headless Chromium (every peer listed, a loss chart with points, a screenshot kept), the
JSON at /api/swarm, events derived from successive snapshots, and one-line errors for a dead DHT address and
a port in use.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tasklet.peer.emulation.procs import PEER_COMMAND, PeerProcesses, launch, read_line, stop_all, write_small_config
from tasklet.peer.observe.http import ObserveServer, asset
from tasklet.peer.observe.watch import diff_events

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DEAD_DHT = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWAj3BTFRBD4KWhiWMGopsoPREfShqbe4MKMccyMJtxdQg"  # discard port
N_PEERS = 3


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.headers.get("Content-Type", ""), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def wait_json(url: str, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        try:
            status, _, body = get(url)
            if status == 200:
                last = json.loads(body)
                if predicate(last):
                    return last
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}; last {url}: {json.dumps(last)[:2000]}")


class PageDom(HTMLParser):
    """What the test checks in the DOM Chromium dumped: peer rows, points of the loss chart, plan cells."""

    def __init__(self) -> None:
        super().__init__()
        self.peer_rows: list[str] = []
        self.plan_cells: list[str] = []
        self.loss_points = 0
        self.sync = ""  # the summary's sync setting
        self._in_loss_chart = False
        self._in_sync = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("class") == "peer":
            self.peer_rows.append(a.get("data-peer-id") or "")
        elif tag == "td" and a.get("data-peer-id"):
            self.plan_cells.append(a["data-peer-id"] or "")
        elif tag == "svg":
            self._in_loss_chart = a.get("id") == "loss-chart"
        elif tag == "circle" and self._in_loss_chart and a.get("class") == "point":
            self.loss_points += 1
        self._in_sync = a.get("id") == "sync"

    def handle_data(self, data: str) -> None:
        if self._in_sync:
            self.sync += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._in_loss_chart = False
        self._in_sync = False


def chromium(url: str, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium as root on a loopback page: no sandbox, no GPU, no network besides the page."""
    assert CHROMIUM is not None
    profile = tmp / f"chromium-profile-{time.monotonic_ns()}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


# ---- in-process parts ----------------------------------------------------------------------------------------

def _snap(peers: list[str], epoch: int | None, step: int | None, state: str, leader: str | None = None) -> dict:
    return {"run": "r", "time": 1.0, "state": state, "step": step, "peers": [{"peer_id": p} for p in peers],
            "plan": {"epoch": epoch, "leader": leader, "pipelines": [peers], "stages": [[0, 4]],
                     "reason": "a peer died", "step": step}}


@pytest.mark.unit
def test_events_are_derived_from_successive_snapshots() -> None:
    first = diff_events(None, _snap(["a"], None, 0, "forming"))
    assert [e["kind"] for e in first] == ["watch"]
    events = diff_events(_snap(["a", "b"], 1, 5, "training", "a"), _snap(["a", "c"], 2, 3, "training", "c"))
    kinds = [e["kind"] for e in events]
    assert kinds == ["join", "leave", "replan", "leader", "rollback"]
    assert "a peer died" in events[2]["text"] and "from step 5 to step 3" in events[4]["text"]
    assert [e["kind"] for e in diff_events(_snap(["a"], 2, 9, "training"), _snap(["a"], 2, 9, "done"))] == ["state"]
    assert diff_events(_snap(["a"], 2, 9, "training"), _snap(["a"], 2, 10, "training")) == []


@pytest.mark.unit
def test_the_http_server_serves_package_assets_and_refuses_the_rest() -> None:
    server = ObserveServer("127.0.0.1", 0, {"/": asset("index.html"), "/dashboard.js": asset("dashboard.js"),
                                            "/boom": lambda: 1 / 0})  # type: ignore[dict-item]
    try:
        status, ctype, body = get(server.url)
        assert status == 200 and ctype.startswith("text/html") and b'id="loss-chart"' in body
        links = re.findall(rb'(?:src|href)="([^"]*)"', body)
        assert links and all(link.startswith(b"/") for link in links), f"only local assets: {links}"
        status, ctype, body = get(server.url + "dashboard.js")
        assert status == 200 and "javascript" in ctype and b"/api/swarm" in body
        assert get(server.url + "nothing")[0] == 404
        assert get(server.url + "boom")[0] == 500
        request = urllib.request.Request(server.url, data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 405
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}"):
            ObserveServer("127.0.0.1", server.port, {})
    finally:
        server.close()


@pytest.mark.unit
def test_observe_sits_between_the_swarm_and_the_node() -> None:
    """tasklet.peer.observe reads peer.swarm / peer.net / peer.config / peer.timing; no lower layer imports it."""
    from tests.support.imports import import_graph, importing

    graph = import_graph()
    lower = ("tasklet.peer.net", "tasklet.peer.swarm", "tasklet.peer.compute", "tasklet.peer.runtime",
             "tasklet.peer.timing", "tasklet.protocol", "tasklet.scheduler")
    assert importing(graph, lower, ("tasklet.peer.observe",)) == []
    allowed = ("tasklet.peer.observe", "tasklet.peer.swarm", "tasklet.peer.net", "tasklet.peer.config",
               "tasklet.peer.timing")
    uses = {t for m, targets in graph.items() if m.startswith("tasklet.peer.observe") for t in targets}
    assert all(any(u == a or u.startswith(a + ".") for a in allowed) for u in uses), sorted(uses)
    assert any(t.startswith("tasklet.peer.observe") for t in graph["tasklet.peer.node.daemon"])


# ---- the command: errors -------------------------------------------------------------------------------------

def _dashboard_error(*args: str) -> tuple[int, list[str]]:
    proc = subprocess.run([*PEER_COMMAND, "dashboard", *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.light_processes  # one short process, no swarm: lane 1 (tests/conftest.py)
@pytest.mark.usefixtures("processes")
def test_dashboard_with_a_dead_dht_address_fails_with_one_line() -> None:
    rc, lines = _dashboard_error("--dht", DEAD_DHT, "--port", "0")
    assert rc == 2, lines
    assert len(lines) == 1 and lines[0].startswith("peer: error: cannot join the DHT"), lines


@pytest.mark.light_processes  # one short process, no swarm: lane 1 (tests/conftest.py)
@pytest.mark.usefixtures("processes")
def test_dashboard_on_a_port_in_use_fails_with_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        rc, lines = _dashboard_error("--dht", DEAD_DHT, "--port", str(port))
    assert rc == 2, lines
    assert lines == [f"peer: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    print(f"port-in-use error after {time.monotonic() - started:.1f} s (before any DHT work)")


# ---- a live swarm in a browser -------------------------------------------------------------------------------

@pytest.mark.usefixtures("processes")
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it as root)")
def test_dashboard_of_a_live_swarm_in_headless_chromium(tmp_path: Path) -> None:
    cfg = write_small_config(tmp_path, steps=1000, min_peers=N_PEERS)
    daemon_dash, metrics = free_port("127.0.0.2"), free_port("127.0.0.2")
    dash_port = free_port()
    dash_log = tmp_path / "dashboard.log"
    dashboard = log = None
    with PeerProcesses(tmp_path, emulate_tflops=0.0003) as procs:
        try:
            addr = procs.start(cfg, "--dashboard-port", str(daemon_dash), "--metrics-port", str(metrics))
            for i in range(1, N_PEERS):
                procs.join(addr, i)
            dashboard, log = launch([*PEER_COMMAND, "dashboard", "--dht", addr, "--port", str(dash_port),
                                     "--interval", "1"], dash_log)
            line = read_line(dashboard, 90, "dashboard of run")
            assert f"http://127.0.0.1:{dash_port}/" in line, dash_log.read_text()[-2000:]
            url = f"http://127.0.0.1:{dash_port}/"
            api = wait_json(url + "api/swarm", lambda s: len(s.get("peers", [])) == N_PEERS
                            and len(s["history"]["loss"]) >= 3 and s["plan"]["epoch"], 180,
                            "every peer and three steps in /api/swarm")
            peer_ids = sorted(p["peer_id"] for p in api["peers"])
            assert sorted(pid for pipe in api["plan"]["pipelines"] for pid in pipe) == peer_ids
            assert all(p["device"] and p["tflops"] > 0 and p["last_seen_s"] >= 0 for p in api["peers"])
            assert {e["kind"] for e in api["events"]} >= {"watch"}
            assert all(isinstance(x, float) for x in api["history"]["loss"])
            assert api["sync"] == {"period": 1, "codec": None, "overlap": False}

            dom_run = chromium(url, tmp_path, "--dump-dom")
            assert dom_run.returncode == 0, dom_run.stderr[-2000:]
            dom = PageDom()
            dom.feed(dom_run.stdout)
            assert sorted(dom.peer_rows) == peer_ids, dom_run.stdout[:3000]
            assert set(dom.plan_cells) == set(peer_ids)
            assert dom.loss_points >= 3, "the loss chart has no points"
            assert dom.sync == "exact sync"
            shot = tmp_path / "dashboard.png"
            shot_run = chromium(url, tmp_path, f"--screenshot={shot}", "--window-size=1280,1400")
            assert shot.exists() and shot.stat().st_size > 20_000, shot_run.stderr[-2000:]
            print(f"screenshot: {shot}")

            # the same page and JSON from the first daemon, which also serves /metrics there
            own = wait_json(f"http://127.0.0.2:{daemon_dash}/api/swarm",
                            lambda s: len(s.get("peers", [])) == N_PEERS, 60, "the daemon's own dashboard")
            assert sorted(p["peer_id"] for p in own["peers"]) == peer_ids
            status, _, body = get(f"http://127.0.0.2:{daemon_dash}/metrics")
            assert status == 200 and b"tasklet_step " in body
            assert get(f"http://127.0.0.2:{metrics}/metrics")[0] == 200
        finally:
            if dashboard is not None:
                stop_all([dashboard], 20.0)
            if log is not None:
                log.close()
