"""`peer doctor`: can this machine take part in a run, and if not, exactly why not.

A volunteer asks this before joining, so every section is a measurement or a reading, never a guess presented
as a fact: the device (its backend, cuda, rocm, mps or cpu, chosen as ``--device`` chooses it; name, memory,
matmul TFLOP/s measured by ``peer.compute.device_probe``; the runtime: the CUDA driver against the CUDA torch
was built for, the HIP version of a ROCm build, macOS for MPS; a line for each feature the backend lacks, e.g.
bf16 on MPS before macOS 14, so the volunteer reads a refusal instead of meeting it mid-run), the free disk
where checkpoints go, whether the ports can be listened on, and with ``--dht``: whether a relay of the swarm
can dial this machine back (``CHECK``, ``peer.net.relay``), the clock offset bounded from the peers' heartbeat
times, and the bandwidth to a few peers.
The verdict takes the run's model and precision (the published run record with ``--dht``, else the local
run.toml or the defaults) and says which stages fit this device's memory, by the scheduler's own estimate
(``stage_memory_bytes``), or which stage does not, what it needs, and what would change that.

Bandwidth to peers: a peer's gRPC server serves only peers whose verified advert it trusts, so the doctor
publishes a ``client`` advert (no role, no work: planners, provers and the election read only workers) with its
certificate for the time it measures, then the same timed stream the prober uses (``PeerClient.probe``).
"""

from __future__ import annotations

import ctypes
import math
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tasklet.peer.compute.device_choice import PRECISIONS, backend_of, precision_refusal, runtime_version, torch_device
from tasklet.peer.compute.device_probe import cpu_memory_bytes, measure_device, mps_memory
from tasklet.peer.compute.family import family_of
from tasklet.peer.config import ConfigError, RunConfig, local_paths_from_toml
from tasklet.peer.node.joining import joiner_config
from tasklet.peer.node.planning import workload_for
from tasklet.peer.runtime.spec import RunSpec
from tasklet.scheduler.plan import even_stages

GB = 1e9
LINK_PEERS = 3  # peers a doctor connects to
CONNECT_TIMEOUT_S = 3.0
PROBE_BYTES = 256 * 1024  # as the prober's (peer.node.prober)
PROBE_TIMEOUT_S = 20.0
BANDWIDTH_WAIT_HEARTBEATS = 4  # the peers read adverts every heartbeat: trusted within two, four with DHT delays
CLOCK_READS = 3  # reads of the heartbeats, a heartbeat apart at most, to narrow the offset bound
CLOCK_TOLERANCE_S = 2.0  # an offset beyond this delays a peer's adverts and link reports noticeably


@dataclass
class DoctorOptions:
    """What `peer doctor` is asked to check."""

    dht: list[str] = field(default_factory=list)
    run_id: str = "tasklet"
    secret: str | None = None
    config: str | None = None  # a run.toml; None: ./run.toml when present, else the defaults
    host: str = "127.0.0.1"
    port: int = 0
    dht_port: int = 0
    device: str = "auto"
    measure_seconds: float = 1.0
    max_vram_gb: float | None = None


# ---------------------------------------------------------------------------------------------- device
def _version(text: str | None) -> tuple[int, int] | None:
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except (ValueError, AttributeError):
        return None


def _driver_version() -> int:
    """The CUDA driver's version as the driver API gives it (12040 for 12.4), or 0 when it cannot be read:
    from torch where its build exposes it, else from ``libcuda`` itself (``cuDriverGetVersion``)."""
    try:
        raw = int(torch._C._cuda_getDriverVersion())  # noqa: SLF001 - not in every torch build
        if raw > 0:
            return raw
    except (AttributeError, RuntimeError, TypeError, ValueError):
        pass
    try:
        out = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(out)) == 0:
            return int(out.value)
    except (OSError, AttributeError):
        pass
    return 0


def cuda_versions() -> dict[str, Any]:
    """The CUDA version torch was built for, the driver's, and whether the driver can run it (driver >= build)."""
    built = torch.version.cuda
    raw = _driver_version()
    driver = f"{raw // 1000}.{raw % 1000 // 10}" if raw > 0 else None
    b, d = _version(built), _version(driver)
    match = None if b is None or d is None else d >= b
    return {"torch_cuda": built, "driver_cuda": driver, "match": match}


