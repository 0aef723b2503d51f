"""The `peer` command answers without loading the heavy libraries: parsing arguments, `peer --help` and
`peer init` must not import torch, transformers, hivemind or grpc (they cost seconds; `python -m bench.cli`
measures the time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "hivemind", "grpc")

# fresh interpreters: sys.modules of this one is not clean
pytestmark = [pytest.mark.usefixtures("processes"), pytest.mark.light_processes]

PROBE = """
import contextlib, io, json, sys
import tasklet.peer.cli
out = {"import": [m for m in HEAVY if m in sys.modules]}
for name, argv in CASES.items():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = tasklet.peer.cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    out[name] = {"code": code, "heavy": [m for m in HEAVY if m in sys.modules]}
print(json.dumps(out))
"""


def test_parsing_help_and_init_import_nothing_heavy(tmp_path: Path) -> None:
    cases = {
        "help": ["--help"],
        "status_help": ["status", "--help"],
        "credits_help": ["credits", "--help"],
        "doctor_help": ["doctor", "--help"],
        "argument_error": ["join"],
        "init": ["init", str(tmp_path / "run.toml")],
    }
    code = f"HEAVY = {HEAVY!r}\nCASES = {cases!r}\n" + PROBE
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["import"] == [], f"import peer.cli loaded {out['import']}"
    for name in cases:
        assert out[name]["heavy"] == [], f"{name} loaded {out[name]['heavy']}"
    assert out["help"]["code"] == 0 and out["status_help"]["code"] == 0 and out["doctor_help"]["code"] == 0
    assert out["credits_help"]["code"] == 0
    assert out["argument_error"]["code"] == 2
    assert out["init"]["code"] == 0
    assert "[run]" in (tmp_path / "run.toml").read_text()
