"""Queues and events over tether channels, and the pickling that carries fds with a message.

A ``Queue`` is a ``SOCK_SEQPACKET`` socket pair (``_native.Endpoint``): ``put`` sends one
message on one end, ``get`` receives one whole message from the other, so any number of
processes and threads may put and get at once, with no feeder thread and no manager
process. An ``Event`` is a flag in a shared memfd page (``_native.SharedFlag``).

Objects are pickled with ``multiprocessing.reduction.ForkingPickler`` (so torch's reductions
apply: a tensor's storage moves to shared memory) while an ``_FdCollector`` stands in for
multiprocessing's "spawning popen": every fd that a reduction passes through
``multiprocessing.reduction.DupFd`` (a shared-memory storage, a connection, a tether queue)
is collected and travels with the message as ``SCM_RIGHTS`` ancillary data, and comes back
in the receiver from ``detach()``. Nothing goes through ``resource_sharer`` and nothing is
copied more than with torch's own queues.

Queues and events travel to other processes only this way: as arguments of a process the
pool starts, or inside a message of another tether channel.

Functions and classes of a ``__main__`` that has no file (a notebook, the REPL, ``python -c``,
stdin) cannot be found by name in another process: those travel by value, pickled by
cloudpickle (an optional dependency, imported only when such an object travels), and so do
the instances of such classes. Everything else still travels by reference."""

from __future__ import annotations

import copyreg
import importlib
import io
import multiprocessing.context
import os
import pickle
import queue
import sys
import threading
import time
from collections import ChainMap
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd, ForkingPickler
from types import FunctionType, ModuleType
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

from . import _native

__all__ = ["Event", "Queue", "Watched", "dumps", "loads"]


class Watched(Protocol):
    """A process a queue watches (see ``Queue.watch``)."""

    def watch_fds(self) -> List[int]:
        """Fds that become readable when the process ends (none once its end was seen)."""
        ...

    def failure(self) -> Optional[BaseException]:
        """The error to raise for how the process ended, or None (it ended well, or its
        failure was reported already)."""
        ...


class SpawningPopen(Protocol):
    """What multiprocessing's reductions ask of the "spawning popen" while an object is
    pickled (an ``_FdCollector``, or the stand-in of a process start in ``_launch``)."""

    def duplicate_for_child(self, fd: int) -> int:
        """Passes ``fd`` with the pickle; returns what names it there."""
        ...

    def DupFd(self, fd: int) -> Any:  # noqa: N802 (multiprocessing's name)
        """An object that pickles as the fd passed (its ``detach()`` returns it there)."""
        ...


