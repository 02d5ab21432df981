"""``tether.Pool``: long-lived worker processes that many DataLoaders borrow in turn or at the
same time (``DataLoader(..., multiprocessing_context=pool.context())``), and a
``concurrent.futures.Executor`` over the same workers.

Each worker is a direct child of this process, started by tether's launch layer (so it
leads its own process group and dies with this process). The worker set lives in Rust
(``_native.WorkerSet``): the table of workers, the tasks queued and in flight, which
worker runs which task, batch sizes, leases, and deaths seen on each worker's pidfd. This
module keeps the Python side: pickling, futures, ``map``'s order, the DataLoader policy, and
one hub thread that takes the worker set's events (results, ended leases, deaths) and
delivers them. A worker that dies fails the task it was running (``WorkerCrashedError``,
a ``BrokenProcessPool``); the tasks it never started run elsewhere, and a replacement starts
on a thread of its own, so the other workers' results keep flowing meanwhile.

As ``concurrent.futures.ProcessPoolExecutor``: work submitted before shutdown finishes
before the interpreter exits (unless ``shutdown(cancel_futures=True)``), whether or not the
pool was shut down or garbage collected; an exception raised in a worker comes back as
itself with the worker's traceback as its ``__cause__``."""

from __future__ import annotations

import concurrent.futures
import gc
import inspect
import itertools
import logging
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool
from concurrent.futures.process import _RemoteTraceback as _CFRemoteTraceback
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Literal,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from . import _channel, _datasets, _launch, _native, _report, _worker
from ._log import logger

if TYPE_CHECKING:
    from . import _status
from .context import Leased, PoolContext

__all__ = ["BrokenPool", "NoFreeWorkerError", "Pool", "RemoteError", "WorkerCrashedError"]

#: Messages of executor tasks in flight per worker (one running, one waiting in its socket).
WINDOW = 2
#: The most tasks one message carries.
MAX_BATCH = 256
#: The most items of one ``map`` that travel as one task.
MAX_CHUNK = 256
#: The most a wait (the hub's, a waiting caller's, a worker's) polls before it sleeps: a
#: sleeping thread costs a wake-up when its message comes. Polling stops for a while when
#: it keeps finding nothing (a busy machine), where it would only take a core from the
#: process that answers.
SPIN = 0.0001
#: How long closing waits for workers to exit after closing their links, before SIGKILL.
EXIT_GRACE = 2.0

_LOGGER = logging.getLogger("concurrent.futures")

State = Literal["running", "shutdown", "closed"]


class WorkerCrashedError(BrokenProcessPool):
    """A pool worker died while it ran (or had just run) a task; the pool started a new
    worker and keeps running. ``pid`` is the worker's, ``exitcode`` its exit code (minus the
    signal number when killed), ``signal_name`` the signal's name (``SIGSEGV``) or None.
    A ``BrokenProcessPool``, as ``ProcessPoolExecutor`` reports the same event."""

    def __init__(
        self, message: str, pid: int, exitcode: int, signal_name: Optional[str] = None
    ) -> None:
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode
        self.signal_name = signal_name

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return type(self), (self.args[0], self.pid, self.exitcode, self.signal_name)


class BrokenPool(BrokenProcessPool):
    """The pool cannot run tasks: a worker failed to start (its error is in the message)."""


class NoFreeWorkerError(RuntimeError):
    """No worker is free for a leased process (a RuntimeError for the caller)."""


