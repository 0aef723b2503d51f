"""The `peer` command: start or join a swarm, watch it, or run a whole local swarm.

Errors a user can fix (a bad address, a port in use, a bad config, a wrong secret) end with one line
``peer: error: ...`` and exit status 2; a run that fails after it started exits with 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from tasklet.peer.config import (
    SECRET_ENV,
    ConfigError,
    RunConfig,
    example_toml,
    local_paths_from_toml,
    reference_markdown,
    resolve_secret,
)
from tasklet.peer.observe.logs import clean, log_formatter
from tasklet.peer.runtime.choices import PSEUDO_GRAD_COMPRESSIONS

DESCRIPTION = """\
Tasklet peer: train a transformer language model together with other volunteers' GPUs.

  peer start --config run.toml     be the first peer of a new swarm (prints the join line)
  peer join --dht ADDR             give this machine's GPU (or CPU) to a running swarm
  peer status --dht ADDR           show the swarm: peers, plan, step, loss, throughput
  peer credits --dht ADDR          each identity's verified work, as the leader signed it (--me: only yours)
  peer dashboard --dht ADDR --port 8080
                                   the same in a browser: peers, plan, links, loss, events
  peer swarm --peers 4 --scenario worldwide_geo_distributed --steps 5
                                   a whole swarm on this machine, on an emulated network
  peer doctor [--dht ADDR]         can this machine take part, and if not why (device, ports, verdict)
  peer pause / peer resume         step this machine out of the swarm without penalty, and back in
  peer identity export --identity KEY --backup FILE
                                   back the peer's key up (`peer identity import` restores it)
  peer init run.toml               write a run.toml with every option and its default
  peer swarm ... --model tiny-llama --tokenizer DIR --data FILE.jsonl
                                   train a Hugging Face model (preset, config.json or folder)
  peer export RESULT_DIR OUT_DIR   write a trained run as a Hugging Face folder (from_pretrained loads it)
  peer generate --model DIR --prompt TEXT
                                   sample text from an exported model
