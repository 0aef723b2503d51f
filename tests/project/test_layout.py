"""The layering of the code base, checked from the source: no import cycle, every import allowed by the layer table
of docs/architecture.md, no mixins, and no code that writes another object's fields.

Every import counts — at module level, inside functions, and under ``if TYPE_CHECKING:`` — because a cycle
hidden behind a lazy or type-only import is still a pair of modules that cannot be understood one at a time.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from tests.support.imports import CORE, PACKAGES, ROOT, SHIPPED, graph_of_tests, import_graph, importing, modules
from tests.support.seams import THIRD_PARTY_WRITES, cross_object_writes, unused_allowances, writes_in


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


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the walk found too few modules to be meaningful"
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph) or [])}"


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _find_cycle({"peer.a": {"peer.b.X"}, "peer.b": {"peer.c"}, "peer.c": {"peer.a"}}) == [
        "peer.a", "peer.b", "peer.c", "peer.a"]
    assert _find_cycle({"peer.a": {"peer.b"}, "peer.b": set()}) is None


def test_scheduler_and_protocol_import_nothing_of_ours() -> None:
    graph = import_graph()
    def package(name: str) -> str:
        return ".".join(name.split(".")[:2])

    leaks = [f"{m} -> {t}" for m, targets in graph.items() if package(m) in ("tasklet.scheduler", "tasklet.protocol")
             for t in targets if package(t) != package(m)]
    assert leaks == []


def test_nothing_outside_tests_imports_tests() -> None:
    assert importing(import_graph(), PACKAGES, ("tests",)) == []


def test_core_layers_never_import_the_emulation_harness() -> None:
    assert importing(import_graph(), CORE, ("tasklet.peer.emulation",)) == []


def test_the_top_level_of_peer_is_small() -> None:
    modules = sorted(p.name for p in (ROOT / "peer").glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 5, modules
    assert {"cli.py", "config.py"} <= set(modules)


# ------------------------------------------------------------------ the layer table of docs/architecture.md
ARCHITECTURE = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class LayerRow:
    """One row of the layer table: the modules it holds (``peer.net``, ``peer.cli``) and the names it may import."""

    folders: tuple[str, ...]
    may_import: frozenset[str]


def _qualified(name: str) -> str:
    """A module as the docs name it (``peer.net``) -> as it is imported (``tasklet.peer.net``)."""
    return f"tasklet.{name}" if name.split(".")[0] in SHIPPED else name


def _dotted(path: str) -> str:
    """``peer/net/`` -> ``tasklet.peer.net``; ``peer/cli.py`` -> ``tasklet.peer.cli``."""
    return _qualified(path.strip("/").removesuffix(".py").replace("/", "."))


def parse_layer_table(markdown: str) -> list[LayerRow]:
    """The rows of the first table under ``## Layers`` with a ``folder`` and a ``may import (of ours)`` column.

    The last column is read as the table's text explains: backticked module names; "nothing"; "all of the above"
    (every row above and what each may import); "everything", optionally "but `x`, `y`" (every row but those);
    text in parentheses is commentary, backticks in it included.
    """
    section = markdown.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    folder_col, import_col = header.index("folder"), header.index("may import (of ours)")
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))] for line in lines[2:]]
    folders = [tuple(_dotted(p) for p in re.findall(r"`([^`]+)`", row[folder_col])) for row in cells]
    rows: list[LayerRow] = []
    for i, row in enumerate(cells):
        text = row[import_col]
        while re.search(r"\([^()]*\)", text):
            text = re.sub(r"\([^()]*\)", "", text)
        names = {_qualified(n) for n in re.findall(r"`([^`]+)`", text)}
        if "everything" in text:
            but = {_qualified(n) for n in re.findall(r"`([^`]+)`", text.split("but", 1)[1])} if "but" in text else set()
            names = {f for fs in folders for f in fs if f not in but}
        if "all of the above" in text:
            for above in rows:
                names |= set(above.folders) | above.may_import
        rows.append(LayerRow(folders[i], frozenset(names)))
        assert rows[-1].folders, f"a layer row names no folder: {row}"
    return rows


def _row_of(module: str, rows: list[LayerRow]) -> tuple[str, LayerRow] | None:
    """The most specific row folder that holds ``module``, and its row."""
    matches = [(f, r) for r in rows for f in r.folders if module == f or module.startswith(f + ".")]
    return max(matches, key=lambda m: len(m[0])) if matches else None


def layer_violations(graph: dict[str, set[str]], rows: list[LayerRow]) -> list[str]:
    """Every import between our modules that the importer's row does not allow, as ``importer -> imported``."""
    bad = []
    for module, targets in sorted(graph.items()):
        own = _row_of(module, rows)
        for target in sorted(targets):
            imported = _resolve(target, graph)
            if imported is None or imported == module:
                continue  # not one of the checked packages (tests: checked on its own)
            if own is None:
                bad.append(f"{module} -> {imported} (no row of the layer table holds {module})")
                continue
            theirs = _row_of(imported, rows)
            if theirs is not None and theirs[0] == own[0]:
                continue  # the same layer
            # a name covers the modules under it, but not those of a more specific row (named on their own)
            if any((imported == n or imported.startswith(n + ".")) and not (theirs and theirs[0].startswith(n + "."))
                   for n in own[1].may_import):
                continue
            bad.append(f"{module} -> {imported} (row {own[0]} may import {sorted(own[1].may_import) or 'nothing'})")
    return bad


