"""``pool.context()``: a real ``multiprocessing.context.BaseContext`` whose ``Process`` runs
its target in a leased worker of a ``tether.Pool`` and whose ``Queue`` and ``Event`` are
tether channels, so that an unmodified ``torch.utils.data.DataLoader`` runs on the pool:

    loader = DataLoader(dataset, num_workers=2, multiprocessing_context=pool.context())

A ``PoolProcess`` wraps a lease, the record the pool keeps of a worker taken by one process
(its id, the worker's pid, how it ended, an event set when it ends). It behaves as the
DataLoader expects of a ``multiprocessing.Process``: its ``pid`` is the worker's (a direct
child of this process, so the worker loop's ``os.getppid()`` check holds), ``is_alive()`` is
true while the target runs in a live worker, ``exitcode`` is the target's (0, a
``SystemExit`` code, 1 on an exception) or the worker's own status when the worker died
(minus the signal number), ``join`` waits for the lease to end, and ``terminate()`` /
``kill()`` kill the worker (the pool starts a new one).

A process takes its worker from the pool's leases (``leases.Leases``) directly, which this
module knows only as the ``Lender`` protocol: the leases import this module, not the other
way round."""

from __future__ import annotations

import multiprocessing.context
import os
import queue
import signal
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence

from tether import _native
from tether.common import words

from . import channel
from .runs import Run

__all__ = ["Leased", "Lender", "PoolContext", "PoolProcess"]

#: How long a failure check waits for the pool to record the end of a lease whose worker
#: was just seen dead (the pool records it as it sees the same pidfd).
_END_RECORD_WAIT = 5.0


class Leased(NamedTuple):
    """What the pool gives a process it started: its lease, whether the target is torch's
    DataLoader worker loop (for torch's wording of failures), the tether queues that
    travelled with the call (they heed the process's end), and the DataLoader iterator's run it
    belongs to (see ``runs``)."""

    lease: _native.Lease
    dataloader: bool
    channels: List[Any]
    run: Optional[Run] = None


class Lender(Protocol):
    """What a pool context needs of its pool: the pool's leases (``leases.Leases``)."""

    @property
    def size(self) -> int:
        """How many workers the pool keeps."""

    @property
    def start_method(self) -> str:
        """The pool's start method."""

    def lend(
        self,
        target: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Dict[str, Any],
        keep_datasets: bool = True,
    ) -> Leased:
        """Runs ``target(*args, **kwargs)`` in a worker taken for it; never waits for one."""

    def send_signal(self, lease: _native.Lease, signum: int) -> None:
        """Sends ``signum`` to the worker of ``lease`` while the lease runs."""


