"""``tether.ProcessPoolExecutor``: ``concurrent.futures.ProcessPoolExecutor``'s signature,
errors and the attributes code reads of it, over tether's pool (``core``, as ``tether.Pool``),
for code written for the standard library's executor. A task whose worker died fails with
CPython's sentence for the event, followed by the worker's pid and end, named as this
executor's (``words.worker_crashed``).

What it takes and says is CPython 3.11's: ``max_workers`` (default: the CPU count; 0 or
less is "max_workers must be greater than 0"), ``mp_context``, ``initializer`` ("initializer
must be a callable"), ``initargs`` and ``max_tasks_per_child`` ("max_tasks_per_child must be
an integer", "... must be >= 1", and refused with the 'fork' start method); ``submit`` after
``shutdown`` is "cannot schedule new futures after shutdown" (after the interpreter's exit
began, "... after interpreter shutdown"); a pool whose worker could not start (its
initializer failed) is broken, and ``submit`` raises ``BrokenProcessPool`` with the reason.

``mp_context`` picks tether's start method: a multiprocessing context (or its name, a
string) of "fork", "spawn" or "forkserver" gives tether's start method of that name (for
"forkserver", tether's warm zygote); None gives tether's default ("forkserver"), or
"spawn" with ``max_tasks_per_child``, as CPython does. ``_mp_context`` is that context.
Workers start on demand, as CPython's do: a ``submit`` that finds no idle worker (CPython's
count: one for each task a worker answered, less those taken since) starts one, up to
``max_workers``, and a ``map`` one for each of its chunks. With "fork", every worker starts
with the executor, which returns once they are ready (no copy of this process may be made
once the pool's thread runs).

Where it differs on purpose, it is tether's pool: a worker that dies fails only the task it
ran, with ``WorkerCrashedError`` (a ``BrokenProcessPool``), and the pool starts another and
keeps running (CPython's pool breaks and fails every pending task); a task a worker has not
started can still be cancelled. A task that cannot be unpickled in its worker, or whose
result cannot be unpickled here, fails with a ``BrokenProcessPool`` (as CPython's) whose
``__cause__`` is that error; the pool keeps running there too.

Code reads ``_max_workers``, ``_mp_context``, ``_max_tasks_per_child``, ``_broken`` (False
or why), ``_shutdown_thread``, ``_processes`` (``{pid: process}``, the workers now, each a
``WorkerProcess`` that answers as a ``multiprocessing.Process``), ``_executor_manager_thread``
(the pool's hub thread) and ``_call_queue`` (the calls waiting for a worker)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.context
import operator
import os
import signal
import threading
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Sequence, Tuple

from tether import _native
from tether.common import words
from tether.spawn import launch

from . import guard
from .core import Core, track

__all__ = ["ProcessPoolExecutor", "WorkerProcess"]

#: Set once the interpreter's exit began (before the pools finish their work).
_exiting = False


def _start_method(
    mp_context: Any, max_tasks_per_child: Optional[int]
) -> Tuple[str, multiprocessing.context.BaseContext]:
    """tether's start method for ``mp_context``, and the multiprocessing context that
    ``_mp_context`` shows (see the module's documentation)."""
    if mp_context is None:
        method = "spawn" if max_tasks_per_child is not None else launch.DEFAULT_START_METHOD
        return method, multiprocessing.get_context(method)
    if isinstance(mp_context, str):
        _check_method(mp_context)
        return mp_context, multiprocessing.get_context(mp_context)
    get_start_method = getattr(mp_context, "get_start_method", None)
    if not callable(get_start_method):
        raise TypeError(
            "mp_context must be a multiprocessing context, the name of a start method or "
            f"None, got {mp_context!r}"
        )
    method = get_start_method(allow_none=False)
    _check_method(method)
    return method, mp_context


def _check_method(method: Any) -> None:
    if method not in launch.START_METHODS:
        raise ValueError(
            f"cannot find context for {method!r}: tether.ProcessPoolExecutor supports "
            + launch.named(launch.START_METHODS, quote="'")
        )


def _resolve(
    max_workers: Optional[int],
    mp_context: Any,
    initializer: Optional[Callable[..., Any]],
    max_tasks_per_child: Optional[int],
) -> Tuple[int, str, multiprocessing.context.BaseContext]:
    """CPython's checks of the arguments, in its order, with its words; the number of
    workers, tether's start method and the context ``_mp_context`` shows."""
    if max_workers is None:
        workers = os.cpu_count() or 1
    else:
        if max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        workers = operator.index(max_workers)
    method, context = _start_method(mp_context, max_tasks_per_child)
    if initializer is not None and not callable(initializer):
        raise TypeError("initializer must be a callable")
    if max_tasks_per_child is not None:
        if not isinstance(max_tasks_per_child, int):
            raise TypeError("max_tasks_per_child must be an integer")
        if max_tasks_per_child <= 0:
            raise ValueError("max_tasks_per_child must be >= 1")
        if not launch.STARTERS[method].fresh:
            raise ValueError(
                f"max_tasks_per_child is incompatible with the {method!r} multiprocessing "
                "start method; supply a different mp_context."
            )
    return workers, method, context


def _unread(error: BaseException, where: str) -> BaseException:
    """A task that could not be unpickled ``where`` (or whose result could not be, "here")
    fails as with CPython's pool: with ``BrokenProcessPool``, the error as its cause."""
    what = "the task could not be unpickled in its worker, so it never ran"
    if where == "here":
        what = "the task's result could not be unpickled here"
    broken = BrokenProcessPool(f"{what} ({type(error).__name__}: {error}); the pool keeps running")
    broken.__cause__ = error
    return broken


class WorkerProcess:
    """A worker of a ``tether.ProcessPoolExecutor`` as a ``multiprocessing.Process`` shows
    itself: ``pid``, ``name``, ``is_alive()``, ``exitcode`` (None while it runs, then its
    exit code or minus the signal that killed it), ``join(timeout)``, ``sentinel``, and
    ``terminate()`` / ``kill()``: the task it runs fails with ``WorkerCrashedError`` and
    the pool starts another worker."""

    daemon = True

    def __init__(self, member: _native.Member, name: str) -> None:
        self._group = member.group
        self._index = member.index
        self.pid = self._group.pid(member.index)
        self.name = name

    @property
    def exitcode(self) -> Optional[int]:
        status = self._group.exit(self._index)
        return None if status is None else words.exitcode_of(status)

    def is_alive(self) -> bool:
        return self._group.exit(self._index) is None

    def join(self, timeout: Optional[float] = None) -> None:
        self._group.wait([self._index], _native.WaitFor.ALL, timeout)

    def terminate(self) -> None:
        self._group.signal(self._index, signal.SIGTERM)

    def kill(self) -> None:
        self._group.signal(self._index, signal.SIGKILL)

    @property
    def sentinel(self) -> int:
        """An fd readable once the worker has ended (its pidfd)."""
        return self._group.sentinel(self._index)

    def __repr__(self) -> str:
        code = self.exitcode
        state = "started" if code is None else f"stopped exitcode={code}"
        return f"<WorkerProcess name={self.name!r} pid={self.pid} {state} daemon>"


class _CallQueue:
    """The calls of a ``tether.ProcessPoolExecutor`` waiting for a worker, as code reads
    ``ProcessPoolExecutor._call_queue``: ``qsize()``, ``empty()``, and ``join_thread()``,
    which returns once the thread that hands the calls to the workers (the pool's hub)
    ended, after ``shutdown``."""

    def __init__(self, core: Core) -> None:
        self._core = core

    def qsize(self) -> int:
        tasks = self._core.tasks
        return sum(1 for task_id in list(tasks.sinks) if not tasks.started(task_id))

    def empty(self) -> bool:
        return self.qsize() == 0

    def join_thread(self) -> None:
        if self._core.state == "running":
            raise AssertionError("the executor is not shut down: its hub thread runs on")
        self._core.wait_closed()


class ProcessPoolExecutor(concurrent.futures.Executor):
    """``concurrent.futures.ProcessPoolExecutor`` over tether's pool: ``max_workers``
    worker processes (default: the CPU count), started as tasks come, with ``mp_context``'s
    start method (a multiprocessing context or its name: "forkserver", tether's warm zygote;
    "spawn"; "fork"; None: "forkserver", or "spawn" with ``max_tasks_per_child``). Each
    worker runs ``initializer(*initargs)`` first and, with ``max_tasks_per_child``, is
    replaced after that many tasks. A worker that dies fails only the task it ran
    (``WorkerCrashedError``, a ``BrokenProcessPool``); the pool starts another."""

    #: Its public name (``tether.pool`` gives it on first use).
    __module__ = "tether.pool"

    def __init__(
        self,
        max_workers: Optional[int] = None,
        mp_context: Any = None,
        initializer: Optional[Callable[..., Any]] = None,
        initargs: Sequence[Any] = (),
        *,
        max_tasks_per_child: Optional[int] = None,
    ) -> None:
        self._max_workers, method, self._mp_context = _resolve(
            max_workers, mp_context, initializer, max_tasks_per_child
        )
        self._initializer = initializer
        self._initargs = initargs
        self._max_tasks_per_child = max_tasks_per_child
        # A copy of this process cannot be made once the hub thread runs: "fork" starts
        # every worker now (as CPython's pool does), the others as tasks come.
        self._on_demand = launch.STARTERS[method].fresh
        #: As CPython's: released for each task a worker answered, taken by a submit that
        #: an idle worker can serve (any other starts a worker, up to ``max_workers``).
        self._idle_worker_semaphore = threading.Semaphore(0)
        self._adjust_lock = threading.Lock()
        core = Core(
            self._max_workers,
            method,
            (),
            initializer,
            initargs,
            max_tasks_per_child,
            start=0 if self._on_demand else self._max_workers,
            name=words.EXECUTOR,
        )
        self._core = core
        core.tasks.unread = _unread
        core.tasks.answered = self._idle_worker_semaphore.release
        track(core)
        self._finalizer = weakref.finalize(self, core.stop, False, False)
        if not self._on_demand:
            try:
                core.wait_ready()
            except BrokenProcessPool:
                pass  # a worker's initializer failed: submit says so, as CPython's does

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        """Runs ``fn(*args, **kwargs)`` in a worker; returns its future."""
        self._check_exiting()
        self._check_guard()
        future = self._core.tasks.queue_call(fn, args, kwargs)
        if self._on_demand:
            with self._adjust_lock:
                if not self._idle_worker_semaphore.acquire(blocking=False):
                    self._core.grow(self._core.started + 1)
        return future

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: Optional[float] = None,
        chunksize: int = 1,
    ) -> Iterator[Any]:
        """``Executor.map``: every call is queued now, in chunks (of ``chunksize`` when
        above 1, else sized to the work); the results come in order."""
        self._check_exiting()
        self._check_guard()
        results = self._core.tasks.queue_map(fn, iterables, timeout, chunksize)
        if self._on_demand:
            self._core.grow(len(self._core.tasks.sinks))  # a worker for each chunk queued
        return results

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks; with ``cancel_futures``, those submitted after the last one
        started are cancelled (those that run are the first ones submitted); the others
        finish. With ``wait``, returns once they did and every worker exited and was reaped
        (no zombie is left, as CPython's executor joins its workers)."""
        self._core.stop(wait, cancel_futures)

    def _check_guard(self) -> None:
        """A worker importing an unguarded main script stops at the call that would start
        workers (see ``guard``), before anything is queued: its exit would wait for it.
        The script's own check (which reads the script) runs until the first worker
        starts: that worker's import runs every statement the check would name."""
        core = self._core
        if not self._on_demand or core.started >= core.size:
            return
        if core.started:
            guard.check(words.EXECUTOR)
        else:
            guard.check_start(words.EXECUTOR, core.start_method)

    def _check_exiting(self) -> None:
        if _exiting and self._core.broken is None:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    # -- what code reads of ProcessPoolExecutor --------------------------------------------

    @property
    def _processes(self) -> Dict[int, WorkerProcess]:
        """The workers now, by pid (a new mapping at each read)."""
        slots = {w.pid: w.slot for w in self._core.workers.workers()}
        processes = {}
        for member in self._core.workers.members():
            pid = member.group.pid(member.index)
            name = f"tether pool {self._core.number} worker {slots.get(pid)}"
            processes[pid] = WorkerProcess(member, name)
        return processes

    @property
    def _broken(self) -> Any:
        """False, or why the pool is broken."""
        return self._core.broken or False

    @property
    def _shutdown_thread(self) -> bool:
        return self._core.state != "running"

    @property
    def _executor_manager_thread(self) -> Optional[threading.Thread]:
        return self._core.hub

    @property
    def _call_queue(self) -> _CallQueue:
        return _CallQueue(self._core)

    def __repr__(self) -> str:
        core = self._core
        return (
            f"<tether.ProcessPoolExecutor max_workers={core.size} "
            f"start_method={core.start_method!r} state={core.state}>"
        )


def _note_exit() -> None:
    global _exiting
    _exiting = True


try:
    # As concurrent.futures does (private to threading): runs before threads are joined.
    threading._register_atexit(_note_exit)  # type: ignore[attr-defined]
except RuntimeError:  # imported while the interpreter shuts down
    pass
