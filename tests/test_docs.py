"""The README as a newcomer meets it: its first command works from a fresh clone, and its configuration
reference says what the code does.

* The two commands are read from the README itself (the fenced blocks between ``<!-- commands:start -->`` and
  ``<!-- commands:end -->``) and the first one is run, as copied, in a fresh ``git clone`` with a fresh
  virtualenv (``tests/newcomer.py``); its output must show a plan, every step, the final loss and where the
  results were saved, and the saved ``run.json`` must agree with what was printed.
* The configuration reference between the ``config-reference`` markers must be exactly what
  ``scripts/gen_config_reference.py`` generates from the code now, and must list every run.toml key and every
  flag of every ``peer`` subcommand.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from peer.cli import build_parser
from peer.config import SECTIONS
from tests.newcomer import REPO, Clone, fresh_clone, newcomer_env

README = REPO / "README.md"
DEMO_TIMEOUT_S = 420.0


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", REPO / "scripts" / "gen_config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def readme_commands(text: str) -> list[str]:
    """The one-line commands of the fenced code blocks between the commands markers."""
    start, end = text.find("<!-- commands:start -->"), text.find("<!-- commands:end -->")
    assert 0 <= start < end, "README.md needs a <!-- commands:start --> ... <!-- commands:end --> block"
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text[start:end], flags=re.S)
    return [b.strip() for b in blocks]


def reference_sections(block: str) -> dict[str, str]:
    """``{heading: body}`` of the reference block's ``### ...`` sections."""
    parts = re.split(r"^### (.+)$", block, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.fixture(scope="session")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> Clone:
    return fresh_clone(tmp_path_factory.getbasetemp() / "newcomer")  # left to pytest's rotation (tests.newcomer)


# ------------------------------------------------------------------------------------- the two commands
def test_readme_starts_with_what_it_is_and_two_one_line_commands() -> None:
    text = README.read_text()
    first_paragraph = text.split("\n\n")[1]
    assert "Tasklet" in first_paragraph and "volunteer" in first_paragraph
    commands = readme_commands(text)
    assert len(commands) == 2, commands
    for command in commands:
        assert "\n" not in command, f"not one line: {command!r}"
        script = command.split()[-1]
        assert (REPO / script).is_file(), f"README command {command!r} runs {script}, which does not exist"
    assert commands[1].endswith("scripts/test.sh"), "the second command is the tests"
    # the commands come before any other section of substance
    assert text.find("<!-- commands:start -->") < text.find("## What the main job prints")


@pytest.mark.timeout(DEMO_TIMEOUT_S + 600)
def test_readme_first_command_trains_a_swarm_from_a_fresh_clone(newcomer: Clone) -> None:
    command = readme_commands(README.read_text())[0]
    tmp = newcomer.root.parent / "tmp"
    proc = subprocess.run(["bash", "-c", command], cwd=newcomer.root, env=newcomer_env(tmp), capture_output=True,
                          text=True, timeout=DEMO_TIMEOUT_S)
    out = proc.stdout
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in out + proc.stderr, proc.stderr[-3000:]
    assert re.search(r"^swarm: 4 peers emulating worldwide_geo_distributed", out, re.M), out
    assert re.search(r"^plan \(epoch \d+\): stages", out, re.M), out
    for step in range(1, 6):
        assert re.search(rf"step {step}/5, loss \d+\.\d+", out), f"no progress line for step {step}:\n{out}"
    trained = re.search(r"^trained 5 steps in [\d.]+ s: loss ([\d.]+) -> ([\d.]+)", out, re.M)
    assert trained, out
    first, last = float(trained.group(1)), float(trained.group(2))
    assert last < first, f"the loss did not go down in 5 steps: {first} -> {last}"
    saved = re.search(r"^parameters and run\.json saved in (\S+)$", out, re.M)
    assert saved, out
    run = json.loads((Path(saved.group(1)) / "run.json").read_text())
    assert len(run["loss"]) == 5
    assert round(run["loss"][0], 4) == first and round(run["loss"][-1], 4) == last


# ------------------------------------------------------------------------------ configuration reference
def test_config_reference_in_readme_is_generated_from_the_code() -> None:
    current = gen.current_block(README.read_text())
    generated = gen.generate()
    assert current == generated, "README's configuration reference is stale: python scripts/gen_config_reference.py"


def test_reference_lists_every_flag_of_every_peer_subcommand() -> None:
    sections = reference_sections(gen.current_block(README.read_text()))
    subcommands = gen.subcommands(build_parser())
    assert {"start", "join", "status", "swarm", "init", "config-reference"} <= set(subcommands)
    for name, (sub, _) in subcommands.items():
        body = sections.get(f"`peer {name}`")
        assert body is not None, f"README's reference has no section for `peer {name}`"
        for action in gen.options(sub):
            names = action.option_strings or [action.metavar or action.dest]
            for flag in names:
                assert f"`{flag}" in body, f"`peer {name}` {flag} is missing from README's reference"


def test_reference_lists_every_run_toml_key() -> None:
    body = reference_sections(gen.current_block(README.read_text()))["run.toml"]
    from dataclasses import fields

    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f"`[{section}] {f.name}`" in body, f"[{section}] {f.name} is missing from README's reference"


def test_every_peer_flag_explains_itself_and_its_default() -> None:
    """``peer X --help`` explains each flag; a flag that is neither required nor a switch names its default."""
    for name, (sub, summary) in gen.subcommands(build_parser()).items():
        assert summary, f"`peer {name}` has no description"
        text = sub.format_help()
        for action in gen.options(sub):
            assert action.help, f"`peer {name}` {action.option_strings or action.dest} has no help"
            flag = (action.option_strings or [action.dest])[0]
            assert flag in text
            if action.required or action.nargs == 0:  # required, or a switch (off unless given)
                continue
            assert "default" in gen._expanded_help(action, sub.prog), f"`peer {name}` {flag}: help names no default"


def test_generator_check_mode_catches_a_stale_readme(tmp_path: Path) -> None:
    fresh = README.read_text()
    readme = tmp_path / "README.md"
    readme.write_text(fresh)
    assert gen.main(["--check", "--readme", str(readme)]) == 0
    stale = fresh.replace("| `[run] seed` | `0` |", "| `[run] seed` | `1` |")
    assert stale != fresh
    readme.write_text(stale)
    assert gen.main(["--check", "--readme", str(readme)]) == 1
    assert gen.main(["--readme", str(readme)]) == 0  # regenerate
    assert readme.read_text() == fresh
    readme.write_text("# no markers here\n")
    assert gen.main(["--check", "--readme", str(readme)]) == 2


def test_readme_links_point_to_files_that_exist() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "expected links to docs/"
    for link in local:
        assert (REPO / link).exists(), f"README links to {link}, which does not exist"