def check_device(opts: DoctorOptions) -> dict[str, Any]:
    """The device ``--device`` names: its backend (``kind``), name, memory, measured TFLOP/s and runtime, with a
    line per feature it lacks (``refused``: a precision, a memory query) so the volunteer sees why, not a fallback.

    Raises DeviceError (a ValueError) when the backend asked for is not on this machine.
    """
    kind = backend_of(opts.device)
    info = measure_device(opts.device, seconds=opts.measure_seconds)
    out: dict[str, Any] = {"kind": info.kind, "name": info.name, "memory_bytes": info.memory_bytes,
                           "tflops": info.tflops, "runtime": runtime_version(kind)}
    if kind == "cuda":
        out["cuda"] = cuda_versions()
    elif kind == "rocm":
        out["rocm"] = {"hip": torch.version.hip}
    notes: list[str] = []
    if kind == "mps":
        _memory, note = mps_memory()
        if note:
            notes.append(f"memory: {note}")
    target = torch_device(kind, opts.device)
    refused = {p: why for p in PRECISIONS if (why := precision_refusal(p, target)) is not None}
    out["precisions"] = {p: refused.get(p, "ok") for p in PRECISIONS}
    notes += [f"precision {p}: {why}" for p, why in refused.items()]
    out["notes"] = notes
    return out


def memory_section(device: dict[str, Any], max_vram_gb: float | None) -> dict[str, Any]:
    """The memory a plan may use: the device's, capped by ``--max-vram``."""
    total = int(device.get("memory_bytes") or 0)
    usable = total if max_vram_gb is None else min(total, int(max_vram_gb * GB))
    return {"device_gb": round(total / GB, 3), "host_gb": round(cpu_memory_bytes() / GB, 3),
            "max_vram_gb": max_vram_gb, "usable_gb": round(usable / GB, 3), "usable_bytes": usable,
            "shared_with_host": device.get("kind") in ("cpu", "mps")}


# ------------------------------------------------------------------------------------------ disk, ports
def check_disk(config: RunConfig, spec: RunSpec | None) -> dict[str, Any]:
    where = Path(config.swarm.checkpoint_dir or ".").expanduser()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    out: dict[str, Any] = {"path": str(where), "free_gb": round(usage.free / GB, 3)}
    if spec is not None:  # a checkpoint holds every stage's fp32 weights and both AdamW moments
        per_checkpoint = workload_for(spec).total_params * 12
        need = per_checkpoint * config.swarm.checkpoint_keep
        out.update(checkpoint_gb=round(per_checkpoint / GB, 3), keep=config.swarm.checkpoint_keep,
                   need_gb=round(need / GB, 3), ok=usage.free >= need)
    return out


def _listen(host: str, port: int) -> tuple[socket.socket | None, dict[str, Any]]:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(8)
    except OSError as exc:
        return None, {"host": host, "port": port, "ok": False, "error": exc.strerror or str(exc)}
    return sock, {"host": host, "port": sock.getsockname()[1], "ok": True}


# --------------------------------------------------------------------------------------------- verdict
def _stage_row(spec: RunSpec, s: int, a: int, b: int, n_stages: int, usable: int) -> dict[str, Any]:
    # stage s holds n_stages - s micro-batches in flight under 1F1B, as the scheduler counts (memory_violations)
    need = workload_for(spec).stage_memory_bytes(a, b, in_flight=n_stages - s)
    return {"stage": s, "layers": [a, b], "need_gb": round(need / GB, 3), "fits": need <= usable}


def _need(spec: RunSpec, s: int, a: int, b: int, n_stages: int, **changes: Any) -> float:
    from dataclasses import replace

    return workload_for(replace(spec, **changes)).stage_memory_bytes(a, b, in_flight=n_stages - s)


def verdict(spec: RunSpec, usable_bytes: int, stages: list[tuple[int, int]] | None = None,
            source: str = "") -> dict[str, Any]:
    """Which stages of ``spec``'s model this device holds at the run's precision.

    ``stages``: the run's split (its plan); None: the run lets the scheduler choose, so the fewest even stages
    of which this device holds at least one are shown. When no stage fits, the smallest stage the run could
    have is named with its need, and what would make it fit.
    """
    n_layers = workload_for(spec).n_layers
    out: dict[str, Any] = {"model": source, "precision": spec.precision, "micro_batch": spec.micro_batch,
                           "device_gb": round(usable_bytes / GB, 3)}
    if stages is None:
        for n in range(1, n_layers + 1):
            rows = [_stage_row(spec, s, a, b, n, usable_bytes) for s, (a, b) in enumerate(even_stages(n_layers, n))]
            if any(r["fits"] for r in rows):
                break
        out["split"] = "even, the fewest stages of which one fits (the run lets the scheduler choose)"
    else:
        n = len(stages)
        rows = [_stage_row(spec, s, a, b, n, usable_bytes) for s, (a, b) in enumerate(stages)]
        out["split"] = "the run's plan"
    out["stages"] = rows
    fitting = [r["stage"] for r in rows if r["fits"]]
    out["fits"] = fitting
    out["ok"] = bool(fitting)
    if fitting:
        out["summary"] = f"this machine can hold stage(s) {', '.join(map(str, fitting))} of {len(rows)}"
        return out
    worst = min(rows, key=lambda r: r["need_gb"])  # the least demanding stage still does not fit
    a, b = worst["layers"]
    out["why_not"] = (f"stage {worst['stage']} (layers {a}..{b - 1}) needs {worst['need_gb']:.3g} GB at "
                      f"{spec.precision} with micro_batch {spec.micro_batch}; this device has "
                      f"{usable_bytes / GB:.3g} GB")
    out["would_help"] = _remedies(spec, worst["stage"], a, b, n, usable_bytes, worst["need_gb"])
    out["summary"] = out["why_not"]
    return out


