"""Queues and events over tether channels.

A ``Queue`` is a ``SOCK_SEQPACKET`` socket pair (``_native.Endpoint``): ``put`` sends one
message on one end, ``get`` receives one whole message from the other, so any number of
processes and threads may put and get at once, with no feeder thread and no manager
process. An ``Event`` is a flag in a shared memfd page (``_native.SharedFlag``). A message
is pickled by ``common.pickling`` (its fds travel with it as ``SCM_RIGHTS`` ancillary data).

Queues and events travel to other processes only this way: as arguments of a process the
pool starts, or inside a message of another tether channel."""

from __future__ import annotations

import queue
import threading
import time
from multiprocessing.context import get_spawning_popen
from multiprocessing.reduction import DupFd
from typing import Any, List, Optional, Protocol, Tuple

from tether import _native
from tether.common.pickling import FdCollector, dumps, loads

__all__ = ["Event", "Queue", "Feeder"]


class Feeder(Protocol):
    """A process that feeds a queue (see ``Queue.add_feeder``)."""

    def sentinels(self) -> List[int]:
        """Fds that become readable when the process ends (none once its end was seen)."""
        ...

    def failure(self) -> Optional[BaseException]:
        """The error to raise for how the process ended, or None (it ended well, or its
        failure was reported already)."""
        ...


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
    if isinstance(popen, FdCollector):
        popen.channels.append(obj)
    return popen


class Queue:
    """A multi-producer, multi-consumer queue between processes (the ``Queue`` of a pool
    context). ``put`` never needs a feeder thread: a message is in the channel when ``put``
    returns. ``get`` works from any thread and raises ``queue.Empty`` on timeout; in the main
    thread it also notices when a process that feeds it died (see ``add_feeder``)."""

    def __init__(self, maxsize: int = 0) -> None:
        self._tx, self._rx = _native.Endpoint.pair()
        self._maxsize = maxsize
        self._feeders: List[Feeder] = []

    def __reduce__(self) -> Tuple[Any, Tuple[Any, Any]]:
        _check_travel(self)
        return _rebuild_queue, (DupFd(self._tx.fileno()), DupFd(self._rx.fileno()))

    def add_feeder(self, process: Feeder) -> None:
        """Makes ``get`` in the main thread heed the end of ``process`` (one that received
        this queue): when it ends badly, the wait raises its failure (for a DataLoader worker, the
        ``RuntimeError`` torch's SIGCHLD handler raises: "DataLoader worker (pid N) is killed
        by signal: Killed."), so the DataLoader reports it at once."""
        self._feeders.append(process)

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        """Sends ``obj``; waits only while the channel's buffer is full (``queue.Full`` after
        ``timeout``, or at once when not ``block``)."""
        collector = FdCollector()
        data = dumps(obj, collector)
        if not self._tx.send(data, collector.fds, timeout if block else 0.0):
            raise queue.Full

    def put_nowait(self, obj: Any) -> None:
        self.put(obj, False)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        """Receives one object, waiting up to ``timeout`` (for ever when None). In the main
        thread the same wait heeds the processes given to ``add_feeder`` (their pidfds and
        end events, no polling) and raises the failure of one that ended badly."""
        if not block:
            timeout = 0.0
        elif timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        if self._feeders and threading.current_thread() is threading.main_thread():
            got = self._get_heeding_feeders(timeout)
        else:
            got = self._rx.recv(timeout)
        if got is None:
            raise queue.Empty
        return loads(got.data, got.fds)

    def _get_heeding_feeders(self, timeout: Optional[float]) -> Optional[_native.Message]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            fds: List[int] = []
            owners: List[Feeder] = []
            for process in self._feeders:
                for fd in process.sentinels():
                    fds.append(fd)
                    owners.append(process)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = self._rx.recv_or_sentinel(left, fds)
            if not isinstance(got, int):
                return got
            process = owners[got]
            error = process.failure()
            if error is not None:
                raise error
            # It ended well (or was reported): stop heeding it.
            self._feeders = [p for p in self._feeders if p is not process]

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
    queue_._feeders = []
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
