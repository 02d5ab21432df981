"""What one import did, as a warm zygote recorded it (``run.warm.record``) and as a rank replays
it (``run.warm.serve``): a ``Node`` per package whose import the zygote ran, with the modules it
loaded, what its import read (``Inputs``) and, in order, what it did to the process (its
``ops``): the nodes of other packages it imported, warnings it issued, what it wrote on
stdout and stderr, warnings filters, ``atexit`` functions, signal handlers, loggers, import
hooks and the attributes it set on modules loaded before it.

A node's state is applied by ``apply`` (in a rank, at the script's own import; in the
zygote, while a later package's import uses it), and ``Undo`` puts the process back as it
was before (in the zygote, after each preloaded package: nothing of it shows in a rank until
it is imported there)."""

from __future__ import annotations

import _warnings
import atexit
import signal
import sys
import types
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

#: An attribute that a module did not have.
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<missing>"})()


class Child(NamedTuple):
    """The import of another package's node, at this point of the import."""

    node: "Node"


class Filter(NamedTuple):
    """A warnings filter added (``warnings._add_filter``'s arguments)."""

    args: Tuple[Any, ...]
    append: bool


class ResetFilters(NamedTuple):
    """``warnings.resetwarnings()``."""


class CatchWarnings(NamedTuple):
    """The start (``enter``) or the end of a ``warnings.catch_warnings()`` block."""

    enter: bool
    record: bool


class Warn(NamedTuple):
    """A warning issued, whatever the filters said at the time: it is issued again under the
    rank's filters (``warnings.warn_explicit``). One whose ``stacklevel`` points past the
    package's own code, to the code that imported it, has ``importer`` N: the Nth frame of
    the importing code (the rank's own, at its import)."""

    message: Any
    category: type
    filename: str
    lineno: int
    module: Optional[str]
    globals: Optional[Dict[str, Any]]
    importer: int = 0


class Write(NamedTuple):
    """Bytes written on stdout (1) or stderr (2)."""

    fd: int
    data: bytes


class AtExit(NamedTuple):
    """``atexit.register(func, *args, **kwargs)``."""

    func: Callable[..., Any]
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


class Signal(NamedTuple):
    """``signal.signal(signum, handler)``."""

    signum: int
    handler: Any


class Attrs(NamedTuple):
    """Attributes set on (or deleted from, ``MISSING``) a module loaded before: ``changes``
    maps each name to its value before and after."""

    module: types.ModuleType
    changes: Dict[str, Tuple[Any, Any]]


class Loggers(NamedTuple):
    """Loggers (and their placeholders) created, by name."""

    entries: Dict[str, Any]


class Hook(NamedTuple):
    """A finder or path hook added to ``sys.meta_path`` or ``sys.path_hooks`` (at the front
    when ``front``, else at the end)."""

    where: str
    hook: Any
    front: bool


class Fixup(NamedTuple):
    """What a new interpreter's standard library has of its own, made at this point (a fresh
    random state, the time logging started, ...): see ``run.warm.serve.FIXUPS``."""

    name: str


Op = Any  # one of the classes above


class Inputs:
    """What an import read that a rank may have otherwise: variables (``None``: unset), the
    working directory, ``sys.argv``, ``__main__``'s attributes, files and directories (their
    ``stat`` signature, ``None`` when missing)."""

    __slots__ = ("env", "whole_env", "cwd", "argv", "main", "files")

    def __init__(self) -> None:
        self.env: Dict[str, Optional[str]] = {}
        self.whole_env = False
        self.cwd: Optional[str] = None
        self.argv: Optional[List[str]] = None
        self.main = False
        self.files: Dict[str, Optional[Tuple[int, int, int]]] = {}


class Node:
    """The import of one package (or of a module of another package than the import that
    started it), as the zygote ran it."""

    __slots__ = ("name", "package", "modules", "ops", "inputs", "problems", "native", "served")

    def __init__(self, name: str) -> None:
        self.name = name
        self.package = name.partition(".")[0]
        #: The modules its import loaded, in order (the node's own first).
        self.modules: Dict[str, Any] = {}
        self.ops: List[Op] = []
        self.inputs = Inputs()
        #: Why its import cannot be kept for the ranks (empty when it can).
        self.problems: List[str] = []
        #: Whether it loaded compiled code of its own (outside the standard library).
        self.native = False
        #: In a rank: whether it has been given to the program.
        self.served = False

    def __repr__(self) -> str:
        return f"<warm node {self.name}: {len(self.modules)} modules>"

    def tree(self) -> List["Node"]:
        """This node and every node it imported, each once, children first."""
        seen: Dict[int, Node] = {}

        def walk(node: Node) -> None:
            if id(node) in seen:
                return
            seen[id(node)] = node  # (before the children: an import cycle ends here)
            for op in node.ops:
                if type(op) is Child:
                    walk(op.node)

        walk(self)
        return list(reversed(list(seen.values())))

    def is_native(self) -> bool:
        """Whether its import (or one it made) loaded compiled code outside the standard
        library: such code is loaded once per process, and cannot be imported again."""
        return any(node.native for node in self.tree())


