"""``tether.Pool``: long-lived worker processes that many DataLoaders borrow in turn or at the
same time (``DataLoader(..., multiprocessing_context=pool.context())``), and a
``concurrent.futures.Executor`` over the same workers.

This module is the pool's face; its concerns live in modules of their own: ``core`` (the
workers' start and healing, the hub thread, the states running -> shutdown -> closed),
``tasks`` (``submit`` and ``map``, and what a worker's death does to them), ``futures``
(the futures and ``map``'s results), ``leases`` (the workers lent to processes, and the
dataset cache) and ``loader`` (``pool.context()``, whose processes take their workers from
the leases).

As ``concurrent.futures.ProcessPoolExecutor``: work submitted before shutdown finishes
before the interpreter exits (unless ``shutdown(cancel_futures=True)``), whether or not the
pool was shut down or garbage collected; an exception raised in a worker comes back as
itself with the worker's traceback as its ``__cause__``."""

from __future__ import annotations

import concurrent.futures
import os
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

from tether.common import stacks
from tether.errors import NoFreeWorkerError, RemoteError
from tether.spawn import launch

from .core import Core, track
from .errors import BrokenPool, WorkerCrashedError
from .loader import PoolContext

__all__ = ["BrokenPool", "NoFreeWorkerError", "Pool", "RemoteError", "WorkerCrashedError"]


@launch.with_start_methods
class Pool(concurrent.futures.Executor):
    """Long-lived worker processes for DataLoaders and for ``concurrent.futures`` work.

    ``processes`` workers (default: the CPU count) are started at once with
    ``start_method``: {start_methods} (the zygote preloads ``preload`` when given); each
    imports the modules in ``preload`` and runs ``initializer(*initargs)`` first. With
    ``max_tasks_per_child``, a worker exits after that many executor tasks and a new one
    takes its place. ``pool.context()`` is a multiprocessing context for
    ``DataLoader(multiprocessing_context=...)`` whose processes are leased pool workers;
    ``submit`` / ``map`` run tasks on the free workers. ``shutdown()`` (or leaving a
    ``with`` block) stops everything once the work given is done; so does the garbage
    collection of the pool, and the interpreter's exit."""

    #: Its public name (``tether.pool`` gives it on first use).
    __module__ = "tether.pool"

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
        method = launch.DEFAULT_START_METHOD if start_method is None else start_method
        launch.check_start_method(method, "tether.Pool")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be callable")
        if max_tasks_per_child is not None and (
            not isinstance(max_tasks_per_child, int)
            or isinstance(max_tasks_per_child, bool)
            or max_tasks_per_child < 1
        ):
            raise ValueError("max_tasks_per_child must be >= 1")
        if max_tasks_per_child is not None and not launch.STARTERS[method].fresh:
            # Each replacement would fork this process, which has threads by then (the hub's).
            raise ValueError(
                f"max_tasks_per_child is incompatible with the {method!r} start method: every "
                "replacement would fork this process, which has threads; use "
                + launch.named(launch.FRESH_START_METHODS, quote="'")
            )
        self._core = Core(
            processes, method, list(preload or ()), initializer, initargs, max_tasks_per_child
        )
        track(self._core)
        self._finalizer = weakref.finalize(self, self._core.stop, False, False)
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
        objects, and a later loader over the same objects sends none of them, unless what
        pickling them would send now cannot be proven to be what was sent (any change, at
        any depth; see docs/pool.md): then it sends them again, so that the workers never
        read a stale dataset. Each loader starts from the objects as they were sent: what
        a worker changed in its copy (in ``worker_init_fn``, ``__getitem__``, ``__iter__``)
        is undone. With ``keep_datasets=False``, every iterator sends them anew; either
        way they are pickled once per loader, not once per worker.
        """
        ref = self._contexts.get(keep_datasets)
        context = None if ref is None else ref()
        if context is None:
            context = PoolContext(self._core.leases, pool=self, keep_datasets=bool(keep_datasets))
            self._contexts[keep_datasets] = weakref.ref(context)
        return context

    def refresh(self, dataset: Any = None) -> None:
        """Makes the next loader send again every kept object that holds ``dataset``
        (itself, or a ``Subset``, a ``ConcatDataset``... of it, at any depth; every kept
        object, when None): its workers unpickle it afresh (its ``__setstate__`` runs
        again, and re-reads what it reads)."""
        self._core.leases.kept.send_again(dataset)

    def pids(self) -> List[int]:
        """The pids of the current workers (a replaced worker has a new pid)."""
        return self._core.workers.pids()

    def stacks(self, timeout: float = 5.0, native: bool = False) -> Dict[int, str]:
        """Where every worker is: ``{pid: text}``, the Python stack of each of its threads
        (see ``ProcessContext.stacks``); a worker that cannot answer says why."""
        targets = self._core.workers.members()
        return {a.pid: a.text for a in stacks.ask(targets, timeout, native)}

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        """Runs ``fn(*args, **kwargs)`` in a free worker; returns its future. A worker that
        dies while running it fails the future with ``WorkerCrashedError``."""
        return self._core.tasks.queue_call(fn, args, kwargs)

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
        return self._core.tasks.queue_map(fn, iterables, timeout, chunksize)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops the pool: no new tasks; with ``cancel_futures`` every task submitted after
        the last one started is cancelled, wherever it waits (those that run are the first
        ones submitted); the others finish. With ``wait`` this returns once
        they are done and every worker has exited (otherwise that happens in the
        background). Every DataLoader iterator's workers are taken back, within a grace
        period of a few seconds (a worker loop that does not end by then is killed): an
        iterator's next ``next()`` then raises an error that says so."""
        self._core.stop(wait, cancel_futures)

    def __repr__(self) -> str:
        core = self._core
        return (
            f"<tether.Pool processes={core.size} start_method={core.start_method!r} "
            f"state={core.state}>"
        )
