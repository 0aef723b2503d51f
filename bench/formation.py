"""Swarm formation with real `peer` processes: time from `peer start` to every advert visible and to the
first plan, for swarms of 8, 16 and 32 local peers.

``python -m bench.formation [--sizes 8 16 32] [--json]``

Each size starts one `peer start` and N-1 `peer join` processes on loopback (each a full daemon: hivemind
DHT node, gRPC worker, heartbeat, link prober; TFLOP/s emulated so no matmul is timed), and a read-only DHT
client polls what `peer status` would show. "all adverts" is when the client sees N live peers; "first plan"
when the leader has published plan epoch 1 (after waiting for [swarm] min_peers = N, probing links and
running the scheduler). The run then trains one step and every peer exits. All peers share this machine's
cores, so large swarms measure CPU contention as much as the protocol: say so when quoting the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peer.emulation.procs import PeerProcesses, write_small_config
from peer.swarm.status import StatusReader


def form(n: int, timeout_s: float, say: Any, keep_logs: bool = False) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"tasklet-formation-{n}-"))
    cfg = write_small_config(folder, steps=1, min_peers=n, stages=2, heartbeat_s=2.0)
    out: dict[str, Any] = {"peers": n, "all_adverts_s": None, "first_plan_s": None, "first_step_s": None}
    try:
        with PeerProcesses(folder, emulate_tflops=0.001) as procs:
            t0 = time.monotonic()
            addr = procs.start(cfg, timeout_s=timeout_s)
            out["first_peer_s"] = time.monotonic() - t0
            for i in range(1, n):
                procs.join(addr, i)
            with StatusReader([addr]) as reader:
                deadline = t0 + timeout_s
                while time.monotonic() < deadline:
                    try:
                        st = reader.read()
                    except Exception:  # the DHT may be busy; try again
                        time.sleep(0.5)
                        continue
                    now = time.monotonic() - t0
                    if out["all_adverts_s"] is None and len(st.peers) >= n:
                        out["all_adverts_s"] = now
                    if out["first_plan_s"] is None and st.plan.get("epoch"):
                        out["first_plan_s"] = now
                    if st.progress.get("state") == "done" or (st.progress.get("step") or 0) >= 1:
                        out["first_step_s"] = now
                        break
                    time.sleep(0.25)
    finally:
        if keep_logs:
            say(f"  logs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    say(f"  {n:>3} peers: first peer up {out.get('first_peer_s', 0):.1f} s, all adverts "
        f"{_fmt(out['all_adverts_s'])}, first plan {_fmt(out['first_plan_s'])}, first step {_fmt(out['first_step_s'])}")
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32], help="swarm sizes (default: 8 16 32)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per size, seconds (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--keep-logs", action="store_true", help="keep each swarm's peer logs and say where")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    say("swarm formation (real peer processes on loopback, all on this machine)")
    rows = [form(n, args.timeout, say, args.keep_logs) for n in args.sizes]
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
