"""What a warm zygote preloads for a script: the installed packages (and standard-library
modules) that the script imports, read from its source without running it (``ast``), and
from the sources of the user's own modules it imports, followed the same way (at most
``MAX_FILES`` files). The user's own modules are never preloaded: they may change between
attempts, and each rank imports them afresh, as a new interpreter does.

What a package sees at import must be what it would see in the rank: from the first
statement that changes the environment, ``sys.path``, the import hooks or the working
directory (``os.environ[...] = ...``, ``os.putenv``, ``sys.path.insert``,
``site.addsitedir``, ``os.chdir``, ...), in a file or in one of the user's modules it
imports, the imports that follow are left to the ranks (``import os; os.environ["OMP_NUM_THREADS"]
= "4"; import numpy``: numpy is not preloaded, its threads must see the 4).

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
from typing import Dict, List, Optional, Sequence, Set, Tuple

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
        #: Whether each file read changes what later imports see.
        self.changes: Dict[str, bool] = {}

    def add(self, name: str) -> None:
        if name not in self.found and name.split(".")[0] not in NEVER:
            self.found.append(name)

    def module(self, name: str, names: Sequence[str] = ()) -> bool:
        """An import of ``name`` (``from name import names``); whether it changes what later
        imports see (a module of the user's that does)."""
        spec = find(name, self.search)
        where = None if spec is None else _location(spec)
        if spec is None or where is None:
            return False
        kind = self.places.kind(where)
        changes = False
        if kind == "own":
            changes = self.source(spec, name)
        elif kind in ("installed", "stdlib"):
            self.add(name)
        for sub in names:
            if changes:
                break
            if sub != "*" and spec.submodule_search_locations is not None:
                child = f"{name}.{sub}"
                if find(child, self.search) is not None:
                    changes = self.module(child)
        return changes

    def source(self, spec: importlib.machinery.ModuleSpec, name: str) -> bool:
        """Follows a module of the user's: its own imports count too."""
        if spec.origin and spec.origin.endswith(".py"):
            is_package = spec.submodule_search_locations is not None
            return self.file(spec.origin, name if is_package else name.rpartition(".")[0])
        return False

    def file(self, path: str, package: Optional[str]) -> bool:
        """The imports of the source file ``path``, of ``package`` (for relative imports);
        whether it changes what later imports see (a file that cannot be read is taken to:
        when in doubt, nothing after it is preloaded)."""
        real = os.path.realpath(path)
        if real in self.read:
            return self.changes.get(real, False)
        if len(self.read) >= MAX_FILES:
            return True
        self.read.add(real)
        try:
            if os.path.getsize(real) > MAX_BYTES:
                raise ValueError("too large")
            with open(real, "rb") as f:
                tree = ast.parse(f.read(), filename=path)
        except (OSError, SyntaxError, ValueError):
            self.changes[real] = True
            return True
        found, changes = imports(tree, package)
        for name, names in found:
            if self.module(name, names):
                changes = True
                break
        self.changes[real] = changes
        return changes


def imports(tree: ast.AST, package: Optional[str]) -> Tuple[List[Tuple[str, List[str]]], bool]:
    """Every ``(module, names)`` a tree imports (``import a.b``: ``("a.b", [])``; ``from a
    import b, c``: ``("a", ["b", "c"])``), relative imports made absolute against
    ``package``, in source order, up to its first change of what later imports see; and
    whether it has one. Nothing under ``if TYPE_CHECKING:`` counts."""
    found: List[Tuple[str, List[str]]] = []
    todo: List[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(reversed(node.orelse))
            continue
        if _changes_imports(node):
            return found, True
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            if base is not None:
                found.append((base, [alias.name for alias in node.names]))
        todo.extend(reversed(list(ast.iter_child_nodes(node))))
    return found, False


#: Calls that change what an import sees, whatever they are called on.
_CHANGING_CALLS = {"putenv", "unsetenv", "chdir", "fchdir", "addsitedir"}
#: Methods that change a mapping or a list.
_MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "insert", "append", "extend"}
_MUTATORS |= {"remove", "__setitem__", "__delitem__"}
#: What a change is made to: ``os.environ``, ``sys.path``, ``sys.meta_path``, ...
_WATCHED = {"os": {"environ", "environb"}, "sys": {"path", "meta_path", "path_hooks"}}


def _names(node: ast.AST) -> bool:
    """Whether ``node`` names the environment (``os.environ``, or ``environ`` imported from
    os), ``sys.path`` or the import hooks; ``x[k]`` counts as ``x``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.attr in _WATCHED.get(node.value.id, ())
    return isinstance(node, ast.Name) and node.id in _WATCHED["os"]


def _changes_imports(node: ast.AST) -> bool:
    """Whether the statement or call ``node`` changes the environment, ``sys.path``, the
    import hooks or the working directory."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        return any(_names(target) for target in targets)
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id in _CHANGING_CALLS
    if isinstance(func, ast.Attribute):
        if func.attr in _CHANGING_CALLS:
            return True
        return func.attr in _MUTATORS and _names(func.value)
    return False


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
