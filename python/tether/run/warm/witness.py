"""What the recorder (``run.warm.record``) sees while a preloaded package is imported, noted in
the node being imported (``Recorder.current``):

- reads of ``os.environ`` (each variable read, and its value, is an input of the import; a
  variable that differs between ranks, or the whole environment read by a package, is a
  problem), of ``sys.argv`` (an input) and of ``__main__``'s attributes (a problem);
- calls of the clock, of random sources and of the process id (``time``'s and ``os``'s
  functions, ``random``'s, witnessed meanwhile; a module that bound one of them by name gets
  the real one back afterwards): a problem when the import made them, unless the standard
  library's own import did, where tether gives each rank its own at that point (a
  ``Fixup``); the working directory read is an input;
- files and directories read, temporary files made (the interpreter's audit events);
- warnings: every warning issued is kept (filters and all, the zygote shows none) and issued
  again in the rank under its own filters; filters, ``catch_warnings`` blocks, ``atexit``
  functions and signal handlers as they are set;
- what is written on fds 1 and 2, cut at each node's start and end.

Reads through Python are seen; a compiled library's own reads are not."""

from __future__ import annotations

import _warnings
import errno
import os
import sys
import time
import types
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Set, Tuple

from . import reads, scan
from .nodes import (
    AtExit,
    CatchWarnings,
    Filter,
    Fixup,
    Node,
    ResetFilters,
    Signal,
    Undo,
    Warn,
)
from .output import Output

_signal: Any = __import__("_signal")  # (the C module: signal.signal calls it)
_filters_mutated: Callable[[], None] = vars(_warnings)["_filters_mutated"]

#: The filter that lets the zygote see every warning: the recorder keeps it first.
SEE_ALL = ("always", None, Warning, None, 0)


class Host(Protocol):
    """The recorder, as the witness knows it."""

    places: scan.Places
    varying: Set[str]
    undo: Optional[Undo]
    atexit_expected: int

    @property
    def current(self) -> Optional[Node]: ...

    def problem(self, why: str) -> None: ...


