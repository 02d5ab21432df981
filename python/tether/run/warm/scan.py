"""What a warm zygote preloads for a script: the installed packages (and standard-library
modules) that the script imports, read from its source without running it (``ast``), and
from the sources of the user's own modules it imports, followed the same way (at most
``MAX_FILES`` files). The user's own modules are never preloaded: they may change between
attempts, and each rank imports them afresh, as a new interpreter does.

A rank gets a preloaded module only when its own import reaches it (``run.warm.serve``), and
only when what the module's import read is what the rank has then; else the rank imports it
itself. A module of compiled code (torch, numpy) cannot be imported twice in a process, so
for it that check must hold by construction: the scan tells the imports that the script
makes unconditionally before any statement that could change what an import reads (its
*prefix*: imports, definitions, assignments of names, ``if TYPE_CHECKING:``, ``try: import
... except ImportError:``, warnings filters and prints), and only these may load compiled
code in the zygote.

A name is looked up as the rank's interpreter would look it up (``sys.path``, the script's
directory first), with the import system's path finder, which imports nothing: a module of
the user's that shadows an installed one is the user's. Imports under ``if TYPE_CHECKING:``
are not counted, nor standard-library modules that act on the terminal or the desktop at
import (``readline``, ``curses``, ``tkinter``, ...)."""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Set, Tuple

from tether.zygote import client

from .prefix import Scope

#: The most source files read (the script and the user's own modules it imports).
MAX_FILES = 200
#: A source file larger than this is not read.
MAX_BYTES = 4 << 20
#: Standard-library modules whose import acts on the terminal or the desktop.
NEVER = frozenset(
    {"__main__", "antigravity", "curses", "idlelib", "readline", "rlcompleter", "this"}
    | {"tkinter", "turtle", "turtledemo"}
)


class Places:
    """Where installed packages, the standard library and tether itself live."""

    def __init__(self) -> None:
        self.installed = tuple(client._site_dirs())
        self.stdlib = tuple(client._stdlib_dirs())
        self.tether = os.path.realpath(os.path.dirname(os.path.abspath(__file__))) + os.sep

    def kind(self, path: str) -> str:
        """``installed``, ``stdlib``, ``tether`` or ``own`` (anything else: the user's)."""
        real = os.path.realpath(path)
        if real.startswith(self.tether):
            return "tether"
        if real.startswith(self.installed):
            return "installed"
        if real.startswith(self.stdlib) and "-packages" not in real:
            return "stdlib"
        return "own"


def find(name: str, search: Sequence[str]) -> Optional[importlib.machinery.ModuleSpec]:
    """The spec of the module ``name`` (dotted), found on ``search`` and in the packages'
    own directories, without importing anything; None when there is none, or when it is
    built in or frozen (nothing to import there)."""
    spec = None
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        where = list(search) if spec is None else spec.submodule_search_locations
        if where is None:
            return None
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), where)
        except (ImportError, ValueError, OSError):
            return None
        if spec is None:
            return None
    return spec


def _location(spec: importlib.machinery.ModuleSpec) -> Optional[str]:
    if spec.origin and os.path.isabs(spec.origin):
        return spec.origin
    locations = list(spec.submodule_search_locations or ())
    return locations[0] if locations else None


class Plan(NamedTuple):
    """What a script imports: every installed or standard module, in the order met, and
    those of them in the script's prefix (see the module's documentation)."""

    found: Tuple[str, ...]
    prefix: FrozenSet[str]


