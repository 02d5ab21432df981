"""Which statements of a script (and of the user's modules it imports) cannot change what an
import reads: the environment, ``sys.path`` and the import hooks, the working directory. The
imports a script makes unconditionally before its first other statement are its *prefix*
(``run.warm.scan``): only they may load compiled code in a warm zygote, which a rank cannot
import a second time if what it reads turned out different.

A statement is harmless when it only binds names, defines functions and classes, reads, or
calls the standard library outside what changes those (``os.putenv``, ``os.chdir``,
``site``, ``importlib``, ``ctypes``, a change of ``os.environ`` or ``sys.path``, or of an
alias of them) and methods of the objects such calls made. A call of the user's own code or
of an installed package's (``load_dotenv()``) may do anything: the prefix ends there."""

from __future__ import annotations

import ast
import builtins
from typing import Callable, Dict, Optional, Sequence, Tuple

#: What a change of ends the prefix (a name starting so, or an alias of one of them).
PROTECTED: Tuple[str, ...] = (
    "os.environ",
    "os.environb",
    "sys.path",
    "sys.meta_path",
    "sys.path_hooks",
)
PROTECTED += ("sys.modules", "sys.path_importer_cache")
#: Methods of protected objects that only read.
READERS = {"get", "copy", "keys", "values", "items", "index", "count", "__contains__"}
#: Standard-library functions (and modules) that may change what an import reads.
CHANGERS: Tuple[str, ...] = (
    "os.putenv",
    "os.unsetenv",
    "os.chdir",
    "os.fchdir",
    "os.chroot",
    "site",
)
CHANGERS += ("importlib", "runpy", "ctypes", "builtins", "pkgutil", "zipimport", "imp")
#: Built-in functions that may run or change anything.
BUILTIN_CHANGERS = {"exec", "eval", "compile", "setattr", "delattr", "__import__", "globals"}
BUILTIN_CHANGERS |= {"vars", "locals", "breakpoint", "input"}

#: What a name is bound to: a module or a member of one (``module:os.path``), an object
#: made in the script by harmless code (``local``), an alias of a protected object
#: (``alias``), or something of the user's (``own``: a function or class defined here).
Binding = str


