"""``tether.Pool``'s exceptions that are ``BrokenProcessPool``s, in a module of their own:
``concurrent.futures.process`` (and multiprocessing's queues with it) is imported only when a
pool needs them. Their public name is ``tether.errors``'s, which gives them on first use."""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool
from typing import Any, Optional, Tuple


class WorkerCrashedError(BrokenProcessPool):
    """A pool worker died while it ran (or had just run) a task; the pool started a new
    worker and keeps running. ``pid`` is the worker's, ``exitcode`` its exit code (minus the
    signal number when killed), ``signal_name`` the signal's name (``SIGSEGV``) or None.
    A ``BrokenProcessPool``, as ``ProcessPoolExecutor`` reports the same event."""

    __module__ = "tether.errors"

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

    __module__ = "tether.errors"