class Scan:
    """The modules found so far, in the order met."""

    def __init__(self, places: Places, search: Sequence[str]) -> None:
        self.places = places
        self.search = list(search)
        self.found: List[str] = []
        self.prefix: Set[str] = set()
        self.read: Set[str] = set()
        #: Whether every statement run so far is one that cannot change what an import reads.
        self.pure = True
        self.kinds: Dict[str, str] = {}

    def plan(self) -> Plan:
        return Plan(tuple(self.found), frozenset(self.prefix))

    def add(self, name: str, prefix: bool) -> None:
        if name.split(".")[0] in NEVER:
            return
        if name not in self.found:
            self.found.append(name)
        if prefix:
            self.prefix.add(name)

    def module(self, name: str, names: Sequence[str], prefix: bool) -> None:
        """An import of ``name`` (``from name import names``), unconditional in the prefix
        when ``prefix``."""
        spec = find(name, self.search)
        where = None if spec is None else _location(spec)
        if spec is None or where is None:
            if spec is None and name.split(".")[0] not in sys.builtin_module_names:
                self.pure = False  # not found here: what runs instead is unknown
            return
        kind = self.places.kind(where)
        if kind == "own":
            self.source(spec, name, prefix)
        elif kind in ("installed", "stdlib"):
            self.add(name, prefix and self.pure)
        for sub in names:
            if sub != "*" and spec.submodule_search_locations is not None:
                child = f"{name}.{sub}"
                if find(child, self.search) is not None:
                    self.module(child, (), prefix)

    def source(self, spec: importlib.machinery.ModuleSpec, name: str, prefix: bool) -> None:
        """Follows a module of the user's: its statements run now, its imports count too."""
        if spec.origin and spec.origin.endswith(".py"):
            is_package = spec.submodule_search_locations is not None
            self.file(spec.origin, name if is_package else name.rpartition(".")[0], prefix)
        else:
            self.pure = False

    def file(self, path: str, package: Optional[str], unconditional: bool = True) -> None:
        """The source file ``path`` of ``package`` (for relative imports), run (a file that
        cannot be read is taken to change anything: nothing after it is in the prefix)."""
        real = os.path.realpath(path)
        if real in self.read:
            return
        if len(self.read) >= MAX_FILES:
            self.pure = False
            return
        self.read.add(real)
        try:
            if os.path.getsize(real) > MAX_BYTES:
                raise ValueError("too large")
            with open(real, "rb") as f:
                tree = ast.parse(f.read(), filename=path)
        except (OSError, SyntaxError, ValueError):
            self.pure = False
            return
        scope = Scope(self.kind_of)
        self.body(tree.body, package, unconditional, scope)

    def kind_of(self, top: str) -> str:
        """``stdlib``, ``installed``, ``own`` or ``missing``: where the top-level module
        ``top`` is found."""
        kind = self.kinds.get(top)
        if kind is None:
            spec = find(top, self.search)
            where = None if spec is None else _location(spec)
            if where is not None:
                kind = self.places.kind(where)
            else:
                kind = "stdlib" if top in sys.builtin_module_names else "missing"
            self.kinds[top] = kind
        return kind

    def body(
        self,
        statements: Sequence[ast.stmt],
        package: Optional[str],
        unconditional: bool,
        scope: Any,
    ) -> None:
        for statement in statements:
            self.statement(statement, package, unconditional, scope)

    def statement(
        self, node: ast.stmt, package: Optional[str], unconditional: bool, scope: Any
    ) -> None:
        """One statement, run in order: its imports, and whether the prefix ends here."""
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found = imports_of(node, package)
            for name, names in found:
                self.module(name, names, unconditional and self.pure)
            scope.bind_import(node, [name for name, _ in found])
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            self.body(node.orelse, package, unconditional, scope)
        elif isinstance(node, ast.Try):
            self.body(node.body, package, unconditional, scope)
            for handler in node.handlers:
                self.body(handler.body, package, False, scope)
            self.body(node.orelse, package, False, scope)
            self.body(node.finalbody, package, unconditional, scope)
        elif isinstance(node, (ast.If, ast.For, ast.With)) and self._block(node, scope):
            inner = isinstance(node, ast.With) and unconditional
            self.body(node.body, package, inner, scope)
            self.body(getattr(node, "orelse", []), package, False, scope)
        elif isinstance(node, ast.ClassDef) and scope.define(node):
            self.body(node.body, package, unconditional, scope)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and scope.define(node):
            self.later(node, package)
        elif not scope.harmless(node):
            self.pure = False
            self.later(node, package)

    @staticmethod
    def _block(node: ast.stmt, scope: Any) -> bool:
        """Whether the head of an ``if``, ``for`` or ``with`` is harmless (its names bound)."""
        if isinstance(node, ast.If):
            return bool(scope.expression(node.test))
        if isinstance(node, ast.For):
            if scope.expression(node.iter) and scope.target(node.target):
                scope.bind(node.target, None)
                return True
            return False
        items = getattr(node, "items", [])
        if all(scope.expression(item.context_expr) for item in items):
            for item in items:
                if item.optional_vars is not None:
                    scope.bind(item.optional_vars, None)
            return True
        return False

    def later(self, node: ast.AST, package: Optional[str]) -> None:
        """The imports inside ``node`` (a function's body, a loop, ...), which run later if
        at all: never in the prefix."""
        pure = self.pure
        todo: List[ast.AST] = list(ast.iter_child_nodes(node))
        while todo:
            sub = todo.pop(0)
            if isinstance(sub, ast.If) and _is_type_checking(sub.test):
                todo[:0] = sub.orelse
                continue
            if isinstance(sub, (ast.Import, ast.ImportFrom)):
                for name, names in imports_of(sub, package):
                    self.module(name, names, False)
            todo[:0] = list(ast.iter_child_nodes(sub))
        self.pure = pure