"""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not in 0..65535")
    return value


def _schedule(text: str):  # noqa: ANN202 - peer.node.schedule.Schedule (a small module: parsing stays fast)
    from tasklet.peer.node.schedule import ScheduleError, parse_schedule

    try:
        return parse_schedule(text)
    except ScheduleError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bulk_port(text: str) -> int | None:
    return None if text == "off" else _port(text)


def _add_peer_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the gRPC server listens on; 0.0.0.0 for all interfaces (default: %(default)s)",
    )
    g.add_argument("--port", type=_port, default=0, help="gRPC port; 0 picks a free one (default: %(default)s)")
    g.add_argument(
        "--bulk-port",
        type=_bulk_port,
        default=0,
        metavar="PORT",
        help="TCP port of the bulk lane: large tensors pushed to this peer outside gRPC, with the same mutual TLS "
        "and checks and fewer copies; 0 picks a free one, 'off' turns it off. Behind port forwarding, forward it "
        "as the same port number, or peers fall back to gRPC (default: %(default)s)",
    )
    g.add_argument("--dht-host", default="127.0.0.1", help="address the DHT node listens on (default: %(default)s)")
    g.add_argument("--dht-port", type=_port, default=0, help="DHT port; 0 picks a free one (default: %(default)s)")
    g.add_argument(
        "--announce",
        default=None,
        metavar="HOST:PORT",
        help="address other peers should use to reach this peer's gRPC server, when it differs from "
        "--host:--port (NAT port forwarding, containers); default: --host:--port, or with --host 0.0.0.0 on "
        "`peer join` the address a relay of the swarm sees. A peer nobody can dial (NAT) is found out and "
        "reached through a relay",
    )
    g.add_argument(
        "--relay-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="offer a relay for peers behind NAT on this TCP port of --host (a third port to open; needs an "
        "address others can dial; default: off)",
    )
    g = p.add_argument_group("identity and access")
    g.add_argument(
        "--identity",
        default=None,
        metavar="FILE",
        help="private key file; created if missing, so a restarted peer keeps its id (default: a new key each run)",
    )
    g.add_argument("--secret", default=None, help=SECRET_HELP)
    g.add_argument("--secret-file", default=None, metavar="FILE", help=SECRET_FILE_HELP)
    g = p.add_argument_group("device")
    g.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "rocm", "mps", "cpu"],  # device_choice.DEVICE_CHOICES (kept torch-free here)
        help="compute device: cuda (NVIDIA), rocm (AMD, torch's ROCm build), mps (Apple) or cpu; auto takes the "
        "first of cuda/rocm, mps, cpu present (default: %(default)s)",
    )
    g.add_argument(
        "--emulate-tflops",
        type=_positive_float,
        default=None,
        metavar="X",
        help="declare X TFLOP/s instead of measuring, and stretch compute to it (local swarms; default: measure)",
    )
    g.add_argument(
        "--emulate-device",
        type=int,
        default=None,
        metavar="I",
        help="in a run with an [emulation] scenario: emulate its I-th device's links and speed (default: none)",
    )
    g.add_argument(
        "--measure-seconds",
        type=_positive_float,
        default=1.0,
        help="time spent measuring the device's matmul speed (default: %(default)s)",
    )
    g = p.add_argument_group("owner limits (the plan respects them; none is punished)")
    g.add_argument("--max-vram", type=_positive_float, default=None, metavar="GB",
                   help="plan at most this much of the device's memory for this peer (default: all of it)")
    g.add_argument("--max-upload", type=_positive_float, default=None, metavar="MBIT",
                   help="send at most this many Mbit/s in total (enforced by the transport; the plan prices this "
                   "peer's links by it) (default: no limit)")
    g.add_argument("--max-download", type=_positive_float, default=None, metavar="MBIT",
                   help="take in at most this many Mbit/s in total (enforced by the transport: it reads the next "
                   "chunk when the limit allows, and flow control holds the senders back; the plan prices links to "
                   "this peer by it) (default: no limit)")
    g.add_argument("--schedule", type=_schedule, default=None, metavar="HH:MM-HH:MM[,...]",
                   help="take part only in these daily windows of local time (e.g. 22:00-08:00): outside them the "
                   "peer pauses as `peer pause` does and the leader plans around its leaving (default: always)")
    g.add_argument("--state-dir", default=None, metavar="DIR",
                   help="folder of this peer's owner-only control socket for `peer pause` / `peer resume` "
                   "(default: the --identity file's folder; without --identity: no control socket)")
    g = p.add_argument_group("monitoring")
    g.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics on --host; 0 picks a free port (default: off)",
    )
    g.add_argument(
        "--dashboard-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve the swarm dashboard (as `peer dashboard`) on --host at this port (default: off)",
    )
    g.add_argument(
        "--json-log",
        action="store_true",
        help="write every log record and every phase event on stderr as one JSON object per line, for machines, "
        "instead of the human lines and bars: ts, level, logger, msg; a phase event (measuring, waiting for a "
        "plan, fetching, training, done, left) adds event, phase, reason and its figures (bytes_done, "
        "bytes_total, bytes_per_s, eta_s, steps_per_s, tokens_per_s, busy_share, ...) (default: off)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging detail on stderr (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peer", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "start",
        help="start a new swarm from a run.toml and print the join line",
        description="Be the first peer: create the DHT, publish the run, train.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="the run.toml (see `peer init`)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in [swarm] checkpoint_dir (default: start fresh)",
    )
    _add_peer_options(p)

    p = sub.add_parser(
        "join", help="join a running swarm", description="Join a swarm and train with it until the run is done."
    )
    p.add_argument(
        "--dht",
        required=True,
        nargs="+",
        metavar="ADDR",
        help="multiaddr(s) of any peer of the swarm, as printed by `peer start`",
    )
    p.add_argument("--run", default="tasklet", help="run name ([run] run_id) to join (default: %(default)s)")
    p.add_argument("--organiser", default=None, metavar="PEER_ID",
                   help="the organiser's peer id, as the join line names it: only a run record that this peer "
                   "signed is accepted (default: the only organiser the DHT names, trusted at first sight)")
    g = p.add_argument_group("this peer's files (the run names none; it checks their fingerprints)")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="a run.toml of which only the local paths are read ([run] corpus, tokenizer, [model] config, "
                   "[swarm] checkpoint_dir, save_dir, [log] tensorboard_dir, [emulation] scenario); the flags "
                   "below override it (default: none)")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="training text: a text, JSONL or Parquet file or a folder (default: the standard library)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local tokenizer folder (AutoTokenizer) (default: byte-level)")
    g.add_argument("--model", default=None, metavar="DIR|CONFIG|PRESET",
                   help="this peer's copy of the run's Hugging Face model (default: the run's preset, or the byte GPT)")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where this peer keeps checkpoint copies, and writes checkpoints if it leads (default: "
                   "STATE_DIR/checkpoints with a --state-dir or --identity, else none)")
    g.add_argument("--save-dir", default=None, metavar="DIR",
                   help="where this peer writes the final parameters if it leads at the end (default: none)")
    _add_peer_options(p)

    p = sub.add_parser(
        "status",
        help="show a swarm's peers, plan and progress",
        description="Join the DHT as a read-only client and print the swarm.",
    )
    p.add_argument("--dht", required=True, nargs="+", metavar="ADDR", help="multiaddr(s) of any peer")
    p.add_argument("--run", default="tasklet", help="run name (default: %(default)s)")
    p.add_argument("--secret", default=None, help=SECRET_HELP)
    p.add_argument("--secret-file", default=None, metavar="FILE", help=SECRET_FILE_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table (default: off)")
    p.add_argument(
        "--watch",
        type=_positive_float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS until interrupted (default: print once; bare --watch: 2 s)",
    )
    p.add_argument("--me", default=None, metavar="IDENTITY|PEER_ID", help=ME_HELP)

    p = sub.add_parser(
        "credits",
        help="each peer identity's verified contribution, as the leader signed it",
        description="Join the DHT as a read-only client and print the leader's signed contribution record: per "
        "identity, the micro-batches of applied steps its pipelines committed, steps, plans, training seconds "
        "and exclusions. The leader is believed: it signs the record, and it can lie.",
    )
    p.add_argument("--dht", required=True, nargs="+", metavar="ADDR", help="multiaddr(s) of any peer")
    p.add_argument("--run", default="tasklet", help="run name (default: %(default)s)")
    p.add_argument("--secret", default=None, help=SECRET_HELP)
    p.add_argument("--secret-file", default=None, metavar="FILE", help=SECRET_FILE_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table (default: off)")
    p.add_argument("--me", default=None, metavar="IDENTITY|PEER_ID", help=ME_HELP)

    p = sub.add_parser(
        "dashboard",
        help="serve a web page showing a swarm live (peers, plan, links, loss, events)",
        description="Join the DHT as a read-only client (like `peer status`) and serve the swarm as a web page "
        "at / and as JSON at /api/swarm. The page needs no internet access.",
    )
    p.add_argument("--dht", required=True, nargs="+", metavar="ADDR", help="multiaddr(s) of any peer")
    p.add_argument("--port", type=_port, default=8080, help="HTTP port; 0 picks a free one (default: %(default)s)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to serve on; 0.0.0.0 for every interface (default: %(default)s)"
    )
    p.add_argument("--run", default="tasklet", help="run name (default: %(default)s)")
    p.add_argument("--secret", default=None, help=SECRET_HELP)
    p.add_argument("--secret-file", default=None, metavar="FILE", help=SECRET_FILE_HELP)
    p.add_argument(
        "--interval", type=_positive_float, default=2.0, help="seconds between reads of the DHT (default: %(default)s)"
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging detail on stderr (default: %(default)s)",
    )

    p = sub.add_parser(
        "swarm",
        help="run a whole swarm on this machine on an emulated network",
        description="Start N local peer processes emulating a scenario's devices and links, train, "
        "and print what happened.",
    )
    p.add_argument("--peers", type=int, required=True, help="number of peer processes")
    p.add_argument(
        "--scenario",
        required=True,
        metavar="NAME|FILE[:NAME]",
        help="network scenario: a bundled name (e.g. worldwide_geo_distributed) or a JSON file",
    )
    p.add_argument("--steps", type=int, default=5, help="training steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data order (default: %(default)s)")
    p.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="write every stage's final parameters and run.json here (default: a temporary folder)",
    )
    p.add_argument("--stages", type=int, default=0, help="pipeline stages; 0: the scheduler chooses (default: 0)")
    p.add_argument(
        "--bandwidth-scale",
        type=_positive_float,
        default=0.01,
        help="multiplies the scenario's bandwidths so a CPU-sized model feels them (default: %(default)s)",
    )
    p.add_argument(
        "--tflops", type=_positive_float, default=0.002, help="emulated TFLOP/s of each device (default: %(default)s)"
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=900.0,
        help="stop the swarm after this many seconds (default: %(default)s)",
    )
    p.add_argument("--log-dir", default=None, help="peer logs go here (default: a temporary folder)")
    p.add_argument("--model", default="", metavar="DIR|CONFIG|PRESET",
                   help="a Hugging Face model: a folder (config.json + safetensors), a config.json, or a preset "
                   "(tiny-llama, tiny-gpt2, llama-3.2-1b, llama-3-8b, gpt3-xl) (default: the byte-level GPT)")
    p.add_argument("--tokenizer", default="", metavar="DIR",
                   help="a local tokenizer folder (AutoTokenizer) (default: byte-level)")
    p.add_argument("--data", default="stdlib", metavar="PATH",
                   help="training text: a text, JSONL or Parquet file or a folder (default: the standard library)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="field of JSONL records / Parquet rows holding the text (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--sync-period", type=int, default=1, metavar="H",
                   help="1: exact gradient averaging every step; H > 1: DiLoCo, an outer round every H steps "
                   "(default: %(default)s)")
    p.add_argument("--outer-lr", type=_positive_float, default=0.7,
                   help="DiLoCo outer learning rate (default: %(default)s)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="DiLoCo outer Nesterov momentum, in [0, 1) (default: %(default)s)")
    p.add_argument("--pseudo-grad-compression", default="none", choices=PSEUDO_GRAD_COMPRESSIONS,
                   help="DiLoCo pseudo-gradients on the wire; topk, topk2, topk4 (one entry per block of 64, "
                        "fp32 / 2-bit / 4-bit) go with error feedback (default: %(default)s)")

    p = sub.add_parser(
        "export",
        help="write a trained run as a Hugging Face model folder",
        description="Merge the stages of a result folder (`peer swarm --save`, [swarm] save_dir) into config.json, "
        "model.safetensors and the tokenizer's files, loadable with AutoModelForCausalLM.from_pretrained.",
    )
    p.add_argument("result_dir", help="the run's result folder (run.json + stage-*.pt)")
    p.add_argument("out_dir", help="the Hugging Face folder to write")

    p = sub.add_parser(
        "generate",
        help="sample text from a Hugging Face model folder",
        description="Load a local model folder (e.g. written by `peer export`) and print a sampled continuation.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="a local Hugging Face model folder")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens to sample (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--temperature", type=_positive_float, default=1.0, help="sampling temperature (default: 1.0)")

    p = sub.add_parser(
        "doctor",
        help="check whether this machine can take part in a run, and if not why",
        description="Measure this machine (device, memory, disk, ports) and, with --dht, how the swarm reaches it "
        "(dial-back through a relay, clock offset, connects to a few peers); then say which stages of the run's "
        "model fit this device at the run's precision, or which stage does not, what it needs and what would help.",
    )
    p.add_argument("--dht", default=[], nargs="+", metavar="ADDR",
                   help="multiaddr(s) of any peer: check against that swarm's run (default: the local run.toml)")
    p.add_argument("--run", default="tasklet", help="run name with --dht (default: %(default)s)")
    p.add_argument("--secret", default=None, help=SECRET_HELP)
    p.add_argument("--secret-file", default=None, metavar="FILE", help=SECRET_FILE_HELP)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the run.toml to judge without --dht (default: ./run.toml if present, else the defaults)")
    p.add_argument("--host", default="127.0.0.1", help="address the peer would listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=0, help="gRPC port to try; 0: any free one (default: 0)")
    p.add_argument("--dht-port", type=_port, default=0, help="DHT port to try; 0: any free one (default: 0)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "rocm", "mps", "cpu"],
                   help="compute device to check, as peer start takes it (default: %(default)s)")
    p.add_argument("--measure-seconds", type=_positive_float, default=1.0,
                   help="time spent measuring the device's matmul speed (default: %(default)s)")
    p.add_argument("--max-vram", type=_positive_float, default=None, metavar="GB",
                   help="judge as `peer join --max-vram GB` would plan (default: the whole device)")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a report)")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="logging detail on stderr (default: %(default)s)")

    for name, what in (("pause", "leave the swarm at the next step boundary, without penalty, until `peer resume`"),
                       ("resume", "rejoin the swarm after `peer pause`")):
        p = sub.add_parser(name, help=f"{what} (a peer running on this machine)",
                           description=f"Ask the peer running on this machine, through its owner-only control "
                           f"socket, to {what}.")
        p.add_argument("--state-dir", default=None, metavar="DIR",
                       help="the peer's state folder, as given to `peer join` (default: ~/.tasklet)")
        p.add_argument("--peer", default=None, metavar="ID",
                       help="which peer, when several run from that folder (default: the only one)")

    p = sub.add_parser("identity", help="show, back up or restore this peer's identity (its key and peer id)",
                       description="A peer's id is its key's: back the --identity file up, and restore it after a "
                       "reinstall, so the peer is the same peer to the swarm. The backup holds the private key "
                       "unencrypted (readable by its owner only): keep it as secret as the key.")
    p.add_argument("action",
                   help="show, export or import. show: print the identity's peer id; export: write a checked "
                   "backup of it to --backup; import: restore it from --backup")
    p.add_argument("--identity", required=True, metavar="FILE", help="the identity file (`peer join --identity`)")
    p.add_argument("--backup", default=None, metavar="FILE",
                   help="the backup file that export writes and import reads (default: none; needed by both)")
    p.add_argument("--force", action="store_true",
                   help="export: overwrite an existing backup; import: replace an identity file of another peer "
                   "(default: off)")

    p = sub.add_parser("stewards", help="the organiser adds peers that may lead its running swarm",
                       description="Sign, with the organiser's key, a record that adds stewards: peers that may lead "
                       "the run (by default only the organiser's own peer may). The swarm reads it within a few "
                       "heartbeats; while no steward is live the swarm waits, nothing lost. Stewards cannot be "
                       "removed from a running swarm (start a new run).")
    p.add_argument("peer_id", nargs="+", help="the peer ids to add as stewards, in order of preference (`peer "
                   "identity show --identity FILE` prints a peer's)")
    p.add_argument("--identity", required=True, metavar="FILE",
                   help="the organiser's identity file, as given to `peer start --identity`")
    p.add_argument("--dht", required=True, nargs="+", metavar="ADDR", help="multiaddr(s) of any peer of the swarm")
    p.add_argument("--run", default="tasklet", help="run name (default: %(default)s)")
    p.add_argument("--secret", default=None, help=SECRET_HELP)
    p.add_argument("--secret-file", default=None, metavar="FILE", help=SECRET_FILE_HELP)

    p = sub.add_parser("init", help="write an example run.toml with every option and its default")
    p.add_argument("path", nargs="?", default="run.toml", help="file to write (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file (default: off)")

    sub.add_parser("config-reference", help="print the run.toml reference (Markdown)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "WARNING")
    handler = logging.StreamHandler(sys.stderr)  # control characters inert in either format
    handler.setFormatter(log_formatter(json_log=getattr(args, "json_log", False)))
    logging.basicConfig(level=level, handlers=[handler])
    for noisy in ("hivemind", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))
    if args.command in ("start", "join"):  # a peer: one OpenMP team, its compute thread's (peer.compute.threads)
        from tasklet.peer.compute.threads import prepare_process

        prepare_process()
    try:
        if hasattr(args, "secret"):  # --secret, --secret-file or TASKLET_SECRET, resolved once
            args.secret = resolve_secret(args.secret, args.secret_file, os.environ)
        return COMMANDS[args.command](args)
    except (ConfigError, UserError) as exc:
        last_line(f"error: {exc}", getattr(args, "json_log", False))
        return 2
    except KeyboardInterrupt:
        return 130


SECRET_HELP = (f"the swarm's join secret, if it has one (default: none); other users of this machine can read "
               f"a command line, so prefer --secret-file or {SECRET_ENV}")
ME_HELP = ("show only this identity's credit: an identity file (`peer join --identity`) or a peer id "
           "(default: every peer)")
SECRET_FILE_HELP = f"read the join secret from FILE (its first line); or set {SECRET_ENV} (default: none)"


class UserError(RuntimeError):
    """Something the user can fix; shown as one line."""


def last_line(text: str, json_log: bool) -> None:
    """A failed command's last line on stderr, ``peer: TEXT`` (control characters inert: it may quote a peer),
    or with --json-log a JSON record of it, so that stderr stays one JSON object per line."""
    if json_log:
        logging.getLogger("tasklet.peer.cli").error(text)
    else:
        print(f"peer: {clean(text)}", file=sys.stderr)


def _options(args: argparse.Namespace):  # noqa: ANN202 - PeerOptions, imported lazily (torch, hivemind)
    from tasklet.peer.node.daemon import PeerOptions

    return PeerOptions(
        host=args.host,
        port=args.port,
        bulk_port=args.bulk_port,
        dht_host=args.dht_host,
        dht_port=args.dht_port,
        announce=args.announce,
        identity=args.identity,
        secret=args.secret,
        run_id=getattr(args, "run", "tasklet"),
        device=args.device,
        emulate_tflops=args.emulate_tflops,
        emulate_device=args.emulate_device,
        resume=getattr(args, "resume", False),
        measure_seconds=args.measure_seconds,
        metrics_port=args.metrics_port,
        dashboard_port=args.dashboard_port,
        progress=True,
        json_log=args.json_log,
        relay_port=args.relay_port,
        max_vram_gb=args.max_vram,
        max_upload_mbps=args.max_upload,
        max_download_mbps=args.max_download,
        state_dir=args.state_dir,
        schedule=args.schedule,
        organiser=getattr(args, "organiser", None),
    )


def _run_daemon(args: argparse.Namespace, config: RunConfig | None, peers: list[str],
                local_paths: dict[tuple[str, str], str] | None = None) -> int:
    from tasklet.peer.node.daemon import DaemonError, PeerDaemon, stop_on_signals
    from tasklet.peer.node.join_watch import report_end

    if args.announce and ":" not in args.announce:
        raise UserError(f"--announce {args.announce!r}: expected HOST:PORT")
    if args.announce and args.dht_port == 0:
        raise UserError(
            "--announce needs a fixed --dht-port too (others must be able to reach the DHT at a known port)"
        )
    if args.host in ("0.0.0.0", "::") and not args.announce and (config is not None or args.relay_port is not None):
        raise UserError(
            f"--host {args.host} listens on every interface but is no address others can dial: "
            "add --announce HOST:PORT (this machine's public or LAN address)"
        )
    opts = _options(args)
    opts.local_paths = local_paths or {}
    if config is not None and config.swarm.secret:
        opts.secret = config.swarm.secret
    from tasklet.peer.compute.threads import claim_compute_threads
    from tasklet.peer.emulation.network import ScenarioEmulation  # an emulated run's network and device clock

    claim_compute_threads()  # this thread measures the device and computes (PeerDaemon.run)
    daemon = PeerDaemon(opts, peers, config, emulation=ScenarioEmulation())
    try:
        daemon.start()
    except DaemonError as exc:
        raise UserError(str(exc)) from None
    stop_on_signals(daemon.stop_requested)
    try:
        if config is not None:
            print(daemon.join_line(), flush=True)
        status = daemon.run()
        report_end(daemon.phases, daemon.done.is_set(), daemon.exit_error)
    finally:
        daemon.shutdown()
    if daemon.exit_error:
        last_line(daemon.exit_error, args.json_log)
    return status


def cmd_start(args: argparse.Namespace) -> int:
    return _run_daemon(args, RunConfig.load(args.config), [])


def cmd_join(args: argparse.Namespace) -> int:
    return _run_daemon(args, None, list(args.dht), join_paths(args))


def join_paths(args: argparse.Namespace) -> dict[tuple[str, str], str]:
    """A joiner's own local paths: its flags, else its --config's, else a checkpoint folder in its state
    folder (the run record names none)."""
    paths = local_paths_from_toml(args.config) if args.config else {}
    flags = {("run", "corpus"): args.data, ("run", "tokenizer"): args.tokenizer, ("model", "config"): args.model,
             ("swarm", "checkpoint_dir"): args.checkpoint_dir, ("swarm", "save_dir"): args.save_dir}
    paths.update({key: value for key, value in flags.items() if value is not None})
    state_dir = args.state_dir or (os.path.dirname(os.path.abspath(args.identity)) if args.identity else None)
    if ("swarm", "checkpoint_dir") not in paths and state_dir:
        paths[("swarm", "checkpoint_dir")] = os.path.join(state_dir, "checkpoints")
    return paths


def _me(value: str | None) -> str | None:
    """--me: the peer id of an identity file, or the value itself when it is no file (a peer id)."""
    if value is None or not os.path.exists(value):
        return value
    from tasklet.peer.identity.keys import Identity

    try:
        return Identity.load(value).peer_id
    except Exception as exc:  # not a key file: say so rather than show nobody's credit
        raise UserError(f"--me {value}: not an identity file ({exc})") from None


def _status_reader(args: argparse.Namespace):  # noqa: ANN202 - StatusReader, imported lazily (hivemind)
    from tasklet.peer.swarm.dht import DHTStartError
    from tasklet.peer.swarm.status import StatusReader

    try:
        return StatusReader(list(args.dht), args.run, args.secret)
    except DHTStartError as exc:
        raise UserError(str(exc)) from None


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from tasklet.peer.swarm.status import credit_summary, format_credits, format_status, status_json

    me = _me(args.me)
    with _status_reader(args) as reader:
        while True:
            st = reader.read()
            if not st.peers and not st.plan.get("epoch"):
                raise UserError(f"no run named {args.run!r} is visible in this DHT (wrong --run or --secret?)")
            if me is not None:  # this identity only: where it is in the plan, and its credit
                summary = credit_summary(st.progress)
                peer = next((p for p in st.peers if p["peer_id"] == me), None)
                row = next((r for r in summary["peers"] if r["peer_id"] == me), None)
                text = (json.dumps({"peer_id": me, "peer": peer, "credit": row, "step": st.progress.get("step")},
                                   indent=1) if args.json else format_credits(summary, me))
                print(text, flush=True)
            else:
                print(status_json(st) if args.json else format_status(st), flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
            if not args.json:
                print()


def cmd_credits(args: argparse.Namespace) -> int:
    import json

    from tasklet.peer.swarm.status import credit_summary, format_credits

    me = _me(args.me)
    with _status_reader(args) as reader:
        progress = reader.read_progress()
    if progress is None:
        raise UserError(f"no progress record of run {args.run!r} is visible in this DHT (wrong --run or --secret, "
                        "or no leader has published yet?)")
    summary = credit_summary(progress)
    if me is not None:
        summary["peers"] = [r for r in summary["peers"] if r["peer_id"] == me]
    print(json.dumps(summary, indent=1) if args.json else format_credits(summary, me), flush=True)
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tasklet.peer.observe.dashboard import serve_dashboard
    from tasklet.peer.swarm.dht import DHTStartError

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve_dashboard(list(args.dht), args.run, args.secret, args.host, args.port, interval_s=args.interval,
                        stop=stop, say=lambda line: print(line, flush=True))
    except (DHTStartError, OSError) as exc:
        raise UserError(str(exc)) from None
    return 0


def cmd_swarm(args: argparse.Namespace) -> int:
    from tasklet.peer.emulation.daemon_swarm import SwarmOptions, run_swarm
    from tasklet.scheduler import PlanningError

    if args.peers < 1:
        raise UserError(f"--peers must be at least 1, got {args.peers}")
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    opts = SwarmOptions(
        peers=args.peers,
        scenario=args.scenario,
        steps=args.steps,
        seed=args.seed,
        save=args.save,
        stages=args.stages,
        bandwidth_scale=args.bandwidth_scale,
        tflops=args.tflops,
        timeout_s=args.timeout,
        log_dir=args.log_dir,
        model=args.model,
        tokenizer=args.tokenizer,
        data=args.data,
        text_field=args.text_field,
        seq_len=args.seq_len,
        sync_period=args.sync_period,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        pseudo_grad_compression=args.pseudo_grad_compression,
    )
    try:
        return run_swarm(opts)
    except (PlanningError, ValueError) as exc:
        raise UserError(str(exc)) from None


def cmd_export(args: argparse.Namespace) -> int:
    from tasklet.peer.compute.hf.export import export

    try:
        out = export(args.result_dir, args.out_dir)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(f"wrote {out}; load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tasklet.peer.compute.hf.export import generate

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    try:
        print(generate(args.model, args.prompt, args.max_new_tokens, args.seed, args.temperature))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from tasklet.peer.node.doctor import DoctorOptions, format_report, run_doctor

    opts = DoctorOptions(dht=list(args.dht), run_id=args.run, secret=args.secret, config=args.config,
                         host=args.host, port=args.port, dht_port=args.dht_port, device=args.device,
                         measure_seconds=args.measure_seconds, max_vram_gb=args.max_vram)
    try:
        report = run_doctor(opts)
    except ValueError as exc:  # a device that is not there (--device cuda on a CPU machine)
        raise UserError(str(exc)) from None
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    return 0 if report["verdict"]["ok"] else 1


def cmd_control(args: argparse.Namespace) -> int:
    from tasklet.peer.node.control_socket import ControlError, ask, default_state_dir, find_socket

    folder = Path(args.state_dir).expanduser() if args.state_dir else default_state_dir()
    try:
        answer = ask(find_socket(folder, args.peer), args.command)
    except ControlError as exc:
        raise UserError(str(exc)) from None
    if not answer.get("ok"):
        raise UserError(str(answer.get("error", "refused")))
    state = "paused" if answer.get("paused") else "running"
    note = f" ({answer['note']})" if answer.get("note") else ""
    print(f"peer {state}{note}")
    return 0


def cmd_identity(args: argparse.Namespace) -> int:
    from tasklet.peer.identity.keys import Identity
    from tasklet.peer.node.identity_backup import BackupError, export_identity, import_identity

    if args.action not in ("show", "export", "import"):
        raise UserError(f"peer identity {args.action[:40]!r}: expected show, export or import")
    if args.action != "show" and not args.backup:
        raise UserError(f"peer identity {args.action} needs --backup FILE")
    try:
        if args.action == "show":
            print(Identity.load(args.identity).peer_id)
        elif args.action == "export":
            peer_id = export_identity(args.identity, args.backup, args.force)
            print(f"wrote a backup of peer {peer_id} to {args.backup} (it holds the private key: keep it secret)")
        else:
            peer_id = import_identity(args.backup, args.identity, args.force)
            print(f"restored peer {peer_id} to {args.identity}; join with --identity {args.identity}")
    except (BackupError, ValueError) as exc:
        raise UserError(str(exc)) from None
    return 0


def cmd_stewards(args: argparse.Namespace) -> int:
    from tasklet.peer.identity.keys import Identity
    from tasklet.peer.node.stewards import StewardsError, add_stewards
    from tasklet.peer.swarm.adverts import check_peer_id
    from tasklet.peer.swarm.dht import DHTStartError

    try:
        ids = [check_peer_id(p, "peer_id") for p in args.peer_id]
        identity = Identity.load(args.identity)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        revision, stewards = add_stewards(list(args.dht), args.run, args.secret, identity, ids)
    except (StewardsError, DHTStartError) as exc:
        raise UserError(str(exc)) from None
    print(f"stewards of run {args.run!r} (record {revision}, signed by the organiser {identity.peer_id}): "
          f"{', '.join(stewards)}; the swarm reads it within a few heartbeats")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.exists() and not args.force:
        raise UserError(f"{path} exists; use --force to overwrite it")
    path.write_text(example_toml())
    print(f"wrote {path}; edit [run] and [model], then: peer start --config {path}")
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    print(reference_markdown())
    return 0


COMMANDS = {
    "start": cmd_start,
    "join": cmd_join,
    "stewards": cmd_stewards,
    "status": cmd_status,
    "credits": cmd_credits,
    "dashboard": cmd_dashboard,
    "swarm": cmd_swarm,
    "export": cmd_export,
    "generate": cmd_generate,
    "doctor": cmd_doctor,
    "identity": cmd_identity,
    "pause": cmd_control,
    "resume": cmd_control,
    "init": cmd_init,
    "config-reference": cmd_config_reference,
}


if __name__ == "__main__":
    sys.exit(main())
