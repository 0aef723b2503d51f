"""The README as a newcomer meets it, and the pages of docs/ behind it: the README is short, its first command
works from a fresh clone, the configuration reference says what the code does, and every link leads somewhere.

* The two commands are read from the README itself (the fenced blocks between ``<!-- commands:start -->`` and
  ``<!-- commands:end -->``) and the first one is run, as copied, in a fresh ``git clone`` with a fresh
  virtualenv (``tests/support/newcomer.py``); its output must show a plan, every step, the final loss and where the
  results were saved, and the saved ``run.json`` must agree with what was printed.
* The README is a newcomer's page of at most 300 lines: what Tasklet is, the two commands, joining, headline
  figures, limits and a map of docs/; it links every page of docs/.
* The configuration reference between the ``config-reference`` markers of ``docs/configuration.md`` must be
  exactly what ``scripts/gen_config_reference.py`` generates from the code now, and must list every run.toml key
  and every flag of every ``peer`` subcommand.
* Every relative link (and image) in README.md and docs/ points at a file that exists, and at a heading of it
  when it names one; every benchmark with a command has a page in docs/benchmarks/.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import time
from pathlib import Path
from types import ModuleType

import pytest

from tasklet.peer.cli import build_parser
from tasklet.peer.config import SECTIONS
from tests.support.newcomer import REPO, Clone, newcomer_env
from tests.support.system_watch import forbidding, snapshot, system_calls

README = REPO / "README.md"
DOCS = REPO / "docs"
CONFIGURATION = DOCS / "configuration.md"
README_MAX_LINES = 300
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
    # the demo may not install or configure anything outside the checkout: the system tools it could reach for
    # fail (and say so), and the system folders it could write are compared before and after
    forbidden, calls = newcomer.root.parent / "forbidden-bin", newcomer.root.parent / "forbidden-calls"
    forbidding(forbidden, calls)
    env = newcomer_env(tmp)
    env["PATH"] = f"{forbidden}:{env['PATH']}"
    before = snapshot()
    started = time.monotonic()
    proc = subprocess.run(["bash", "-c", command], cwd=newcomer.root, env=env, capture_output=True, text=True,
                          timeout=DEMO_TIMEOUT_S)
    print(f"the README's first command took {time.monotonic() - started:.1f} s (the virtualenv already made)")
    out = proc.stdout
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert system_calls(calls) == [], f"the demo ran system tools: {system_calls(calls)}"
    assert snapshot() == before, "the demo changed /usr/local or /etc"
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
def test_config_reference_is_generated_from_the_code() -> None:
    current = gen.current_block(CONFIGURATION.read_text())
    generated = gen.generate()
    assert current == generated, "docs/configuration.md is stale: python scripts/gen_config_reference.py"


def test_reference_lists_every_flag_of_every_peer_subcommand() -> None:
    sections = reference_sections(gen.current_block(CONFIGURATION.read_text()))
    subcommands = gen.subcommands(build_parser())
    assert {"start", "join", "status", "swarm", "init", "config-reference"} <= set(subcommands)
    for name, (sub, _) in subcommands.items():
        body = sections.get(f"`peer {name}`")
        assert body is not None, f"docs/configuration.md has no section for `peer {name}`"
        for action in gen.options(sub):
            names = action.option_strings or [action.metavar or action.dest]
            for flag in names:
                assert f"`{flag}" in body, f"`peer {name}` {flag} is missing from docs/configuration.md"


def test_reference_lists_every_run_toml_key() -> None:
    body = reference_sections(gen.current_block(CONFIGURATION.read_text()))["run.toml"]
    from dataclasses import fields

    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f"`[{section}] {f.name}`" in body, f"[{section}] {f.name} is missing from docs/configuration.md"


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


def test_generator_check_mode_catches_a_stale_page(tmp_path: Path) -> None:
    fresh = CONFIGURATION.read_text()
    page = tmp_path / "configuration.md"
    page.write_text(fresh)
    assert gen.main(["--check", "--page", str(page)]) == 0
    stale = fresh.replace("| `[run] seed` | `0` |", "| `[run] seed` | `1` |")
    assert stale != fresh
    page.write_text(stale)
    assert gen.main(["--check", "--page", str(page)]) == 1
    assert gen.main(["--page", str(page)]) == 0  # regenerate
    assert page.read_text() == fresh
    page.write_text("# no markers here\n")
    assert gen.main(["--check", "--page", str(page)]) == 2


# ------------------------------------------------------------------------------- the README and docs/
def test_readme_is_a_newcomers_page() -> None:
    text = README.read_text()
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    for heading in ("## Two commands", "## What the main job prints", "## Joining a real swarm",
                    "## Headline figures", "## Known limits", "## Documentation"):
        assert re.search(rf"^{re.escape(heading)}", text, re.M), f"README.md has no section {heading!r}"
    for command in ("peer start", "peer join --dht", "--secret", "docker run"):
        assert command in text, f"README.md's joining section lacks {command!r}"
    # one layer table (docs/architecture.md) and one configuration reference (docs/configuration.md)
    assert "may import (of ours)" not in text and gen.START not in text
    linked = {(REPO / link).resolve() for link, _ in _links(README)}
    for page in [*DOCS.glob("*.md"), DOCS / "benchmarks" / "README.md"]:
        assert page.resolve() in linked, f"README.md's map of docs/ does not link {page.relative_to(REPO)}"


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _links(page: Path, root: Path = REPO) -> list[tuple[str, str]]:
    """``(path, anchor)`` of every relative link and image of ``page`` (fenced code left out), path relative to
    ``root``; a link to a heading of the page itself has the page's own path."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page.resolve()
        found.append((str(file.relative_to(root.resolve())) if file.is_relative_to(root.resolve()) else str(file),
                      anchor))
    return found


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``: lower case, punctuation dropped, spaces to hyphens,
    ``-1``, ``-2`` ... for repeats."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _broken_links(pages: list[Path], root: Path = REPO) -> list[str]:
    broken = []
    for page in pages:
        for path, anchor in _links(page, root):
            target = root / path
            where = f"{page.relative_to(root)} -> {path}{'#' + anchor if anchor else ''}"
            if not target.exists():
                broken.append(f"{where}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{where}: no such heading")
    return broken


def test_every_relative_link_in_readme_and_docs_leads_somewhere() -> None:
    assert _broken_links(_markdown_files()) == []


def test_the_link_check_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## `peer status` and more\n\n## Repeat\n\n## Repeat\n")
    (tmp_path / "README.md").write_text(
        "# R\n\n[ok](docs/a.md) [ok](docs/a.md#peer-status-and-more) [ok](docs/a.md#repeat-1) [ok](#r)\n"
        "![missing](docs/b.png) [bad anchor](docs/a.md#nowhere) [web](https://example.com/x.md)\n\n"
        "```\n[in code](docs/none.md)\n```\n")
    assert _broken_links([tmp_path / "README.md"], tmp_path) == [
        "README.md -> docs/b.png: no such file", "README.md -> docs/a.md#nowhere: no such heading"]


def test_every_benchmark_has_a_page() -> None:
    helpers = {"launcher"}  # the fork launcher of bench.formation, not a benchmark
    pages = "\n".join(p.read_text() for p in sorted((DOCS / "benchmarks").glob("*.md")))
    for module in sorted((REPO / "bench").glob("*.py")):
        if module.stem in helpers or 'if __name__ == "__main__"' not in module.read_text():
            continue
        assert f"python -m bench.{module.stem}" in pages, f"bench/{module.name} has no page in docs/benchmarks/"
    assert "python -m bench.headline" in pages and "python -m tasklet.scheduler bench" in pages
