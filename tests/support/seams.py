"""Writes into another object's fields, found from the source: the check behind ``tests/project/test_layout.py``'s
``test_nothing_writes_another_objects_fields``.

An object's fields are written by its own methods. An assignment (``=``, ``+=``, annotated, a tuple target's parts)
to ``X.attr`` is allowed when ``X`` is

* ``self`` or ``cls``;
* a name the same function made itself: not one of its parameters and not bound as an alias of ``self.<...>`` or of
  a parameter (``msg = pb.Foo(); msg.data = ...`` is fine, ``w = self.worker; w.x = 1`` is not);
* a record reached from ``self`` through a subscript or a call: an element of a container the object owns or a value
  one of its methods returned (``st = self._steps[k]; st.phase = ...``, ``for e in self._book.values(): e.n += 1``,
  ``self._steps[k].phase = ...``), or a new instance (``book = cls(); book.steps = 0``).

Everything else is a write into someone else's object: ``self.a.b = ...`` (depth two or more from ``self``), a
parameter's field, an alias's field, a module's attribute (``module.fn = ...``), a global's field. Objects of
third-party libraries that the code builds or configures are written through their own API, which sometimes is an
attribute (ctypes' ``argtypes``, a torch parameter's ``.grad``); such writes are listed in ``THIRD_PARTY_WRITES``
with the reason, one ``"path:target"`` entry each (no line number, so an edit elsewhere in the file does not move it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.imports import ROOT

# "path relative to the repository:target as written" -> why writing that third-party object's attribute is its API.
# An entry "path:name.*" covers every field of ``name`` there.
THIRD_PARTY_WRITES: dict[str, str] = {
    "peer/swarm/dht.py:node.protocol.storage": "hivemind's DHT node has no API to bound its storage: ours goes in",
    "peer/swarm/dht.py:node.protocol.cache": "the same, for its cache (our nodes never ask others to cache)",
    "peer/emulation/doors_attack.py:node.protocol.storage": "an attack's stranger DHT node: a storage that keeps "
                                                            "nothing (hivemind has no API for it)",
    "peer/emulation/doors_attack.py:node.protocol.cache": "the same, for its cache",
    "peer/emulation/doors_attack.py:node.protocol.record_validator": "an attack's DHT node signing as each of its "
                                                                     "free identities (hivemind signs as one)",
    "protocol/codec.py:msg.*": "a protobuf Tensor filled in place: the caller's `out` (envelope.tensors.add()) "
                               "saves the copy protobuf makes of an appended message",
    "protocol/lowbit.py:msg.*": "the same protobuf Tensor, its low-bit fields",
    "protocol/sparse.py:msg.*": "the same protobuf Tensor, its sparse low-bit fields",
    "peer/net/client.py:envelope.*": "a protobuf Envelope (or its wire form) to send: its header gets the protocol "
                                     "version and sender when the caller left them empty",
    "peer/net/server.py:request.sender": "a received protobuf request: the TLS-authenticated caller replaces the "
                                         "sender it claims",
    "protocol/message.py:_ONES_F32.flags.writeable": "numpy's way to make an array read-only",
    "peer/compute/reference.py:anchor[n].grad": "torch's way to hand an optimizer a gradient",
}

SCOPE = ("peer", "scheduler", "protocol")

_OWNED, _SELF, _PARAM, _ALIAS, _MODULE, _GLOBAL = "owned", "self", "parameter", "alias", "module", "global"


@dataclass(frozen=True)
class Write:
    """One write into another object's field: where, the target as written, and what ``X`` is."""

    line: int
    target: str
    why: str


def _chain(expr: ast.expr) -> tuple[str | None, list[str]]:
    """The name an expression is reached from and the steps from it (``"attr"``, ``"index"``, ``"call"``):
    ``self._book.values()`` -> ("self", ["attr", "attr", "call"]); None for anything not rooted in a name."""
    steps: list[str] = []
    while True:
        if isinstance(expr, ast.Attribute):
            steps.append("attr")
            expr = expr.value
        elif isinstance(expr, ast.Subscript):
            steps.append("index")
            expr = expr.value
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr" \
                and expr.args:
            steps.append("attr")  # getattr(x, name) is x.<name>
            expr = expr.args[0]
        elif isinstance(expr, ast.Call):
            steps.append("call")
            expr = expr.func
        elif isinstance(expr, ast.Starred | ast.Await):
            expr = expr.value
        elif isinstance(expr, ast.Name):
            return expr.id, steps[::-1]
        else:
            return None, []