def test_the_layer_table_names_modules_that_exist() -> None:
    rows = parse_layer_table(ARCHITECTURE.read_text())
    graph = import_graph()
    assert len(rows) >= 10, rows
    for row in rows:
        for name in (*row.folders, *row.may_import):
            assert _resolve(name, graph) == name, f"docs/architecture.md's layer table names {name!r}: no such module"


def test_every_import_is_allowed_by_the_layer_table() -> None:
    """docs/architecture.md's layer table is the one statement of what may import what, and it is true."""
    assert layer_violations(import_graph(), parse_layer_table(ARCHITECTURE.read_text())) == []


def test_the_layer_table_parser_lets_the_most_specific_row_win() -> None:
    table = """
## Layers

| layer | folder | what | may import (of ours) |
| --- | --- | --- | --- |
| wire | `protocol/` | x | nothing |
| runtime contracts | `peer/runtime/` | x | `protocol` (the codec, `protocol.codec`) |
| leader side | `peer/runtime/lead/` | x | all of the above |
| peer side | `peer/runtime/stage/` | x | `peer.runtime`, `protocol` |
| node | `peer/node/` | x | everything but `peer.cli` |
| entry | `peer/cli.py` | x | everything |

## Next
"""
    rows = parse_layer_table(table)
    assert [r.folders for r in rows] == [("tasklet.protocol",), ("tasklet.peer.runtime",),
                                         ("tasklet.peer.runtime.lead",),
                                         ("tasklet.peer.runtime.stage",), ("tasklet.peer.node",), ("tasklet.peer.cli",)]
    assert rows[0].may_import == frozenset() and rows[1].may_import == {"tasklet.protocol"}
    assert rows[2].may_import == {"tasklet.protocol", "tasklet.peer.runtime"}
    assert "tasklet.peer.cli" not in rows[4].may_import and "tasklet.peer.runtime.stage" in rows[4].may_import
    graph = {
        "tasklet.protocol.codec": set(),
        "tasklet.peer.runtime.control": {"tasklet.protocol.codec"},
        "tasklet.peer.runtime.lead.coordinator": {"tasklet.peer.runtime.control", "tasklet.peer.runtime.lead.pool"},
        "tasklet.peer.runtime.lead.pool": set(),
        "tasklet.peer.runtime.stage.worker": {"tasklet.peer.runtime.control.Op", "tasklet.peer.runtime.lead.pool"},
        "tasklet.peer.node.daemon": {"tasklet.peer.runtime.stage.worker", "tasklet.peer.runtime.lead.coordinator"},
        "tasklet.peer.cli": {"tasklet.peer.node.daemon"},
    }
    # the peer side names `peer.runtime`, which covers the shared contracts but not the leader side's own row
    assert layer_violations(graph, rows) == [
        "tasklet.peer.runtime.stage.worker -> tasklet.peer.runtime.lead.pool (row tasklet.peer.runtime.stage may "
        "import ['tasklet.peer.runtime', 'tasklet.protocol'])"]
    graph["tasklet.peer.runtime.control"].add("tasklet.peer.runtime.stage.worker")  # a contract importing a side
    assert len(layer_violations(graph, rows)) == 2


