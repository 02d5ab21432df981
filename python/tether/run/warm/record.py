"""A warm zygote's preload, recorded: every import runs under ``Recorder``, which splits it
into ``nodes.Node``s (one per package an import reached, nested as the imports were) and
notes, for each, what it read and what it did (``witness`` sees the reads, warnings, output,
exit functions and signal handlers; this module the modules, the namespaces of the modules
loaded before, loggers, import hooks and what must not change, ``probes``).

The import system's ``_find_and_load`` (every import not in ``sys.modules`` yet goes through
it) opens and closes the nodes. A module's namespace is compared with what its own import
left at each node's start and end (all modules at an installed package's, those of the
interpreter's start at every one): a change is the current node's (``Attrs``).

Between two preloaded packages, everything the first did is undone (``Undo``): the zygote,
and every rank it forks, look as a new interpreter before the script's first line. A package
whose import needs what an earlier one loaded gets it back (``use``), as a child node: in a
rank too, an import brings back exactly what it imported in the zygote."""

from __future__ import annotations

import _frozen_importlib
import atexit
import importlib.machinery
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Set

from tether.zygote import server

from . import nodes, probes, reads, scan
from .nodes import AtExit, Child, Fixup, Hook, Loggers, Node, Warn, Write
from .witness import Witness

_bootstrap: Any = _frozen_importlib  # (the import system, whose _find_and_load is wrapped)

#: The import system's own function, which the recorder (and a rank's server) wraps.
FIND_AND_LOAD = _bootstrap._find_and_load
_EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)


