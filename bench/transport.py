"""Transport benchmark: stream throughput of large tensors on loopback, unshaped and through emulated links.

    python -m bench.transport            # a table
    python -m bench.transport --json     # {"unshaped_gbps": X, "plaintext_gbps": P, "tls_cost_pct": C,
                                         #  "shaped": [{"rate_mbps": R, "achieved_mbps": Y,
                                         #   "latency_ms": L, "achieved_latency_ms": M}, ...]}

What is measured, and why it is honest:

* Sender and receiver are separate processes (as peers are), each with one torch thread, talking gRPC over
  127.0.0.1. Each message is a float32 tensor that the sender encodes (protocol.codec) and pushes, and the
  receiver reassembles, checks and decodes (dtype, shape, size, NaN/inf), i.e. tensor in to tensor out.
* Unshaped throughput: tensor bytes / wall time of a stream of pushes with up to `max_inflight_pushes` in
  flight, from the first encode to the last acknowledgement; the median of several trials.
* Encryption: every figure is over mutual TLS (the default everywhere; each process has its own identity and
  trusts the other's certificate). The receiver also serves a plaintext port (TransportConfig(tls=None), a
  baseline only); the unshaped stream runs against both in the same run, trials interleaved, and
  ``tls_cost_pct`` is 100 x (1 - TLS / plaintext). Target (issue #12): at most 15%.
* Shaped rate: the receiver timestamps the arrival of each message; the achieved rate is the tensor bytes of
  all messages but the first divided by the time between the first and the last arrival, which is the
  link's throughput in steady state, free of its latency.
* Shaped latency: one-way time from the start of a push of a small tensor (1 KiB) to its arrival in the
  receiver's handler, on an idle link, median of several; both processes read the same CLOCK_MONOTONIC.
  It includes loopback gRPC, (de)serialisation and the small message's own transmission time. The shapers
  are calibrated first: the same measurement without shaping gives the transport's own latency (about
  2 ms here), which each shaper subtracts from its hold time (LinkShaper.base_delay_s), so that the
  end-to-end latency is the configured one. The table prints that base latency.

Targets (issue #3): unshaped >= 3 Gbit/s; shaped >= 90% of the configured rate, latency within 2 ms + 5%.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from peer.net import PeerClient, PeerServer, TransportConfig
from peer.net.shaping import LinkShaper
from peer.net.tls import process_tls
from protocol import tasklet_pb2 as pb
from protocol.codec import decode_tensor, encode_tensor

LIMITS = dict(max_message_bytes=8 << 20, chunk_bytes=4 << 20, max_envelope_bytes=256 << 20)
CONFIG = TransportConfig(**LIMITS)  # this process's TLS identity (peer.net.tls.process_tls)
PLAINTEXT = TransportConfig(**LIMITS, tls=None)
DEFAULT_LINKS = ((10.0, 40.0), (100.0, 10.0), (1000.0, 2.0))  # (Mbit/s, one-way ms)


@dataclass(frozen=True)
class BenchConfig:
    tensor_mib: int = 16  # size of each message in the unshaped stream
    unshaped_mib: int = 512  # per trial
    trials: int = 3
    shaped_seconds: float = 2.0  # planned duration of each shaped stream
    latency_samples: int = 15
    links: tuple[tuple[float, float], ...] = DEFAULT_LINKS


def _receiver(conn: Connection) -> None:
    """Child process: a PeerServer whose handler decodes every tensor and logs its arrival."""
    torch.set_num_threads(1)
    arrivals: list[tuple[float, int, float]] = []

    def on_push(env: pb.Envelope) -> None:
        nbytes = sum(decode_tensor(t).numel() * 4 for t in env.tensors)
        arrivals.append((time.monotonic(), nbytes, float(env.meta.get("sent_at", "nan"))))

    def status() -> dict[str, Any]:
        log = list(arrivals)
        arrivals.clear()
        return {"arrivals": log}

    tls = process_tls()
    server, plain = PeerServer(CONFIG), PeerServer(PLAINTEXT)
    for srv in (server, plain):
        srv.register_push("ACTIVATION", on_push)
        srv.set_status_provider(status)
    conn.send((server.start(), plain.start(), tls.certificate_text))
    try:
        tls.trust_only([conn.recv()])  # the sender's certificate: the one peer this receiver accepts
        conn.poll(3600)  # until the parent says stop (or goes away)
    finally:
        server.stop(grace=1.0)
        plain.stop(grace=1.0)


def _envelope(t: torch.Tensor) -> pb.Envelope:
    env = pb.Envelope(kind=pb.ACTIVATION)
    env.meta["sent_at"] = repr(time.monotonic())
    encode_tensor("x", t, out=env.tensors.add())
    return env


def _stream(client: PeerClient, tensor: torch.Tensor, count: int, timeout_s: float) -> float:
    """Push `count` copies of `tensor`, pipelined; return the wall time from first encode to last ack."""
    start = time.monotonic()
    futures = [client.push_async(_envelope(tensor), timeout_s) for _ in range(count)]
    for future in futures:
        future.result(timeout=timeout_s)
    return time.monotonic() - start


def unshaped_gbps(endpoints: dict[str, tuple[str, TransportConfig]], cfg: BenchConfig) -> dict[str, float]:
    """Median throughput per path (name -> endpoint, config), trials interleaved so load hits all alike."""
    tensor = torch.randn(cfg.tensor_mib << 20 >> 2)
    count = max(2, cfg.unshaped_mib // cfg.tensor_mib)
    clients = {name: PeerClient(ep, config) for name, (ep, config) in endpoints.items()}
    rates: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for client in clients.values():
            client.push(_envelope(tensor), 60)  # warm up the connection and both processes' allocators
        for _ in range(cfg.trials):
            for name, client in clients.items():
                rates[name].append(8 * count * tensor.numel() * 4 / _stream(client, tensor, count, 120) / 1e9)
        next(iter(clients.values())).status(timeout_s=10)  # drop the arrival log
    finally:
        for client in clients.values():
            client.close()
    return {name: statistics.median(r) for name, r in rates.items()}


def _small_push_latencies(client: PeerClient, samples: int, gap_s: float) -> list[float]:
    """One-way latencies of small pushes on an idle link (send time to arrival in the receiver's handler)."""
    client.status(timeout_s=10)  # drop older arrivals
    small = torch.randn(256)
    for _ in range(samples):
        client.push(_envelope(small), 10)
        time.sleep(gap_s)  # let the link go idle: the latency of an unloaded link
    return [arrived - sent for arrived, _, sent in client.status(timeout_s=10)["arrivals"]]


def base_latency_s(endpoint: str, cfg: BenchConfig) -> float:
    """The transport's own one-way latency on loopback (unshaped), used to calibrate the shapers."""
    with PeerClient(endpoint, CONFIG) as client:
        return statistics.median(_small_push_latencies(client, cfg.latency_samples, 0.01))


def shaped_link(endpoint: str, rate_mbps: float, latency_ms: float, cfg: BenchConfig) -> tuple[dict[str, float], float]:
    """Measure one emulated link; return its row of the result and the base latency it was calibrated with."""
    base_s = base_latency_s(endpoint, cfg)  # right before: the machine's load changes the transport's latency
    shaper = LinkShaper(rate_mbps * 1e6, latency_ms / 1e3, base_delay_s=base_s)
    with PeerClient(endpoint, CONFIG, shaper=shaper) as client:
        lat = _small_push_latencies(client, cfg.latency_samples, 0.01 + latency_ms / 1e3)

        total_bytes = rate_mbps * 1e6 / 8 * cfg.shaped_seconds
        tensor_bytes = int(min(4 << 20, max(64 << 10, total_bytes / 16)))
        tensor = torch.randn(tensor_bytes // 4)
        count = max(4, int(total_bytes // tensor_bytes))
        _stream(client, tensor, count, cfg.shaped_seconds * 10 + 30)
        arrivals = client.status(timeout_s=10)["arrivals"]
    # Steady-state rate at the receiver: the bytes that arrived after the first message, over the time they
    # took (the link's latency falls out; messages leave the link in FIFO order, see peer.net.shaping).
    times = [a[0] for a in arrivals]
    after_first = sum(a[1] for a in arrivals[1:])
    achieved = 8 * after_first / (max(times) - min(times)) / 1e6
    row = {
        "rate_mbps": rate_mbps,
        "achieved_mbps": round(achieved, 2),
        "latency_ms": latency_ms,
        "achieved_latency_ms": round(statistics.median(lat) * 1e3, 3),
    }
    return row, base_s


def run(cfg: BenchConfig) -> tuple[dict[str, Any], list[float]]:
    """Run the benchmark; return the result (the JSON of the issue) and each link's calibrated base latency."""
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the receiver process did not start within 60 s")
        tls_port, plain_port, receiver_cert = parent.recv()
        process_tls().trust_only([receiver_cert])
        parent.send(process_tls().certificate_text)
        endpoint = f"{CONFIG.host}:{tls_port}"
        paths = {"tls": (endpoint, CONFIG), "plaintext": (f"{CONFIG.host}:{plain_port}", PLAINTEXT)}
        rates = unshaped_gbps(paths, cfg)
        result: dict[str, Any] = {
            "unshaped_gbps": round(rates["tls"], 3),
            "plaintext_gbps": round(rates["plaintext"], 3),
            "tls_cost_pct": round(100 * (1 - rates["tls"] / rates["plaintext"]), 1),
            "shaped": [],
        }
        bases = []
        for rate_mbps, latency_ms in cfg.links:
            row, base_s = shaped_link(endpoint, rate_mbps, latency_ms, cfg)
            result["shaped"].append(row)
            bases.append(base_s)
        return result, bases
    finally:
        parent.send("stop")
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


def _table(result: dict[str, Any], bases: list[float], cfg: BenchConfig) -> str:
    lines = [
        f"unshaped loopback, mutual TLS: {result['unshaped_gbps']:.2f} Gbit/s "
        f"({cfg.tensor_mib} MiB float32 tensors, encode + push + decode, median of {cfg.trials}; target >= 3)",
        f"unshaped loopback, plaintext:  {result['plaintext_gbps']:.2f} Gbit/s (baseline, same run, trials "
        f"interleaved); encryption costs {result['tls_cost_pct']:.1f}% (target <= 15%)",
        "base ms: the transport's own one-way latency (unshaped small push, median), measured before each link;"
        " its shaper holds messages for the configured latency less this",
        "",
        f"{'rate Mbit/s':>12} {'achieved':>10} {'%':>6} {'latency ms':>11} {'achieved':>9} {'error ms':>9} "
        f"{'allowed':>8} {'base ms':>8}",
    ]
    for row, base_s in zip(result["shaped"], bases, strict=True):
        allowed = 2.0 + 0.05 * row["latency_ms"]
        err = row["achieved_latency_ms"] - row["latency_ms"]
        pct = 100 * row["achieved_mbps"] / row["rate_mbps"]
        lines.append(
            f"{row['rate_mbps']:>12g} {row['achieved_mbps']:>10.2f} {pct:>6.1f}"
            f" {row['latency_ms']:>11g} {row['achieved_latency_ms']:>9.2f} {err:>9.2f} {allowed:>8.2f}"
            f" {base_s * 1e3:>8.2f}"
        )
    lines.append("(targets: achieved >= 90% of the rate; |latency error| <= 2 ms + 5%)")
    return "\n".join(lines)


def _links(text: str) -> tuple[tuple[float, float], ...]:
    pairs = []
    for item in text.split(","):
        rate, _, latency = item.partition("@")
        pairs.append((float(rate), float(latency or 0.0)))
    return tuple(pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tasklet transport benchmark (loopback gRPC, link emulation)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument("--quick", action="store_true", help="small volumes (a smoke run, figures are rough)")
    parser.add_argument(
        "--links",
        type=_links,
        default=DEFAULT_LINKS,
        help="shaped links as RATE_MBPS@LATENCY_MS,... (default 10@40,100@10,1000@2)",
    )
    args = parser.parse_args(argv)
    cfg = BenchConfig(links=args.links)
    if args.quick:
        cfg = BenchConfig(
            tensor_mib=4, unshaped_mib=32, trials=1, shaped_seconds=0.3, latency_samples=3, links=args.links
        )
    result, bases = run(cfg)
    print(json.dumps(result) if args.json else _table(result, bases, cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