# ------------------------------------------------------------------------------------------------- mixins
MIXINS_ALLOWED: set[str] = set()


def _classes() -> dict[str, tuple[ast.ClassDef, str]]:
    """``{module.Class: (node, module)}`` of every top-level class in ``peer/`` outside ``peer/emulation``."""
    found = {}
    for module, path in modules(("peer",)).items():
        if module == "tasklet.peer.emulation" or module.startswith("tasklet.peer.emulation."):
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                found[f"{module}.{node.name}"] = (node, module)
    return found


def _self_attributes(cls: ast.ClassDef) -> tuple[set[str], set[str]]:
    """(names a class defines: methods, class attributes, ``self.x = ...``; names it reads as ``self.x``)."""
    defined, read = set(), set()
    for item in cls.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            defined.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            defined.add(item.target.id)
        elif isinstance(item, ast.Assign):
            defined.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (defined if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return defined, read


def mixins(classes: dict[str, tuple[ast.ClassDef, str]]) -> set[str]:
    """Classes named ``...Mixin``, and base classes of ours that read ``self`` attributes they never define: a part of
    another class split off into a file of its own, which works only inside the class that inherits it."""
    by_name = {node.name: qual for qual, (node, _) in classes.items()}
    found = {qual for qual, (node, _) in classes.items() if node.name.endswith("Mixin")}
    for node, _ in classes.values():
        for base in node.bases:
            qual = by_name.get(ast.unparse(base).rpartition(".")[2])
            if qual is None:
                continue
            base_node = classes[qual][0]
            if any(isinstance(b, ast.Name) and b.id in ("Protocol", "ABC") for b in base_node.bases):
                continue  # an interface, not a part of an implementation
            defined, read = _self_attributes(base_node)
            if read - defined:
                found.add(qual)
    return found


def test_no_mixin_classes_in_peer() -> None:
    found = mixins(_classes())
    assert found - MIXINS_ALLOWED == set()
    assert MIXINS_ALLOWED - found == set(), "no longer a mixin (or gone): remove from MIXINS_ALLOWED"


def test_the_mixin_check_finds_a_mixin() -> None:
    source = """
class Part:
    def helper(self):
        return self.host_state + 1

class Whole(Part):
    def __init__(self):
        self.host_state = 1

class Base:
    def __init__(self):
        self.x = 1
    def get(self):
        return self.x

class Derived(Base):
    pass

class WireMixin:
    pass
"""
    classes = {f"m.{n.name}": (n, "m") for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    assert mixins(classes) == {"m.Part", "m.WireMixin"}


# ------------------------------------------------------------------------------------- cross-object writes
def test_nothing_writes_another_objects_fields() -> None:
    """An object's fields are written by its own methods (tests/support/seams.py says what counts)."""
    assert cross_object_writes() == []


def test_every_third_party_write_allowed_still_exists_and_says_why() -> None:
    assert unused_allowances() == [], "no longer written (or moved): remove from THIRD_PARTY_WRITES"
    assert all(reason.strip() for reason in THIRD_PARTY_WRITES.values())


def _written(source: str) -> list[str]:
    return [w.target for w in writes_in(source)]


def test_the_write_check_finds_each_kind_of_cross_object_write() -> None:
    source = """
import os

class Driver:
    def __init__(self, coordinator, store):
        self.coordinator = coordinator
        self.store = store
        self.steps = {}
        self.count = 0

    def deep(self):
        self.coordinator.pacing.rate = 3       # self.a.b
        self.store.pin = 1                     # self.a

    def through_parameter(self, events):
        events.fetched = True                  # a parameter's field

    def through_alias(self, other):
        w = self.coordinator
        w.step = 1                             # an alias of self.<...>
        o = other.inner
        o.x, self.count = 1, 2                 # an alias of a parameter, in a tuple target
        o.y += 1

    def through_module(self):
        os.sep = "/"                           # a module's attribute

def patch():
    import json
    json.loads = None                          # a module imported in the function
"""
    assert sorted(_written(source)) == sorted(["self.coordinator.pacing.rate", "self.store.pin", "events.fetched",
                                               "w.step", "o.x", "o.y", "os.sep", "json.loads"])


def test_the_write_check_allows_own_fields_and_own_records() -> None:
    source = """
import pb

class Book:
    def __init__(self):
        self.entries = {}
        self.steps = {}
        self.total = 0

    def record(self, key):
        self.total += 1
        msg = pb.Foo()
        msg.data = b"x"
        for entry in self.entries.values():
            entry.n += 1
        st = self.steps[key]
        st.phase = "done"
        self.steps[key].attempt = 2

    @classmethod
    def load(cls):
        book = cls()
        book.total: int = 3
        return book
"""
    assert _written(source) == []


# ------------------------------------------------------------------------------------ the tests' own layout
# tests/<folder>/ mirrors a package of the code; four folders hold what spans packages: whole swarms of real
# processes, the benchmarks' tests, the project itself (install, images, docs, this file) and the shared support
CODE_FOLDERS = {"protocol", "scheduler", "identity", "net", "swarm", "compute", "runtime", "node", "observe",
                "emulation"}
CROSS_FOLDERS = {"swarms", "benchmarks", "project", "support"}


def test_no_test_module_imports_another() -> None:
    """What tests share lives in tests/support."""
    graph = graph_of_tests()
    assert len(graph) > 100, "the walk found too few test modules to be meaningful"
    assert _test_to_test_imports(graph) == []


def _test_to_test_imports(graph: dict[str, set[str]]) -> list[str]:
    def is_test_module(name: str) -> bool:
        return name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")

    return [f"{m} -> {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
            if is_test_module(t) and t != m]


def test_the_test_import_check_finds_one() -> None:
    graph = {"tests.swarms.test_a": {"tests.support.waits", "tests.swarms.test_b"}, "tests.swarms.test_b": set(),
             "tests.support.waits": set()}
    assert _test_to_test_imports(graph) == ["tests.swarms.test_a -> tests.swarms.test_b"]


def test_tests_are_grouped_in_folders_that_mirror_the_code() -> None:
    tests = ROOT / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == [], "a test module belongs in a folder of tests/"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert folders <= CODE_FOLDERS | CROSS_FOLDERS, folders - CODE_FOLDERS - CROSS_FOLDERS
    packages = {p.name for p in (ROOT / "peer").iterdir() if (p / "__init__.py").exists()} | {"protocol", "scheduler"}
    assert packages >= CODE_FOLDERS, f"a test folder names no package of the code: {CODE_FOLDERS - packages}"
    for folder in folders:
        assert (tests / folder / "__init__.py").exists(), f"tests/{folder} is not a package (test names would clash)"
        if folder != "support":
            assert list((tests / folder).glob("test_*.py")), f"tests/{folder} holds no test module"


# ------------------------------------------------------------------------------- registered extension points
def test_every_model_family_module_is_registered() -> None:
    """A family's module under peer/compute/family/ defines a ModelFamily that the registry holds: a family file
    that nobody registered is dead code a reader would take for a working family."""
    from tasklet.peer.compute import family

    registered = {type(family.family_by_kind(k)) for k in family.kinds()}
    assert {"gpt", "hf"} <= set(family.kinds())
    defined = []
    for path in sorted((ROOT / "peer" / "compute" / "family").glob("*.py")):
        tree = ast.parse(path.read_text())
        defined += [(path.stem, n.name) for n in tree.body if isinstance(n, ast.ClassDef)
                    and any(isinstance(b, ast.Name) and b.id == "ModelFamily" for b in n.bases)]
    assert defined, "no ModelFamily subclass found: the check reads the wrong folder"
    assert {name for _, name in defined} == {cls.__name__ for cls in registered}, (defined, registered)


def test_every_gradient_check_is_in_the_list_the_exchange_runs() -> None:
    """Each check class of peer/runtime/stage/gradient_checks.py is an entry of GRADIENT_CHECKS, once."""
    from tasklet.peer.runtime.stage import gradient_checks as gc

    path = ROOT / "peer" / "runtime" / "stage" / "gradient_checks.py"
    classes = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)
               and any(isinstance(f, ast.FunctionDef) and f.name == "inspect" for f in n.body)
               and not any(isinstance(b, ast.Name) and b.id == "Protocol" for b in n.bases)}
    listed = [type(c).__name__ for c in gc.GRADIENT_CHECKS]
    assert len(classes) >= 4 and sorted(listed) == sorted(classes), (classes, listed)
    names = [c.name for c in gc.GRADIENT_CHECKS]
    assert len(set(names)) == len(names), names
