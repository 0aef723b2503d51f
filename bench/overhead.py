"""What a peer costs beyond its arithmetic: a peer's training step against a plain PyTorch loop of the same work.

``python -m bench.overhead [--json] [--device cpu|cuda] [--quick] [--cases plain,lone,replicas,pipeline]``

For each model (the 152M byte GPT, 12 x 1024, and one Hugging Face preset) and each size of step (tokens a step),
the same model, tokens, precision and AdamW are trained by

(a) ``plain``: a plain PyTorch loop written here (one ``nn.Module``, ``loss.backward()`` accumulating over the
    micro-batches, ``torch.optim.AdamW``), in this process;
(b) ``lone``: one peer alone (a real ``peer start``: one stage, one pipeline, its own leader);
(c) ``replicas``: two peers on loopback holding two replicas of one stage (two pipelines: each computes half
    the micro-batches, then the verified reduce-scatter + all-gather);
(d) ``pipeline``: two peers on loopback as one pipeline of two stages.

Per case: the median step time (the first steps, which warm caches and allocators, are left out), tokens/s, and,
for the peers, each peer's own breakdown of its step as it logs it (``peer.runtime.stage.timing``): device
compute, waiting for the network (shards, digests), host work on parameters and gradients (copies, sums,
checks, the optimizer step, the parameters hash), control round trips (leases) and the share of the step its
device computed. A peer's step time is the time from one step's end to the next as the leader logs them, so it
counts what the leader does between steps too (``leader_step_s``: the leader's own figure, from a step's start
order to its end, which leaves that out). The figures of merit are ``lone / plain`` (target <= 1.10),
``replicas / (lone + wire)`` where ``wire`` is the time the shards a replica exchanges take on loopback at the
measured rate (target <= 1.25), and ``pipeline / lone`` (target <= 1.15 at 8,192 tokens a step).

A shared or virtual machine's speed drifts by more than these margins from minute to minute: ``--rounds R``
runs the cases of each row R times in turn (plain, lone, ..., plain, lone, ...), and each ratio is the median
of the R ratios of cases run minutes apart (``ratios_by_round`` lists them); a case's figures are those of its
median round. With R > 1 one more plain loop runs after the last round, and each round's ratios use the mean of
the plain loop timed just before its peers and the one just after them (:func:`bracketed`): a drift of the
machine's speed that is linear over a round cancels out.

Peers use the machine's cores as a volunteer's would (no thread cap); two peers on one machine get half the
cores each. ``--quick``: a 2-layer GPT of width 64 and a few steps, a check of this script (well under a
minute on a CPU). On a GPU (``--device cuda``, ``scripts/gpu_check.py``) the report adds each case's model
FLOP/s and MFU against the device's peak as ``peer doctor`` measures it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOAD = "uptime"  # the machine's load is printed beside every figure: timings on a shared machine are noisy

STEP_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*?step (\d+): loss ([0-9.]+|-), ([0-9.]+) s, "
                       r"([0-9.]+) tokens/s", re.MULTILINE)
TIMES_LINE = re.compile(r"step (\d+) times: (.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Model:
    """One model of the benchmark: a name, its [model] TOML lines, and whether it is a Hugging Face preset."""

    name: str
    toml: tuple[str, ...]
    seq_len: int


def byte_gpt(layers: int, width: int, heads: int, seq: int) -> Model:
    return Model(f"byte GPT {layers} x {width}", ("[model]", f"n_layers = {layers}", f"d_model = {width}",
                                                  f"n_heads = {heads}", f"seq_len = {seq}"), seq)


def preset(name: str, seq: int) -> Model:
    return Model(f"HF {name}", ("[model]", f'config = "{name}"', f"seq_len = {seq}"), seq)


def run_toml(folder: Path, model: Model, *, steps: int, peers: int, stages: int, micro_batch: int,
             micro_batches: int, precision: str) -> Path:
    """``folder/run.toml`` of one case (spot checks off: a lone pipeline has no shadow to compare anyway)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = "\n".join([
        "[run]", 'run_id = "tasklet"', f"steps = {steps}", f"micro_batch = {micro_batch}",
        f"n_microbatches = {micro_batches}", f'precision = "{precision}"', *model.toml,
        "[swarm]", f"min_peers = {peers}", f"stages = {stages}", "heartbeat_s = 1.0", "plan_time_limit_s = 1.0",
        "[trust]", "spot_check = 0.0", "probation_check = 0.0", ""])
    path = folder / "run.toml"
    path.write_text(text)
    return path