def _remedies(spec: RunSpec, s: int, a: int, b: int, n_stages: int, usable: int, need_gb: float) -> list[str]:
    tips = []
    if spec.micro_batch > 1:
        need = _need(spec, s, a, b, n_stages, micro_batch=1)
        tips.append(f"micro_batch 1: this stage would need {need / GB:.3g} GB"
                    + (" (fits)" if need <= usable else " (still too much)"))
    if spec.precision == "fp32":
        need = _need(spec, s, a, b, n_stages, precision="bf16")
        tips.append(f"precision bf16: this stage would need {need / GB:.3g} GB"
                    + (" (fits)" if need <= usable else " (still too much)"))
    if spec.micro_batch > 1 and spec.precision == "fp32":
        need = _need(spec, s, a, b, n_stages, micro_batch=1, precision="bf16")
        tips.append(f"both: {need / GB:.3g} GB" + (" (fits)" if need <= usable else " (still too much)"))
    if b - a > 1:
        tips.append("more stages (fewer layers each): [swarm] stages")
    tips.append(f"a device with at least {math.ceil(need_gb * 10) / 10:g} GB")
    return tips


# ------------------------------------------------------------------------------------------- the swarm
def _clock(reader: Any, heartbeat_s: float) -> dict[str, Any]:
    """This machine's clock minus the swarm's, bounded from heartbeat times: a peer's lag ``now - heartbeat_at``
    is the offset plus the heartbeat's age (0..one heartbeat), so the offset lies in
    [max lag - heartbeat, min lag]; reads a few times to narrow it."""
    from tasklet.peer.swarm.membership import now

    low, high, peers = -math.inf, math.inf, 0
    for i in range(CLOCK_READS):
        if i:
            time.sleep(min(heartbeat_s / CLOCK_READS, 2.0))
        entries = reader.membership.live_entries()
        at = now()
        for e in entries:
            lag = at - e.heartbeat_at
            low, high = max(low, lag - heartbeat_s), min(high, lag)
        peers = max(peers, len(entries))
    if not peers:
        return {"checked": False, "why": "no live peer to compare with"}
    if low > high:
        return {"checked": True, "peers": peers, "offset_s": None, "ok": False,
                "why": "the peers' clocks disagree with each other by more than a heartbeat"}
    offset = (low + high) / 2
    return {"checked": True, "peers": peers, "offset_s": round(offset, 3), "bound_s": round((high - low) / 2, 3),
            "ok": abs(offset) <= CLOCK_TOLERANCE_S + (high - low) / 2}


def _links(entries: list[Any], reader: Any, endpoint: str, heartbeat_s: float) -> list[dict[str, Any]]:
    """A TCP connect, then the bandwidth, to up to LINK_PEERS directly reachable peers."""
    out, direct = [], []
    for e in entries[:LINK_PEERS]:
        a = e.advert
        row: dict[str, Any] = {"peer_id": a.peer_id, "endpoint": a.endpoint, "bandwidth_mbps": None}
        out.append(row)
        if "@" in a.endpoint:
            row.update(ok=None, why="reached through a relay; no direct connect to time")
            continue
        host, _, port = a.endpoint.rpartition(":")
        started = time.perf_counter()
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
                row.update(ok=True, connect_ms=round((time.perf_counter() - started) * 1e3, 2))
            direct.append((row, a))
        except (OSError, ValueError) as exc:
            row.update(ok=False, error=str(exc))
    if direct:
        _bandwidths(direct, reader, endpoint, heartbeat_s)
    return out


