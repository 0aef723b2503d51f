"""Swarm formation with real `peer` processes: time from the first `peer start` to every advert visible and to
the first plan, for swarms of 8, 16 and 32 local peers, with where the time went and the DHT load per peer.

``python -m bench.formation [--sizes 8 16 32] [--steps 1] [--launcher fork|exec] [--json]``

Each size starts one `peer start` and, right after it printed its join line, N-1 `peer join` daemons on
loopback (each a full daemon: hivemind DHT node, gRPC worker, heartbeat, link prober; TFLOP/s emulated so no
matmul is timed).

Launchers. ``--launcher fork`` (the default, ``bench.launcher``): one process imports torch, hivemind, grpc and
the peer code once, then forks each daemon, which runs exactly `peer start` / `peer join` (``peer.cli.main``)
as a process of its own: its own session, identity, hivemind DHT process, libp2p daemon, gRPC server and
heartbeats. This is representative of a real swarm, where every volunteer starts on its own machine in
parallel and pays its own imports there; ``--launcher exec`` (one ``python -m tasklet.peer.cli`` per peer) serializes
N interpreters' imports (about 3.5 CPU-s each) on this machine's cores, which measures the emulation, not the
protocol. What the fork launcher does not measure: that per-host import time (reported once as
``launcher_import_s``), and each host's own memory (children share pages copy-on-write). All peers still
share this machine's cores for everything after the imports, so the figures stay pessimistic for large N.

Every figure is seconds from the moment the benchmark launched the first peer (after the launcher's imports):

* ``first_peer_s``: the first peer printed its join line (others can join);
* ``all_adverts_s``: a read-only DHT client (what `peer status` runs, polled once a second) sees N live peers;
* ``first_plan_s``: the leader published plan epoch 1, i.e. after waiting for [swarm] min_peers = N, probing
  links, running the scheduler and every worker accepting its assignment (from the leader's log line
  ``plan epoch 1 (start)``; the client's sighting when the log has none);
* ``first_step_s``: the client sees step 1 done (or the run done).

``startup`` gives each start-up phase of a peer (median and max over the N peers): ``process`` is from the
process's start to its daemon code (interpreter, imports), then the DHT node, the run record and corpus, the
worker server, reachability, the announcement; ``last_announced_s`` is when the last peer announced itself.
``dht_ops_per_heartbeat`` is each role's DHT gets, records those gets returned (a get of every advert returns
one per live peer) and stores per heartbeat as the daemons log them (median over the peers' log lines; a
worker is a peer holding an assignment, "idle" one without): run with ``--steps 30`` or more so the workers
log a few such lines after the first plan. All peers share this machine's cores, so large swarms measure
CPU contention as much as the protocol: say so when quoting.

Start-up and protocol apart: ``last_announced_s`` is start-up (every daemon up and announced); ``protocol_s`` =
``first_plan_s - last_announced_s`` is the protocol after that (the leader seeing everyone, link reports, the
scheduler, assignments). ``swarm_cpu_s`` is the CPU-seconds the peers used (daemons, their DHT processes and
libp2p daemons, sampled from /proc by process group; ``swarm_cpu_by_process_s`` splits it), so a run on a
loaded machine can be compared with one on a quiet machine; ``load_before``/``load_after`` are the load
averages. Every process a run starts is ended on return, on an error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.launcher import ForkedPeers
from tasklet.peer.emulation.procs import PeerProcesses, write_small_config
from tasklet.peer.swarm.status import StatusReader

POLL_S = 1.0  # the status client's poll: a faster one would load the DHT it measures
_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
_PHASES_RE = re.compile(_STAMP + r"INFO peer\.node\.daemon: start-up phases (\{.*\})$", re.M)
_ANNOUNCED_RE = re.compile(_STAMP + r"INFO peer\.node\.daemon: peer \w+ announced:", re.M)
_OPS_RE = re.compile(_STAMP + r"INFO peer\.node\.daemon: dht ops per heartbeat (\{.*\})$", re.M)
_PLAN_RE = re.compile(_STAMP + r"INFO peer\.runtime\.driver: plan epoch 1 \(start\)", re.M)


def _wall(stamp: str) -> float:
    return time.mktime(time.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S")) + int(stamp[20:]) / 1e3


def form(n: int, timeout_s: float, say: Any, keep_logs: bool = False, steps: int = 1,
         launcher: str = "fork") -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"tasklet-formation-{n}-"))
    cfg = write_small_config(folder, steps=steps, min_peers=n, stages=2, heartbeat_s=2.0)
    out: dict[str, Any] = {"peers": n, "launcher": launcher, "all_adverts_s": None, "first_plan_s": None,
                           "first_step_s": None, "load_before": _load()}
    cpu = GroupCpu()
    try:
        with _launch(launcher, folder) as procs:
            if isinstance(procs, ForkedPeers):
                out["launcher_import_s"], out["launcher_import_cpu_s"] = procs.import_s, procs.import_cpu_s
            t0, wall0 = time.monotonic(), time.time()
            addr = procs.start(cfg, timeout_s=timeout_s)
            out["first_peer_s"] = time.monotonic() - t0
            for i in range(1, n):
                procs.join(addr, i)
            with StatusReader([addr]) as reader:
                deadline = t0 + timeout_s
                while time.monotonic() < deadline:
                    cpu.sample(_peer_groups(procs))
                    try:
                        st = reader.read()
                    except Exception:  # the DHT may be busy; try again
                        time.sleep(POLL_S)
                        continue
                    now = time.monotonic() - t0
                    if out["all_adverts_s"] is None and len(st.peers) >= n:
                        out["all_adverts_s"] = now
                    if out["first_plan_s"] is None and st.plan.get("epoch"):
                        out["first_plan_s"] = now
                    if st.progress.get("state") == "done" or (st.progress.get("step") or 0) >= 1:
                        out["first_step_s"] = out["first_step_s"] or now
                        if steps <= 1 or st.progress.get("state") == "done":
                            break
                    time.sleep(POLL_S)
            cpu.sample(_peer_groups(procs))
            logs = [procs.log_text(i) for i in range(n)]
        out.update(_from_logs(logs, wall0, n))
        out["swarm_cpu_s"] = round(cpu.total(), 1)
        out["swarm_cpu_by_process_s"] = cpu.by_kind()
        out["load_after"] = _load()
        if out.get("last_announced_s") is not None and out.get("first_plan_s") is not None:
            out["protocol_s"] = round(out["first_plan_s"] - out["last_announced_s"], 2)
    finally:
        if keep_logs:
            say(f"  logs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    say(f"  {n:>3} peers ({launcher} launcher): first peer up {out.get('first_peer_s', 0):.1f} s, last announced "
        f"{_fmt(out.get('last_announced_s'))}, all adverts {_fmt(out['all_adverts_s'])}, first plan "
        f"{_fmt(out['first_plan_s'])} (protocol after the last announcement {_fmt(out.get('protocol_s'))}), "
        f"first step {_fmt(out['first_step_s'])}")
    say(f"        swarm CPU {out.get('swarm_cpu_s', 0):.0f} s {out.get('swarm_cpu_by_process_s')}, load average "
        f"{out['load_before']} before, {out.get('load_after')} after"
        + (f"; launcher imports {out['launcher_import_s']} s once ({out['launcher_import_cpu_s']} CPU-s)"
           if "launcher_import_s" in out else ""))
    phases = out.get("startup") or {}
    if phases:
        say("        start-up (median/max s): " + ", ".join(f"{k} {v['median']}/{v['max']}" for k, v in phases.items()))
    for role, ops in (out.get("dht_ops_per_heartbeat") or {}).items():
        say(f"        {role}: {ops['get']} DHT gets ({ops['rows']} records read), {ops['store']} stores per heartbeat "
            f"({ops['lines']} log lines)")
    return out


def _from_logs(logs: list[str], wall0: float, n: int) -> dict[str, Any]:
    """Start-up phases, the last announcement, the leader's plan publication and DHT ops, from the peers' logs."""
    out: dict[str, Any] = {}
    phases: dict[str, list[float]] = {}
    announced: list[float] = []
    ops: dict[str, list[dict[str, Any]]] = {}
    for text in logs:
        for _, body in _PHASES_RE.findall(text)[:1]:
            for k, v in json.loads(body).items():
                phases.setdefault(k, []).append(float(v))
        announced += [_wall(stamp) - wall0 for stamp in _ANNOUNCED_RE.findall(text)[:1]]
        plans = _PLAN_RE.findall(text)
        if plans:
            out["first_plan_s"] = round(_wall(plans[0]) - wall0, 2)
        for _, body in _OPS_RE.findall(text):
            line = json.loads(body)
            ops.setdefault(line["role"], []).append(line)
    out["startup"] = {k: {"median": round(statistics.median(v), 2), "max": round(max(v), 2)}
                      for k, v in phases.items()}
    if len(announced) == n:
        out["last_announced_s"] = round(max(announced), 2)
    out["dht_ops_per_heartbeat"] = {
        role: {"get": round(statistics.median(x["get"] for x in lines), 2),
               "store": round(statistics.median(x["store"] for x in lines), 2),
               "rows": round(statistics.median(x.get("rows", 0) for x in lines), 2), "lines": len(lines)}
        for role, lines in sorted(ops.items())
    }
    return out


def _launch(launcher: str, folder: Path) -> PeerProcesses | ForkedPeers:
    if launcher == "fork":
        return ForkedPeers(folder, emulate_tflops=0.001)
    return PeerProcesses(folder, emulate_tflops=0.001)


def _peer_groups(procs: PeerProcesses | ForkedPeers) -> list[int]:
    """The process group of every peer (each peer leads one: its DHT process and p2pd are in it)."""
    if isinstance(procs, ForkedPeers):
        return list(procs.pids.values())
    return [p.pid for p in procs.procs]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class GroupCpu:
    """CPU-seconds (user + system) of every process in some process groups, sampled from /proc: the highest
    value seen per process, so a process that ended between samples keeps what it used until the last one."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self.kind: dict[int, str] = {}  # pid -> "daemon" (leads its group), "p2pd" or "dht" (hivemind's process)
        self.tick = os.sysconf("SC_CLK_TCK")

    def sample(self, groups: list[int]) -> None:
        wanted = set(groups)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                name, rest = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)
                fields = rest.split()
            except (OSError, ValueError):
                continue
            if int(fields[2]) in wanted:  # fields after the name: state, ppid, pgrp, ..., utime at 11, stime 12
                pid = int(entry)
                used = (int(fields[11]) + int(fields[12])) / self.tick
                self.seen[pid] = max(used, self.seen.get(pid, 0.0))
                self.kind[pid] = "daemon" if pid == int(fields[2]) else "p2pd" if "p2pd" in name else "dht"

    def total(self) -> float:
        return sum(self.seen.values())

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, used in self.seen.items():
            out[self.kind[pid]] = round(out.get(self.kind[pid], 0.0) + used, 1)
        return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32], help="swarm sizes (default: 8 16 32)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per size, seconds (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=1,
                        help="training steps of each run (default: 1; 30 or more to see the DHT load after the plan)")
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--keep-logs", action="store_true", help="keep each swarm's peer logs and say where")
    parser.add_argument("--launcher", choices=("fork", "exec"), default="fork",
                        help="fork: daemons forked from one process that imported torch/hivemind once (hosts "
                             "starting in parallel); exec: one `peer` process each (default: fork)")
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.sizes) or args.steps < 1:
        parser.error("--sizes must be at least 2 and --steps at least 1")
    logging.basicConfig(level=logging.ERROR)

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwind, so every peer this run started is ended
    say(f"swarm formation (real peer processes on loopback, all on this machine, {args.launcher} launcher)")
    rows = [form(n, args.timeout, say, args.keep_logs, args.steps, args.launcher) for n in args.sizes]
    if args.json:
        print(json.dumps({"formation": rows}))
        return 0
    say("")
    say(f"{'peers':>5}  {'all adverts':>12}  {'first plan':>11}  {'first step':>11}")
    for r in rows:
        cells = [_fmt(r["all_adverts_s"]), _fmt(r["first_plan_s"]), _fmt(r["first_step_s"])]
        say(f"{r['peers']:>5}  {cells[0]:>12}  {cells[1]:>11}  {cells[2]:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