def load() -> str:
    """The load averages, as ``uptime`` shows them."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


# --------------------------------------------------------------------------------------------- (a) plain loop
def plain(cfg: Path, steps: int, device: str) -> dict[str, Any]:
    """Train the run file's model in this process with a textbook loop; per-step seconds."""
    import torch

    from tasklet.peer.compute.data import Corpus, microbatch
    from tasklet.peer.compute.model import lm_loss
    from tasklet.peer.compute.reference import reference_adamw
    from tasklet.peer.config import RunConfig

    spec = RunConfig.load(cfg).spec()
    model = spec.model.build_stage(0, spec.model.n_layers).to(device)
    optimizer = reference_adamw(model, spec.optim)
    corpus = Corpus.load(spec.corpus)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision)
    seconds, losses = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in range(spec.n_microbatches):
            x, y = microbatch(corpus, spec.seed, step, mb, spec.micro_batch, spec.model.seq_len)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device_type=device.split(":")[0], dtype=dtype or torch.float32,
                                enabled=dtype is not None):
                loss = lm_loss(model(x), y)
            (loss / spec.n_microbatches).backward()
            total += float(loss.detach())
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        losses.append(total / spec.n_microbatches)
    params = sum(p.numel() for p in model.parameters())
    return {"step_s": seconds, "loss": losses, "params": params}


# ----------------------------------------------------------------------------------------------- (b-d) peers
def peer_times(log: str) -> list[dict[str, float]]:
    """A peer's per-step breakdown lines (``step N times: wall 1.23 s, compute 1.10 s, ...``)."""
    rows = []
    for m in TIMES_LINE.finditer(log):
        row: dict[str, float] = {"step": int(m[1])}
        for part in m[2].split(", "):
            name, _, value = part.partition(" ")
            row[name] = float(value.split()[0])
        rows.append(row)
    return rows