class Recorder:
    """Records the imports made while it is installed (``with recorder:``)."""

    def __init__(self, places: scan.Places, varying: Set[str]) -> None:
        self.places = places
        self.varying = varying
        self.stack: List[Node] = []
        #: Every module loaded under record, by name, and the node that loaded it.
        self.owner: Dict[str, Node] = {}
        #: What each module's namespace was when its node ended (or when recording began),
        #: and the same as last compared (what changed since is the current node's).
        self.references: Dict[str, Dict[str, Any]] = {}
        self.seen: Dict[str, Dict[str, Any]] = {}
        self.baseline = [n for n, m in sys.modules.items() if isinstance(_namespace(m), dict)]
        self.known: Set[str] = set(sys.modules)
        #: The nodes made since this was last emptied (``run.warm.guard`` empties it per package).
        self.created: List[Node] = []
        #: Nodes of earlier packages brought back for the current one.
        self.used: Set[int] = set()
        self.paused = 0
        self.witness = Witness(self)
        self.loggers: Set[str] = set()
        #: The loggers that logging's own import left (None until logging is imported).
        self.logger_reference: Optional[Dict[str, Any]] = (
            dict(_loggers()) if "logging" in sys.modules else None
        )
        self.hooks: Dict[str, List[Any]] = {}
        self.atexit_expected = 0
        self.settings: Dict[str, Any] = {}
        self.fds: Set[int] = set()
        #: What to undo when the current package's import ends.
        self.undo: Optional[nodes.Undo] = None

    def __enter__(self) -> "Recorder":
        _bootstrap._find_and_load = self.find_and_load
        self.witness.__enter__()
        for name in self.baseline:  # (as witnessed: sys.argv is the witness's meanwhile)
            self._reference(name)
        self.resync()
        self.fds = probes.fds()
        return self

    def __exit__(self, *exc: object) -> None:
        self.witness.__exit__()
        _bootstrap._find_and_load = FIND_AND_LOAD
        namespaces = [_namespace(m) for n in self._nodes() for m in n.modules.values()]
        namespaces += [_namespace(sys.modules.get(name)) for name in self.baseline]
        self.witness.unbind(ns for ns in namespaces if isinstance(ns, dict))
        for node in self._nodes():
            for name in node.modules:  # (what each import left, with the real functions)
                namespace = _namespace(node.modules[name])
                if isinstance(namespace, dict):
                    self.references[name] = dict(namespace)

    def _nodes(self) -> List[Node]:
        return list({id(node): node for node in self.owner.values()}.values())

    @property
    def current(self) -> Optional[Node]:
        return self.stack[-1] if self.stack and not self.paused else None

    def problem(self, why: str) -> None:
        if self.current is not None and why not in self.current.problems:
            self.current.problems.append(why)

    # -- nodes --------------------------------------------------------------------------

    @reads.hidden_from_warnings
    def find_and_load(self, name: str, import_: Callable[..., Any]) -> Any:
        """``_find_and_load`` under record."""
        if self.paused or name in sys.modules:
            return FIND_AND_LOAD(name, import_)
        earlier = self.owner.get(name)
        if earlier is not None:
            self.use(earlier)
            if name in sys.modules:
                return sys.modules[name]
        current = self.stack[-1] if self.stack else None
        if current is not None and current.package == name.partition(".")[0]:
            try:
                return FIND_AND_LOAD(name, import_)
            finally:
                self.adopt(current)
        node = Node(name)
        self.created.append(node)
        heavy = installed(name)
        if current is not None:
            self.boundary(heavy)
            current.ops.append(Child(node))
        self.stack.append(node)
        env, cwd = dict(os.environ._data), _cwd()  # type: ignore[attr-defined]
        try:
            return FIND_AND_LOAD(name, import_)
        finally:
            self.adopt(node)
            self.boundary(heavy)
            self.stack.pop()
            self.close(node, env, cwd)

    def adopt(self, node: Node) -> None:
        """Gives ``node`` the modules that appeared in ``sys.modules`` since last looked
        (and takes back those a failed import removed)."""
        if len(sys.modules) == len(self.known):
            return
        names = set(sys.modules)
        for name in names - self.known:
            if name not in self.owner:
                node.modules[name] = sys.modules[name]
                self.owner[name] = node
        for name in self.known - names:
            if self.owner.get(name) is node:
                node.modules.pop(name, None)
                del self.owner[name]
        self.known = names

    def close(self, node: Node, env: Dict[bytes, bytes], cwd: Optional[str]) -> None:
        """What is noted of a node once its import ended."""
        self.paused += 1
        try:
            if os.environ._data != env:  # type: ignore[attr-defined]
                node.problems.append("its import changed the environment")
            if _cwd() != cwd:
                node.problems.append("its import changed the working directory")
            for name, module in node.modules.items():
                if name in ("warnings", "atexit", "random"):
                    self.witness.patch(name, module)
                self._reference(name)
                self._file(node, module)
            if "logging" in node.modules:
                self.logger_reference = dict(_loggers())
            if "numpy.random.mtrand" in node.modules:
                node.ops.append(Fixup("numpy.random"))  # seeded from the system, in C
            for path in list(node.inputs.files):
                node.inputs.files[path] = signature(path)
        finally:
            self.paused -= 1

    def _file(self, node: Node, module: Any) -> None:
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not os.path.isabs(path):
            return
        node.inputs.files.setdefault(path, None)
        kind = self.places.kind(path)
        if kind == "own":
            why = f"its import imported {module.__name__}, a module of yours"
            if why not in node.problems:
                node.problems.append(why)
        elif kind != "stdlib" and path.endswith(_EXTENSIONS):
            node.native = True

    def _reference(self, name: str) -> None:
        namespace = _namespace(sys.modules.get(name))
        if isinstance(namespace, dict):
            self.references[name] = dict(namespace)
            self.seen[name] = dict(namespace)

    def use(self, node: Node) -> None:
        """Brings back a node of an earlier package (with what it imported and the state it
        set), which the current import needs: the current node notes it as a child."""
        self.boundary(heavy=False)
        current = self.current
        if current is not None:
            current.ops.append(Child(node))
        self.paused += 1
        try:
            self._bring_back(node)
            self.resync()
            # What the settings of a library brought back are now is what later changes of
            # them count from.
            ready = {n for n, o in self.owner.items() if id(o) in self.used} | set(self.baseline)
            for what, value in probes.read(ready).items():
                self.settings.setdefault(what, value)
        finally:
            self.paused -= 1

    def _bring_back(self, node: Node) -> None:
        """``node``'s modules and state, each node it imported at its point (as a rank is
        served, without its output or warnings)."""
        if id(node) in self.used:
            return
        self.used.add(id(node))
        nodes.insert(node, sys.modules["__main__"], None)
        for op in node.ops:
            kind = type(op)
            if kind is Child:
                self._bring_back(op.node)
            elif kind not in (Warn, Write, Fixup, nodes.CatchWarnings):
                if kind is AtExit and self.undo is not None:
                    self.undo.registered.append(op.func)
                nodes.apply_state(op)

    def resync(self) -> None:
        """Takes the process's state as it is now as the point from which the current node's
        changes count (after the recorder itself changed it)."""
        self.known = set(sys.modules)
        for name in self.seen:
            namespace = _namespace(sys.modules.get(name))
            if isinstance(namespace, dict):
                self.seen[name] = dict(namespace)
        self.loggers = set(_loggers())
        self.hooks = {"meta_path": list(sys.meta_path), "path_hooks": list(sys.path_hooks)}
        self.atexit_expected = atexit._ncallbacks()

    # -- what changed, at each node's start and end ------------------------------------

    def boundary(self, heavy: bool) -> None:
        """Gives the current node what changed since the last boundary: its output, its
        modules, the namespaces of modules loaded before (all of them at an installed
        package's boundary, else those of the interpreter's start), loggers, import hooks,
        exit functions, and at an installed package's boundary what must not change."""
        node = self.current
        if node is None:
            return
        self.paused += 1
        try:
            self.witness.output.cut(node)
            self.adopt(node)
            open_nodes = {id(n) for n in self.stack}
            for name in list(self.seen) if heavy else self.baseline:
                self._attrs(node, name, open_nodes)
            self._loggers(node)
            self._hooks(node)
            count = atexit._ncallbacks()
            if count != self.atexit_expected:
                node.problems.append("its import registered an exit function from C code")
                self.atexit_expected = count
            if heavy:
                self._unchangeable(node, open_nodes)
        finally:
            self.paused -= 1

    def _attrs(self, node: Node, name: str, open_nodes: Set[int]) -> None:
        owner = self.owner.get(name)
        if owner is not None and id(owner) in open_nodes:
            return  # a module still being imported: its namespace is its own node's
        namespace = _namespace(sys.modules.get(name))
        seen = self.seen.get(name)
        if not isinstance(namespace, dict) or seen is None:
            return
        found = nodes.changes(namespace, seen)
        if found:
            node.ops.append(nodes.Attrs(sys.modules[name], found))
            self.seen[name] = dict(namespace)

    def _loggers(self, node: Node) -> None:
        now = _loggers()
        if len(now) != len(self.loggers):
            added = {k: v for k, v in now.items() if k not in self.loggers}
            if added:
                node.ops.append(Loggers(added))
            self.loggers = set(now)

    def _hooks(self, node: Node) -> None:
        for where, before in self.hooks.items():
            hooks = getattr(sys, where)
            if hooks == before:
                continue
            for index, hook in enumerate(hooks):
                if not any(hook is old for old in before):
                    node.ops.append(Hook(where, hook, index == 0))
            self.hooks[where] = list(hooks)

    def _unchangeable(self, node: Node, open_nodes: Set[int]) -> None:
        ready = {n for n, owner in self.owner.items() if id(owner) not in open_nodes}
        settings = probes.read(ready | set(self.baseline))
        for what in probes.changed(self.settings, settings):
            node.problems.append(f"its import changed {what}")
        self.settings = settings
        fds = probes.fds()
        for fd in sorted(fds - self.fds - self.witness.output.fds()):
            node.problems.append(f"its import opened {probes.describe_fd(fd)} and keeps it open")
        self.fds = fds

    # -- a root: one package the script imports ----------------------------------------

    def root(self, name: str) -> Optional[Node]:
        """Imports ``name`` under record, then undoes everything it did; the node that
        loaded it (None when an earlier package had); an import's error is raised."""
        self.undo = nodes.Undo(self.references)
        self.settings = probes.read(set(self.owner) | set(self.baseline))
        path, threads = list(sys.path), len(probes.threads())
        before = name in self.owner
        try:
            __import__(name)
            node = None if before else self.owner.get(name)
            if node is not None:
                self._root_checks(node, path, threads)
            return node
        finally:
            self.paused += 1
            try:
                self.undo.restore()
                self._restore_loggers()
                self.used.clear()
                self.resync()
            finally:
                self.paused -= 1

    def _restore_loggers(self) -> None:
        """Gives logging back the loggers its own import left: the others come back with the
        imports that made them."""
        node = self.owner.get("logging")
        logging = node.modules.get("logging") if node is not None else sys.modules.get("logging")
        if logging is not None and self.logger_reference is not None:
            registry = logging.Logger.manager.loggerDict
            registry.clear()
            registry.update(self.logger_reference)

    def _root_checks(self, node: Node, path: List[str], threads: int) -> None:
        """What only the end of a preloaded package's import tells (its node's problems)."""
        if len(probes.threads()) > threads:
            server._quiesce()
            running = probes.threads()
            if len(running) > threads:
                node.problems.append(f"its import left a thread running ({running[-1]!r})")
        if probes.children():
            node.problems.append("its import started a process that still runs")
        if probes.cuda_in_use():
            node.problems.append("its import initialized CUDA")
        if sys.path != path:
            node.problems.append("its import changed sys.path")


def signature(path: str) -> Optional[tuple]:
    """What tells that a file or directory changed: its modification time, size and inode
    (None when it does not exist)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _namespace(module: Any) -> Any:
    try:
        return module.__dict__
    except Exception:  # noqa: BLE001 - an odd object in sys.modules
        return None


_getcwd = os.getcwd  # (the real one: the witness's reads are the imports')


def _cwd() -> Optional[str]:
    try:
        return _getcwd()
    except OSError:
        return None


def installed(name: str) -> bool:
    """Whether ``name`` is a module of an installed package (not the standard library's)."""
    return name.partition(".")[0] not in sys.stdlib_module_names


def _loggers() -> Dict[str, Any]:
    """logging's loggers by name (none while logging is not imported, or being imported)."""
    logger = getattr(sys.modules.get("logging"), "Logger", None)
    manager = getattr(logger, "manager", None)
    return getattr(manager, "loggerDict", {})
