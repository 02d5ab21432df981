"""The one pickling of tether: what carries fds with a message or a process start.

Objects are pickled with ``multiprocessing.reduction.ForkingPickler``'s reductions (so
torch's apply: a tensor's storage moves to shared memory) while an ``FdCollector`` stands in
for multiprocessing's "spawning popen": every fd that a reduction passes through
``multiprocessing.reduction.DupFd`` (a shared-memory storage, a connection, a tether queue)
is collected. For a channel message it travels with the message as ``SCM_RIGHTS``
ancillary data and comes back in the receiver from ``detach()``; for a process start
(``inherit``) the child inherits it under the same number. Nothing goes through
``resource_sharer`` and nothing is copied more than with torch's own queues.

Functions and classes of a ``__main__`` that has no file (a notebook, the REPL, ``python -c``,
stdin) cannot be found by name in another process: those travel by value, pickled by
cloudpickle (tether's dependency, imported only when such an object travels), and so do the
instances of such classes. Everything else still travels by reference.

What a pool's workers receive for a DataLoader travels *as a fork's workers would have it*
(``as_fork``): the functions and classes of ``__main__`` (whatever its file), lambdas and
functions or classes defined inside a function travel by value, with the values that the
globals their code names have in this process now (a fork copies the parent's module; an
import by name would give the worker's own, import-time value)."""

from __future__ import annotations

import copyreg
import importlib
import io
import multiprocessing.context
import os
import pickle
import sys
import threading
from collections import ChainMap
from multiprocessing.reduction import ForkingPickler
from types import FunctionType, ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = [
    "FdCollector",
    "Nested",
    "dispatch_table",
    "dump",
    "dumps",
    "loads",
    "main_without_file",
    "register",
    "travels_by_value",
]