def _own_record(steps: list[str]) -> bool:
    """A chain from ``self`` through a subscript or a call: an element of a container the object owns, a value one
    of its methods returned, a new instance (``cls(...)``), not the object held in one of its fields."""
    return "index" in steps or "call" in steps


class _Scope:
    """The names one function (or the module) binds, and what each is bound to."""

    def __init__(self, node: ast.AST, parent: _Scope | None) -> None:
        self.parent = parent
        self.is_class = isinstance(node, ast.ClassDef)
        self.params: set[str] = set()
        self.bound: dict[str, list[ast.expr | None]] = {}  # name -> values it is bound to (None: made here)
        self.imported: set[str] = set()
        self.declared_outer: set[str] = set()  # global / nonlocal
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            self.params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
            self.params |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
            body: list[ast.AST] = [node.body] if isinstance(node, ast.Lambda) else list(node.body)
        else:
            body = list(getattr(node, "body", []))
        for stmt in body:
            for child in _walk_own(stmt):
                self._bind(child)

    def _bind(self, node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind_target(target, node.value)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr) and node.value is not None:
            self._bind_target(node.target, node.value)
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            self._bind_target(node.target, node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._bind_target(node.optional_vars, node.context_expr)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            self.imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Global | ast.Nonlocal):
            self.declared_outer |= set(node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            self.imported.add(node.name)  # a function or class object: its attributes are module-level state
        elif isinstance(node, ast.ExceptHandler) and node.name:
            self.bound.setdefault(node.name, []).append(None)

    def _bind_target(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self.bound.setdefault(target.id, []).append(value)
        elif isinstance(target, ast.Tuple | ast.List):
            values = value.elts if isinstance(value, ast.Tuple | ast.List) and len(value.elts) == len(target.elts) \
                else [value] * len(target.elts)
            for t, v in zip(target.elts, values, strict=True):
                self._bind_target(t, v)
        elif isinstance(target, ast.Starred):
            self._bind_target(target.value, value)

    def kind(self, name: str, seen: frozenset[str] = frozenset()) -> str:
        """What ``name`` is in this scope: one of the kinds above."""
        if name in self.declared_outer or (name not in self.params and name not in self.bound
                                           and name not in self.imported):
            outer = self.parent
            while outer is not None and outer.is_class:  # a class body's names are not seen by its methods
                outer = outer.parent
            if outer is None:
                return _GLOBAL
            kind = outer.kind(name, seen)
            return _GLOBAL if kind == _OWNED and outer.parent is None else kind
        if name in ("self", "cls") and name in self.params:
            return _SELF
        if name in self.params:
            return _PARAM
        if name in self.imported:
            return _MODULE
        if name in seen:
            return _OWNED
        kinds = {self._value_kind(v, seen | {name}) for v in self.bound[name]}
        for worst in (_PARAM, _ALIAS, _MODULE, _GLOBAL, _SELF):
            if worst in kinds:
                return worst
        return _OWNED

    def _value_kind(self, value: ast.expr | None, seen: frozenset[str]) -> str:
        """What a name bound to ``value`` is: an alias of ``self``'s field or of a parameter, or something made here."""
        if value is None:
            return _OWNED
        if isinstance(value, ast.IfExp):
            kinds = {self._value_kind(value.body, seen), self._value_kind(value.orelse, seen)}
            return next((k for k in (_PARAM, _ALIAS, _MODULE, _SELF) if k in kinds), _OWNED)
        if isinstance(value, ast.BoolOp):
            kinds = {self._value_kind(v, seen) for v in value.values}
            return next((k for k in (_PARAM, _ALIAS, _MODULE, _SELF) if k in kinds), _OWNED)
        root, steps = _chain(value)
        if root is None:
            return _OWNED
        root_kind = self.kind(root, seen)
        if root_kind == _SELF:
            return _SELF if not steps else (_OWNED if _own_record(steps) else _ALIAS)
        if root_kind in (_PARAM, _ALIAS):
            return _ALIAS
        if root_kind in (_MODULE, _GLOBAL):
            # ``pb.Foo()``, ``make(x)``: a new object; ``module.thing`` / ``GLOBAL``: the module's own object
            return _OWNED if "call" in steps else _ALIAS
        return _OWNED


def _walk_own(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` that yields nested functions, lambdas and classes but does not go into them."""
    yield node
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk_own(child)


def _targets(node: ast.AST) -> Iterator[ast.Attribute]:
    """The attribute targets an assignment statement writes (tuple targets' parts included)."""
    if isinstance(node, ast.Assign):
        roots: list[ast.expr] = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        roots = [node.target]
    else:
        return
    while roots:
        t = roots.pop()
        if isinstance(t, ast.Tuple | ast.List):
            roots.extend(t.elts)
        elif isinstance(t, ast.Starred):
            roots.append(t.value)
        elif isinstance(t, ast.Attribute):
            yield t


def _judge(target: ast.Attribute, scope: _Scope) -> str | None:
    """Why writing ``target`` writes another object's field, or None when the object is this code's own."""
    root, steps = _chain(target.value)
    if root is None:
        return "a field of an expression's value"
    kind = scope.kind(root)
    if kind == _SELF:
        if not steps:
            return None
        return None if _own_record(steps) else f"a field of {ast.unparse(target.value)}"
    if kind == _OWNED:
        return None if not steps else f"a field of a field of {root} (depth >= 2)"
    return {_PARAM: f"a field of the parameter {root}", _ALIAS: f"a field of {root}, an alias of another object's",
            _MODULE: f"an attribute of the module or module-level object {root}",
            _GLOBAL: f"a field of the global {root}"}[kind]


def writes_in(source: str) -> list[Write]:
    """Every write into another object's field in one module's source, in line order."""
    tree = ast.parse(source)
    found: list[Write] = []

    def visit(node: ast.AST, scope: _Scope) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, _Scope(child, scope))
                continue
            if isinstance(child, ast.ClassDef):
                visit(child, _Scope(child, scope))
                continue
            for target in _targets(child):
                why = _judge(target, scope)
                if why is not None:
                    found.append(Write(child.lineno, ast.unparse(target), why))
            visit(child, scope)

    visit(tree, _Scope(tree, None))
    return sorted(found, key=lambda w: w.line)


def _python_files(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        yield from (f for f in files if not f.name.endswith("_pb2.py"))


def cross_object_writes(paths: Iterable[Path] = tuple(ROOT / p for p in SCOPE),
                        allowed: dict[str, str] | None = None) -> list[str]:
    """``"path:line: target (why)"`` for every write into another object's field in the modules under ``paths``
    (``*_pb2.py`` skipped), less the entries of ``allowed`` (``THIRD_PARTY_WRITES`` by default)."""
    allowed = THIRD_PARTY_WRITES if allowed is None else allowed
    bad = []
    for path in _python_files(paths):
        rel = path.resolve().relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else str(path)
        for w in writes_in(path.read_text()):
            if not _allowed(f"{rel}:{w.target}", allowed):
                bad.append(f"{rel}:{w.line}: {w.target} ({w.why})")
    return bad


def _allowed(where: str, allowed: dict[str, str]) -> bool:
    """``where`` ("path:target") is an entry of ``allowed``, or the field of a "path:name.*" entry's ``name``."""
    path, _, target = where.partition(":")
    return where in allowed or f"{path}:{target.rpartition('.')[0]}.*" in allowed


def unused_allowances(paths: Iterable[Path] = tuple(ROOT / p for p in SCOPE),
                      allowed: dict[str, str] | None = None) -> list[str]:
    """Entries of ``allowed`` that no longer match a write (so the list can only shrink)."""
    allowed = THIRD_PARTY_WRITES if allowed is None else allowed
    seen: set[str] = set()
    for path in _python_files(paths):
        rel = path.resolve().relative_to(ROOT).as_posix()
        seen |= {f"{rel}:{w.target}" for w in writes_in(path.read_text())}
    return sorted(entry for entry in allowed if not any(_allowed(w, {entry: ""}) for w in seen))
