"""`peer swarm`: a whole swarm on this machine — N real peer daemons on an emulated network.

Unlike ``peer.emulation.local`` (bare workers driven by a coordinator in the caller's process), everything here
goes through the daemons as on volunteers' machines: DHT, adverts, election, leader role.

Peer 0 runs `peer start`, the others `peer join` with the join line it prints, exactly as volunteers would.
Each peer emulates one device of a scenario (its links are shaped, its compute stretched to the declared
TFLOP/s, see ``peer.node.planning.EmulatedNetwork``). The launcher watches the swarm through the DHT like `peer
status` does, prints progress, waits for every peer to exit and summarises what happened from the leader's
``run.json``. Every process it starts is ended before it returns.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasklet.peer.compute.textdata import load_corpus
from tasklet.peer.config import EmulationSection, ModelSection, RunConfig, RunSection, SwarmSection
from tasklet.peer.emulation.procs import PeerProcesses
from tasklet.peer.node.planning import check_model_fits
from tasklet.peer.observe.progress import ProgressDisplay
from tasklet.peer.swarm.status import StatusReader
from tasklet.scheduler import Cluster
from tasklet.scheduler.cluster import load_scenario

log = logging.getLogger(__name__)

LEAVE_GRACE_S = 20.0  # peers leave by themselves when the run is done; after this they are ended


@dataclass
class SwarmOptions:
    peers: int
    scenario: str
    steps: int = 5
    seed: int = 0
    save: str | None = None
    stages: int = 0
    bandwidth_scale: float = 0.01
    tflops: float = 0.002
    micro_batch: int = 4
    n_microbatches: int = 8
    n_layers: int = 4
    d_model: int = 64
    seq_len: int = 64
    timeout_s: float = 900.0
    log_dir: str | None = None
    heartbeat_s: float = 1.0
    model: str = ""  # a Hugging Face model (preset, config.json, folder); "": the byte GPT
    tokenizer: str = ""
    data: str = "stdlib"
    text_field: str = "text"
    sync_period: int = 1  # DiLoCo ([run] sync_period etc.): 1 = exact averaging every step
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    pseudo_grad_compression: str = "none"


def spread_devices(cluster: Cluster, n: int) -> list[int]:
    """``n`` devices of the scenario taken round-robin over its regions, so a small swarm spans the world."""
    if n > cluster.n:
        raise ValueError(f"--peers {n}: the scenario has only {cluster.n} devices")
    by_region: dict[str, list[int]] = {}
    for d, r in enumerate(cluster.regions):
        by_region.setdefault(r, []).append(d)
    queues = list(by_region.values())
    out: list[int] = []
    while len(out) < n:
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def _absolute(value: str) -> str:
    """A path that exists, made absolute; anything else (a preset name, "stdlib", "") unchanged."""
    return str(Path(value).resolve()) if value and Path(value).exists() else value


def write_config(opts: SwarmOptions, folder: Path, devices: list[int], save_dir: Path) -> Path:
    cfg = RunConfig(
        run=RunSection(run_id="swarm", steps=opts.steps, seed=opts.seed, micro_batch=opts.micro_batch,
                       n_microbatches=opts.n_microbatches, tokenizer=_absolute(opts.tokenizer),
                       corpus=_absolute(opts.data), text_field=opts.text_field, sync_period=opts.sync_period,
                       outer_lr=opts.outer_lr, outer_momentum=opts.outer_momentum,
                       pseudo_grad_compression=opts.pseudo_grad_compression),
        # peers run in other folders: paths must not be relative
        model=ModelSection(n_layers=opts.n_layers, d_model=opts.d_model, seq_len=opts.seq_len,
                           config=_absolute(opts.model)),
        swarm=SwarmSection(min_peers=opts.peers, stages=opts.stages, heartbeat_s=opts.heartbeat_s,
                           save_dir=str(save_dir)),
        emulation=EmulationSection(scenario=opts.scenario, devices=devices, bandwidth_scale=opts.bandwidth_scale,
                                   tflops=opts.tflops),
    )
    cfg.validate("peer swarm")
    path = folder / "run.toml"
    path.write_text(cfg.to_toml())
    return path


def run_swarm(opts: SwarmOptions, say: Callable[[str], None] = print) -> int:
    """Start the swarm, follow it, summarise it; 0 when it trained every step."""
    cluster = load_scenario(opts.scenario)
    devices = spread_devices(cluster, opts.peers)
    work = Path(tempfile.mkdtemp(prefix="tasklet-swarm-"))
    save_dir = Path(opts.save) if opts.save else work / "result"
    log_dir = Path(opts.log_dir) if opts.log_dir else work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    config = write_config(opts, work, devices, save_dir)
    spec = RunConfig.load(config).spec()  # bad model, tokenizer or data files: one line, before any peer starts
    check_model_fits(spec, [float(cluster.memory_bytes[d]) for d in devices])
    load_corpus(spec.corpus, spec.tokenizer, spec.text_field, spec.model)  # also tokenizes once into the cache
    regions = [cluster.regions[d] for d in devices]
    say(
        f"swarm: {opts.peers} peers emulating {cluster.name} devices {devices} (regions {', '.join(regions)}); "
        f"bandwidth x{opts.bandwidth_scale:g}, {opts.tflops:g} TFLOP/s emulated per device"
    )
    say(f"logs in {log_dir}")
    procs = PeerProcesses(log_dir)
    started = time.monotonic()
    try:
        addr = procs.start(config, "--emulate-device", "0")
        say(f"first peer up; others run: {procs.join_line}")
        for i in range(1, opts.peers):
            procs.join(addr, i, "--run", "swarm", "--emulate-device", str(i))
        _follow(addr, procs, opts, started, say)
    finally:
        procs.close(LEAVE_GRACE_S, ask_first=False)
    return _summarise(save_dir, opts, cluster, devices, time.monotonic() - started, say)


def _follow(addr: str, procs: PeerProcesses, opts: SwarmOptions, started: float, say: Callable[[str], None]) -> None:
    """Print progress as the leader publishes it, until every peer has exited or the timeout."""
    deadline = started + opts.timeout_s
    with (
        StatusReader([addr], run_id="swarm") as reader,
        ProgressDisplay(opts.steps, plain=say, started=started) as display,  # a bar on a terminal, else lines
    ):
        while procs.alive() and time.monotonic() < deadline:
            try:
                st = reader.read()
            except Exception as exc:  # the DHT may be shutting down as the run ends
                log.info("status read: %s", exc)
                time.sleep(1.0)
                continue
            p = st.progress
            display.update(p.get("step"), loss=p.get("loss"), step_s=p.get("step_s"),
                           tokens_per_s=p.get("tokens_per_s"), epoch=st.plan.get("epoch"), peers=len(st.peers))
            time.sleep(1.0)
    if procs.alive():
        say(f"timeout: the swarm did not finish within {opts.timeout_s:.0f} s; stopping it")


def _summarise(
    save_dir: Path, opts: SwarmOptions, cluster: Cluster, devices: list[int], wall_s: float, say: Callable[[str], None]
) -> int:
    run_file = save_dir / "run.json"
    if not run_file.exists():
        say(f"FAILED: no result in {save_dir} (see the peer logs)")
        return 1
    run: dict[str, Any] = json.loads(run_file.read_text())
    losses, secs = run["loss"], run["step_s"]
    plan = run.get("plan") or {}
    say("")
    say(f"plan (epoch {plan.get('epoch')}): stages (layer ranges) {plan.get('stages')}")
    for r, pipe in enumerate(plan.get("pipelines", [])):
        peers = [run.get("peers", {}).get(str(d)) or {} for d in pipe]
        emu = [p.get("emu") for p in peers]
        scenario_ids = [devices[e] if isinstance(e, int) and e < len(devices) else "?" for e in emu]
        where = [str(p.get("region", "?")) for p in peers]
        say(f"  pipeline {r}: scenario devices {scenario_ids} in {' -> '.join(where)}")
    if len(run.get("plans", [])) > 1:
        say(f"re-plans: {len(run['plans']) - 1}")
    tokens = opts.micro_batch * opts.n_microbatches * opts.seq_len
    steady = sorted(secs[1:]) or secs
    median = steady[len(steady) // 2]
    say(
        f"trained {len(losses)} steps in {wall_s:.1f} s: loss {losses[0]:.4f} -> {losses[-1]:.4f}; median "
        f"{median:.2f} s/step, {tokens / median:.0f} tokens/s"
    )
    say(f"parameters and run.json saved in {save_dir}")
    return 0 if len(losses) == opts.steps else 1