def swarm(folder: Path, cfg: Path, peers: int, device: str, deadline_s: float) -> dict[str, Any]:
    """Run ``peers`` real peers on ``cfg`` until the first one (the leader) exits at the run's end."""
    from tasklet.peer.emulation.procs import run_to_end

    threads = max(1, (os.cpu_count() or 1) // peers)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if peers > 1:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.monotonic()
    finished, logs = run_to_end(folder, cfg, peers, deadline_s, device=device, env=env)
    return {"finished": finished, "wall_s": round(time.monotonic() - t0, 1), "steps": leader_steps(logs[0]),
            "peers": [peer_times(text) for text in logs]}


def leader_steps(log: str) -> list[dict[str, Any]]:
    """The leader's step lines: each step's own figure (``s``) and, from the second on, ``cycle_s``: the time from
    the step before's line to its own (None after a gap in the steps: a re-plan or a roll-back)."""
    rows = [{"step": int(m[3]), "s": float(m[5]), "tokens_per_s": float(m[6]), "at": _log_time(m[1], m[2])}
            for m in STEP_LINE.finditer(log)]
    for prev, row in zip(rows, rows[1:], strict=False):  # from one step's end to the next: all a step costs
        row["cycle_s"] = round(row["at"] - prev["at"], 3) if row["step"] == prev["step"] + 1 else None
    return rows


def _log_time(stamp: str, millis: str) -> float:
    """A log line's time (``2026-12-07 10:57:42`` and ``774``) in seconds."""
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def _median_after(values: list[float], warmup: int) -> float | None:
    kept = values[warmup:] or values[-1:]
    return statistics.median(kept) if kept else None


def summarise(case: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Median step time and each peer's median breakdown over the steps after the warm-up."""
    steps = case["steps"]
    cycles = [r["cycle_s"] for r in steps if r["step"] >= warmup and r.get("cycle_s") is not None]
    out: dict[str, Any] = {"step_s": statistics.median(cycles) if cycles else _median_after([r["s"] for r in steps],
                                                                                           warmup),
                           "leader_step_s": _median_after([r["s"] for r in steps], warmup)}
    out["peers"] = []
    for rows in case.get("peers", []):
        kept = [r for r in rows if r["step"] >= warmup] or rows[-1:]
        if kept:
            out["peers"].append({k: round(statistics.median(r[k] for r in kept), 4)
                                 for k in kept[0] if k != "step"})
    return out


def wire_seconds(params: int, replicas: int = 2) -> tuple[float, float]:
    """What the shards one replica of ``replicas`` exchanges per step take on loopback: the bytes (reduce-scatter
    and all-gather, fp32) and their time at the rate a loopback socket copy moves here (measured)."""
    import socket
    import threading

    data = bytes(32 << 20)
    a, b = socket.socketpair()
    got = [0]

    def drain() -> None:
        while got[0] < 4 * len(data):
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            got[0] += len(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    t0 = time.perf_counter()
    for _ in range(4):
        a.sendall(data)
    reader.join(30)
    rate = got[0] / (time.perf_counter() - t0)
    a.close()
    b.close()
    shard_bytes = 2 * 4 * params * (replicas - 1) / replicas
    return shard_bytes, shard_bytes / rate


def device_peak(device: str) -> float | None:
    """The device's measured TFLOP/s (``peer doctor``'s probe), for MFU; None off a GPU."""
    if not device.startswith("cuda"):
        return None
    from tasklet.peer.compute.device_probe import measure_device

    return float(measure_device(device, seconds=2.0).tflops)


def run(models: list[Model], tokens: list[int], cases: list[str], steps: int, warmup: int, device: str,
        precision: str, out: Path, deadline_s: float, rounds: int = 1) -> list[dict[str, Any]]:
    """Every case of every model and step size, the cases of one row ``rounds`` times in turn (module docstring:
    a round's cases run minutes apart, so their ratios are paired against the machine's drift)."""
    peak = device_peak(device)
    results = []
    for model in models:
        for per_step in tokens:
            sequences = max(1, per_step // model.seq_len)
            micro_batches = min(8, sequences)  # two pipelines or stages need at least two micro-batches
            micro_batch = sequences // micro_batches
            row: dict[str, Any] = {"model": model.name, "tokens_per_step": micro_batch * micro_batches * model.seq_len,
                                   "micro_batch": micro_batch, "micro_batches": micro_batches, "device": device,
                                   "precision": precision, "cases": {}}
            tag = f"{model.name.replace(' ', '_')}-{per_step}"
            by_round: list[dict[str, dict[str, Any]]] = []
            for rnd in range(rounds):
                got_cases: dict[str, dict[str, Any]] = {}
                for case in cases:
                    summary = _run_case(row, case, model, out / tag / f"round{rnd}" / case, steps, warmup, device,
                                        precision, deadline_s, peak)
                    if summary is not None:
                        got_cases[case] = summary
                by_round.append(got_cases)
            row["cases"] = {case: _median_round([r[case] for r in by_round if case in r]) for case in by_round[0]}
            if rounds > 1 and "plain" in cases:  # bracket the last round's peers in time too
                closing = _run_case(row, "plain", model, out / tag / "closing" / "plain", steps, warmup, device,
                                    precision, deadline_s, peak)
                row["plain_closing_step_s"] = closing["step_s"] if closing else None
                by_round = bracketed(by_round, row["plain_closing_step_s"])
            per_round = [ratios({**row, "cases": r}) for r in by_round]
            row["ratios"] = {k: round(statistics.median(r[k] for r in per_round if k in r), 3)
                             for k in per_round[0]}
            if rounds > 1:
                row["ratios_by_round"] = per_round
            results.append(row)
    return results


def _run_case(row: dict[str, Any], case: str, model: Model, folder: Path, steps: int, warmup: int, device: str,
              precision: str, deadline_s: float, peak: float | None) -> dict[str, Any] | None:
    """One case of ``row`` (its model and step size): its summary, or None when the case needs more micro-batches."""
    micro_batch, micro_batches = row["micro_batch"], row["micro_batches"]
    peers, stages = {"plain": (0, 0), "lone": (1, 1), "replicas": (2, 1), "pipeline": (2, 2)}[case]
    if peers > 1 and micro_batches < 2:
        return None
    cfg = run_toml(folder, model, steps=steps, peers=max(1, peers), stages=max(1, stages),
                   micro_batch=micro_batch, micro_batches=micro_batches, precision=precision)
    before = load()
    if case == "plain":
        got = plain(cfg, steps, device)
        row["params"] = got["params"]
        summary: dict[str, Any] = {"step_s": _median_after(got["step_s"], warmup)}
        summary["all_step_s"] = [round(s, 4) for s in got["step_s"]]
    else:
        got = swarm(folder, cfg, peers, device, deadline_s)
        summary = summarise(got, warmup)
        summary["all_step_s"] = [r["s"] for r in got["steps"]]
        summary["finished"] = got["finished"]
    summary["load"] = f"{before} -> {load()}"
    s = summary["step_s"]
    summary["tokens_per_s"] = round(row["tokens_per_step"] / s, 1) if s else None
    if peak and s and "params" in row:
        flops = 6 * row["params"] * row["tokens_per_step"] / s
        summary["model_tflops"] = round(flops / 1e12, 3)
        summary["mfu"] = round(flops / (peak * 1e12), 4)
    print(f"  {model.name}, {row['tokens_per_step']} tokens/step, {case}: "
          f"{'-' if s is None else f'{s:.3f}'} s/step (load {summary['load']})", file=sys.stderr, flush=True)
    return summary


def _median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A case over its rounds: the round whose step time is the median (its breakdown too), with every round's."""
    timed = sorted((r for r in runs if r["step_s"] is not None), key=lambda r: r["step_s"])
    pick = timed[(len(timed) - 1) // 2] if timed else runs[-1]
    return {**pick, "rounds_step_s": [r["step_s"] for r in runs]} if len(runs) > 1 else pick


def bracketed(by_round: list[dict[str, dict[str, Any]]], closing_s: float | None) -> list[dict[str, dict[str, Any]]]:
    """Each round's plain figure replaced by the mean of its own and the next plain run's (the closing run's for the
    last round): a round's peers then stand against plain loops timed just before and just after them, so a
    drift of the machine's speed that is linear over a round cancels out of their ratios."""
    plains = [r.get("plain", {}).get("step_s") for r in by_round] + [closing_s]
    out = []
    for i, r in enumerate(by_round):
        before, after = plains[i], plains[i + 1]
        if before and after:
            r = {**r, "plain": {**r["plain"], "step_s": (before + after) / 2}}
        out.append(r)
    return out


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """The figures of merit of one model and step size (module docstring)."""
    c = {k: v.get("step_s") for k, v in row["cases"].items()}
    out: dict[str, float] = {}
    if c.get("lone") and c.get("plain"):
        out["lone_over_plain"] = round(c["lone"] / c["plain"], 3)
    if c.get("replicas") and c.get("lone") and row.get("params"):
        shard_bytes, wire_s = wire_seconds(row["params"])
        out["wire_s"] = round(wire_s, 4)
        out["replicas_over_lone_plus_wire"] = round(c["replicas"] / (c["lone"] + wire_s), 3)
    if c.get("pipeline") and c.get("lone"):
        out["pipeline_over_lone"] = round(c["pipeline"] / c["lone"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="(default: cpu)")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 2 tokens sizes, few steps: a check")
    parser.add_argument("--cases", default="plain,lone,replicas,pipeline", help="(default: %(default)s)")
    parser.add_argument("--models", default="gpt,hf", help="gpt (the 152M byte GPT), hf (the preset), or both")
    parser.add_argument("--hf-preset", default=None,
                        help="Hugging Face preset (default: llama-3.2-1b on cuda, tiny-llama on cpu)")
    parser.add_argument("--tokens", default="512,8192", help="tokens a step, comma-separated (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=8, help="steps of each case (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="first steps left out: kernels, allocator and caches warm up (default: %(default)s)")
    parser.add_argument("--precision", default=None, help="fp32 / bf16 (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--out", type=Path, default=None, help="folder for run files and logs (default: a temp)")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds a swarm case may run")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the cases of each row this many times in turn; each ratio is the median of the "
                             "rounds' ratios, each paired in time against a machine whose speed drifts "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.quick:
        models = [byte_gpt(2, 64, 4, 32)]
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens != "512,8192" else [64, 256]
        steps, warmup = min(args.steps, 4), min(args.warmup, 1)
    else:
        models = []
        if "gpt" in args.models.split(","):
            models.append(byte_gpt(12, 1024, 16, 512))
        if "hf" in args.models.split(","):
            models.append(preset(args.hf_preset or ("llama-3.2-1b" if cuda else "tiny-llama"), 512))
        tokens = [int(t) for t in args.tokens.split(",")]
        steps, warmup = args.steps, args.warmup
    precision = args.precision or ("bf16" if cuda else "fp32")
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        out = args.out or Path(tmp)
        results = run(models, tokens, args.cases.split(","), steps, warmup, args.device, precision, out,
                      args.deadline, max(1, args.rounds))
    if args.json:
        print(json.dumps({"results": results, "load": load()}))
        return 0
    for r in results:
        print(f"{r['model']}, {r['tokens_per_step']} tokens/step ({r['micro_batches']} x {r['micro_batch']} "
              f"sequences), {r['precision']} on {r['device']}")
        for case, c in r["cases"].items():
            s, own = c["step_s"], c.get("leader_step_s")
            print(f"  {case:<9} {'-' if s is None else f'{s:8.3f}'} s/step  {c['tokens_per_s'] or 0:10.1f} tokens/s"
                  f"  load {c['load']}" + (f"  MFU {c['mfu']:.3f}" if "mfu" in c else "")
                  + (f"  (the leader's own step figure {own:.3f} s)" if own else ""))
            for i, p in enumerate(c.get("peers", [])):
                print(f"    peer {i}: " + ", ".join(f"{k} {v}" for k, v in p.items()))
        if r.get("plain_closing_step_s"):
            print(f"  plain loop after the last round: {r['plain_closing_step_s']:.3f} s/step (each round's ratios "
                  "use the plain loops before and after its peers)")
        print("  " + ", ".join(f"{k} {v}" for k, v in r["ratios"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
