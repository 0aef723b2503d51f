"""The import graph of our packages, read from the source (every import counts: module level, inside functions,
under ``TYPE_CHECKING``): shared by the layering checks of ``tests/project/test_layout.py`` and
``tests/observe/test_dashboard.py``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("peer", "protocol", "scheduler", "bench")
SHIPPED = ("peer", "protocol", "scheduler")  # imported as tasklet.peer, tasklet.protocol, tasklet.scheduler
OURS = ("tasklet", "bench", "tests")
CORE = ("tasklet.peer.net", "tasklet.peer.swarm", "tasklet.peer.compute", "tasklet.peer.runtime", "tasklet.peer.node")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["tasklet", *parts] if parts[0] in SHIPPED else parts)


def modules(packages: tuple[str, ...]) -> dict[str, Path]:
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


def import_graph() -> dict[str, set[str]]:
    ours = modules(PACKAGES)
    known = set(ours) | set(modules(("tests",)))
    return {name: _imports(name, path, known) for name, path in ours.items()}


def graph_of_tests() -> dict[str, set[str]]:
    """The import graph of the test modules and their support (what each imports of ours and of the tests)."""
    tests = modules(("tests",))
    known = set(tests) | set(modules(PACKAGES))
    return {name: _imports(name, path, known) for name, path in tests.items()}


def importing(graph: dict[str, set[str]], importers: tuple[str, ...], imported: tuple[str, ...]) -> list[str]:
    def under(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    return sorted(f"{m} -> {t}" for m, targets in graph.items() if under(m, importers)
                  for t in targets if under(t, imported))
