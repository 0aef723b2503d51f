"""The layering of the code base, checked from the source: no import cycle, lower layers import no higher ones.

Every import counts — at module level, inside functions, and under ``if TYPE_CHECKING:`` — because a cycle
hidden behind a lazy or type-only import is still a pair of modules that cannot be understood one at a time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("peer", "protocol", "scheduler", "bench")
OURS = (*PACKAGES, "tests")
CORE = ("peer.net", "peer.swarm", "peer.compute", "peer.runtime", "peer.node")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(packages: tuple[str, ...]) -> dict[str, Path]:
    return {_module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_ours(name: str) -> bool:
    return name.split(".")[0] in OURS


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules that ``name`` imports anywhere in its source; ``from a import b`` counts ``a.b`` when that is
    a module, else ``a`` (a package that a submodule import merely passes through is not counted)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:  # a submodule if it is one (``from . import x``), else the module itself
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    return {m for m in found if _is_ours(m) and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules(PACKAGES)
    known = set(modules) | set(_modules(("tests",)))
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _resolve(target: str, graph: dict[str, set[str]]) -> str | None:
    """The module of ours that an imported name refers to (``peer.net.PeerClient`` -> ``peer.net``)."""
    while target and target not in graph:
        target = target.rpartition(".")[0]
    return target or None


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    edges = {m: {r for t in targets if (r := _resolve(t, graph)) and r != m} for m, targets in graph.items()}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n):], n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def _importing(graph: dict[str, set[str]], importers: tuple[str, ...], imported: tuple[str, ...]) -> list[str]:
    def under(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    return sorted(f"{m} -> {t}" for m, targets in graph.items() if under(m, importers)
                  for t in targets if under(t, imported))


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    assert len(graph) > 50, "the walk found too few modules to be meaningful"
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph) or [])}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _find_cycle({"peer.a": {"peer.b.X"}, "peer.b": {"peer.c"}, "peer.c": {"peer.a"}}) == [
        "peer.a", "peer.b", "peer.c", "peer.a"]
    assert _find_cycle({"peer.a": {"peer.b"}, "peer.b": set()}) is None


def test_scheduler_and_protocol_import_nothing_of_ours() -> None:
    graph = _graph()
    leaks = [f"{m} -> {t}" for m, targets in graph.items() if m.split(".")[0] in ("scheduler", "protocol")
             for t in targets if t.split(".")[0] != m.split(".")[0]]
    assert leaks == []


def test_nothing_outside_tests_imports_tests() -> None:
    assert _importing(_graph(), PACKAGES, ("tests",)) == []


def test_core_layers_never_import_the_emulation_harness() -> None:
    assert _importing(_graph(), CORE, ("peer.emulation",)) == []


def test_the_top_level_of_peer_is_small() -> None:
    modules = sorted(p.name for p in (ROOT / "peer").glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 5, modules
    assert {"cli.py", "config.py"} <= set(modules)