class RemoteError(Exception):
    """An exception raised in a worker that could not be rebuilt here (its class does not
    pickle or unpickle): its type's name, its message and the worker's traceback text."""

    def __init__(self, type_name: str, message: str, traceback: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.traceback = traceback

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return type(self), (self.type_name, self.message, self.traceback)


def _remote_traceback(text: str) -> BaseException:
    """The ``__cause__`` of an exception raised in a worker, as ``concurrent.futures``
    makes it (``.tb`` is the worker's traceback)."""
    # It takes the traceback's text (its type stubs say a traceback object).
    return _CFRemoteTraceback(f'\n"""\n{text}"""')  # type: ignore[arg-type]


def _rebuild(info: _worker.ErrorInfo) -> BaseException:
    """The exception a worker described (see ``_worker.describe``)."""
    type_name, message, text, pickled = info
    exc = _report.unpickle_exception(pickled)
    if exc is None:
        exc = RemoteError(type_name, message, text)
    exc.__cause__ = _remote_traceback(text)
    return exc


def _status_text(exitcode: int) -> Tuple[str, Optional[str], Optional[str]]:
    """("killed by signal SIGSEGV (Segmentation fault)" or "exited with code 3", the
    signal's name, a hint)."""
    if exitcode < 0:
        name = _native.signal_name(-exitcode)
        try:
            description = signal.strsignal(-exitcode)
        except ValueError:
            description = None
        text = f"killed by signal {name}" + (f" ({description})" if description else "")
        return text, name, _native.signal_hint(-exitcode)
    return f"exited with code {exitcode}", None, None


def _crash_error(pid: int, exitcode: int, lost: bool) -> WorkerCrashedError:
    text, name, hint = _status_text(exitcode)
    when = (
        "after running this task, before its result was sent back"
        if lost
        else "while running this task"
    )
    return WorkerCrashedError(
        f"tether.Pool worker (pid {pid}) {text} {when}"
        + (f" ({hint})" if hint else "")
        + "; the pool started a new worker",
        pid,
        exitcode,
        name,
    )


# -- delivery ---------------------------------------------------------------------------------

_delivery = threading.local()


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
            if not getattr(_delivery, "active", False):
                raise
            _LOGGER.exception("exception calling callback for %r", future)


class _TaskFuture(concurrent.futures.Future):
    """The future of a submitted task. It stays pending until a worker starts the task:
    ``cancel()`` withdraws a task not started yet, wherever it waits (here, or in a
    worker's socket); ``running()`` asks the worker set."""

    def __init__(self) -> None:
        super().__init__()
        self._tether_core: Optional["_Core"] = None
        self._tether_id = 0

    def cancel(self) -> bool:
        core = self._tether_core
        if core is not None and not self.done() and not core.withdraw([self._tether_id]):
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
        core = self._tether_core
        if core is None or self.done():
            return timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if not core.workers.started(self._tether_id):
            core.free_held_workers()
        core.take(self, timeout)
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def running(self) -> bool:
        core = self._tether_core
        if core is not None and not self.done() and core.workers.started(self._tether_id):
            return True
        return super().running()

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future], object]) -> None:
        super().add_done_callback(_Guarded(fn))


def _settle(future: concurrent.futures.Future, ok: bool, value: Any) -> None:
    """Sets a future's outcome; a callback's error is logged, never raised here."""
    if isinstance(future, _TaskFuture):
        future._tether_core = None
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled meanwhile
    except BaseException:  # noqa: BLE001 - a callback not wrapped by us
        _LOGGER.exception("exception calling callback for %r", future)


_PENDING = object()


class _MapRun:
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


class _Chunk:
    """Items of a ``map`` that travel as one task: where their results go, and what they
    call (kept to run again the items a dead worker never reached)."""

    __slots__ = ("run", "indices", "fn", "calls")

    def __init__(
        self, run: _MapRun, indices: Sequence[int], fn: Callable[..., Any], calls: List[Any]
    ) -> None:
        self.run = run
        self.indices = indices
        self.fn = fn
        self.calls = calls


Sink = Union[_TaskFuture, _Chunk]


_signatures: Dict[Any, Optional[inspect.Signature]] = {}


def _dataloader_call(
    target: Any, args: Sequence[Any], kwargs: Dict[str, Any]
) -> Optional[Dict[str, Any]]:
    """The arguments of torch's DataLoader worker loop, by name, when ``target`` is it."""
    if getattr(target, "__name__", None) != "_worker_loop" or not str(
        getattr(target, "__module__", "")
    ).startswith("torch.utils.data"):
        return None
    if target not in _signatures:
        try:
            _signatures[target] = inspect.signature(target)
        except (TypeError, ValueError):
            _signatures[target] = None
    sig = _signatures[target]
    if sig is None:
        return None
    try:
        bound = sig.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    if "worker_id" not in bound or "num_workers" not in bound:
        return None
    return dict(bound)


def _describe_call(target: Any, loader: Optional[Dict[str, Any]]) -> str:
    if loader is not None:
        holder = loader.get("dataset_holder", loader.get("dataset"))
        dataset = holder[0] if isinstance(holder, list) and holder else holder
        return f"DataLoader iterator(s) over {type(dataset).__name__}"
    name = getattr(target, "__qualname__", None) or repr(target)
    return f"process(es) running {getattr(target, '__module__', '?')}.{name}"


def _dumps(obj: Any, collector: _channel._FdCollector) -> Tuple[Optional[bytes], Any]:
    """``(bytes, None)``, or ``(None, the error)`` when ``obj`` does not pickle (a
    ``KeyboardInterrupt`` is raised, not returned)."""
    try:
        return _channel.dumps(obj, collector), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit in a __reduce__ included
        return None, exc