class Scope:
    """The names of one source file, as its statements run."""

    def __init__(self, kind_of: Callable[[str], str]) -> None:
        #: The kind of a top-level module: ``stdlib``, ``installed``, ``own`` or ``missing``.
        self.kind_of = kind_of
        self.names: Dict[str, Binding] = {}

    def bind_import(self, node: ast.AST, absolute: Sequence[str]) -> None:
        """Binds the names an import statement binds (``absolute``: the module it imports,
        made absolute, for ``from`` imports)."""
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    self.names[alias.asname] = f"module:{alias.name}"
                else:
                    top = alias.name.split(".")[0]
                    self.names[top] = f"module:{top}"
        elif isinstance(node, ast.ImportFrom) and absolute:
            for alias in node.names:
                if alias.name != "*":
                    self.names[alias.asname or alias.name] = f"module:{absolute[0]}.{alias.name}"

    def resolve(self, node: ast.AST) -> Optional[str]:
        """The dotted name an expression names (``os.environ.get`` for ``environ.get`` after
        ``from os import environ``), ``local...``/``alias...``/``own...`` for a name bound
        here, or None."""
        if isinstance(node, ast.Name):
            bound = self.names.get(node.id)
            if bound is None:
                return node.id if hasattr(builtins, node.id) else None
            return bound[len("module:") :] if bound.startswith("module:") else bound
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    # -- statements ----------------------------------------------------------------------

    def harmless(self, node: ast.stmt) -> bool:
        """Whether the simple statement ``node`` cannot change what an import reads (and
        binds what it binds)."""
        if isinstance(node, (ast.Pass, ast.Global, ast.Nonlocal, ast.Break, ast.Continue)):
            return True
        if isinstance(node, ast.Expr):
            return self.expression(node.value)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if value is not None and not self.expression(value):
                return False
            if not all(self.target(t) for t in targets):
                return False
            for target in targets:
                self.bind(target, value)
            return True
        if isinstance(node, ast.Assert):
            return self.expression(node.test) and (node.msg is None or self.expression(node.msg))
        if isinstance(node, ast.Raise):
            return node.exc is None or self.expression(node.exc)
        if isinstance(node, ast.Delete):
            return all(isinstance(t, ast.Name) or self.target(t) for t in node.targets)
        return False

    def target(self, node: ast.AST) -> bool:
        """Whether assigning to ``node`` changes nothing protected: a name, or an item or
        attribute of an object the script made."""
        if isinstance(node, ast.Name):
            return True
        if isinstance(node, (ast.Tuple, ast.List)):
            return all(self.target(t) for t in node.elts)
        if isinstance(node, ast.Starred):
            return self.target(node.value)
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            base = node.value
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            return isinstance(base, ast.Name) and self.names.get(base.id) == "local"
        return False

    def bind(self, target: ast.AST, value: Optional[ast.AST]) -> None:
        if isinstance(target, ast.Name):
            named = None if value is None else self.resolve(value)
            own = named is not None and (named == "own" or named.startswith("own."))
            self.names[target.id] = "alias" if _protected(named) else "own" if own else "local"
        elif isinstance(target, (ast.Tuple, ast.List)):
            for each in target.elts:
                self.bind(each, None)

    def define(self, node: ast.AST) -> bool:
        """A ``def`` or ``class`` statement: whether its decorators, bases and defaults are
        harmless; binds its name (the user's own: calling it may do anything)."""
        parts = list(getattr(node, "decorator_list", []))
        if isinstance(node, ast.ClassDef):
            parts += node.bases + [k.value for k in node.keywords]
        else:
            arguments = getattr(node, "args", None)
            if arguments is not None:
                parts += [d for d in arguments.defaults + arguments.kw_defaults if d is not None]
        harmless = all(self.expression(part) for part in parts)
        self.names[getattr(node, "name", "")] = "own"
        return harmless

    # -- expressions ---------------------------------------------------------------------

    def expression(self, node: ast.AST) -> bool:
        """Whether evaluating ``node`` cannot change what an import reads."""
        if isinstance(node, ast.Call):
            if not self.call(node):
                return False
        elif isinstance(node, ast.NamedExpr):
            self.names[node.target.id] = "local"
        elif isinstance(node, (ast.Await, ast.Yield, ast.YieldFrom)):
            return False
        elif isinstance(node, ast.Lambda):
            return True  # made, not run
        return all(self.expression(child) for child in ast.iter_child_nodes(node))

    def call(self, node: ast.Call) -> bool:
        """Whether the call itself (its function) is harmless."""
        func = node.func
        named = self.resolve(func)
        if named is None:
            # A method of what a harmless call made: ``Path(p).resolve()``.
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call):
                return self.call(func.value)
            return False
        if named.startswith(("local.", "own.", "alias.")) or named in ("own", "alias"):
            head, _, method = named.partition(".")
            return head == "local" or (head == "alias" and method in READERS)
        if _protected(named):
            return named.rpartition(".")[2] in READERS
        if "." not in named:
            return hasattr(builtins, named) and named not in BUILTIN_CHANGERS
        if named.startswith(CHANGERS) and _member_of(named, CHANGERS):
            return False
        return self.kind_of(named.split(".")[0]) == "stdlib"


def _protected(named: Optional[str]) -> bool:
    return named is not None and (named == "alias" or _member_of(named, PROTECTED))


def _member_of(named: str, roots: Sequence[str]) -> bool:
    """Whether the dotted ``named`` is one of ``roots`` or inside one."""
    return any(named == root or named.startswith(root + ".") for root in roots)
