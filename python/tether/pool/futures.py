"""Where the outcomes of ``tether.Pool``'s tasks go: the futures of ``submit`` and the runs
of ``map`` results (read in order, each item keeping its own result or exception), and the
rebuilding of an exception raised in a worker. As ``concurrent.futures``: such an exception
comes back as itself with the worker's traceback as its ``__cause__``, and a done-callback's
error is logged, never raised into the pool."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import (
    Any,
    Callable,
    Iterable,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    Union,
)

from tether.common import reports

_LOGGER = logging.getLogger("concurrent.futures")


def rebuild(info: reports.Described) -> BaseException:
    """The exception a worker described (see ``worker.describe``)."""
    return reports.rebuild(reports.Described(*info))


# -- delivery ---------------------------------------------------------------------------------

#: ``active`` while this thread delivers outcomes for the pool (the hub, or a caller taking
#: its own result).
delivery = threading.local()


class _Guarded:
    """A done-callback as the pool runs it: whatever it raises is logged as
    ``concurrent.futures`` logs a callback's error, and never stops the delivery of other
    results (a ``BaseException`` too, when the pool's thread runs it)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, future: concurrent.futures.Future) -> None:
        try:
            self.fn(future)
        except Exception:
            raise  # the Future logs it itself
        except BaseException:
            if not getattr(delivery, "active", False):
                raise
            _LOGGER.exception("exception calling callback for %r", future)


class Source(Protocol):
    """Where a task future's result comes from (``tasks.Tasks``)."""

    def withdraw(self, ids: List[int]) -> List[int]:
        """Cancels those of the tasks ``ids`` not started yet."""

    def started(self, task_id: int) -> bool:
        """Whether a worker started the task."""

    def take(self, future: "TaskFuture", timeout: Optional[float]) -> None:
        """Waits for the future's outcome in this thread and sets it, when it can."""


class TaskFuture(concurrent.futures.Future):
    """The future of a submitted task. It stays pending until a worker starts the task:
    ``cancel()`` withdraws a task not started yet, wherever it waits (here, or in a
    worker's socket); ``running()`` asks the worker set."""

    def __init__(self) -> None:
        super().__init__()
        self._tether_tasks: Optional[Source] = None
        self._tether_id = 0

    def cancel(self) -> bool:
        tasks = self._tether_tasks
        if tasks is not None and not self.done() and not tasks.withdraw([self._tether_id]):
            return False
        if not super().cancel():
            return False
        self.set_running_or_notify_cancel()  # tells wait() and as_completed() at once
        return True

    def result(self, timeout: Optional[float] = None) -> Any:
        return super().result(self._take_here(timeout))

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        return super().exception(self._take_here(timeout))

    def _take_here(self, timeout: Optional[float]) -> Optional[float]:
        """Takes this task's result from its worker in this thread, when it can (saving
        the hub's wake-up); returns what is left of ``timeout``."""
        tasks = self._tether_tasks
        if tasks is None or self.done():
            return timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        tasks.take(self, timeout)
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def running(self) -> bool:
        tasks = self._tether_tasks
        if tasks is not None and not self.done() and tasks.started(self._tether_id):
            return True
        return super().running()

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future], object]) -> None:
        super().add_done_callback(_Guarded(fn))


def settle(future: concurrent.futures.Future, ok: bool, value: Any) -> None:
    """Sets a future's outcome; a callback's error is logged, never raised here."""
    if isinstance(future, TaskFuture):
        future._tether_tasks = None
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled meanwhile
    except BaseException:
        _LOGGER.exception("exception calling callback for %r", future)


_PENDING = object()


class MapRun:
    """The results of one ``map`` call, filled by the hub, read in order by its iterator,
    which drops each result as it yields it."""

    __slots__ = ("results", "cond", "closed", "__weakref__")

    def __init__(self, size: int) -> None:
        self.results: List[Any] = [_PENDING] * size
        self.cond = threading.Condition()
        self.closed = False

    def deliver(self, outcomes: Iterable[Tuple[int, bool, Any]]) -> None:
        with self.cond:
            if self.closed:
                return
            for index, ok, value in outcomes:
                self.results[index] = (ok, value)
            self.cond.notify_all()

    def take(self, index: int, deadline: Optional[float]) -> Any:
        """The result of item ``index`` (raising its exception), waiting until
        ``deadline``."""
        with self.cond:
            while self.results[index] is _PENDING:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise concurrent.futures.TimeoutError()
                self.cond.wait(left)
            (ok, value), self.results[index] = self.results[index], None
        if not ok:
            raise value
        return value


class Chunk:
    """Items of a ``map`` that travel as one task: where their results go, and what they
    call (kept to run again the items a dead worker never reached)."""

    __slots__ = ("run", "indices", "fn", "calls")

    def __init__(
        self, run: MapRun, indices: Sequence[int], fn: Callable[..., Any], calls: List[Any]
    ) -> None:
        self.run = run
        self.indices = indices
        self.fn = fn
        self.calls = calls


Sink = Union[TaskFuture, Chunk]


def chunk_outcomes(
    indices: Sequence[int],
    entries: List[Any],
    unread: Callable[[BaseException, str], BaseException],
) -> Iterator[Tuple[int, bool, Any]]:
    """A chunk's results, item by item (see ``worker``): an entry ``(None, error)`` did not
    unpickle here, and fails its item with ``unread(error, "here")``."""
    for index, (ok, value) in zip(indices, entries):
        if ok is None:
            yield index, False, unread(value, "here")
        else:
            yield index, bool(ok), (value if ok else rebuild(value))
