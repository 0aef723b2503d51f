"""A volunteer GPU's check, in one run: what `peer doctor` measures, an exact two-peer run on the GPU checked
against single-process training on the CPU, a bf16 single-peer run's throughput, and ``bench.overhead`` (a peer's
step against plain PyTorch, MFU).

    python scripts/gpu_check.py --out DIR [--device cuda] [--quick]

Real `peer start` / `peer join` processes on loopback (``peer.emulation.procs``), the device each peer would
use as a volunteer's. Writes ``DIR/gpu_check.json`` (one object: ``doctor``, ``exact``, ``throughput``) and
the peers' logs under ``DIR/logs-*``, and prints the figures as it goes. Each part has its own deadline and a
failed part is recorded, not fatal, so one run on a lent machine brings back whatever worked.
``--device cpu --quick`` runs the same path on a CPU machine in about a minute (a check of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasklet.peer.compute.model import ModelConfig  # noqa: E402
from tasklet.peer.emulation.procs import PEER_COMMAND, child_env, run_to_end  # noqa: E402
from tasklet.peer.runtime.bounds import stage_numel  # noqa: E402

STEP_LINE = re.compile(r"step (\d+): loss ([0-9.]+|-), ([0-9.]+) s, ([0-9.]+) tokens/s")


def run_toml(folder: Path, *, steps: int, peers: int, stages: int, layers: int, width: int, heads: int,
             seq: int, micro_batch: int, micro_batches: int, precision: str, save: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "\n".join([
        "[run]", 'run_id = "tasklet"', f"steps = {steps}", f"micro_batch = {micro_batch}",
        f"n_microbatches = {micro_batches}", f'precision = "{precision}"',
        "[model]", f"n_layers = {layers}", f"d_model = {width}", f"n_heads = {heads}", f"seq_len = {seq}",
        "[swarm]", f"min_peers = {peers}", f"stages = {stages}", "heartbeat_s = 1.0", "plan_time_limit_s = 1.0",
        f'save_dir = "{folder / "save"}"' if save else "", ""])
    path = folder / "run.toml"
    path.write_text(text)
    return path


def steps_of(log: str) -> list[dict[str, float | None]]:
    """The leader's per-step lines: step, loss, seconds, tokens/s."""
    rows = []
    for m in STEP_LINE.finditer(log):
        rows.append({"step": int(m[1]), "loss": None if m[2] == "-" else float(m[2]), "s": float(m[3]),
                     "tokens_per_s": float(m[4])})
    return rows


PEER_ENV: dict[str, str] | None = None  # the peers' environment: None, one torch thread each (``--one-thread``)


def swarm(folder: Path, cfg: Path, peers: int, device: str, deadline_s: float) -> dict[str, Any]:
    """Run ``peers`` peers on ``cfg`` until the first one exits (the run's end) or ``deadline_s``."""
    t0 = time.monotonic()
    finished, logs = run_to_end(folder, cfg, peers, deadline_s, device=device, env=PEER_ENV, poll_s=1.0)
    log = logs[0]
    rows = steps_of(log)
    probe = [ln.split("device_probe: ", 1)[-1] for ln in log.splitlines() if "device_probe: " in ln][:1]
    return {"finished": finished, "wall_s": round(time.monotonic() - t0, 1), "steps": rows,
            "plan": [ln.split("] ", 1)[-1] for ln in log.splitlines() if "driver: plan epoch" in ln][:2],
            "device_probe": probe}


