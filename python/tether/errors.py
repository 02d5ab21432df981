"""The exceptions a failed child raises in its parent, with torch's names, messages and
attributes (so code written against ``torch.multiprocessing`` keeps working), and those of
``tether.Pool``. Its ``BrokenProcessPool``s (``WorkerCrashedError``, ``BrokenPool``, as
``concurrent.futures`` reports the same events) live in ``tether.pool.errors`` and are given
here by name on first use, so that ``import tether`` does not import
``concurrent.futures.process`` (and multiprocessing's queues with it)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple


class ProcessException(Exception):  # noqa: N818 - torch.multiprocessing's name
    """A child process failed. ``error_index`` is its rank; ``error_pid`` (and ``pid``, the
    same) its process id. The constructor takes torch's arguments."""

    __slots__ = ("msg", "error_index", "pid", "error_pid")

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid
        self.pid = error_pid

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return type(self), (self.msg, self.error_index, self.error_pid)


class ProcessRaisedException(ProcessException):
    """The child raised an exception; its traceback is in the message and, when the exception
    could be rebuilt in the parent, the original exception is ``__context__`` (suppressed in
    the printed traceback, which shows the child's once, in the message)."""


class ProcessExitedException(ProcessException):
    """The child exited with a non-zero code or was killed by a signal. ``exit_code`` is
    negative for a signal (as in multiprocessing) and ``signal_name`` names it."""

    __slots__ = ("exit_code", "signal_name")

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: Optional[str] = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return (
            type(self),
            (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name),
        )


class ProcessTimeoutError(TimeoutError):
    """The job ran past its ``timeout``: every rank's stack was taken, then every rank was
    stopped (SIGTERM, the grace period, SIGKILL). ``stacks`` maps each rank to the text of
    its stack (or why there is none), and its ``summary`` names the rank not where the
    others wait (the message ends with it); ``timeout`` is the limit in seconds."""

    def __init__(self, msg: str, stacks: Dict[int, str], timeout: float) -> None:
        super().__init__(msg)
        self.msg = msg
        self.stacks = stacks
        self.timeout = timeout

    def __str__(self) -> str:
        return self.msg

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return type(self), (self.msg, self.stacks, self.timeout)


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


def __getattr__(name: str) -> Any:
    """``WorkerCrashedError`` and ``BrokenPool``, from ``pool.errors`` when first asked for."""
    if name in ("WorkerCrashedError", "BrokenPool"):
        from .pool import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
