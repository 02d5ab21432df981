"""A warm rank's imports: what the zygote preloaded (``run.warm.record``) is hidden in the rank,
and ``Server`` gives it to the program when its own import reaches it, with what that import
did, at that moment: its modules in ``sys.modules``, its warnings issued again under the
rank's filters, what it printed written on the rank's current streams (a
``redirect_stdout`` sees it), its filters, exit functions, signal handlers, loggers and
attributes set, and what a new interpreter's standard library has of its own (``FIXUPS``).

A node is served only when what its import read is what the rank has at that moment (its
variables, working directory, ``sys.argv``, ``sys.path``, files, no logger or module of its
own made otherwise already); else the rank imports it itself, as a new interpreter would. A
node that loaded compiled code (torch) cannot be imported twice in a process: the zygote
preloads it only for a script that imports it before anything that could change what it
reads (``run.warm.scan``), and a rank whose files or script changed since starts as a new
interpreter instead (``run.warm.start``); if it still differs at use, the rank is served and says so
on stderr."""

from __future__ import annotations

import _frozen_importlib
import _imp
import os
import sys
import time
import types
from typing import Any, Callable, Dict, List, Optional, Set

from . import nodes, reads
from .nodes import CatchWarnings, Child, Fixup, Loggers, Node, Warn, Write
from .record import FIND_AND_LOAD, signature

_bootstrap: Any = _frozen_importlib


def _random() -> None:
    sys.modules["random"].seed()


def _logging() -> None:
    logging: Any = sys.modules["logging"]
    logging._startTime = time.time()


def _multiprocessing() -> None:
    process: Any = sys.modules["multiprocessing.process"]
    current = process._current_process
    current._config["authkey"] = process.AuthenticationString(os.urandom(32))
    try:
        process.ORIGINAL_DIR = os.path.abspath(os.getcwd())
    except OSError:
        process.ORIGINAL_DIR = None


def _numpy_random() -> None:
    sys.modules["numpy.random"].seed()


#: What each process of a new interpreter has of its own, made where its import made it.
FIXUPS: Dict[str, Callable[[], None]] = {
    "random": _random,
    "logging": _logging,
    "multiprocessing.process": _multiprocessing,
    "numpy.random": _numpy_random,
}


class Preloaded:
    """What a rank receives of its zygote's preload."""

    def __init__(
        self,
        owner: Dict[str, Node],
        main: types.ModuleType,
        path: List[str],
        directories: Dict[str, Any],
        environment: Dict[str, str],
        varying: Set[str],
    ) -> None:
        #: Each preloaded module's node.
        self.owner = owner
        #: The zygote's ``__main__``, for which a rank has its own.
        self.main = main
        self.path = path
        self.directories = directories
        self.environment = environment
        self.varying = varying


