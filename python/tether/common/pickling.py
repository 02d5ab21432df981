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
import io
import multiprocessing.context
import os
import pickle
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import by_value as by_value
from .by_value import BY_VALUE_KINDS, main_without_file, travels_by_value

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
    ``__main__`` travels by value (see ``by_value``)."""

    def reducer_override(self, obj: Any) -> Any:
        # Called for every object but atoms, strings and builtin containers: as little work
        # as possible.
        if isinstance(obj, BY_VALUE_KINDS) and getattr(obj, "__module__", None) == "__main__":
            return by_value.reduce(obj, dispatch_table())
        return NotImplemented


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
        cls = by_value.as_fork_class(dispatch_table()) if as_fork else _pickler_class()
        if overrides:
            cls = _with_overrides(cls, overrides)
        pickler = cls(file, pickle.HIGHEST_PROTOCOL, buffer_callback=buffer_callback)
        try:
            pickler.dump(obj)
        except Exception as exc:
            named = by_value.named_global(getattr(pickler, "by_value", ()), cls)
            if named is None:
                raise
            raise named from exc
    finally:
        _popen_tls.spawning_popen = previous


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