def part_doctor(out: Path, device: str, quick: bool) -> dict[str, Any]:
    cmd = [*PEER_COMMAND, "doctor", "--device", device, "--json", "--measure-seconds", "1" if quick else "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=child_env(), check=False)
    (out / "doctor.err").write_text(done.stderr)
    result = json.loads(done.stdout)
    print(json.dumps(result, indent=1)[:3000], flush=True)
    return result


def part_exact(out: Path, device: str, quick: bool) -> dict[str, Any]:
    from tasklet.peer.emulation.reference_check import gap_to_reference

    steps = 3 if quick else 8
    folder = out / "exact"
    # one stage, two pipelines: the replicas average and check each other's sums (the all-gather digest);
    # small enough for the single-process reference on one CPU thread (seconds a step)
    cfg = run_toml(folder, steps=steps, peers=2, stages=1, layers=4, width=64 if quick else 128,
                   heads=4, seq=32 if quick else 128, micro_batch=2 if quick else 4,
                   micro_batches=8, precision="fp32")
    result = swarm(folder, cfg, 2, device, 240)
    gap = gap_to_reference(folder / "save", steps)
    result["reference_gap"] = {"max_abs": gap.max_abs, "max_rel": gap.max_rel, "loss_rel": gap.loss_rel}
    print(json.dumps(result, indent=1), flush=True)
    return result


def part_throughput(out: Path, device: str, quick: bool, peers: int = 1, steps: int = 10) -> dict[str, Any]:
    """One stage on ``peers`` peers (``peers`` pipelines: a group of that many replicas averages each step); the
    one-peer run saves its stage at the end (a state of 1.8 GB: over the transport's 1 GiB default)."""
    folder = out / f"throughput{peers}"
    layers, width, seq, mb, n_mb = (2, 64, 32, 2, 4) if quick else (12, 1024, 512, 8, 8)
    cfg = run_toml(folder, steps=3 if quick else steps, peers=peers, stages=1, layers=layers, width=width,
                   heads=4 if quick else 16, seq=seq, micro_batch=mb, micro_batches=n_mb,
                   precision="fp32" if quick else "bf16", save=peers == 1)
    result = swarm(folder, cfg, peers, device, 240)
    if peers == 1:
        saved = sorted((folder / "save").glob("stage-*.pt"))
        result["saved"] = {f.name: f.stat().st_size for f in saved}
    params = stage_numel(ModelConfig(n_layers=layers, d_model=width, n_heads=4 if quick else 16, seq_len=seq),
                         (0, layers))
    timed = [r for r in result["steps"] if r["step"] >= 2]  # the first steps warm kernels and caches
    if timed:
        tps = sorted(r["tokens_per_s"] for r in timed)[len(timed) // 2]
        result["median_tokens_per_s"] = tps
        result["median_step_s"] = sorted(r["s"] for r in timed)[len(timed) // 2]
        result["params"] = params
        result["model_tflops"] = 6 * params * tps / 1e12  # forward + backward, attention not counted
    print(json.dumps(result, indent=1), flush=True)
    return result


def part_overhead(out: Path, device: str, quick: bool) -> dict[str, Any]:
    """``python -m bench.overhead`` on the device: a lone peer (and two on loopback) against a plain PyTorch loop of
    the same model, with each peer's breakdown of its step and the MFU (its own process, so its JSON is whole)."""
    cmd = [sys.executable, "-m", "bench.overhead", "--json", "--device", device, "--out", str(out / "overhead")]
    cmd += ["--quick"] if quick else ["--cases", "plain,lone,replicas,pipeline", "--steps", "6"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          check=False, cwd=Path(__file__).resolve().parent.parent)
    (out / "overhead.err").write_text(done.stderr)
    result = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-3000:]}
    print(json.dumps(result, indent=1)[:6000], flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and the peers' logs")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="(default: cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps: a check of the script")
    parser.add_argument("--one-thread", action="store_true",
                        help="peers' torch on one CPU thread, as in `peer swarm` (default: all cores, as a volunteer)")
    parser.add_argument("--steps", type=int, default=10, help="steps of the throughput runs (default: 10)")
    parser.add_argument("--parts", default="doctor,exact,throughput1,throughput2,overhead",
                        help="which parts, comma-separated (default: %(default)s)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    global PEER_ENV
    if not args.one_thread:  # a volunteer's peer has the machine's cores; the launcher's default is one thread
        PEER_ENV = dict(os.environ, PYTHONUNBUFFERED="1")
    parts: dict[str, Callable[[Path, str, bool], dict[str, Any]]] = {
        "doctor": part_doctor, "exact": part_exact,
        "throughput1": lambda o, d, q: part_throughput(o, d, q, steps=args.steps),
        "throughput2": lambda o, d, q: part_throughput(o, d, q, peers=2, steps=args.steps),
        "overhead": part_overhead}
    report: dict[str, Any] = {"device": args.device}
    for name, part in parts.items():
        if name not in args.parts.split(","):
            continue
        t0 = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            report[name] = part(args.out, args.device, args.quick)
        except Exception as exc:  # noqa: BLE001 - a failed part is recorded; the next still runs
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            print(report[name]["trace"], flush=True)
        report[name]["part_s"] = round(time.monotonic() - t0, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