class Server:
    """Serves the preload in a rank (installed as the import system's ``_find_and_load``)."""

    def __init__(self, preloaded: Preloaded, private: Dict[str, Any]) -> None:
        self.preloaded = preloaded
        self.owner = preloaded.owner
        #: Modules of tether's that the rank's own import gets as they are (faulthandler,
        #: whose functions tether watches).
        self.private = private
        self.refused: Set[int] = set()
        self.catching: List[Any] = []

    @reads.hidden_from_warnings
    def find_and_load(self, name: str, import_: Callable[..., Any]) -> Any:
        if name in sys.modules:
            return FIND_AND_LOAD(name, import_)
        node = self.owner.get(name)
        if node is None or node.served or id(node) in self.refused:
            kept = self.private.pop(name, None)
            if kept is not None:
                sys.modules[name] = kept
                return kept
            return FIND_AND_LOAD(name, import_)
        _imp.acquire_lock()
        try:
            if not node.served and name not in sys.modules:
                self._serve_or_refuse(node)
        finally:
            _imp.release_lock()
        module = sys.modules.get(name)
        return module if module is not None else FIND_AND_LOAD(name, import_)

    def _serve_or_refuse(self, node: Node) -> None:
        why = self.why_not(node)
        if why is None:
            self.serve(node)
        elif node.is_native():
            sys.stderr.write(
                f"tether: warning: warm rank: {node.name} was imported by the zygote, and "
                f"{why} in this rank; it cannot be imported twice in a process, so this rank "
                "has the zygote's (--no-warm starts every rank as a new interpreter)\n"
            )
            self.serve(node)
        else:
            self.refused.add(id(node))

    # -- whether the rank has what the import read --------------------------------------

    def why_not(self, node: Node) -> Optional[str]:
        """Why ``node`` (or a node it imported) cannot be served as it is: what its import
        read that differs now, in words; None when nothing does."""
        if sys.path != self.preloaded.path:
            return "sys.path differs"
        for path, known in self.preloaded.directories.items():
            if signature(path) != known:
                return f"{path} changed"
        native = node.is_native()
        if native and self._environment() != self.preloaded.environment:
            return "the environment differs"
        for each in node.tree():
            if not each.served:
                why = self._inputs(each, check_files=not native)
                if why is not None:
                    return why
        return None

    def _environment(self) -> Dict[str, str]:
        varying = self.preloaded.varying
        return {k: v for k, v in os.environ.items() if k not in varying}

    def _inputs(self, node: Node, check_files: bool) -> Optional[str]:
        inputs = node.inputs
        if id(node) in self.refused:
            return f"{node.name} is the rank's own"
        for key, value in inputs.env.items():
            if os.environ.get(key) != value:
                return f"${key} differs"
        if inputs.cwd is not None and _cwd() != inputs.cwd:
            return "the working directory differs"
        if inputs.argv is not None and sys.argv != inputs.argv:
            return "sys.argv differs"
        if check_files:
            for path, known in inputs.files.items():
                if signature(path) != known:
                    return f"{path} changed"
        for name, module in node.modules.items():
            present = sys.modules.get(name)
            if present is not None and present is not module and module is not self.preloaded.main:
                return f"{name} was imported otherwise"
        logging = sys.modules.get("logging")
        for op in node.ops:
            if type(op) is Loggers and logging is not None:
                made = logging.Logger.manager.loggerDict
                for name in op.entries:
                    if name in made and made[name] is not op.entries[name]:
                        return f"the logger {name!r} exists already"
        return None

    # -- serving --------------------------------------------------------------------------

    def serve(self, node: Node) -> None:
        """Gives ``node`` (and each node it imported, at its point) to the program."""
        if node.served:
            return
        node.served = True
        nodes.insert(node, sys.modules["__main__"], self.preloaded.main)
        try:
            for op in node.ops:
                self._apply(op)
        except BaseException:
            for name in node.modules:
                sys.modules.pop(name, None)
            while self.catching:  # a warning raised inside a catch_warnings block
                self.catching.pop().__exit__(None, None, None)
            raise

    def _apply(self, op: Any) -> None:
        kind = type(op)
        if kind is Child:
            self.serve(op.node)
        elif kind is Warn:
            self._warn(op)
        elif kind is Write:
            _write(op.fd, op.data)
        elif kind is Fixup:
            FIXUPS[op.name]()
        elif kind is CatchWarnings:
            if op.enter:
                block = sys.modules["warnings"].catch_warnings(record=op.record)
                block.__enter__()
                self.catching.append(block)
            elif self.catching:
                self.catching.pop().__exit__(None, None, None)
        else:
            nodes.apply_state(op)

    def _warn(self, op: Warn) -> None:
        """Issues again a warning of the import under the rank's filters: where the import
        put it, or at the rank's own import statement (``Warn.importer``)."""
        filename, lineno, module, namespace = op.filename, op.lineno, op.module, op.globals
        if op.importer:
            frame = _importer(op.importer)
            if frame is None:
                return
            filename, lineno, namespace = frame.f_code.co_filename, frame.f_lineno, frame.f_globals
            module = namespace.get("__name__")
        # (Without the module's globals: given them, warn_explicit reads the source line even
        # for a warning its filters ignore, and imports linecache for it, as warn does not.)
        registry = None if namespace is None else namespace.setdefault(_REGISTRY, {})
        sys.modules["warnings"].warn_explicit(
            op.message, op.category, filename, lineno, module, registry
        )


_REGISTRY = "__warningregistry__"


def _importer(depth: int) -> Any:
    """The ``depth``-th frame of the code that imported what is being served (tether's own
    frames and the import system's aside)."""
    frame: Optional[types.FrameType] = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not reads.internal(path) and not path.startswith(_HERE):
            depth -= 1
            if depth == 0:
                return frame
        frame = frame.f_back
    return None


_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _write(fd: int, data: bytes) -> None:
    """Writes what the preload wrote on ``fd``, on the rank's stream of that name now (its
    bytes as they were, when the stream is still the interpreter's own)."""
    stream = sys.stdout if fd == 1 else sys.stderr
    original = sys.__stdout__ if fd == 1 else sys.__stderr__
    if stream is None:
        return
    if original is not None and stream is original:
        original.flush()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    else:
        encoding = getattr(stream, "encoding", None) or "utf-8"
        stream.write(data.decode(encoding, "replace"))


def _cwd() -> Optional[str]:
    try:
        return os.getcwd()
    except OSError:
        return None


def enter(server: Server) -> None:
    """Makes the rank's imports go through ``server``, and gives the program a ``__main__``
    of its own (the zygote's is frozen with the preload: a script's globals kept in it would
    never be collected, and its open files never flushed at the end)."""
    old = sys.modules["__main__"]
    main = types.ModuleType("__main__")
    main.__dict__.update(old.__dict__)
    sys.modules["__main__"] = main
    _bootstrap._find_and_load = server.find_and_load