class _Core:
    """The pool's state, shared by the ``Pool`` façade, its contexts, the hub thread and the
    replacement threads (none of which keeps the façade alive)."""

    def __init__(
        self,
        processes: int,
        start_method: str,
        preload: Sequence[str],
        initializer: Optional[Callable[..., Any]],
        initargs: Sequence[Any],
        max_tasks_per_child: Optional[int] = None,
    ) -> None:
        self.size = processes
        self.number = next(_numbers)
        self.max_tasks_per_child = max_tasks_per_child
        #: The process that made the pool (a copy inherited through a fork does nothing).
        self.pid = os.getpid()
        self.start_method = start_method
        self.preload = list(preload)
        self.config = {
            "preload": self.preload,
            "initializer": initializer,
            "initargs": tuple(initargs),
            "spin": SPIN,
            "max_tasks": max_tasks_per_child,
        }
        self.workers = _native.WorkerSet(WINDOW, MAX_BATCH, SPIN)
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.sinks: Dict[int, Sink] = {}
        self.leases: Dict[int, str] = {}
        self.reserved: "weakref.WeakKeyDictionary[Any, List[int]]" = weakref.WeakKeyDictionary()
        #: What the workers keep of the DataLoaders they served.
        self.kept = _datasets.Kept()
        self.replacing: "set[threading.Thread]" = set()
        self.state: State = "running"
        self.broken: Optional[str] = None
        #: Notified by the hub when a worker becomes ready or dies.
        self.changed = threading.Condition(self.lock)
        #: When ``free_held_workers`` last collected garbage.
        self.collected = -1.0
        try:
            self._start_workers(list(range(processes)))
            self.hub = threading.Thread(target=self._hub, name="tether-pool-hub", daemon=True)
            self.hub.start()
            self._wait_ready()
        except BaseException:
            self._close(kill=True)
            raise

    def _wait_ready(self) -> None:
        """Waits until every worker is ready; raises ``BrokenPool`` with the error of a
        worker that died first (its initializer failed, its start did)."""
        with self.changed:
            while self.broken is None and self.state != "closed":
                workers = self.workers.workers()
                if len(workers) == self.size and all(w[2] for w in workers):
                    return
                self.changed.wait()
            if self.broken is not None:
                raise BrokenPool(self.broken)

    # -- workers ---------------------------------------------------------------------------

    def _start_workers(self, slots: List[int]) -> None:
        """Starts the workers of ``slots`` in one launch, each linked to the set."""
        links = [self.workers.link() for _ in slots]
        fds = {slot: link.child_fds() for slot, link in zip(slots, links)}
        # A fork child closes what it inherits of the pool: every worker's socket.
        inherited = self.workers.parent_fds() + [link.parent_fd() for link in links]
        logger.info("pool %d: starting worker(s) %s", self.number, slots)
        group = _launch.start(
            _worker.serve,
            (fds, self.config),
            slots,
            self.start_method,
            preload=self.preload or None,
            keep_fds=[fd for pair in fds.values() for fd in pair],
            close_in_child=inherited,
            title=(
                f"tether pool {self.number} worker {{rank}} [{self.start_method}, "
                f"parent {os.getpid()}]",
                f"tether:p{self.number}w{{rank}}",
            ),
        )
        for member, (slot, link) in enumerate(zip(slots, links)):
            try:
                self.workers.add(slot, link, group, member)
            except (RuntimeError, OSError):
                # Closed meanwhile (or it cannot be watched): it must not outlive the pool.
                group.signal(member, signal.SIGKILL)
                group.wait([member], "all", 5.0)

    def pids(self) -> List[int]:
        return self.workers.pids()

    def status(self) -> "_status.Pool":
        """This pool and its workers, for ``tether.status()``."""
        from . import _status

        leased = {lease_id: what for lease_id, what in self.leases.items()}
        workers = [
            _status.Child(
                pid,
                f"worker {slot}",
                _worker_state(ready, leased.get(lease) if lease is not None else None, reserved),
            )
            for slot, pid, ready, lease, reserved in self.workers.workers()
        ]
        return _status.Pool(self.number, self.start_method, workers)

    # -- executor --------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.broken is not None:
            raise BrokenPool(self.broken)
        if self.state != "running":
            raise RuntimeError("cannot schedule new futures after shutdown")

    def submit(
        self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> _TaskFuture:
        self.check_open()
        future = _TaskFuture()
        collector = _channel._FdCollector(dup=True)
        blob, error = _dumps((_worker.CALL, fn, args, kwargs), collector)
        if blob is None:
            collector.close()
            future.set_exception(error)
            return future
        task_id = next(self.ids)
        future._tether_core, future._tether_id = self, task_id
        self._queue([(task_id, blob, collector.fds)], [(task_id, future)])
        return future

    def _queue(
        self, tasks: List[Tuple[int, bytes, List[int]]], sinks: List[Tuple[int, Sink]]
    ) -> None:
        self.sinks.update(sinks)
        try:
            self.workers.submit(tasks)  # the set owns the fds from here on
        except RuntimeError:
            for task_id, _ in sinks:
                self.sinks.pop(task_id, None)
            raise RuntimeError("cannot schedule new futures after shutdown") from None

    def chunk_size(self, items: int) -> int:
        """Items per task for a ``map`` of ``items``: enough tasks to spread them, few
        enough that each carries many (one, when workers retire after so many tasks)."""
        if self.max_tasks_per_child is not None:
            return 1
        return max(1, min(MAX_CHUNK, items // (self.size * 8)))

    def map(self, fn: Callable[..., Any], calls: List[Any], size: int, run: _MapRun) -> List[int]:
        """Queues ``calls`` as chunks of ``size``; returns their task ids."""
        self.check_open()
        fn_blob, fn_error = _dumps(fn, _channel._FdCollector())
        if fn_blob is None:
            run.deliver((i, False, fn_error) for i in range(len(calls)))
            return []
        tasks: List[Tuple[int, bytes, List[int]]] = []
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
        run: _MapRun,
        tasks: List[Tuple[int, bytes, List[int]]],
        sinks: List[Tuple[int, Sink]],
    ) -> None:
        """Pickles one chunk; when it does not pickle, the items that do not get their
        error and the others travel together."""
        collector = _channel._FdCollector(dup=True)
        blob, error = _dumps((_worker.CHUNK, fn, calls), collector)
        if blob is None:
            collector.close()
            if len(calls) == 1:
                run.deliver([(indices[0], False, error)])
                return
            good = []
            for index, args in zip(indices, calls):
                single, error = _dumps(args, _channel._FdCollector())
                if single is None:
                    run.deliver([(index, False, error)])
                else:
                    good.append((index, args))
            if good:
                self._chunk(fn, [a for _, a in good], [i for i, _ in good], run, tasks, sinks)
            return
        task_id = next(self.ids)
        tasks.append((task_id, blob, collector.fds))
        sinks.append((task_id, _Chunk(run, indices, fn, calls)))

    def take(self, future: _TaskFuture, timeout: Optional[float] = None) -> None:
        """Waits for ``future``'s result in this thread and delivers it (see
        ``WorkerSet.wait_for``); leaves it to the hub when that cannot be done here."""
        got = self.workers.wait_for(future._tether_id, timeout)
        if got is None:
            return
        ok, data, fds = got
        sink = self.sinks.pop(future._tether_id, None)
        if sink is None:
            _channel._close_all(fds)
            return
        was = getattr(_delivery, "active", False)
        _delivery.active = True
        try:
            self._deliver(sink, ok, data, fds)
        finally:
            _delivery.active = was
        if self.state != "running":
            self.workers.wake()  # the hub closes the pool once no work is left

    def free_held_workers(self) -> None:
        """When no worker is free, a DataLoader iterator that is garbage but not collected
        yet (in a reference cycle) may hold some: collects the garbage, at most once a
        second, never from the hub (an iterator's finalizer waits for the hub)."""
        now = time.monotonic()
        if now - self.collected < 1.0 or threading.current_thread() is getattr(self, "hub", None):
            return
        workers = self.workers.workers()
        if any(lease is None and not reserved for _, _, _, lease, reserved in workers):
            return
        if any(lease is not None for _, _, _, lease, _ in workers):
            self.collected = now
            gc.collect()

    def withdraw(self, ids: List[int]) -> List[int]:
        """Cancels those of the tasks ``ids`` not started yet (their sinks are dropped)."""
        cancelled = self.workers.cancel(ids)
        for task_id in cancelled:
            self.sinks.pop(task_id, None)
        return cancelled

    # -- leased processes ------------------------------------------------------------------

    def lease(
        self,
        target: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Dict[str, Any],
        keep_datasets: bool = True,
    ) -> Leased:
        """Takes a worker for a process (for a DataLoader's first worker, as many as the
        loader has workers, or a clear error), pickles the process's call (passing the fds
        it names) and sends it there. For torch's DataLoader worker loop, the dataset,
        ``collate_fn`` and ``worker_init_fn`` travel as ``_datasets.Kept`` decides: a
        reference to the worker's copy, or one pickle shared by the loader's workers."""
        if self.broken is not None:
            raise BrokenPool(self.broken)
        if self.state == "closed":
            raise RuntimeError("the tether.Pool is shut down")
        loader = _dataloader_call(target, args, kwargs)
        lease_id = next(self.ids)
        try:
            slot = self._take_slot(loader)
        except NoFreeWorkerError:
            # An iterator that is garbage but not yet collected (in a reference cycle with
            # the traceback of an error it raised) still holds workers: collect it (its
            # __del__ gives them back); a worker that died may be being replaced: wait for
            # that. Then try once more.
            gc.collect()
            self.join_replacements()
            slot = self._take_slot(loader)
        try:
            forget = _datasets.Forgetting(())
            commit: Optional[Callable[[], None]] = None
            if loader is not None:
                kwargs, forget, commit = self.kept.prepare(
                    loader, slot, self._pid_in(slot), keep_datasets
                )
                args = ()
            collector = _channel._FdCollector()
            # torch's worker loop seeds the random generators itself (see _worker._run_lease).
            blob = _channel.dumps((forget, target, args, kwargs, loader is not None), collector)
            lease = self.workers.lease(slot, lease_id, blob, collector.fds)
        except BaseException:
            self.workers.unreserve([slot])
            raise
        if commit is not None:
            commit()
        self.leases[lease_id] = _describe_call(target, loader)
        return Leased(lease, loader is not None, collector.channels)

    def _pid_in(self, slot: int) -> int:
        for worker_slot, pid, *_ in self.workers.workers():
            if worker_slot == slot:
                return pid
        return 0

    def _take_slot(self, loader: Optional[Dict[str, Any]]) -> int:
        """A reserved or free worker's slot for a process (see ``lease``)."""
        done_event = None if loader is None else loader.get("done_event")
        if loader is not None and done_event is not None and loader["worker_id"] > 0:
            reserved = self.reserved.get(done_event)
            if reserved:
                return reserved.pop(0)
        need = (
            1 if loader is None else max(1, int(loader["num_workers"]) - int(loader["worker_id"]))
        )
        slots = self.workers.reserve(need)
        if not slots:
            num_workers = None if loader is None else int(loader["num_workers"])
            raise NoFreeWorkerError(self._exhausted(need, num_workers))
        rest = slots[1:]
        if rest and done_event is not None:
            self.reserved[done_event] = rest
            weakref.finalize(done_event, self.workers.unreserve, rest)
        elif rest:
            self.workers.unreserve(rest)
        return slots[0]

    def _exhausted(self, need: int, num_workers: Optional[int]) -> str:
        what = (
            f"a DataLoader with num_workers={num_workers}"
            if num_workers is not None
            else "a process"
        )
        holders: Dict[str, List[int]] = {}
        reserved = free = 0
        for _slot, pid, _ready, lease_id, is_reserved in self.workers.workers():
            if lease_id is not None:
                holders.setdefault(self.leases.get(lease_id, "a process"), []).append(pid)
            elif is_reserved:
                reserved += 1
            else:
                free += 1
        held = sum(len(p) for p in holders.values())
        lines = [
            f"tether.Pool(processes={self.size}) cannot lease {need} worker(s) for {what}: "
            f"only {free} of its {self.size} workers are free; {held} are leased"
            + (f" and {reserved} reserved by a DataLoader being started" if reserved else "")
            + (":" if holders else ".")
        ]
        for description, pids in holders.items():
            lines.append(f"  - {len(pids)} by {description} (pid {', '.join(map(str, pids))})")
        lines.append(
            "A DataLoader iterator keeps its workers until it is exhausted or deleted (with "
            "persistent_workers, until the loader is deleted). Make the pool larger, lower "
            "num_workers, or finish the other iterations first."
        )
        return "\n".join(lines)

    def signal(self, lease: _native.Lease, signum: int) -> None:
        self.workers.signal_lease(lease, signum)

    # -- the hub ---------------------------------------------------------------------------

    def _hub(self) -> None:
        """Takes the worker set's events and delivers them, until the pool is closed."""
        _delivery.active = True
        while True:
            events = self.workers.poll(None)
            if events is None:
                return
            try:
                self._handle(events)
            except Exception:  # noqa: BLE001 - the hub must outlive any bug of ours
                threading.excepthook(
                    threading.ExceptHookArgs((*sys.exc_info(), threading.current_thread()))
                )
            del events
            if self.state != "running" and not self.workers.busy():
                self._close(kill=False)
                return

    def _handle(self, events: List[Any]) -> None:
        for event in events:
            kind = event[0]
            if kind == "results":
                self._on_results(event[3])
            elif kind == "lease":
                self.leases.pop(event[2].id, None)
                end = event[2].end()
                if end is not None and end[0] != 0:
                    self.kept.lost(event[1])
            elif kind == "died":
                self._on_death(*event[1:])
            if kind in ("ready", "died"):
                with self.changed:
                    self.changed.notify_all()

    def _on_results(self, outcomes: List[Tuple[int, bool, bytes, List[int]]]) -> None:
        for task_id, ok, data, fds in outcomes:
            sink = self.sinks.pop(task_id, None)
            if sink is None:
                _channel._close_all(fds)
            else:
                self._deliver(sink, ok, data, fds)

    def _deliver(self, sink: Sink, ok: bool, data: bytes, fds: List[int]) -> None:
        """Unpickles a task's outcome and hands it to its future or map."""
        try:
            value = _channel.loads(data, fds)
        except BaseException as exc:  # noqa: BLE001 - SystemExit while unpickling too
            self._fail(sink, exc)
            return
        if isinstance(sink, _Chunk):
            if ok:
                sink.run.deliver(_entries(sink.indices, value))
            else:  # the chunk itself failed (it did not unpickle)
                self._fail(sink, _rebuild(value))
        elif ok:
            _settle(sink, True, value)
        else:
            _settle(sink, False, _rebuild(value))

    def _fail(self, sink: Sink, error: BaseException) -> None:
        if isinstance(sink, _Chunk):
            sink.run.deliver((i, False, error) for i in sink.indices)
        else:
            _settle(sink, False, error)

    def _on_death(
        self,
        slot: int,
        pid: int,
        status: _native.ExitStatus,
        ready: bool,
        crashed: Optional[Tuple[int, int]],
        lost: List[int],
        lease: Optional[_native.Lease],
        report: bytes,
    ) -> None:
        """A worker died: fail what it was running, and the results it never sent; start a
        replacement (or, when it died before it was ready, mark the pool broken)."""
        # 255 stands for a status something else took (a SIGCHLD set to SIG_IGN).
        exitcode = 255 if status.exitcode is None else status.exitcode
        logger.info("pool %d: worker %d (pid %d) died with %s", self.number, slot, pid, status)
        if lease is not None:
            self.leases.pop(lease.id, None)
        if crashed is not None:
            self._on_crash(crashed[0], crashed[1], pid, exitcode)
        for task_id in lost:
            sink = self.sinks.pop(task_id, None)
            if sink is not None:
                self._fail(sink, _crash_error(pid, exitcode, lost=True))
        if not ready and self.state != "closed" and self.broken is None:
            self._break(self._startup_failure(pid, exitcode, report))
        elif self.state != "closed" and self.broken is None:
            thread = threading.Thread(
                target=self._replace, args=(slot,), name="tether-pool-replace", daemon=True
            )
            with self.lock:
                self.replacing.add(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # interpreter shutting down
                with self.lock:
                    self.replacing.discard(thread)
                self._break(f"could not start a replacement worker: {exc!r}")

    def _on_crash(self, task_id: int, item: int, pid: int, exitcode: int) -> None:
        sink = self.sinks.pop(task_id, None)
        if isinstance(sink, _Chunk):
            done, rest = sink.indices[:item], sink.indices[item + 1 :]
            sink.run.deliver((i, False, _crash_error(pid, exitcode, lost=True)) for i in done)
            sink.run.deliver([(sink.indices[item], False, _crash_error(pid, exitcode, lost=False))])
            if rest and not sink.run.closed:
                tasks: List[Tuple[int, bytes, List[int]]] = []
                sinks: List[Tuple[int, Sink]] = []
                self._chunk(sink.fn, sink.calls[item + 1 :], rest, sink.run, tasks, sinks)
                try:
                    self._queue(tasks, sinks)
                except RuntimeError as exc:
                    for _, chunk in sinks:
                        self._fail(chunk, exc)
        elif sink is not None:
            _settle(sink, False, _crash_error(pid, exitcode, lost=False))

    def _replace(self, slot: int) -> None:
        try:
            self._start_workers([slot])
            logger.info("pool %d: worker %d replaced", self.number, slot)
        except BaseException as exc:  # noqa: BLE001 - a pool that cannot heal is broken
            self._break(f"could not start a replacement worker: {exc!r}")
        finally:
            with self.lock:
                self.replacing.discard(threading.current_thread())
            self.workers.wake()

    def _break(self, message: str) -> None:
        """Marks the pool broken: every task not started fails with ``BrokenPool``."""
        self.broken = message
        for task_id in self.workers.cancel_all():
            sink = self.sinks.pop(task_id, None)
            if sink is not None:
                self._fail(sink, BrokenPool(message))

    def _startup_failure(self, pid: int, exitcode: int, raw_report: bytes) -> str:
        report = _report.decode(raw_report)
        text, _, _ = _status_text(exitcode)
        message = f"a tether.Pool worker (pid {pid}) {text} before it was ready"
        if report is not None:
            message += ":\n" + report[0]
        return message

    # -- shutdown --------------------------------------------------------------------------

    def shutdown(self, wait: bool, cancel_futures: bool) -> None:
        with self.lock:
            if self.state == "running":
                self.state = "shutdown"
        if cancel_futures:
            for task_id in self.workers.cancel_all():
                sink = self.sinks.pop(task_id, None)
                if isinstance(sink, _TaskFuture):
                    concurrent.futures.Future.cancel(sink)
                    sink.set_running_or_notify_cancel()
                elif sink is not None:
                    self._fail(sink, concurrent.futures.CancelledError())
        self.workers.wake()
        if wait:
            self.join()

    def join(self) -> None:
        """Waits for the hub (which closes the pool once its work is done) and for the
        replacements being started."""
        hub = getattr(self, "hub", None)
        if hub is not None and hub is not threading.current_thread():
            hub.join()
        self.join_replacements()

    def join_replacements(self) -> None:
        """Waits until the workers being started to replace dead ones are in the set."""
        with self.lock:
            starting = list(self.replacing)
        for thread in starting:
            if thread is not threading.current_thread():
                thread.join()

    def _close(self, kill: bool) -> None:
        """Stops every worker; tasks never answered fail; leases end with their workers'
        status. With ``kill``, workers get SIGKILL at once."""
        with self.lock:
            if self.state == "closed":
                return
            self.state = "closed"
            self.changed.notify_all()
        left = self.workers.close(kill, 0.0 if kill else EXIT_GRACE)
        error = RuntimeError("the tether.Pool was shut down before this task ran")
        for task_id in left:
            sink = self.sinks.pop(task_id, None)
            if sink is not None:
                self._fail(sink, error)
        for sink in list(self.sinks.values()):
            self._fail(sink, error)
        self.sinks.clear()
        self.leases.clear()
        _live.discard(self)


def _entries(indices: Sequence[int], entries: List[Any]) -> Iterator[Tuple[int, bool, Any]]:
    """A chunk's results, item by item (see ``_worker``)."""
    for index, (ok, value) in zip(indices, entries):
        if ok is None:
            try:
                ok, value = pickle.loads(value)
            except BaseException as exc:  # noqa: BLE001
                yield index, False, exc
                continue
        yield index, bool(ok), (value if ok else _rebuild(value))


_live: "weakref.WeakSet[_Core]" = weakref.WeakSet()
#: Numbers the pools of this process (as they show in ``ps`` and ``tether.status()``).
_numbers = itertools.count(1)


def status() -> List["_status.Pool"]:
    """The pools of this process and their workers (see ``tether.status()``)."""
    return [core.status() for core in sorted(_live, key=lambda c: c.number)]


def _worker_state(ready: bool, leased_to: Optional[str], reserved: bool) -> str:
    if not ready:
        return "starting"
    if leased_to is not None:
        return f"leased to {leased_to}"
    return "reserved for a DataLoader" if reserved else "ready"


def _python_exit() -> None:
    """At interpreter exit, before threads are joined: every pool finishes the work it was
    given (as ``ProcessPoolExecutor`` does), then stops."""
    for core in list(_live):
        if core.pid == os.getpid():
            core.free_held_workers()
            core.shutdown(wait=True, cancel_futures=False)


try:
    # What concurrent.futures registers its own exit hook with (private to threading, not in
    # its type stubs): it runs before non-daemon threads are joined.
    threading._register_atexit(_python_exit)  # type: ignore[attr-defined]
except RuntimeError:  # imported while the interpreter shuts down
    pass


class Pool(concurrent.futures.Executor):
    """Long-lived worker processes for DataLoaders and for ``concurrent.futures`` work.

    ``processes`` workers (default: the CPU count) are started at once with
    ``start_method`` ("forkserver", the default: forks of tether's zygote, which preloads
    ``preload`` when given; "spawn"; or "fork"); each imports the modules in ``preload``
    and runs ``initializer(*initargs)`` first. With ``max_tasks_per_child``, a worker exits
    after that many executor tasks and a new one takes its place. ``pool.context()`` is a
    multiprocessing context for ``DataLoader(multiprocessing_context=...)`` whose processes
    are leased pool workers; ``submit`` / ``map`` run tasks on the free workers.
    ``shutdown()`` (or leaving a ``with`` block) stops everything once the work given is
    done; so does the garbage collection of the pool, and the interpreter's exit."""

    def __init__(
        self,
        processes: Optional[int] = None,
        *,
        start_method: Optional[str] = None,
        preload: Optional[Sequence[str]] = None,
        initializer: Optional[Callable[..., Any]] = None,
        initargs: Sequence[Any] = (),
        max_tasks_per_child: Optional[int] = None,
    ) -> None:
        if processes is None:
            processes = os.cpu_count() or 1
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ValueError(f"processes must be a positive int, got {processes!r}")
        method = _launch.DEFAULT_START_METHOD if start_method is None else start_method
        _launch.check_start_method(method, "tether.Pool")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be callable")
        if max_tasks_per_child is not None and (
            not isinstance(max_tasks_per_child, int)
            or isinstance(max_tasks_per_child, bool)
            or max_tasks_per_child < 1
        ):
            raise ValueError("max_tasks_per_child must be >= 1")
        if max_tasks_per_child is not None and method == "fork":
            # Each replacement would fork this process, which has threads by then (the hub's).
            raise ValueError(
                "max_tasks_per_child is incompatible with the 'fork' start method: every "
                "replacement would fork this process, which has threads; use 'forkserver' "
                "(the default) or 'spawn'"
            )
        self._core = _Core(
            processes, method, list(preload or ()), initializer, initargs, max_tasks_per_child
        )
        _live.add(self._core)
        self._finalizer = weakref.finalize(self, self._core.shutdown, False, False)
        # The context keeps the pool alive (a DataLoader may hold only the context); the
        # pool refers to it weakly, so that dropping the pool alone still closes it at once.
        self._contexts: Dict[bool, "weakref.ReferenceType[PoolContext]"] = {}

    @property
    def processes(self) -> int:
        """How many workers the pool keeps."""
        return self._core.size

    @property
    def start_method(self) -> str:
        return self._core.start_method

    @property
    def preload(self) -> List[str]:
        return list(self._core.preload)

    def context(self, *, keep_datasets: bool = True) -> PoolContext:
        """A ``multiprocessing`` context whose ``Process`` runs in a leased pool worker and
        whose ``Queue`` and ``Event`` are tether channels: pass it as a DataLoader's
        ``multiprocessing_context``.

        With ``keep_datasets`` (the default), the workers keep the dataset, ``collate_fn``
        and ``worker_init_fn`` a loader sent them for as long as this process holds those
        objects, and a later loader over the same objects sends none of them: torch's
        ``persistent_workers`` contract, across loaders. The next loader sees an attribute
        of the dataset rebound (at any depth of its attributes) and a torch tensor in it
        changed in place; any other change in place after ``refresh(dataset)``. With
        ``keep_datasets=False``, every iterator sends them anew, as it finds them (fork's
        semantics); either way they are pickled once per loader, not once per worker."""
        ref = self._contexts.get(keep_datasets)
        context = None if ref is None else ref()
        if context is None:
            context = PoolContext(self._core, pool=self, keep_datasets=bool(keep_datasets))
            self._contexts[keep_datasets] = weakref.ref(context)
        return context

    def refresh(self, dataset: Any = None) -> None:
        """Makes the next loader send ``dataset`` (every object the workers keep, when
        None) again, so that its workers see changes made in place that the pool cannot
        notice (an item appended to a list it holds, a numpy array written to)."""
        self._core.kept.refresh(dataset)

    def pids(self) -> List[int]:
        """The pids of the current workers (a replaced worker has a new pid)."""
        return self._core.pids()

    def stacks(self, timeout: float = 5.0, native: bool = False) -> Dict[int, str]:
        """Where every worker is: ``{pid: text}``, the Python stack of each of its threads
        (see ``ProcessContext.stacks``); a worker that cannot answer says why."""
        from . import _stacks

        targets = self._core.workers.members()
        return {pid: text for pid, _, text in _stacks.ask(targets, timeout, native)}

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        """Runs ``fn(*args, **kwargs)`` in a free worker; returns its future. A worker that
        dies while running it fails the future with ``WorkerCrashedError``."""
        return self._core.submit(fn, args, kwargs)

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: Optional[float] = None,
        chunksize: int = 1,
    ) -> Iterator[Any]:
        """Like ``concurrent.futures.Executor.map``: the results of ``fn`` over the zipped
        iterables, in order. The calls are all queued now and travel to the workers in
        chunks (of ``chunksize`` when above 1, else sized to the work), each item keeping
        its own result or exception. Leaving the iterator early cancels what has not
        started."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        core = self._core
        core.check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        calls = list(zip(*iterables))
        run = _MapRun(len(calls))
        size = chunksize if chunksize > 1 else core.chunk_size(len(calls))
        ids = core.map(fn, calls, size, run)
        return _results(core, run, ids, len(calls), deadline)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops the pool: no new tasks; with ``cancel_futures`` every task not started is
        cancelled, wherever it waits; the others finish. With ``wait`` this returns once
        they are done and every worker has exited (otherwise that happens in the
        background). Workers still leased to a DataLoader are killed."""
        self._core.shutdown(wait, cancel_futures)

    def __repr__(self) -> str:
        core = self._core
        return (
            f"<tether.Pool processes={core.size} start_method={core.start_method!r} "
            f"state={core.state}>"
        )


def _results(
    core: _Core, run: _MapRun, ids: List[int], count: int, deadline: Optional[float]
) -> Iterator[Any]:
    """``map``'s iterator: yields each result without keeping it."""
    try:
        for index in range(count):
            yield run.take(index, deadline)
    finally:
        with run.cond:
            run.closed = True
        core.withdraw(ids)
