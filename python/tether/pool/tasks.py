"""The executor side of ``tether.Pool``: ``submit`` and ``map`` (chunks sized to the work, a
chunk that does not pickle cut down to the items that do), where each task's outcome goes
(``Tasks.sinks``, see ``futures``), and what a worker's death does to them: the item
it ran fails with ``WorkerCrashedError``, the items of its chunk it never reached run again.
A task its worker could not unpickle, or whose result does not unpickle here, fails with
that error as ``Tasks.unread`` gives it (as it is, unless the pool's face says otherwise)."""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
)

from tether import _native
from tether.common import pickling, words

from . import worker
from .errors import WorkerCrashedError
from .futures import (
    Chunk,
    MapRun,
    Sink,
    TaskFuture,
    chunk_outcomes,
    delivery,
    rebuild,
    settle,
)

#: The most items of one ``map`` that travel as one task.
MAX_CHUNK = 256

#: A task as the worker set takes it: its id, its pickled call, the fds it carries.
Task = _native.Task


def crash_error(death: _native.WorkerDied, lost: bool, owner: str) -> WorkerCrashedError:
    """The error of a task whose worker died (see ``words.worker_crashed``)."""
    exitcode = words.exitcode_of(death.status)
    name = _native.signal_name(-exitcode) if exitcode < 0 else None
    message = words.worker_crashed(death, lost, owner)
    return WorkerCrashedError(message, death.pid, exitcode, name)


def _as_it_is(error: BaseException, where: str) -> BaseException:
    return error


def _dumps(obj: Any, collector: pickling.FdCollector) -> Tuple[Optional[bytes], Any]:
    """``(bytes, None)``, or ``(None, the error)`` when ``obj`` does not pickle (a
    ``KeyboardInterrupt`` is raised, not returned)."""
    try:
        return pickling.dumps(obj, collector), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit in a __reduce__ included
        return None, exc


class TaskHost(Protocol):
    """What the tasks need of the pool that hosts them (its ``core.Core``)."""

    def check_open(self) -> None:
        """Raises when the pool takes no new task."""

    def taken(self) -> None:
        """A caller took a result in its own thread."""