class _FdRef:
    """What ``DupFd`` returns while an ``FdCollector`` is active: the position of an fd in
    the message's fd list. It pickles as a call that claims that fd in the receiver."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> Tuple[Callable[[int], "_ReceivedFd"], Tuple[int]]:
        return _received_fd, (self.index,)


class _Inherited:
    """What ``DupFd`` returns for a process start: an fd the child inherits under the same
    number (multiprocessing's protocol: ``detach()`` returns it)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


class FdCollector:
    """Stands in for multiprocessing's "spawning popen" while an object is pickled, so that
    multiprocessing primitives and shared tensors can name the fds that must travel with
    it. For a channel message, ``duplicate_for_child`` collects the fd and returns its
    position in the message, ``DupFd`` wraps that position; with ``dup``, the fds are
    duplicates owned by the collector (for a message sent later, after the pickled objects
    may be gone). For a process start (``inherit``), the fd keeps its number: the child
    inherits it."""

    def __init__(self, dup: bool = False, inherit: bool = False) -> None:
        self.fds: List[int] = []
        self.dup = dup
        self.inherit = inherit
        #: The tether queues pickled into the message (a pool process watches them).
        self.channels: List[Any] = []

    def duplicate_for_child(self, fd: int) -> int:
        if self.inherit:
            self.fds.append(fd)
            return fd
        self.fds.append(os.dup(fd) if self.dup else fd)
        return len(self.fds) - 1

    def DupFd(self, fd: int) -> Union[_FdRef, _Inherited]:  # noqa: N802 (multiprocessing's name)
        """What pickles as the fd ``duplicate_for_child`` named ``fd`` (a position in the
        message, or the inherited number)."""
        return _Inherited(fd) if self.inherit else _FdRef(fd)

    def close(self) -> None:
        """Closes the duplicates (only those made with ``dup``)."""
        if self.dup:
            close_all(self.fds)
            self.fds = []


class _Incoming:
    """The fds of a message being unpickled; those nobody claims are closed afterwards."""

    __slots__ = ("fds", "claimed")

    def __init__(self, fds: Sequence[int]) -> None:
        self.fds = list(fds)
        self.claimed = [False] * len(self.fds)

    def take(self, index: int) -> int:
        if self.claimed[index]:
            return os.dup(self.fds[index])
        self.claimed[index] = True
        return self.fds[index]

    def close_unclaimed(self) -> None:
        close_all(fd for fd, taken in zip(self.fds, self.claimed) if not taken)


class _ReceivedFd:
    """An fd that arrived with a message; ``detach()`` hands it over (multiprocessing's
    protocol, used by torch's ``rebuild_storage_fd`` and by ``rebuild_connection``)."""

    __slots__ = ("_incoming", "_index")

    def __init__(self, incoming: _Incoming, index: int) -> None:
        self._incoming = incoming
        self._index = index

    def detach(self) -> int:
        return self._incoming.take(self._index)


_tls = threading.local()
# multiprocessing's own thread-local "spawning popen" (what get_spawning_popen() reads).
_popen_tls = multiprocessing.context._tls  # type: ignore[attr-defined]


def _received_fd(index: int) -> _ReceivedFd:
    incoming: Optional[_Incoming] = getattr(_tls, "incoming", None)
    if incoming is None:
        raise RuntimeError("a tether fd reference was unpickled outside of a channel message")
    return _ReceivedFd(incoming, index)


class Nested:
    """A pickle inside a message, made with the message's collector: it unpickles, while
    the message does (with the message's fds), into its value, or into ``(None, the
    error)`` when that fails, so that one part that does not unpickle spoils no other."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> Tuple[Callable[[bytes], Any], Tuple[bytes]]:
        return _nested, (self.data,)


def _nested(data: bytes) -> Any:
    try:
        return pickle.loads(data)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - this part's error (SystemExit too)
        return None, exc


def close_all(fds: Any) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class _Pickler(pickle.Pickler):
    """``ForkingPickler``'s reductions (copyreg's table plus those registered with
    ``ForkingPickler.register``, e.g. torch's) in a table shared by every instance, rebuilt
    when a registration is added: ``ForkingPickler`` copies it for each message."""

    dispatch_table: Dict[Any, Any] = {}
    _sizes = (-1, -1)


class _MainByValuePickler(_Pickler):
    """``_Pickler`` for a process whose ``__main__`` has no file: a function or class of
    ``__main__`` travels by value (see ``_by_value``)."""

    def reducer_override(self, obj: Any) -> Any:
        # Called for every object but atoms, strings and builtin containers: as little work
        # as possible.
        if isinstance(obj, _BY_VALUE_KINDS) and getattr(obj, "__module__", None) == "__main__":
            return _by_value(obj)
        return NotImplemented


_BY_VALUE_KINDS = (FunctionType, type)


def travels_by_value(obj: Union[FunctionType, type], as_fork: bool) -> bool:
    """Whether a function or class travels by value: one of ``__main__`` when ``__main__``
    has no file, or (``as_fork``) whenever an import by name would not give this very
    object: ``__main__``'s, a lambda, one defined inside a function, one whose name was
    rebound (cloudpickle's rule)."""
    module = getattr(obj, "__module__", None)
    if module == "__main__":
        return as_fork or main_without_file()
    if not as_fork:
        return False
    found: Any = sys.modules.get(module) if isinstance(module, str) else None
    for part in getattr(obj, "__qualname__", "<").split("."):
        found = getattr(found, part, None)
    return found is not obj


def main_without_file() -> bool:
    """Whether this process's ``__main__`` has no file another process could import it from
    (a notebook or IPython, the REPL, ``python -c``, stdin: no ``__file__``, or a name such
    as ``<stdin>``), and is no module run with ``-m``."""
    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return False
    path = getattr(main, "__file__", None)
    return not isinstance(path, str) or path.startswith("<")


def _pickler_class() -> "type[_Pickler]":
    # The reducers registered with ForkingPickler.register (torch's tensors and storages);
    # private to multiprocessing and not in its type stubs.
    extra = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    sizes = (len(copyreg.dispatch_table), len(extra))
    if _Pickler._sizes != sizes:
        table = dict(copyreg.dispatch_table)
        table.update(extra)
        _Pickler.dispatch_table = table
        _Pickler._sizes = sizes
    # Only then does every object pickled pass through a Python call (reducer_override).
    return _MainByValuePickler if main_without_file() else _Pickler


def dispatch_table() -> Dict[Any, Any]:
    """The reductions pickle looks up by type before ``__reduce_ex__``: copyreg's table and
    those registered with ``ForkingPickler.register`` (torch's tensors and storages)."""
    return _pickler_class().dispatch_table


def _cloudpickle(obj: Any) -> ModuleType:
    """cloudpickle (installed with tether), or, where it is missing all the same, a
    PicklingError that says why ``obj`` needs it and how to get it."""
    try:
        return importlib.import_module("cloudpickle")
    except ImportError:
        if obj is None:
            what = "what a pool's workers receive for a DataLoader cannot be pickled"
        else:
            kind = "class" if isinstance(obj, type) else "function"
            what = (
                f"the {kind} {obj.__qualname__} cannot travel to another process: it is "
                "defined in a __main__ without a file (a notebook, the REPL, python -c or "
                "stdin)"
            )
        raise pickle.PicklingError(
            f"{what}: tether sends such functions and classes by value with cloudpickle, a "
            "dependency of tether missing from this environment (was tether installed with "
            "--no-deps?): pip install cloudpickle"
        ) from None


def _by_value(obj: Union[FunctionType, type]) -> Tuple[Callable[[bytes], Any], Tuple[bytes]]:
    """The reduction of a function or class of a ``__main__`` without a file: cloudpickle's
    pickle of it (code, closure, the globals it uses, a class's body) with the reductions of
    ``ForkingPickler`` (so a tensor it refers to moves to shared memory, an fd travels with
    the message), unpickled where the message is. cloudpickle gives a class an id that
    follows it: the same class pickled in several messages, or sent back, is one class."""
    pickler = _by_value_pickler(_cloudpickle(obj))
    buf = io.BytesIO()
    try:
        pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:
        named = _unpicklable_global(obj, pickler)
        if named is None:
            raise
        raise named from exc
    return _from_main, (buf.getvalue(),)


def _unpicklable_global(obj: Union[FunctionType, type], pickler: type) -> Optional[Exception]:
    """A ``PicklingError`` that names what ``obj`` (a function or class that travels by
    value) reads and cannot travel: a global its code (or its methods') names, a variable
    it closes over, a class attribute. None when none of them is why it could not."""
    for what, reader, value in _what_travels_with(obj):
        if isinstance(value, (ModuleType, FunctionType, type)):
            continue  # (each is looked at in turn)
        try:
            pickler(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(value)
        except Exception as why:  # noqa: BLE001 - the one to name
            return pickle.PicklingError(
                f"{what} (a {type(value).__qualname__}), which {reader} reads, cannot travel "
                f"to another process: {why}. A function or class that travels by value takes "
                "the values of what its code reads with it, as a fork would give them; make "
                "this one picklable, or create it in the other process (in a pool's worker: "
                "in worker_init_fn, or lazily in __getitem__)"
            )
    return None


def _what_travels_with(obj: Union[FunctionType, type]) -> Iterator[Tuple[str, str, Any]]:
    """``(what it is, who reads it, its value)`` for each value that travels with ``obj``."""
    functions: List[Any] = [obj] if isinstance(obj, FunctionType) else []
    if isinstance(obj, type):
        for name, member in vars(obj).items():
            member = getattr(member, "__func__", member)
            if isinstance(member, property):
                functions.extend((member.fget, member.fset, member.fdel))
            elif not isinstance(member, FunctionType) and not name.startswith("__"):
                yield f"the attribute {name!r} of class {obj.__qualname__}", "it", member
            functions.append(member)
    for function in functions:
        if not isinstance(function, FunctionType):
            continue
        names = function.__code__.co_freevars
        for name, cell in zip(names, function.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            yield f"the variable {name!r} it closes over", function.__qualname__, value
        for name in _code_names(function.__code__):
            if name in function.__globals__:
                what = f"the global {name!r} of {function.__module__}"
                yield what, function.__qualname__, function.__globals__[name]


def _code_names(code: Any) -> List[str]:
    """The global names a code object and the code objects it holds may read."""
    names: List[str] = []
    todo = [code]
    while todo:
        current = todo.pop()
        names.extend(current.co_names)
        todo.extend(c for c in current.co_consts if hasattr(c, "co_names"))
    return list(dict.fromkeys(names))


#: ``(ForkingPickler's table, the pickler class made with it)``.
_by_value_class: Optional[Tuple[Any, type]] = None


def _by_value_pickler(cloudpickle: ModuleType) -> type:
    """cloudpickle's Pickler, with ``ForkingPickler``'s reductions under its own."""
    global _by_value_class
    table = _pickler_class().dispatch_table
    if _by_value_class is None or _by_value_class[0] is not table:
        base = cloudpickle.Pickler
        made = type(
            "_ByValuePickler", (base,), {"dispatch_table": ChainMap(base.dispatch_table, table)}
        )
        _by_value_class = (table, made)
    return _by_value_class[1]


def _from_main(data: bytes) -> Any:
    """A function or class of the sender's ``__main__``, rebuilt from cloudpickle's bytes."""
    return pickle.loads(data)


def register(cls: type, reducer: Callable[[Any], Any]) -> None:
    """Registers (or replaces) ``ForkingPickler``'s reduction of ``cls``, here too."""
    ForkingPickler.register(cls, reducer)
    _Pickler._sizes = (-1, -1)


def dump(
    obj: Any,
    collector: FdCollector,
    file: Any,
    buffer_callback: Optional[Callable[[pickle.PickleBuffer], Any]] = None,
    *,
    as_fork: bool = False,
    overrides: Optional[Dict[Any, Any]] = None,
) -> None:
    """Pickles ``obj`` into ``file`` as ``ForkingPickler`` would (protocol 5, so that
    ``buffer_callback`` may take large buffers out of band); the fds it names go to
    ``collector.fds``. ``as_fork``: see the module's documentation; ``overrides``:
    reductions that stand in for the usual ones of their types (the same dict each time)."""
    previous = getattr(_popen_tls, "spawning_popen", None)
    _popen_tls.spawning_popen = collector
    try:
        cls = _as_fork_class() if as_fork else _pickler_class()
        if overrides:
            cls = _with_overrides(cls, overrides)
        pickler = cls(file, pickle.HIGHEST_PROTOCOL, buffer_callback=buffer_callback)
        try:
            pickler.dump(obj)
        except Exception as exc:
            named = _named_global(getattr(pickler, "by_value", ()), cls)
            if named is None:
                raise
            raise named from exc
    finally:
        _popen_tls.spawning_popen = previous


#: ``(the usual table, the as-fork pickler class made with it)``.
_as_fork: Optional[Tuple[Dict[Any, Any], type]] = None


def _as_fork_class() -> type:
    """cloudpickle's Pickler (what cannot be imported by name as this process has it travels
    by value, in this one pickle: what several functions share stays shared) with
    ``ForkingPickler``'s reductions."""
    global _as_fork
    usual = _pickler_class().dispatch_table
    if _as_fork is None or _as_fork[0] is not usual:
        base = _cloudpickle(None).Pickler
        table = dict(base.dispatch_table)
        table.update(usual)

        def reducer_override(self: Any, obj: Any) -> Any:
            if isinstance(obj, _BY_VALUE_KINDS) and travels_by_value(obj, as_fork=True):
                self.by_value.append(obj)  # (named if a global of it cannot travel)
            return base.reducer_override(self, obj)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            base.__init__(self, *args, **kwargs)
            self.by_value = []

        members = {"dispatch_table": table, "reducer_override": reducer_override}
        _as_fork = (usual, type("_AsForkPickler", (base,), {**members, "__init__": __init__}))
    return _as_fork[1]


#: ``(pickler class, overrides) -> (the overrides, the class with them)``: a pickler reads
#: its table when it is made.
_overridden: Dict[Tuple[type, int], Tuple[Dict[Any, Any], type]] = {}


def _with_overrides(cls: type, overrides: Dict[Any, Any]) -> type:
    made = _overridden.get((cls, id(overrides)))
    if made is None or made[0] is not overrides:
        table = {**cls.dispatch_table, **overrides}  # type: ignore[attr-defined]
        made = (overrides, type(cls.__name__, (cls,), {"dispatch_table": table}))
        _overridden[(cls, id(overrides))] = made
    return made[1]


def _named_global(objects: Sequence[Any], pickler: type) -> Optional[Exception]:
    """The error that names the global of one of ``objects`` (functions and classes that
    travelled by value) that cannot travel, if that is why a pickling failed."""
    for obj in objects:
        named = _unpicklable_global(obj, pickler)
        if named is not None:
            return named
    return None


def dumps(obj: Any, collector: FdCollector) -> bytes:
    """``dump`` into bytes."""
    buf = io.BytesIO()
    dump(obj, collector, buf)
    return buf.getvalue()


def loads(data: Any, fds: Sequence[int], buffers: Optional[Sequence[Any]] = None) -> Any:
    """Unpickles a message (any bytes-like object) whose fds arrived as ``fds`` (this
    process owns them), with its out-of-band ``buffers``: the fds its objects claim are
    theirs, the rest are closed."""
    if not fds:
        return pickle.loads(data, buffers=buffers)  # nothing in it can claim an fd
    previous = getattr(_tls, "incoming", None)
    incoming = _Incoming(fds)
    _tls.incoming = incoming
    try:
        return pickle.loads(data, buffers=buffers)
    finally:
        _tls.incoming = previous
        incoming.close_unclaimed()