class PoolProcess:
    """A process of a pool context: its target runs in a leased pool worker."""

    _counter = 0

    def __init__(
        self,
        lender: Lender,
        group: None = None,
        target: Optional[Callable[..., Any]] = None,
        name: Optional[str] = None,
        args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None,
        *,
        daemon: Optional[bool] = None,
        keep_datasets: bool = True,
    ) -> None:
        if group is not None:
            raise ValueError("group argument must be None for now")
        PoolProcess._counter += 1
        self._lender = lender
        self._keep_datasets = keep_datasets
        self._target = target
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self.name = name or f"TetherPoolProcess-{PoolProcess._counter}"
        self.daemon = bool(daemon)
        self._lease: Optional[_native.Lease] = None
        self._dataloader = False
        self._run: Optional[Run] = None
        self._joined = False
        self._reported = False
        #: The process that made this one; a copy in another process (a fork) is inert.
        self._owner = os.getpid()

    # -- what multiprocessing.Process offers -----------------------------------------------

    def run(self) -> None:
        """What the worker runs: ``target(*args, **kwargs)``."""
        if self._target is not None:
            self._target(*self._args, **self._kwargs)

    def start(self) -> None:
        """Leases a pool worker and runs the target there. Raises RuntimeError (saying who
        holds the workers) when none is free; never waits for one."""
        if self._lease is not None:
            raise AssertionError("cannot start a process twice")
        target = self._target if self._target is not None else _run_method
        args = self._args if self._target is not None else (self,)
        leased = self._lender.lend(target, args, self._kwargs, self._keep_datasets)
        self._lease, self._dataloader, self._run = leased.lease, leased.dataloader, leased.run
        for sent in leased.channels:
            if isinstance(sent, channel.Queue):
                sent.add_feeder(self)
        # The worker has its own copy: keep no reference to the dataset and the rest.
        self._target, self._args, self._kwargs = None, (), {}

    @property
    def pid(self) -> Optional[int]:
        return None if self._lease is None else self._lease.pid

    ident = pid

    @property
    def exitcode(self) -> Optional[int]:
        """None while the target runs; then its exit code, or the dead worker's status."""
        end = None if self._lease is None else self._lease.end()
        return None if end is None else end.code

    def _ours(self) -> Optional[_native.Lease]:
        """The lease when started, and by this process (a copy inherited through a fork
        has none)."""
        return self._lease if self._owner == os.getpid() else None

    def is_alive(self) -> bool:
        """True while the target runs; and, when the pool took the worker back from its
        DataLoader iterator, until the process is joined: the error the iterator's queue
        raises then is the one to report, not a death."""
        lease = self._ours()
        if lease is None:
            return False
        taken_back = self._run is not None and self._run.taken_back is not None
        return lease.end() is None or (taken_back and not self._joined)

    def join(self, timeout: Optional[float] = None) -> None:
        """Waits until the target has returned (or its worker died), up to ``timeout``."""
        if self._lease is None:
            raise AssertionError("can only join a started process")
        lease = self._ours()
        if lease is not None and lease.wait(timeout) is not None:
            self._joined = True

    def terminate(self) -> None:
        """Stops the target by killing its worker with SIGTERM (the pool replaces it).
        Does nothing once the target has returned: the worker may serve someone else."""
        lease = self._ours()
        if lease is not None:
            self._lender.send_signal(lease, signal.SIGTERM)

    def kill(self) -> None:
        """As ``terminate`` with SIGKILL."""
        lease = self._ours()
        if lease is not None:
            self._lender.send_signal(lease, signal.SIGKILL)

    def close(self) -> None:
        if self.is_alive():
            raise ValueError("Cannot close a process while it is still running.")

    @property
    def sentinel(self) -> int:
        """An fd readable once the target has returned or its worker died."""
        if self._lease is None:
            raise ValueError("process not started")
        return self._lease.fileno()

    @property
    def authkey(self) -> bytes:
        return bytes(multiprocessing.current_process().authkey)

    # -- what a queue asks of its feeders (see channel.Queue.add_feeder) ---------------------------

    def sentinels(self) -> List[int]:
        """The fds that become readable when this process ends: its lease's event and its
        worker's pidfd."""
        if self._lease is None or self._reported:
            return []
        return [self._lease.fileno(), self._lease.sentinel()]

    def failure(self) -> Optional[RuntimeError]:
        """The error a heeding ``Queue.get`` raises once this process ended badly (torch's
        words for a DataLoader worker), or None. Reported once."""
        if self._reported or self._lease is None:
            return None
        end = self._lease.wait(_END_RECORD_WAIT)
        if end is None:
            return None
        self._reported = True
        if self._run is not None and self._run.taken_back is not None:
            return self._run.error()
        if end.code == 0:
            return None
        pid = self._lease.pid
        if self._dataloader:
            return RuntimeError(words.dataloader_worker_ended(pid, end.code))
        return RuntimeError(words.pool_process_ended(self.name, pid, end.code))

    def __repr__(self) -> str:
        if self._lease is None:
            state = "initial"
        else:
            code = self.exitcode
            state = "started" if code is None else f"stopped exitcode={code}"
        daemon = " daemon" if self.daemon else ""
        return f"<PoolProcess name={self.name!r} pid={self.pid} {state}{daemon}>"


def _run_method(process: PoolProcess) -> None:
    """The target of a process whose class overrides ``run`` (pickled whole)."""
    process.run()