def insert(node: Node, main: types.ModuleType, zygote_main: Optional[types.ModuleType]) -> None:
    """Puts the node's modules in ``sys.modules`` and each on its package (as the import
    system does); an alias of the zygote's ``__main__`` (``__mp_main__``) names ``main``."""
    for name, module in node.modules.items():
        if module is zygote_main:
            module = main
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        package = sys.modules.get(parent) if parent else None
        if package is not None and module is not main:
            try:
                setattr(package, child, module)
            except (AttributeError, TypeError):
                pass


def apply_state(op: Op) -> None:
    """Applies what ``op`` did to the process's state (not its output, nor a warning)."""
    kind = type(op)
    if kind is Filter:
        sys.modules["warnings"]._add_filter(*op.args, append=op.append)
    elif kind is ResetFilters:
        sys.modules["warnings"].resetwarnings()
    elif kind is AtExit:
        atexit.register(op.func, *op.args, **op.kwargs)
    elif kind is Signal:
        signal.signal(op.signum, op.handler)
    elif kind is Attrs:
        for key, (_, value) in op.changes.items():
            _set(op.module, key, value)
    elif kind is Loggers:
        manager = sys.modules["logging"].Logger.manager
        manager.loggerDict.update(op.entries)
    elif kind is Hook:
        hooks = getattr(sys, op.where)
        if op.hook not in hooks:
            hooks.insert(0 if op.front else len(hooks), op.hook)


def _set(module: types.ModuleType, key: str, value: Any) -> None:
    if value is MISSING:
        module.__dict__.pop(key, None)
    else:
        module.__dict__[key] = value


class Undo:
    """The process's state that a preloaded import changes, as it was: ``restore`` puts it
    back (in the zygote, after each preloaded package)."""

    def __init__(self, references: Dict[str, Dict[str, Any]]) -> None:
        self.modules = set(sys.modules)
        self.filters = list(_warnings.filters)
        self.handlers = _handlers()
        self.meta_path = list(sys.meta_path)
        self.path_hooks = list(sys.path_hooks)
        self.importer_cache = dict(sys.path_importer_cache)
        #: Each module's namespace as its own import left it (or, for a module loaded
        #: before the preload, as it was then).
        self.references = references
        self.registered: List[Callable[..., Any]] = []

    def restore(self) -> None:
        for name in [name for name in sys.modules if name not in self.modules]:
            del sys.modules[name]
        _warnings.filters[:] = self.filters
        vars(_warnings)["_filters_mutated"]()
        for func in self.registered:
            atexit.unregister(func)
        self.registered.clear()
        for signum, handler in self.handlers.items():
            if signal.getsignal(signum) is not handler and handler is not None:
                signal.signal(signum, handler)
        sys.meta_path[:] = self.meta_path
        sys.path_hooks[:] = self.path_hooks
        for key in [key for key in sys.path_importer_cache if key not in self.importer_cache]:
            del sys.path_importer_cache[key]
        for name, reference in self.references.items():
            module = sys.modules.get(name)
            if module is not None:
                restore_namespace(module, reference)


def restore_namespace(module: types.ModuleType, reference: Dict[str, Any]) -> None:
    """Makes ``module``'s namespace ``reference`` again, key by key."""
    namespace = module.__dict__
    if _same(namespace, reference):
        return
    for key in [key for key in namespace if key not in reference]:
        del namespace[key]
    for key, value in reference.items():
        if namespace.get(key, MISSING) is not value:
            namespace[key] = value


def _same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether ``a`` and ``b`` hold the same values (dicts compare each value by identity
    first, in C; a value whose own comparison fails counts as changed)."""
    try:
        return len(a) == len(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an array's or a tensor's comparison
        return False


def changes(namespace: Dict[str, Any], reference: Dict[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """What differs between ``namespace`` and ``reference``, by identity: name -> (before,
    after)."""
    if _same(namespace, reference):
        return {}
    found = {}
    for key, value in namespace.items():
        old = reference.get(key, MISSING)
        if old is not value:
            found[key] = (old, value)
    for key, old in reference.items():
        if key not in namespace:
            found[key] = (old, MISSING)
    return found


def _handlers() -> Dict[int, Any]:
    handlers = {}
    for signum in signal.valid_signals():
        try:
            handlers[int(signum)] = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
    return handlers
