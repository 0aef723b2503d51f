"""How fast the `peer` command answers when it has nothing heavy to do.

``python -m bench.cli [--json] [--repeats 5]`` runs, each ``--repeats`` times in a fresh interpreter
(``python -m tasklet.peer.cli``, as the ``peer`` script does): ``peer --help``, ``peer init FILE`` (into a temporary
folder), ``peer status --help`` and an argument error (``peer join`` without ``--dht``), and prints the median
wall time of each in seconds. These commands parse arguments and write a file; they must not load torch,
transformers, hivemind or grpc (``tests/node/test_cli_fast.py`` checks the imports; this measures the time). Load on
a shared machine inflates every figure: report ``uptime`` beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS: dict[str, list[str]] = {
    "help_s": ["--help"],
    "init_s": ["init", "{dir}/run.toml", "--force"],
    "status_help_s": ["status", "--help"],
    "argument_error_s": ["join"],
}


def time_command(args: list[str], repeats: int) -> float:
    """Median wall time (s) of ``peer ARGS`` over ``repeats`` fresh interpreters."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        argv = [a.replace("{dir}", tmp) for a in args]
        for _ in range(repeats):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "tasklet.peer.cli", *argv], env=env, capture_output=True, timeout=120,
                           check=False)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    result: dict[str, float | int] = {name: round(time_command(cmd, args.repeats), 3) for name, cmd in COMMANDS.items()}
    result["repeats"] = args.repeats
    result["load_1min"] = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:18} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
