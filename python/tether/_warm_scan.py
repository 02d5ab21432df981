"""What a warm zygote preloads for a script: the installed packages (and standard-library
modules) that the script imports, read from its source without running it (``ast``), and
from the sources of the user's own modules it imports, followed the same way (at most
``MAX_FILES`` files). The user's own modules are never preloaded: they may change between
attempts, and each rank imports them afresh, as a new interpreter does.

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
from typing import List, Optional, Sequence, Set, Tuple

from . import _zygote

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
        self.installed = tuple(_zygote._site_dirs())
        self.stdlib = tuple(_zygote._stdlib_dirs())
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


class Scan:
    """The modules found so far, in the order met."""

    def __init__(self, places: Places, search: Sequence[str]) -> None:
        self.places = places
        self.search = list(search)
        self.found: List[str] = []
        self.read: Set[str] = set()

    def add(self, name: str) -> None:
        if name not in self.found and name.split(".")[0] not in NEVER:
            self.found.append(name)

    def module(self, name: str, names: Sequence[str] = ()) -> None:
        """An import of ``name`` (``from name import names``)."""
        spec = find(name, self.search)
        where = None if spec is None else _location(spec)
        if spec is None or where is None:
            return
        kind = self.places.kind(where)
        if kind == "own":
            self.source(spec, name)
        elif kind in ("installed", "stdlib"):
            self.add(name)
        for sub in names:
            if sub != "*" and spec.submodule_search_locations is not None:
                child = f"{name}.{sub}"
                if find(child, self.search) is not None:
                    self.module(child)

    def source(self, spec: importlib.machinery.ModuleSpec, name: str) -> None:
        """Follows a module of the user's: its own imports count too."""
        if spec.origin and spec.origin.endswith(".py"):
            is_package = spec.submodule_search_locations is not None
            self.file(spec.origin, name if is_package else name.rpartition(".")[0])

    def file(self, path: str, package: Optional[str]) -> None:
        """The imports of the source file ``path``, of ``package`` (for relative imports)."""
        real = os.path.realpath(path)
        if real in self.read or len(self.read) >= MAX_FILES:
            return
        self.read.add(real)
        try:
            if os.path.getsize(real) > MAX_BYTES:
                return
            with open(real, "rb") as f:
                tree = ast.parse(f.read(), filename=path)
        except (OSError, SyntaxError, ValueError):
            return
        for name, names in imports(tree, package):
            self.module(name, names)


def imports(tree: ast.AST, package: Optional[str]) -> List[Tuple[str, List[str]]]:
    """Every ``(module, names)`` a tree imports (``import a.b``: ``("a.b", [])``; ``from a
    import b, c``: ``("a", ["b", "c"])``), relative imports made absolute against
    ``package``, in source order; nothing under ``if TYPE_CHECKING:``."""
    found: List[Tuple[str, List[str]]] = []
    todo: List[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(reversed(node.orelse))
            continue
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            if base is not None:
                found.append((base, [alias.name for alias in node.names]))
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


def preload(event: str, target: str, extra: Sequence[str] = ()) -> List[str]:
    """The modules the zygote of ``python -u SCRIPT`` (``event`` ``cpython.run_file``,
    ``target`` the script) or ``python -u -m MODULE`` (``cpython.run_module``) preloads, then
    ``extra``; the script's directory (or ``-m``'s working directory) is ``sys.path[0]``."""
    scan = Scan(Places(), sys.path)
    if event == "cpython.run_file":
        scan.file(target, None)
    else:
        main = main_module(target, sys.path)
        if main is not None:
            package = main[1]
            if package:
                scan.module(package)
            scan.file(main[0], package)
    for name in extra:
        scan.add(name)
    return scan.found