def _bandwidths(rows: list[tuple[dict[str, Any], Any]], reader: Any, endpoint: str, heartbeat_s: float) -> None:
    """Publish a ``client`` advert (so the peers trust this doctor's certificate), probe each peer's link, leave."""
    from tasklet.peer.compute.device_probe import DeviceInfo
    from tasklet.peer.net.client import PeerClient
    from tasklet.peer.net.config import TransportConfig
    from tasklet.peer.net.tls import TlsContext
    from tasklet.peer.swarm.adverts import Advert
    from tasklet.peer.timing import now
    from tasklet.protocol.errors import TransportError

    tls = TlsContext(reader.identity)
    tls.trust.set_group("swarm", [a.cert for _, a in rows if a.cert])
    device = DeviceInfo("peer doctor", "cpu", max(1, cpu_memory_bytes()), 0.0, measured=False, emulated=False)
    advert = Advert(reader.identity.peer_id, endpoint, device, now(), role="client", cert=tls.certificate_text)
    reader.membership.announce(advert)
    try:
        deadline = time.monotonic() + BANDWIDTH_WAIT_HEARTBEATS * heartbeat_s + PROBE_TIMEOUT_S
        for row, a in rows:
            config = TransportConfig(tls=tls, bulk_port=None)
            with PeerClient(a.endpoint, config, sender=reader.identity.peer_id, expect_peer=a.peer_id) as client:
                while True:  # refused until the peer has read our advert (a heartbeat or two)
                    try:
                        bps = client.probe(PROBE_BYTES, timeout_s=max(1.0, deadline - time.monotonic()))
                        row["bandwidth_mbps"] = round(bps / 1e6, 2)
                        break
                    except TransportError as exc:
                        if time.monotonic() + heartbeat_s / 2 > deadline:
                            row["bandwidth_error"] = str(exc)[:300]
                            break
                        time.sleep(heartbeat_s / 2)
    finally:
        reader.membership.leave()


def _reachability(relays: list[str], port: int) -> dict[str, Any]:
    from tasklet.peer.net.relay import check_reachable

    if not relays:
        return {"checked": False, "why": "no peer of the swarm offers a relay (--relay-port) to dial this one back"}
    try:
        is_open, seen = check_reachable(relays[0], port)
    except (OSError, ValueError) as exc:
        return {"checked": False, "relay": relays[0], "why": f"cannot ask relay {relays[0]}: {exc}"}
    return {"checked": True, "relay": relays[0], "seen_as": seen, "port": port, "open": is_open,
            "path": "direct" if is_open else "relayed (nobody can dial this port; a relay will carry its traffic)"}


def _swarm(opts: DoctorOptions, grpc_port: int) -> tuple[dict[str, Any], RunConfig | None, list | None]:
    """Reachability, clock and links from the swarm, and the published run's config and stage split."""
    from tasklet.peer.swarm.dht import DHTStartError
    from tasklet.peer.swarm.membership import SwarmSecretError, verify_swarm_secret
    from tasklet.peer.swarm.status import StatusReader

    try:
        reader = StatusReader(list(opts.dht), opts.run_id, opts.secret)
    except DHTStartError as exc:
        raise ConfigError(f"--dht: {exc}") from None
    with reader:
        try:
            record = verify_swarm_secret(reader.dht, opts.run_id, opts.secret)
        except SwarmSecretError as exc:
            raise ConfigError(str(exc)) from None
        config = None
        if record is not None:  # the record's settings with this machine's own paths (--config), never the record's
            own = local_paths_from_toml(opts.config) if opts.config else {}
            config = joiner_config(record.config, own, opts.run_id)
        entries = [e for e in reader.live_entries() if e.advert.role != "client"]
        latest = reader.latest_plan()
        stages = latest.plan.get("stages") if latest is not None else None
        heartbeat = config.swarm.heartbeat_s if config is not None else RunConfig().swarm.heartbeat_s
        relays = [e.advert.relay for e in entries if e.advert.relay]
        found = {"reachability": _reachability(relays, grpc_port), "clock": _clock(reader, heartbeat),
                 "links": _links(entries, reader, f"{opts.host}:{grpc_port}", heartbeat), "peers": len(entries)}
    return found, config, stages


# ------------------------------------------------------------------------------------------------ report
def _local_config(path: str | None) -> tuple[RunConfig, str]:
    if path is None and Path("run.toml").exists():
        path = "run.toml"
    if path is None:
        return RunConfig(), "the defaults (no run.toml)"
    return RunConfig.load(path), path


