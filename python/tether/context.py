"""``pool.context()``: a real ``multiprocessing.context.BaseContext`` whose ``Process`` runs
its target in a leased worker of a ``tether.Pool`` and whose ``Queue`` and ``Event`` are
tether channels, so that an unmodified ``torch.utils.data.DataLoader`` runs on the pool:

    loader = DataLoader(dataset, num_workers=2, multiprocessing_context=pool.context())

A ``PoolProcess`` behaves as the DataLoader expects of a ``multiprocessing.Process``: its
``pid`` is the worker's (a direct child of this process, so the worker loop's
``os.getppid()`` check holds), ``is_alive()`` is true while the target runs in a live worker,
``exitcode`` is the target's (0, a ``SystemExit`` code, 1 on an exception) or the worker's
own status when the worker died (minus the signal number), ``join`` waits for the target to
return, and ``terminate()`` / ``kill()`` kill the worker (the pool starts a new one)."""

from __future__ import annotations

import multiprocessing.context
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence

from . import _channel

if TYPE_CHECKING:
    from .pool import _Core, _Worker

__all__ = ["PoolContext", "PoolProcess"]


class PoolProcess:
    """A process of a pool context: its target runs in a leased pool worker."""

    _counter = 0

    def __init__(
        self,
        core: "_Core",
        group: None = None,
        target: Optional[Callable[..., Any]] = None,
        name: Optional[str] = None,
        args: Sequence[Any] = (),
        kwargs: Optional[Dict[str, Any]] = None,
        *,
        daemon: Optional[bool] = None,
    ) -> None:
        if group is not None:
            raise ValueError("group argument must be None for now")
        PoolProcess._counter += 1
        self._core = core
        self._target = target
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self.name = name or f"TetherPoolProcess-{PoolProcess._counter}"
        self.daemon = bool(daemon)
        self._worker: Optional["_Worker"] = None
        self._worker_for_start: Optional["_Worker"] = None
        self._lease_id = 0
        self._exitcode: Optional[int] = None
        self._done = threading.Event()
        self._died = False
        self._reported = False
        self._describe = ""
        self._dataloader = False

    # -- what multiprocessing.Process offers -----------------------------------------------

    def run(self) -> None:
        """What the worker runs: ``target(*args, **kwargs)``."""
        if self._target is not None:
            self._target(*self._args, **self._kwargs)

    def start(self) -> None:
        """Leases a pool worker and runs the target there. Raises RuntimeError (saying who
        holds the workers) when none is free; never waits for one."""
        if self._worker is not None:
            raise AssertionError("cannot start a process twice")
        target = self._target if self._target is not None else _run_method
        args = self._args if self._target is not None else (self,)
        self._worker = self._core.lease(self, target, args, self._kwargs)
        # The worker has its own copy: keep no reference to the dataset and the rest.
        self._target, self._args, self._kwargs = None, (), {}

    @property
    def pid(self) -> Optional[int]:
        return None if self._worker is None else self._worker.pid

    ident = pid

    @property
    def exitcode(self) -> Optional[int]:
        """None while the target runs; then its exit code, or the dead worker's status."""
        if self._exitcode is not None:
            return self._exitcode
        worker = self._worker
        if worker is None:
            return None
        status = worker.exit()
        return None if status is None else status.exitcode

    def is_alive(self) -> bool:
        return self._worker is not None and self.exitcode is None

    def join(self, timeout: Optional[float] = None) -> None:
        """Waits until the target has returned (or its worker died), up to ``timeout``."""
        if self._worker is None:
            raise AssertionError("can only join a started process")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            if self.exitcode is not None:
                # The worker is dead; the hub reports it in a moment.
                self._done.wait(0.01)
                if not self._done.is_set() and self._worker.exit() is not None:
                    return
                continue
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                return
            self._done.wait(left)

    def terminate(self) -> None:
        """Stops the target by killing its worker with SIGTERM (the pool replaces it).
        Does nothing once the target has returned: the worker may serve someone else."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """As ``terminate`` with SIGKILL."""
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        worker = self._worker
        if worker is None or self._done.is_set():
            return
        with self._core.lock:
            if worker.lease is self and not worker.dead:
                worker.group.signal(0, signum)

    def close(self) -> None:
        if self.is_alive():
            raise ValueError("Cannot close a process while it is still running.")

    @property
    def sentinel(self) -> int:
        raise NotImplementedError("a tether pool process has no sentinel fd; use join()")

    @property
    def authkey(self) -> bytes:
        return bytes(multiprocessing.current_process().authkey)

    # -- called by the pool ----------------------------------------------------------------

    def _finish(self, code: int, died: bool = False) -> None:
        if self._exitcode is None:
            self._exitcode = code
            self._died = died
        self._done.set()

    def _failure_error(self) -> Optional[RuntimeError]:
        """The error a waiting ``Queue.get`` raises once this process failed (torch's words
        for a DataLoader worker), or None. Reported once."""
        if self._reported or self._worker is None:
            return None
        code = self.exitcode
        if code is None or code == 0:
            return None
        self._reported = True
        pid = self.pid
        if code < 0:
            try:
                description = signal.strsignal(-code) or f"signal {-code}"
            except ValueError:
                description = f"signal {-code}"
            if self._dataloader:
                message = f"DataLoader worker (pid {pid}) is killed by signal: {description}. "
                if -code == signal.SIGBUS:
                    message += (
                        "It is possible that dataloader's workers are out of shared memory. "
                        "Please try to raise your shared memory limit."
                    )
            else:
                from . import _native

                message = (
                    f"tether.Pool process {self.name} (pid {pid}) was killed by signal "
                    f"{_native.signal_name(-code)} ({description})"
                )
        elif self._dataloader:
            message = (
                f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {code}. "
                "Details are lost due to multiprocessing. Rerunning with num_workers=0 may "
                "give better error trace."
            )
        else:
            message = f"tether.Pool process {self.name} (pid {pid}) exited with code {code}"
        return RuntimeError(message)

    def __repr__(self) -> str:
        if self._worker is None:
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
    ``Pipe``...) are multiprocessing's own, made as the pool's start method makes them."""

    _name = "tether-pool"

    def __init__(self, core: "_Core") -> None:
        self._core = core

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
        return PoolProcess(self._core, group, target, name, args, kwargs, daemon=daemon)

    def Queue(self, maxsize: int = 0) -> _channel.Queue:  # type: ignore[override]  # noqa: N802
        return _channel.Queue(maxsize)

    def SimpleQueue(self) -> _channel.Queue:  # type: ignore[override]  # noqa: N802
        return _channel.Queue()

    def Event(self) -> _channel.Event:  # type: ignore[override]  # noqa: N802
        return _channel.Event()

    def get_start_method(self, allow_none: bool = False) -> str:
        """The pool's start method ("forkserver", "spawn" or "fork")."""
        return self._core.start_method

    def get_context(self, method: Optional[str] = None) -> Any:
        if method is None:
            return self
        return multiprocessing.get_context(method)

    def __repr__(self) -> str:
        return f"<tether PoolContext of a pool of {self._core.size}>"