def imports_of(node: ast.AST, package: Optional[str]) -> List[Tuple[str, List[str]]]:
    """What an import statement imports: ``import a.b`` is ``("a.b", [])``, ``from a import
    b, c`` is ``("a", ["b", "c"])``; relative imports made absolute against ``package``."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module != "__future__":
        base = _absolute(node.module, node.level, package)
        if base is not None:
            return [(base, [alias.name for alias in node.names])]
    return []


def imports(tree: ast.AST, package: Optional[str]) -> List[Tuple[str, List[str]]]:
    """Every ``(module, names)`` a tree imports, in source order (nothing under ``if
    TYPE_CHECKING:``)."""
    found: List[Tuple[str, List[str]]] = []
    todo: List[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(reversed(node.orelse))
            continue
        found += imports_of(node, package)
        todo.extend(reversed(list(ast.iter_child_nodes(node))))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _absolute(module: Optional[str], level: int, package: Optional[str]) -> Optional[str]:
    if level == 0:
        return module
    if not package:
        return None
    parts = package.split(".")
    if level - 1 > len(parts) - 1:
        return None
    base = ".".join(parts[: len(parts) - (level - 1)])
    return f"{base}.{module}" if module else base


def main_module(name: str, search: Sequence[str]) -> Optional[Tuple[str, Optional[str]]]:
    """The source file and package of ``python -m name``: the module, or a package's
    ``__main__``."""
    spec = find(name, search)
    if spec is None:
        return None
    if spec.submodule_search_locations is not None:
        name = f"{name}.__main__"
        spec = find(name, search)
        if spec is None:
            return None
    if not spec.origin or not os.path.isabs(spec.origin):
        return None
    return spec.origin, name.rpartition(".")[0] or None


def plan(event: str, target: str) -> Plan:
    """What ``python -u SCRIPT`` (``event`` ``cpython.run_file``, ``target`` the script) or
    ``python -u -m MODULE`` (``cpython.run_module``) imports; the script's directory (or
    ``-m``'s working directory) is ``sys.path[0]``."""
    scan = Scan(Places(), sys.path)
    if event == "cpython.run_file":
        scan.file(target, None)
    else:
        main = main_module(target, sys.path)
        if main is not None:
            package = main[1]
            if package:
                scan.module(package, (), True)
            scan.file(main[0], package)
    return scan.plan()
