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
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

from tether import _native
from tether.common import reports, stacks, words
from tether.common.log import logger
from tether.errors import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    ProcessTimeoutError,
)

from . import launch
from .launch import DEFAULT_START_METHOD
from .process import Process, positive_seconds, seconds

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "ProcessTimeoutError",
    "SpawnContext",
    "spawn",
    "start_processes",
]

#: How long ``join`` waits after SIGTERM before SIGKILL, when no grace period is given.
DEFAULT_GRACE = 30.0

#: How long the children have after a forwarded Ctrl-C (SIGINT) before they get SIGTERM.
INT_TO_TERM = 3.0


_live: "weakref.WeakSet[ProcessContext]" = weakref.WeakSet()
_live_lock = threading.Lock()


class ProcessContext:
    """The children of one ``start_processes`` call. ``join`` waits for them, and on the first
    failure stops the others and raises with the failed child's error; past the job's
    ``timeout`` it takes every rank's stack, stops them and raises ``ProcessTimeoutError``.
    ``stacks()`` shows where each rank is, at any time."""

    def __init__(
        self,
        group: _native.Group,
        daemon: bool,
        start_method: str = "",
        what: str = "",
        timeout: Optional[float] = None,
        copies: Any = None,
    ) -> None:
        self._group = group
        #: The job's vault of shared copies (``tether.share``'s key form), kept until the
        #: job ends.
        self._copies = copies
        self._daemon = daemon
        #: The job's time limit in seconds, counted from now, or None.
        self.timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        #: How the children were started and what they run (for ``tether.status()``).
        self.start_method = start_method
        self.what = what
        self.processes: List[Process] = [Process(group, i, daemon) for i in range(len(group))]
        self._done = False
        with _live_lock:
            _live.add(self)
        try:
            # ``tether top PID`` (PID: this process) shows the ranks.
            _native.serve_top(group)
        except OSError as err:
            logger.info("tether top cannot show these ranks: %s", err)

    def pids(self) -> List[int]:
        return [p.pid for p in self.processes]

    @property
    def sentinels(self) -> Dict[int, int]:
        """``{sentinel fd: rank}`` of the processes still running, as torch keeps it."""
        return {p.sentinel: i for i, p in enumerate(self.processes) if p.is_alive()}

    def stacks(
        self, timeout: float = stacks.DEFAULT_TIMEOUT, native: bool = False
    ) -> stacks.Stacks:
        """Where every rank is: ``{rank: text}``, the Python stack of each of its threads
        (most recent call first), asked of all ranks at once without stopping them and
        without ptrace. A rank that cannot answer within ``timeout`` seconds (stopped, in
        the kernel, no longer running, or running no Python of tether's) gets a line that
        says so, with its pid and state; it never holds up the others. With ``native`` and
        py-spy installed, py-spy's native frames follow each stack. The dict's ``summary``
        groups the ranks by where they wait and names those not where most others are;
        ``str()`` of it is the whole block, summary last."""
        ranks = range(len(self.processes))
        answers = stacks.ask([_native.Member(self._group, i) for i in ranks], timeout, native)
        return stacks.of_ranks(ranks, answers)

    def join(self, timeout: Optional[float] = None, grace_period: Optional[float] = None) -> bool:
        """Waits for the children. Returns True once all of them have exited 0 (and on every
        later call), False if ``timeout`` passes with some still running (a negative timeout
        only looks; inf waits for ever). On the first failure (first in time): waits
        ``grace_period`` for the others if given, SIGTERMs the rest, waits ``grace_period``
        (30 s when None), SIGKILLs what is left, and raises ``ProcessRaisedException`` or
        ``ProcessExitedException`` for that child. Past the job's ``timeout`` (given to
        ``start_processes``), takes every rank's stack, stops them the same way and raises
        ``ProcessTimeoutError``. Bad arguments raise before anything else happens, and never
        stop the children."""
        wait = seconds(timeout, "timeout")
        grace = seconds(grace_period, "grace_period")
        if self._done:
            return True
        try:
            settled = self._group.wait(None, _native.WaitFor.ALL_OR_FAILURE, self._bounded(wait))
        except KeyboardInterrupt:
            # Ctrl-C: the children, in process groups of their own, did not get it.
            self._stop_interrupted(grace)
            raise
        except BaseException:
            # Any other interruption while waiting: nothing may be left running.
            self._stop(grace)
            raise
        failed = self._group.first_failure()
        if failed is None:
            if settled:
                self._done, self._copies = True, None
                self._warn_unavailable()
            elif self._deadline is not None and time.monotonic() >= self._deadline:
                raise self._time_out(grace)
            return settled
        if grace is not None:
            self._group.wait(None, _native.WaitFor.ALL, grace)
        self._stop(grace)
        self._done, self._copies = True, None
        # Those stopped now fail later in time: the first failure stays the root cause.
        raise self._error(failed)

    def _bounded(self, wait: Optional[float]) -> Optional[float]:
        """``wait`` cut at the job's deadline."""
        if self._deadline is None:
            return wait
        left = max(0.0, self._deadline - time.monotonic())
        return left if wait is None else min(wait, left)

    def _time_out(self, grace: Optional[float]) -> ProcessTimeoutError:
        """The job ran past its timeout: takes every rank's stack, stops every rank, and
        returns the error that shows them."""
        where = self.stacks()
        self._stop(grace)
        self._done = True
        assert self.timeout is not None
        msg = (
            f"the processes ran past their timeout of {self.timeout:g} s and were stopped; "
            f"where each rank was:\n\n{where}"
        )
        logger.info("timeout of %g s: stopped %d process(es)", self.timeout, len(where))
        return ProcessTimeoutError(msg, where, self.timeout)

    def _stop(self, grace: Optional[float]) -> None:
        """Stops every live child: SIGTERM to its process group (once any failure report in
        progress is written), the grace period, then SIGKILL; a second interruption
        meanwhile kills at once."""
        self._group.terminate(DEFAULT_GRACE if grace is None else grace)

    def _stop_interrupted(self, grace: Optional[float]) -> None:
        """Ctrl-C in ``join``: forwards SIGINT to every live child and says how they will be
        stopped; those still running a few seconds later get SIGTERM, and SIGKILL comes at
        the end of the grace period (30 s when None). A second Ctrl-C kills at once."""
        grace = DEFAULT_GRACE if grace is None else grace
        live = sum(1 for p in self.processes if p.is_alive())
        if live == 0:
            return
        after = min(INT_TO_TERM, grace / 2)
        _say(
            f"tether: Ctrl-C: forwarding SIGINT to {live} process(es); those still running "
            f"{after:g} s later get SIGTERM, and SIGKILL {grace:g} s after the Ctrl-C; press "
            "Ctrl-C again to kill them at once"
        )

        def sent(signum: int, count: int) -> None:
            if signum == signal.SIGKILL:
                _say(
                    f"tether: {count} process(es) still running at the end of the grace "
                    f"period ({grace:g} s): SIGKILL"
                )
            else:
                _say(
                    f"tether: {count} process(es) still running {after:g} s after SIGINT: "
                    f"{words.signal_name(signum)}; SIGKILL in {grace - after:g} s"
                )

        try:
            then = _native.Escalation(signal.SIGTERM, after)
            self._group.terminate(grace, signal.SIGINT, then, sent)
        except KeyboardInterrupt:
            _say("tether: Ctrl-C again: every process was killed")
            raise

    def _warn_unavailable(self) -> None:
        for index, process in enumerate(self.processes):
            status = process.status
            if status is not None and status.unavailable:
                warnings.warn(
                    words.status_unavailable(index, process.pid, status), RuntimeWarning, 3
                )

    def _error(self, index: int) -> ProcessException:
        pid = self.processes[index].pid
        status = self._group.exit(index)
        report = reports.decode(self._group.report(index))
        error: ProcessException
        if report is not None:
            text, cause = report
            error = ProcessRaisedException(words.spawn_raised(index, text), index, pid)
            # The message already shows the child's traceback: the rebuilt exception is kept
            # as the context, out of the printed traceback, so that each line prints once.
            error.__context__ = cause
            error.__suppress_context__ = True
            return error
        assert status is not None and status.exitcode is not None
        name = None if status.signal is None else words.signal_name(status.signal)
        message = words.spawn_ended(index, status)
        error = ProcessExitedException(message, index, pid, status.exitcode, name)
        _add_note(error, words.spawn_note(index, pid, status))
        return error

    def _at_exit(self, interrupted: bool) -> None:
        if self._daemon or interrupted:
            self._stop(1.0)
        elif not self._group.wait(None, _native.WaitFor.ALL, self._bounded(None)):
            # Past the job's timeout: nobody is left to raise to.
            print(f"tether: {self._time_out(None)}", file=sys.stderr)