class Witness:
    """Installed for the whole preload (see the module's documentation)."""

    def __init__(self, recorder: Host) -> None:
        self.recorder = recorder
        self.real_signal = _signal.signal
        self.output = Output()
        self.undo: List[Callable[[], None]] = []
        #: The functions witnessed, by the id of their witnessed stand-in.
        self.wrapped: Dict[int, Any] = {}
        #: Set while the witness's own code runs: what it does is not the import's.
        self.busy = False
        self.catch_depth = 0
        #: The ``warnings`` module the preload uses, and its own functions.
        self.warnings: Any = None
        self.show: Any = None
        self.impl: Any = None
        #: Where the interpreter's audit hook (tether's start-up hook) sends its events.
        self.set_audit: Optional[Callable[[Any], None]] = None

    def node(self) -> Any:
        return None if self.busy else self.recorder.current

    def __enter__(self) -> "Witness":
        reads.listener = self
        self.output.__enter__()
        self.undo.append(self.output.__exit__)
        for environ in (os.environ, os.environb):
            self._swap_class(environ, reads.WatchedEnviron)
        main = sys.modules.get("__main__")
        if type(main) is types.ModuleType:
            self._swap_class(main, reads.WatchedMain)
        argv = sys.argv
        sys.argv = reads.WatchedArgv(argv)
        self.undo.append(lambda: setattr(sys, "argv", argv))
        _warnings.filters.insert(0, SEE_ALL)
        _filters_mutated()
        self.undo.append(self._unsee_all)
        for name in ("warnings", "atexit"):
            if name in sys.modules:
                self.patch(name, sys.modules[name])
        self._set(_signal, "signal", self._signal)
        set_audit = self.set_audit
        if set_audit is not None:
            set_audit(self.audit)
            self.undo.append(lambda: set_audit(None))
        for module in (time, os):
            for name, what in reads.READS[module.__name__].items():
                if hasattr(module, name):
                    self._wrap(module, name, what)
        for name, position in reads.CLOCK_BY_DEFAULT.items():
            self._wrap(time, name, "the time", position)
        return self

    def __exit__(self, *exc: object) -> None:
        reads.listener = None
        while self.undo:
            self.undo.pop()()

    def _swap_class(self, obj: Any, witnessed: type) -> None:
        plain = type(obj)
        obj.__class__ = witnessed
        self.undo.append(lambda: setattr(obj, "__class__", plain))

    def _set(self, owner: Any, name: str, value: Any) -> Any:
        real = getattr(owner, name)
        setattr(owner, name, value)
        self.undo.append(lambda: setattr(owner, name, real))
        return real

    # -- warnings -----------------------------------------------------------------------

    def _wrap(self, owner: Any, name: str, what: str, given: Optional[int] = None) -> None:
        """Watches calls of ``owner.name`` (with ``given``, only those without an argument at
        that position)."""
        real = getattr(owner, name)
        witness = self

        def witnessed(*args: Any, **kwargs: Any) -> Any:
            if given is None or (len(args) <= given and not kwargs):
                witness.read(what, sys._getframe(1))
            return real(*args, **kwargs)

        for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(witnessed, attribute, getattr(real, attribute, None))
        self.wrapped[id(witnessed)] = real
        self._set(owner, name, witnessed)

    def unbind(self, namespaces: Iterable[Dict[str, Any]]) -> None:
        """Gives back the real function to the modules that bound a witnessed one by name."""
        wrapped = self.wrapped
        for namespace in namespaces:
            for key, value in namespace.items():
                if id(value) in wrapped and callable(value):
                    namespace[key] = wrapped[id(value)]

    def patch(self, name: str, module: Any) -> None:
        """Watches the module ``warnings``, ``atexit`` or ``random`` that the preload just
        loaded."""
        if name == "random":
            seed = module.Random.seed
            witness = self

            def seeded(generator: Any, a: Any = None, *args: Any, **kwargs: Any) -> Any:
                if a is None:
                    witness.read("random numbers", sys._getframe(1))
                return seed(generator, a, *args, **kwargs)

            self._set(module.Random, "seed", seeded)
            for draw in reads.DRAWS.split():
                if hasattr(module, draw):
                    self._wrap(module, draw, "random numbers")
        elif name == "atexit":
            real = self._set(module, "register", None)
            module.register = lambda func, *a, **k: self._atexit(real, func, *a, **k)
        elif name == "warnings" and self.warnings is None:
            self._warnings(module)

    def _warnings(self, warnings: Any) -> None:
        self.warnings = warnings
        self.show = warnings._showwarnmsg
        self.impl = warnings._showwarnmsg_impl
        add = self._set(warnings, "_add_filter", None)
        reset = self._set(warnings, "resetwarnings", None)
        enter = self._set(warnings.catch_warnings, "__enter__", None)
        leave = self._set(warnings.catch_warnings, "__exit__", None)
        witness = self

        def add_filter(*args: Any, append: bool) -> None:
            witness.note(Filter(args, append))
            add(*args, append=append)
            witness.see_all()

        def resetwarnings() -> None:
            witness.note(ResetFilters())
            reset()
            witness.see_all()

        def catch_enter(block: Any) -> Any:
            witness.note(CatchWarnings(True, bool(getattr(block, "_record", False))))
            witness.catch_depth += 1
            return enter(block)

        def catch_exit(block: Any, *exc: Any) -> Any:
            witness.catch_depth -= 1
            witness.note(CatchWarnings(False, False))
            return leave(block, *exc)

        warnings._add_filter = add_filter
        warnings.resetwarnings = resetwarnings
        warnings.catch_warnings.__enter__ = catch_enter
        warnings.catch_warnings.__exit__ = catch_exit
        self._set(warnings, "_showwarnmsg", self._showwarnmsg)

    def see_all(self) -> None:
        """Keeps ``SEE_ALL`` first (but inside a ``catch_warnings`` block, whose filters are
        the import's own business)."""
        if self.catch_depth:
            return
        filters = self.warnings.filters
        if not filters or filters[0] is not SEE_ALL:
            if SEE_ALL in filters:
                filters.remove(SEE_ALL)
            filters.insert(0, SEE_ALL)
            _filters_mutated()

    def _unsee_all(self) -> None:
        while SEE_ALL in _warnings.filters:
            _warnings.filters.remove(SEE_ALL)
        _filters_mutated()

    def _showwarnmsg(self, message: Any) -> None:
        if self.warnings._showwarnmsg_impl is not self.impl:
            self.show(message)  # a catch_warnings(record=True) block's own list
            return
        node = self.node()
        if node is None:
            return
        self.output.cut(node)  # (what it printed before comes first)
        found = reads.frame_at(message.filename, message.lineno)
        namespace = None if found is None else found.f_globals
        module = None if namespace is None else namespace.get("__name__")
        importer = self._importer(found)
        node.ops.append(
            Warn(
                message.message,
                message.category,
                message.filename,
                message.lineno,
                module,
                None if importer else namespace,
                importer,
            )
        )

    def _importer(self, found: Any) -> int:
        """How far into the code that imported the package ``found`` (a frame a warning is
        attributed to) is, counted in frames of that code as the warnings module counts them
        (the import system's skipped): 0 when it is the package's own."""
        if found is None or self.recorder.places.kind(found.f_code.co_filename) != "tether":
            return 0
        depth = 0
        frame: Optional[types.FrameType] = sys._getframe(2)  # (the code that called warn)
        while frame is not None:
            path = frame.f_code.co_filename
            if not reads.internal(path):
                if depth or self.recorder.places.kind(path) == "tether":
                    depth += 1
                if frame is found:
                    return depth
            frame = frame.f_back
        return 0

    def note(self, op: Any) -> None:
        node = self.node()
        if node is not None:
            node.ops.append(op)

    # -- exit functions and signal handlers ---------------------------------------------

    def _atexit(self, real: Any, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.note(AtExit(func, args, kwargs))
        self.recorder.atexit_expected += 1
        if self.recorder.undo is not None:
            self.recorder.undo.registered.append(func)
        return real(func, *args, **kwargs)

    def _signal(self, signum: int, handler: Any) -> Any:
        self.note(Signal(int(signum), handler))
        return self.real_signal(signum, handler)

    # -- reads ----------------------------------------------------------------------------

    def audit(self, event: str, args: Tuple[Any, ...]) -> None:
        """The interpreter's audit events while a node is current."""
        node = self.node()
        if node is None:
            return
        if event == "open":
            path, mode, flags = args
            if not isinstance(path, (str, bytes)):
                return
            if reads.reads_only(mode, flags):
                self._input_path(node, path)
            elif not reads.harmless_write(os.fsdecode(path)):
                self._refuse(node, "writes files", path)
        elif event in ("os.listdir", "os.scandir") and isinstance(args[0], (str, bytes)):
            self._input_path(node, args[0])
        elif event in reads.WRITES:
            self._refuse(node, "writes files", args[0] if args else None)
        elif event in reads.CONNECTS:
            self._refuse(node, "uses the network", None)

    def _refuse(self, node: Node, what: str, path: Any) -> None:
        """Keeps the import from doing what only a rank may do (the zygote's preload would
        do it once more than ``python -u`` ranks do); the import is left to the ranks."""
        where = f" ({os.fsdecode(path)})" if isinstance(path, (str, bytes)) else ""
        self._problem(node, f"its import {what}{where}")
        raise PermissionError(errno.EACCES, f"a preload in tether's zygote never {what}")

    def _input_path(self, node: Any, path: Any) -> None:
        self.busy = True
        try:
            path = os.fsdecode(path)
            if not os.path.isabs(path):
                path = os.path.join(os.getcwd(), path)
            path = os.path.normpath(path)
            if not path.startswith(reads.PSEUDO):  # (the kernel's views of this process)
                node.inputs.files.setdefault(path, None)
        finally:
            self.busy = False

    def read(self, what: str, frame: Any) -> None:
        """A call that read ``what`` (the time, random numbers, ...), made in ``frame``."""
        node = self.node()
        if node is None:
            return
        if what == "cwd":
            self.busy = True
            try:
                node.inputs.cwd = os.getcwd()
            except OSError:
                self._problem(node, "its import read a working directory that is gone")
            finally:
                self.busy = False
            return
        reader, stdlib = self._reader(frame, through=True)
        fixup = reads.STDLIB_READS.get((reader, what)) if stdlib else None
        if fixup is not None:
            if Fixup(fixup) not in node.ops:
                node.ops.append(Fixup(fixup))
        elif reader is not None:
            self._problem(node, f"its import read {what}, in {reader}")

    def env_read(self, name: str, value: Optional[str]) -> None:
        node = self.node()
        if node is None:
            return
        if name in self.recorder.varying:
            reader, _ = self._reader(sys._getframe(2), through=False)
            self._problem(node, f"its import read ${name}, in {reader or node.name}")
        node.inputs.env.setdefault(name, value)

    def whole_env(self) -> None:
        self._package_read("the whole environment")

    def argv_read(self) -> None:
        node = self.node()
        if node is not None and node.inputs.argv is None:
            node.inputs.argv = list.copy(sys.argv)

    def main_read(self, name: str) -> None:
        self._package_read(f"__main__.{name}")

    def _package_read(self, what: str) -> None:
        """A read that only a package's own code makes a problem of."""
        node = self.node()
        if node is not None:
            reader, stdlib = self._reader(sys._getframe(3), through=False)
            if reader is not None and not stdlib:
                self._problem(node, f"its import read {what}, in {reader}")

    def _reader(self, frame: Any, through: bool) -> Any:
        self.busy = True
        try:
            return reads.reader(frame, self.recorder.places, through)
        finally:
            self.busy = False

    @staticmethod
    def _problem(node: Node, why: str) -> None:
        if why not in node.problems:
            node.problems.append(why)