class Tasks:
    """The pool's tasks in the worker set and where each one's outcome goes."""

    def __init__(
        self,
        workers: _native.WorkerSet,
        ids: "itertools.count[int]",
        size: int,
        max_tasks_per_child: Optional[int],
        host: TaskHost,
        free_held_workers: Callable[[], None],
        owner: str,
    ) -> None:
        self.workers = workers
        self.ids = ids
        self.size = size
        self.max_tasks_per_child = max_tasks_per_child
        self.host = host
        #: Frees the workers that garbage or failed DataLoader iterators hold, if any (the
        #: pool's ``leases.Leases.free_held_workers``): called when a task waits for one.
        self.free_held_workers = free_held_workers
        #: The pool's name in a crashed task's error (``words.POOL`` or ``EXECUTOR``).
        self.owner = owner
        self.sinks: Dict[int, Sink] = {}
        #: The error a task fails with when it could not be unpickled ``where`` ("in the
        #: worker": it never ran) or its result could not be ("here"), from the error met.
        self.unread: Callable[[BaseException, str], BaseException] = _as_it_is
        #: Called once for each task a worker answered (its outcome was delivered).
        self.answered: Optional[Callable[[], Any]] = None

    # -- queueing ----------------------------------------------------------------------------

    def queue_call(
        self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> TaskFuture:
        """``Executor.submit``: queues ``fn(*args, **kwargs)``; returns its future (failed
        at once with the pickling error when the call does not pickle)."""
        self.host.check_open()
        future = TaskFuture()
        collector = pickling.FdCollector(dup=True)
        blob, error = _dumps((worker.CALL, fn, args, kwargs), collector)
        if blob is None:
            collector.close()
            future.set_exception(error)
            return future
        task_id = next(self.ids)
        future._tether_tasks, future._tether_id = self, task_id
        self._queue([Task(task_id, blob, collector.fds)], [(task_id, future)])
        return future

    def queue_map(
        self,
        fn: Callable[..., Any],
        iterables: Sequence[Iterable[Any]],
        timeout: Optional[float],
        chunksize: int,
    ) -> Iterator[Any]:
        """``Executor.map``: queues every call now, in chunks (of ``chunksize`` when above
        1, else sized to the work); returns the iterator of their results, in order."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        self.host.check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        calls = list(zip(*iterables))
        run = MapRun(len(calls))
        size = chunksize if chunksize > 1 else self.chunk_size(len(calls))
        ids = self._queue_chunks(fn, calls, size, run)
        return self._results(run, ids, len(calls), deadline)

    def _results(
        self, run: MapRun, ids: List[int], count: int, deadline: Optional[float]
    ) -> Iterator[Any]:
        """``map``'s iterator: yields each result without keeping it."""
        try:
            for index in range(count):
                yield run.take(index, deadline)
        finally:
            with run.cond:
                run.closed = True
            self.withdraw(ids)

    def _queue(self, tasks: List[Task], sinks: List[Tuple[int, Sink]]) -> None:
        self.sinks.update(sinks)
        try:
            self.workers.submit(tasks)  # the set owns the fds from here on
        except RuntimeError:
            for task_id, _ in sinks:
                self.sinks.pop(task_id, None)
            raise RuntimeError("cannot schedule new futures after shutdown") from None
        if self.workers.queued():
            self.free_held_workers()  # no worker was free

    def chunk_size(self, items: int) -> int:
        """Items per task for a ``map`` of ``items``: enough tasks to spread them, few
        enough that each carries many (one, when workers retire after so many tasks)."""
        if self.max_tasks_per_child is not None:
            return 1
        return max(1, min(MAX_CHUNK, items // (self.size * 8)))

    def _queue_chunks(
        self, fn: Callable[..., Any], calls: List[Any], size: int, run: MapRun
    ) -> List[int]:
        """Queues ``calls`` as chunks of ``size``; returns their task ids."""
        fn_blob, fn_error = _dumps(fn, pickling.FdCollector())
        if fn_blob is None:
            run.deliver((i, False, fn_error) for i in range(len(calls)))
            return []
        tasks: List[Task] = []
        sinks: List[Tuple[int, Sink]] = []
        for start in range(0, len(calls), size):
            part = calls[start : start + size]
            self._chunk(fn, part, range(start, start + len(part)), run, tasks, sinks)
        self._queue(tasks, sinks)
        return [task_id for task_id, _ in sinks]

    def _chunk(
        self,
        fn: Callable[..., Any],
        calls: List[Any],
        indices: Sequence[int],
        run: MapRun,
        tasks: List[Task],
        sinks: List[Tuple[int, Sink]],
    ) -> None:
        """Pickles one chunk; when it does not pickle, the items that do not get their
        error and the others travel together."""
        collector = pickling.FdCollector(dup=True)
        blob, error = _dumps((worker.CHUNK, fn, calls), collector)
        if blob is None:
            collector.close()
            if len(calls) == 1:
                run.deliver([(indices[0], False, error)])
                return
            good = []
            for index, args in zip(indices, calls):
                single, error = _dumps(args, pickling.FdCollector())
                if single is None:
                    run.deliver([(index, False, error)])
                else:
                    good.append((index, args))
            if good:
                self._chunk(fn, [a for _, a in good], [i for i, _ in good], run, tasks, sinks)
            return
        task_id = next(self.ids)
        tasks.append(Task(task_id, blob, collector.fds))
        sinks.append((task_id, Chunk(run, indices, fn, calls)))

    def started(self, task_id: int) -> bool:
        return self.workers.started(task_id)

    def withdraw(self, ids: List[int]) -> List[int]:
        """Cancels those of the tasks ``ids`` not started yet (their sinks are dropped)."""
        cancelled = self.workers.cancel(ids)
        for task_id in cancelled:
            self.sinks.pop(task_id, None)
        return cancelled

    # -- outcomes ----------------------------------------------------------------------------

    def take(self, future: TaskFuture, timeout: Optional[float] = None) -> None:
        """Waits for ``future``'s result in this thread and delivers it (see
        ``WorkerSet.wait_for``); leaves it to the hub when that cannot be done here."""
        if not self.workers.started(future._tether_id):
            self.free_held_workers()
        got = self.workers.wait_for(future._tether_id, timeout)
        if got is None:
            return
        sink = self.sinks.pop(future._tether_id, None)
        if sink is None:
            pickling.close_all(got.fds)
            return
        was = getattr(delivery, "active", False)
        delivery.active = True
        try:
            self._deliver(sink, got.ok, got.data, got.fds)
        finally:
            delivery.active = was
        self.host.taken()

    def on_results(self, results: List[_native.TaskResult]) -> None:
        for result in results:
            sink = self.sinks.pop(result.id, None)
            if sink is None:
                pickling.close_all(result.fds)
            else:
                self._deliver(sink, result.ok, result.data, result.fds)

    def _deliver(self, sink: Sink, ok: bool, data: bytes, fds: List[int]) -> None:
        """Unpickles a task's outcome and hands it to its future or map."""
        if self.answered is not None:
            self.answered()
        try:
            value = pickling.loads(data, fds)
        except BaseException as exc:  # noqa: BLE001 - SystemExit while unpickling too
            self._fail(sink, self.unread(exc, "here"))
            return
        if isinstance(sink, Chunk):
            if ok:
                sink.run.deliver(chunk_outcomes(sink.indices, value, self.unread))
            else:  # the chunk itself failed (it did not unpickle)
                self._fail(sink, self._error(value))
        elif ok:
            settle(sink, True, value)
        else:
            settle(sink, False, self._error(value))

    def _error(self, info: Any) -> BaseException:
        """The exception a task's failed outcome describes (see ``worker``)."""
        if isinstance(info, worker.Unread):
            return self.unread(rebuild(info.error), "in the worker")
        return rebuild(info)

    def _fail(self, sink: Sink, error: BaseException) -> None:
        if isinstance(sink, Chunk):
            sink.run.deliver((i, False, error) for i in sink.indices)
        else:
            settle(sink, False, error)

    def fail(self, ids: Iterable[int], error: BaseException) -> None:
        """Fails the tasks ``ids`` (those still waiting for an outcome) with ``error``."""
        for task_id in ids:
            sink = self.sinks.pop(task_id, None)
            if sink is not None:
                self._fail(sink, error)

    def fail_all(self, error: BaseException) -> None:
        """Fails every task still waiting for an outcome with ``error``."""
        for sink in list(self.sinks.values()):
            self._fail(sink, error)
        self.sinks.clear()

    def mark_cancelled(self, ids: Iterable[int]) -> None:
        """Cancels the tasks ``ids``, which the worker set withdrew."""
        for task_id in ids:
            sink = self.sinks.pop(task_id, None)
            if isinstance(sink, TaskFuture):
                concurrent.futures.Future.cancel(sink)
                sink.set_running_or_notify_cancel()
            elif sink is not None:
                self._fail(sink, concurrent.futures.CancelledError())

    # -- crashes -----------------------------------------------------------------------------

    def on_death(self, death: _native.WorkerDied) -> None:
        """A worker died: fails the item it was running (``crashed``: the task and the
        item) and the results it never sent (``lost``)."""
        if death.crashed is not None:
            self._on_crash(death.crashed.id, death.crashed.item, death)
        for task_id in death.lost:
            sink = self.sinks.pop(task_id, None)
            if sink is not None:
                self._fail(sink, crash_error(death, True, self.owner))

    def _on_crash(self, task_id: int, item: int, death: _native.WorkerDied) -> None:
        """Fails the item a dead worker ran; the items of its chunk it never reached run
        again, as chunks of their own."""
        sink = self.sinks.pop(task_id, None)
        if isinstance(sink, Chunk):
            done, rest = sink.indices[:item], sink.indices[item + 1 :]
            owner = self.owner
            sink.run.deliver((i, False, crash_error(death, True, owner)) for i in done)
            sink.run.deliver([(sink.indices[item], False, crash_error(death, False, owner))])
            if rest and not sink.run.closed:
                tasks: List[Task] = []
                sinks: List[Tuple[int, Sink]] = []
                self._chunk(sink.fn, sink.calls[item + 1 :], rest, sink.run, tasks, sinks)
                try:
                    self._queue(tasks, sinks)
                except RuntimeError as exc:
                    for _, chunk in sinks:
                        self._fail(chunk, exc)
        elif sink is not None:
            settle(sink, False, crash_error(death, False, self.owner))