class _FdRef:
    """What ``DupFd`` returns while an ``_FdCollector`` is active: the position of an fd in
    the message's fd list. It pickles as a call that claims that fd in the receiver."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> Tuple[Callable[[int], "_ReceivedFd"], Tuple[int]]:
        return _received_fd, (self.index,)


class _FdCollector:
    """Stands in for multiprocessing's "spawning popen" while an object is pickled for a
    channel: ``duplicate_for_child`` collects the fd and returns its position in the
    message, ``DupFd`` wraps that position. With ``dup``, the fds are duplicates owned by the
    collector (for a message sent later, after the pickled objects may be gone)."""

    def __init__(self, dup: bool = False) -> None:
        self.fds: List[int] = []
        self.dup = dup
        #: The tether queues pickled into the message (a pool process watches them).
        self.channels: List[Any] = []
        #: What owns fds of the message that nothing else keeps alive until it is sent.
        self.owners: List[Any] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(os.dup(fd) if self.dup else fd)
        return len(self.fds) - 1

    def DupFd(self, index: int) -> _FdRef:  # noqa: N802 (multiprocessing's name)
        return _FdRef(index)

    def close(self) -> None:
        """Closes the duplicates (only those made with ``dup``)."""
        if self.dup:
            _close_all(self.fds)
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
        _close_all(fd for fd, taken in zip(self.fds, self.claimed) if not taken)


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


def _close_all(fds: Any) -> None:
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
        # Called for every object but atoms and strings: as little work as possible.
        if isinstance(obj, _BY_VALUE_KINDS) and getattr(obj, "__module__", None) == "__main__":
            return _by_value(obj)
        return NotImplemented


_BY_VALUE_KINDS = (FunctionType, type)


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


def _cloudpickle(obj: Any) -> ModuleType:
    """cloudpickle, or a PicklingError that says why ``obj`` needs it and how to get it."""
    try:
        return importlib.import_module("cloudpickle")
    except ImportError:
        kind = "class" if isinstance(obj, type) else "function"
        raise pickle.PicklingError(
            f"the {kind} {obj.__qualname__} cannot travel to another process: it is defined "
            "in a __main__ without a file (a notebook, the REPL, python -c or stdin), whose "
            "functions and classes tether sends by value with cloudpickle, which is not "
            "installed: pip install cloudpickle"
        ) from None


def _by_value(obj: Union[FunctionType, type]) -> Tuple[Callable[[bytes], Any], Tuple[bytes]]:
    """The reduction of a function or class of a ``__main__`` without a file: cloudpickle's
    pickle of it (code, closure, the globals it uses, a class's body) with the reductions of
    ``ForkingPickler`` (so a tensor it refers to moves to shared memory, an fd travels with
    the message), unpickled where the message is. cloudpickle gives a class an id that
    follows it: the same class pickled in several messages, or sent back, is one class."""
    pickler = _by_value_pickler(_cloudpickle(obj))
    buf = io.BytesIO()
    pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return _from_main, (buf.getvalue(),)


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
    collector: SpawningPopen,
    file: Any,
    buffer_callback: Optional[Callable[[pickle.PickleBuffer], Any]] = None,
) -> None:
    """Pickles ``obj`` into ``file`` as ``ForkingPickler`` would (protocol 5, so that
    ``buffer_callback`` may take large buffers out of band); the fds it names go to
    ``collector`` (``collector.fds`` for an ``_FdCollector``)."""
    previous = getattr(_popen_tls, "spawning_popen", None)
    _popen_tls.spawning_popen = collector
    try:
        _pickler_class()(file, pickle.HIGHEST_PROTOCOL, buffer_callback=buffer_callback).dump(obj)
    finally:
        _popen_tls.spawning_popen = previous


def dumps(obj: Any, collector: SpawningPopen) -> bytes:
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


# Channels a pool worker received while serving one task; closed when the task ends, so
# nothing of a finished DataLoader stays open in the worker.
_task_channels: Optional[List[Any]] = None


def begin_task_scope() -> None:
    """In a worker: start recording the channels unpickled from now on."""
    global _task_channels
    _task_channels = []


def end_task_scope() -> None:
    """In a worker: close every channel recorded since ``begin_task_scope``."""
    global _task_channels
    channels, _task_channels = _task_channels, None
    for native in channels or ():
        native.close()


def _adopt(native: Any) -> Any:
    if _task_channels is not None:
        _task_channels.append(native)
    return native


def _check_travel(obj: Any) -> Any:
    """The active collector, or an error: a channel travels only with a process start or a
    channel message (as multiprocessing queues travel only "through inheritance")."""
    popen = get_spawning_popen()
    if popen is None:
        raise RuntimeError(
            f"{type(obj).__name__} objects of tether travel to other processes only as "
            "arguments of a process the pool starts or inside a message of a tether queue"
        )
    if isinstance(popen, _FdCollector):
        popen.channels.append(obj)
    return popen


class Queue:
    """A multi-producer, multi-consumer queue between processes (the ``Queue`` of a pool
    context). ``put`` never needs a feeder thread: a message is in the channel when ``put``
    returns. ``get`` works from any thread and raises ``queue.Empty`` on timeout; in the main
    thread it also notices when a process that feeds it died (see ``watch``)."""

    def __init__(self, maxsize: int = 0) -> None:
        self._tx, self._rx = _native.Endpoint.pair()
        self._maxsize = maxsize
        self._watched: List[Watched] = []

    def __reduce__(self) -> Tuple[Any, Tuple[Any, Any]]:
        _check_travel(self)
        return _rebuild_queue, (DupFd(self._tx.fileno()), DupFd(self._rx.fileno()))

    def watch(self, process: Watched) -> None:
        """Makes ``get`` in the main thread watch ``process`` (one that received this queue):
        when it ends badly, the wait raises its failure (for a DataLoader worker, the
        ``RuntimeError`` torch's SIGCHLD handler raises: "DataLoader worker (pid N) is killed
        by signal: Killed."), so the DataLoader reports it at once."""
        self._watched.append(process)

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        """Sends ``obj``; waits only while the channel's buffer is full (``queue.Full`` after
        ``timeout``, or at once when not ``block``)."""
        collector = _FdCollector()
        data = dumps(obj, collector)
        if not self._tx.send(data, collector.fds, timeout if block else 0.0):
            raise queue.Full

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """Receives one object, waiting up to ``timeout`` (for ever when None). In the main
        thread the same wait watches the processes given to ``watch`` (their pidfds and
        end events, no polling) and raises the failure of one that ended badly."""
        if not block:
            timeout = 0.0
        elif timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        if self._watched and threading.current_thread() is threading.main_thread():
            got = self._get_watching(timeout)
        else:
            got = self._rx.recv(timeout)
        if got is None:
            raise queue.Empty
        return loads(got[0], got[1])

    def _get_watching(self, timeout: Optional[float]) -> Optional[Tuple[bytes, List[int]]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            fds: List[int] = []
            owners: List[Watched] = []
            for process in self._watched:
                for fd in process.watch_fds():
                    fds.append(fd)
                    owners.append(process)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = self._rx.recv_watching(left, fds)
            if not isinstance(got, int):
                return got
            process = owners[got]
            error = process.failure()
            if error is not None:
                raise error
            # It ended well (or was reported): stop watching it.
            self._watched = [p for p in self._watched if p is not process]

    def get_nowait(self) -> Any:
        return self.get(False)

    def empty(self) -> bool:
        return not self._rx.readable()

    def full(self) -> bool:
        return False

    def qsize(self) -> int:
        raise NotImplementedError("tether queues do not count their messages")

    def close(self) -> None:
        """Closes this process's ends of the channel (other processes keep theirs)."""
        self._tx.close()
        self._rx.close()

    def join_thread(self) -> None:
        """Nothing to join: ``put`` needs no feeder thread."""

    def cancel_join_thread(self) -> None:
        """Nothing to cancel: ``put`` needs no feeder thread."""

    def __repr__(self) -> str:
        state = "closed" if self._rx.closed else f"fd {self._rx.fileno()}"
        return f"<tether Queue {state}>"


SimpleQueue = Queue


def _rebuild_queue(tx: Any, rx: Any) -> Queue:
    queue_ = Queue.__new__(Queue)
    queue_._tx = _adopt(_native.Endpoint.from_fd(tx.detach()))
    queue_._rx = _adopt(_native.Endpoint.from_fd(rx.detach()))
    queue_._maxsize = 0
    queue_._watched = []
    return queue_


class Event:
    """A cross-process event (the ``Event`` of a pool context): a flag in a shared page."""

    def __init__(self) -> None:
        self._flag = _native.SharedFlag()

    def __reduce__(self) -> Tuple[Any, Tuple[Any]]:
        _check_travel(self)
        return _rebuild_event, (DupFd(self._flag.fileno()),)

    def is_set(self) -> bool:
        return self._flag.is_set()

    def set(self) -> None:
        self._flag.set()

    def clear(self) -> None:
        self._flag.clear()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._flag.wait(timeout)

    def __repr__(self) -> str:
        return f"<tether Event {'set' if self.is_set() else 'unset'}>"


def _rebuild_event(fd: Any) -> Event:
    event = Event.__new__(Event)
    event._flag = _adopt(_native.SharedFlag.from_fd(fd.detach()))
    return event