def run_doctor(opts: DoctorOptions) -> dict[str, Any]:
    """Every check; the keys are device, memory, disk, ports, reachability, clock, links, verdict."""
    grpc_sock, grpc = _listen(opts.host, opts.port)
    dht_sock, dht = _listen(opts.host, opts.dht_port)
    try:
        report: dict[str, Any] = {"ports": {"grpc": grpc, "dht": dht}}
        stages = None
        if opts.dht:
            if grpc_sock is None:
                found = {"reachability": {"checked": False, "why": "the gRPC port cannot be listened on"},
                         "clock": {"checked": False}, "links": [], "peers": 0}
                config, where = _local_config(opts.config)
            else:
                found, config, stages = _swarm(opts, grpc["port"])
                where = f"run {opts.run_id!r} from the DHT"
                if config is None:
                    raise ConfigError(f"no run named {opts.run_id!r} is published in this DHT (wrong --run?)")
            report.update(reachability=found["reachability"], clock=found["clock"], links=found["links"])
        else:
            config, where = _local_config(opts.config)
            why = "needs --dht (a swarm to ask)"
            report.update(reachability={"checked": False, "why": why}, clock={"checked": False, "why": why},
                          links=[])
    finally:
        for sock in (grpc_sock, dht_sock):
            if sock is not None:
                sock.close()
    spec = config.spec()
    device = check_device(opts)
    memory = memory_section(device, opts.max_vram_gb)
    split = [(int(a), int(b)) for a, b in stages] if stages else (
        even_stages(workload_for(spec).n_layers, config.swarm.stages) if config.swarm.stages else None)
    source = family_of(spec.model).describe(spec.model)
    judged = verdict(spec, memory["usable_bytes"], split, source)
    refusal = device["precisions"].get(spec.precision, "ok")
    if refusal != "ok":  # the memory may suffice, but this device cannot compute in the run's precision at all
        judged.update(ok=False, fits=[], summary=f"this device cannot run precision {spec.precision}: {refusal}")
    report.update(device=device, memory=memory, disk=check_disk(config, spec), verdict={**judged, "config": where})
    return {k: report[k] for k in ("device", "memory", "disk", "ports", "reachability", "clock", "links", "verdict")}


def format_report(report: dict[str, Any]) -> str:
    d, m, disk, v = report["device"], report["memory"], report["disk"], report["verdict"]
    tf = "not measured" if d.get("tflops") is None else f"{d['tflops']:.4g} TFLOP/s (measured)"
    lines = [f"device        {d['kind']}: {d['name']}, {m['device_gb']:.3g} GB, {tf}",
             f"runtime       {d['runtime']}"]
    lines += [f"refused       {note}" if note.startswith("precision") else f"note          {note}"
              for note in d.get("notes", [])]
    if "cuda" in d:
        c = d["cuda"]
        lines.append(f"cuda          torch built for {c['torch_cuda']}, driver {c['driver_cuda']}: "
                     + {True: "ok", False: "DRIVER TOO OLD", None: "unknown"}[c["match"]])
    if m["max_vram_gb"] is not None:
        lines.append(f"memory        --max-vram {m['max_vram_gb']:g}: plans use at most {m['usable_gb']:.3g} GB")
    lines.append(f"disk          {disk['free_gb']:.3g} GB free at {disk['path']}"
                 + (f" (checkpoints need {disk['need_gb']:.3g} GB)" if "need_gb" in disk else ""))
    for name, p in report["ports"].items():
        lines.append(f"port {name:8} {p['host']}:{p['port']} " + ("ok" if p["ok"] else f"cannot listen: {p['error']}"))
    r, c = report["reachability"], report["clock"]
    lines.append("reachability  " + (r.get("path", "") + f" (relay {r['relay']} sees {r['seen_as']})"
                                      if r.get("checked") else f"not checked: {r.get('why')}"))
    lines.append("clock         " + (f"offset {c['offset_s']:+.3f} s (+-{c['bound_s']:.3f})"
                                      if c.get("offset_s") is not None else f"not checked: {c.get('why')}"))
    for link in report["links"]:
        bw = link.get("bandwidth_mbps")
        speed = f", {bw} Mbit/s" if bw is not None else f", bandwidth not measured: {link.get('bandwidth_error')}"
        lines.append(f"link          {link['peer_id'][:12]} {link['endpoint']}: "
                     + (f"connect {link['connect_ms']} ms{speed}" if link.get("ok")
                        else link.get("error") or link.get("why")))
    lines.append(f"verdict       {v['summary']} ({v['model']}, {v['precision']}; config: {v['config']})")
    for row in v["stages"]:
        lines.append(f"  stage {row['stage']} layers {row['layers'][0]}..{row['layers'][1] - 1}: needs "
                     f"{row['need_gb']:.3g} GB " + ("fits" if row["fits"] else "does not fit"))
    for tip in v.get("would_help", []):
        lines.append(f"  would help: {tip}")
    return "\n".join(lines)