def _say(text: str) -> None:
    """A line of tether's own on stderr."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # no stderr (closed, or a pipe nobody reads): the stopping goes on


def _add_note(error: BaseException, note: str) -> None:
    """Adds a note shown under the traceback, leaving ``str(error)`` as torch has it."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        # Python < 3.11 has no add_note; __notes__ is what 3.11's tracebacks show.
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


def live_contexts() -> List[ProcessContext]:
    """The contexts of this process whose children run or have not been joined."""
    with _live_lock:
        contexts = list(_live)
    return [c for c in contexts if not c._done]


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


@launch.with_start_methods
def start_processes(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = DEFAULT_START_METHOD,
    *,
    preload: Optional[Sequence[str]] = None,
    timeout: Optional[float] = None,
) -> Optional[ProcessContext]:
    """Starts ``nprocs`` processes running ``fn(i, *args)`` with ``start_method``:
    {start_methods}. A fork of the zygote is as clean as a fresh interpreter, without the
    interpreter start and the heavy imports; ``preload`` names the modules the zygote
    imports (see ``tether.set_preload``). With ``join`` (the default) waits for all of them
    and raises on the first failure; otherwise returns the ``ProcessContext``. A ``timeout``
    (seconds, counted from the start of the processes) bounds the whole job: once it has
    passed, ``join`` takes every rank's stack, stops them all and raises
    ``ProcessTimeoutError`` (a ``TimeoutError``) whose ``stacks`` shows where each rank was."""
    launch.check_start_method(start_method, "tether")
    if timeout is not None:
        timeout = positive_seconds(timeout, "timeout")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 0:
        raise ValueError(f"nprocs must be a non-negative int, got {nprocs!r}")
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        raise RuntimeError(
            "tether.spawn was called while this process was still importing the main module "
            "of its parent. Start processes only under the usual guard in the main script:\n\n"
            "    if __name__ == '__main__':\n        ...\n"
        )
    from tether.share import meeting

    job = launch.new_job_id()
    try:
        copies: Any = meeting.vault(job)
    except OSError:  # out of fds or threads: the ranks still meet, only without it
        copies = None
    group = launch.start(fn, args, range(nprocs), start_method, preload=preload, job=job)
    what = getattr(fn, "__qualname__", None) or repr(fn)
    context = ProcessContext(group, daemon, start_method, what, timeout, copies)
    logger.debug(
        "started %d process(es) of %s with %s: %s", nprocs, what, start_method, group.pids()
    )
    if not join:
        return context
    while not context.join():
        pass
    return None


#: torch's older name for the same object (``torch.multiprocessing.SpawnContext``).
SpawnContext = ProcessContext


@launch.with_start_methods
def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = DEFAULT_START_METHOD,
    *,
    preload: Optional[Sequence[str]] = None,
    timeout: Optional[float] = None,
) -> Optional[ProcessContext]:
    """Like ``start_processes``, for a fresh-process start method: {fresh_start_methods}.
    As in torch, another ``start_method`` (one that copies this process) gives a
    FutureWarning and the default is used instead."""
    if start_method in launch.STARTERS and not launch.STARTERS[start_method].fresh:
        warnings.warn(
            f"spawn() starts fresh processes and does not use start_method={start_method!r}; "
            f"using {DEFAULT_START_METHOD!r}. Use tether.start_processes(..., "
            f"start_method={start_method!r}) to fork this process.",
            FutureWarning,
            stacklevel=2,
        )
        start_method = DEFAULT_START_METHOD
    return start_processes(
        fn, args, nprocs, join, daemon, start_method, preload=preload, timeout=timeout
    )