class PoolContext(multiprocessing.context.BaseContext):
    """A multiprocessing context backed by a ``tether.Pool``: ``Process`` leases a worker,
    ``Queue`` / ``SimpleQueue`` / ``Event`` are tether channels. Other primitives (``Lock``,
    ``Pipe``...) are multiprocessing's own, made as the pool's start method makes them.
    ``keep_datasets`` says whether the workers keep a DataLoader's dataset for the next
    loader (see ``tether.Pool.context``)."""

    _name = "tether-pool"

    def __init__(self, lender: Lender, pool: object = None, keep_datasets: bool = True) -> None:
        self._lender = lender
        self.keep_datasets = keep_datasets
        #: What must live as long as the context: the ``tether.Pool`` it came from.
        self._pool = pool

    def Process(  # noqa: N802 (multiprocessing's name)
        self,
        group: None = None,
        target: Optional[Callable[..., Any]] = None,
        name: Optional[str] = None,
        args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None,
        *,
        daemon: Optional[bool] = None,
    ) -> PoolProcess:
        return PoolProcess(
            self._lender,
            group,
            target,
            name,
            args,
            kwargs,
            daemon=daemon,
            keep_datasets=self.keep_datasets,
        )

    # Queues and events are tether's channels, not multiprocessing's classes: the type stubs
    # of BaseContext name its own return types, hence the overrides.
    def Queue(self, maxsize: int = 0) -> channel.Queue:  # type: ignore[override]  # noqa: N802
        return _LoaderQueue(maxsize)

    def SimpleQueue(self) -> channel.Queue:  # type: ignore[override]  # noqa: N802
        return _LoaderQueue()

    def Event(self) -> channel.Event:  # type: ignore[override]  # noqa: N802
        return channel.Event()

    def get_start_method(self, allow_none: bool = False) -> str:
        """The pool's start method (the ``start_method`` it was made with)."""
        return self._lender.start_method

    def get_context(self, method: Optional[str] = None) -> Any:
        if method is None:
            return self
        return multiprocessing.get_context(method)

    def __repr__(self) -> str:
        keep = "" if self.keep_datasets else ", keep_datasets=False"
        return f"<tether PoolContext of a pool of {self._lender.size}{keep}>"


class _LoaderQueue(channel.Queue):
    """A queue of a pool context, as its maker sees it. When it is a DataLoader iterator's
    data queue, it tells the iterator's run (``runs``) when the iterator's ``next()``
    raised, and raises the run's error once the pool took its workers back. An error a
    worker sent (torch's ``ExceptionWrapper``) is re-raised without a reference cycle, so
    that an iterator that raised and was dropped gives its workers back at once (torch's
    own ``reraise`` keeps the exception in a local of its frame, which its traceback holds:
    the dropped iterator would wait for the garbage collector, holding the workers)."""

    #: The run of the DataLoader iterator whose data queue this is (set by the pool).
    run: Optional[Run] = None

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        run = self.run
        if run is None:
            item = super().get(block, timeout)
        else:
            run.check()
            run.using()
            try:
                item = super().get(block, timeout)
            except queue.Empty:
                raise
            except BaseException as exc:
                run.failed(type(exc).__name__)
                raise
        if type(item) is tuple and len(item) == 2:
            _acyclic(item[1], run)
        return item


_acyclic_classes: Dict[type, type] = {}


def _acyclic(data: Any, run: Optional[Run] = None) -> None:
    """Gives a torch ``ExceptionWrapper`` a ``reraise`` that leaves no reference cycle (and
    tells ``run`` when it raises)."""
    utils = sys.modules.get("torch._utils")
    wrapper = getattr(utils, "ExceptionWrapper", None)
    if wrapper is None or not isinstance(data, wrapper) or type(data) in _acyclic_classes.values():
        return
    data._tether_run = run
    cls = _acyclic_classes.get(type(data))
    if cls is None:
        cls = type(
            type(data).__name__, (type(data),), {"reraise": _reraise, "__module__": __name__}
        )
        _acyclic_classes[type(data)] = cls
    data.__class__ = cls


def _reraise(self: Any) -> None:
    """torch's ``reraise`` (the same exception and message), whose frame is dropped from the
    traceback, and the exception from this frame's locals, before it propagates."""
    error: Optional[BaseException] = None
    try:
        super(type(self), self).reraise()
    except BaseException as caught:  # noqa: BLE001 - whatever torch raises is re-raised
        error = caught
    if error is None:
        return
    run = getattr(self, "_tether_run", None)
    if run is not None:
        run.failed(type(error).__name__)
    error.__traceback__ = None
    try:
        raise error
    finally:
        error = None
