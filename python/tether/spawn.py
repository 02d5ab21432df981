"""``spawn``, ``start_processes`` and ``ProcessContext``: a drop-in for
``torch.multiprocessing.spawn``, supervised from Rust.

Every child leads its own process group and dies with its parent (SIGKILL as parent-death
signal, whatever the child ignores); its exit is seen through a pidfd the moment it happens
and timestamped, so the root cause is the child that failed first, even when nobody was in
``join()`` at the time; its failure report (traceback and exception) is drained while it
runs, so a report of any size arrives whole and never blocks the child."""

from __future__ import annotations

import atexit
import multiprocessing.process
import signal
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, List, Optional, Sequence

from . import _launch, _native, _report
from ._launch import DEFAULT_START_METHOD
from .errors import ProcessException, ProcessExitedException, ProcessRaisedException

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "spawn",
    "start_processes",
]

#: How long ``join`` waits after SIGTERM before SIGKILL, when no grace period is given.
DEFAULT_GRACE = 30.0


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"<Unknown signal {signum}>"


class Process:
    """One child of a ``ProcessContext``, with the attributes of ``multiprocessing.Process``
    that torch's users rely on."""

    def __init__(self, group: _native.Group, index: int, daemon: bool) -> None:
        self._group = group
        self._index = index
        self.daemon = daemon
        self.pid: int = group.pid(index)
        self.name = f"TetherProcess-{index}"

    @property
    def exitcode(self) -> Optional[int]:
        """None while running; the exit code, or minus the signal number."""
        status = self._group.exit(self._index)
        return None if status is None else status[0]

    @property
    def sentinel(self) -> int:
        """An fd that becomes readable when the process ends (its pidfd)."""
        return self._group.sentinel(self._index)

    def is_alive(self) -> bool:
        return self._group.exit(self._index) is None

    def join(self, timeout: Optional[float] = None) -> None:
        self._group.wait([self._index], "all", timeout)

    def terminate(self) -> None:
        """SIGTERM to the process and its process group."""
        self._group.signal(self._index, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the process and its process group."""
        self._group.signal(self._index, signal.SIGKILL)

    def __repr__(self) -> str:
        code = self.exitcode
        state = "alive" if code is None else f"exitcode={code}"
        return f"<{type(self).__name__} {self.name} pid={self.pid} {state}>"


_live: "weakref.WeakSet[ProcessContext]" = weakref.WeakSet()
_live_lock = threading.Lock()


class ProcessContext:
    """The children of one ``start_processes`` call. ``join`` waits for them, and on the first
    failure stops the others and raises with the failed child's error."""

    def __init__(self, group: _native.Group, daemon: bool) -> None:
        self._group = group
        self._daemon = daemon
        self.processes: List[Process] = [Process(group, i, daemon) for i in range(len(group))]
        self._done = False
        with _live_lock:
            _live.add(self)

    def pids(self) -> List[int]:
        return [p.pid for p in self.processes]

    def join(self, timeout: Optional[float] = None, grace_period: Optional[float] = None) -> bool:
        """Waits for the children. Returns True once all of them have exited 0 (and on every
        later call), False if ``timeout`` passes with some still running. On the first failure
        (first in time): waits ``grace_period`` for the others if given, SIGTERMs the rest,
        waits ``grace_period`` (30 s when None), SIGKILLs what is left, and raises
        ``ProcessRaisedException`` or ``ProcessExitedException`` for that child."""
        if self._done:
            return True
        try:
            settled = self._group.wait(None, "all_or_failure", timeout)
        except BaseException:
            # Ctrl-C (or any interruption) while waiting: nothing may be left running.
            self._stop(grace_period)
            raise
        failed = self._first_failure()
        if failed is None:
            self._done = settled
            return settled
        if grace_period is not None:
            self._group.wait(None, "all", grace_period)
        self._stop(grace_period)
        self._done = True
        # Those stopped now fail later in time: the first failure stays the root cause.
        raise self._error(failed)

    def _first_failure(self) -> Optional[int]:
        failures = []
        for i in range(len(self.processes)):
            at = self._group.failed_at(i)
            if at is not None:
                failures.append((at, i))
        return min(failures)[1] if failures else None

    def _stop(self, grace_period: Optional[float]) -> None:
        """SIGTERM to every live child's process group, the grace period, then SIGKILL; a
        second interruption meanwhile kills at once."""
        grace = DEFAULT_GRACE if grace_period is None else grace_period
        try:
            if self._group.signal_all(signal.SIGTERM):
                self._group.wait(None, "all", grace)
        finally:
            self._group.signal_all(signal.SIGKILL)
            while not self._group.wait(None, "all", 1.0):
                self._group.signal_all(signal.SIGKILL)

    def _error(self, index: int) -> ProcessException:
        pid = self.processes[index].pid
        status = self._group.exit(index)
        assert status is not None
        exitcode, _, core_dumped, _ = status
        report = _report.decode(self._group.report(index))
        error: ProcessException
        if report is not None:
            text, cause = report
            msg = f"\n\n-- Process {index} terminated with the following error:\n{text}"
            error = ProcessRaisedException(msg, index, pid)
            error.__cause__ = cause
        elif exitcode < 0:
            name = _signal_name(-exitcode)
            msg = f"process {index} terminated with signal {name}"
            error = ProcessExitedException(msg, index, pid, exitcode, name)
            note = f"process {index} had pid {pid}"
            if core_dumped:
                note += " and dumped core"
            hint = _native.signal_hint(-exitcode)
            _add_note(error, f"{note}; {hint}" if hint else note)
        else:
            msg = f"process {index} terminated with exit code {exitcode}"
            error = ProcessExitedException(msg, index, pid, exitcode)
            _add_note(error, f"process {index} had pid {pid}")
        return error

    def _at_exit(self, interrupted: bool) -> None:
        if self._daemon or interrupted:
            self._stop(1.0)
        else:
            self._group.wait(None, "all", None)


def _add_note(error: BaseException, note: str) -> None:
    """Adds a note shown under the traceback, leaving ``str(error)`` as torch has it."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


@atexit.register
def _finish_at_exit() -> None:
    """As multiprocessing does at exit: stop daemonic children, wait for the others. When
    the interpreter exits on Ctrl-C, every child is stopped: living in their own process
    groups, they did not get the terminal's SIGINT, and waiting for them would hang."""
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    with _live_lock:
        contexts = list(_live)
    for ctx in contexts:
        ctx._at_exit(interrupted)


def start_processes(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = DEFAULT_START_METHOD,
    *,
    preload: Optional[Sequence[str]] = None,
) -> Optional[ProcessContext]:
    """Starts ``nprocs`` processes running ``fn(i, *args)`` with ``start_method``:
    "forkserver" (the default: a fork of tether's warm zygote, as clean as "spawn" but
    without the interpreter start and the heavy imports; ``preload`` names the modules the
    zygote imports, see ``tether.set_preload``), "spawn" (a fresh interpreter) or "fork" (a
    copy of this process). With ``join`` (the default) waits for all of them and raises on
    the first failure; otherwise returns the ``ProcessContext``."""
    _launch.check_start_method(start_method, "tether")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 0:
        raise ValueError(f"nprocs must be a non-negative int, got {nprocs!r}")
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        raise RuntimeError(
            "tether.spawn was called while this process was still importing the main module "
            "of its parent. Start processes only under the usual guard in the main script:\n\n"
            "    if __name__ == '__main__':\n        ...\n"
        )
    group = _launch.start(fn, args, range(nprocs), start_method, preload=preload)
    context = ProcessContext(group, daemon)
    if not join:
        return context
    while not context.join():
        pass
    return None


def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = DEFAULT_START_METHOD,
    *,
    preload: Optional[Sequence[str]] = None,
) -> Optional[ProcessContext]:
    """Like ``start_processes``, for a fresh-process start method: "forkserver" (the
    default) or "spawn". As in torch, another ``start_method`` ("fork") gives a
    FutureWarning and the default is used instead."""
    if start_method == "fork":
        warnings.warn(
            "spawn() starts fresh processes and does not use start_method='fork'; "
            f"using {DEFAULT_START_METHOD!r}. Use tether.start_processes(..., "
            "start_method='fork') to fork this process.",
            FutureWarning,
            stacklevel=2,
        )
        start_method = DEFAULT_START_METHOD
    return start_processes(fn, args, nprocs, join, daemon, start_method, preload=preload)
