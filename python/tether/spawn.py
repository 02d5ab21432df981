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
import multiprocessing.spawn
import os
import signal
import subprocess
import sys
import threading
import warnings
import weakref
from multiprocessing.context import set_spawning_popen
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import _child, _native, _report
from .errors import ProcessException, ProcessExitedException, ProcessRaisedException

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "spawn",
    "start_processes",
]

START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_START_METHOD = "forkserver"

#: How long ``join`` waits after SIGTERM before SIGKILL, when no grace period is given.
DEFAULT_GRACE = 30.0


class _DupFd:
    """An fd passed to a spawn child under the same number (multiprocessing's protocol)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


class _SpawningPopen:
    """Stands in for the "spawning popen" while the arguments are pickled, so that
    multiprocessing primitives and shared tensors can name the fds the child must inherit."""

    DupFd = _DupFd

    def __init__(self) -> None:
        self.fds: List[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return fd


def _dumps(obj: Any, popen: _SpawningPopen) -> bytes:
    set_spawning_popen(popen)
    try:
        return bytes(ForkingPickler.dumps(obj))
    finally:
        set_spawning_popen(None)


def _preparation_data(popen: _SpawningPopen) -> Dict[str, Any]:
    """What a spawn child needs to look like this process: paths, argv, working directory,
    authkey, and how to rebuild ``__main__`` (by module name or by path)."""
    process = multiprocessing.process.current_process()
    data: Dict[str, Any] = {
        "log_to_stderr": False,
        "authkey": bytes(process.authkey),
        "sys_path": list(sys.path),
        "sys_argv": list(sys.argv),
        "dir": os.getcwd(),
        "orig_dir": multiprocessing.process.ORIGINAL_DIR,
    }
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    main_path = getattr(main, "__file__", None)
    if spec_name is not None:
        data["init_main_from_name"] = spec_name
    elif main_path is not None:
        if not os.path.isabs(main_path) and multiprocessing.process.ORIGINAL_DIR is not None:
            main_path = os.path.join(multiprocessing.process.ORIGINAL_DIR, main_path)
        data["init_main_from_path"] = os.path.normpath(main_path)
    from multiprocessing import resource_tracker

    tracker_fd = getattr(resource_tracker._resource_tracker, "_fd", None)
    if tracker_fd is not None:
        data["tether_tracker_fd"] = popen.duplicate_for_child(tracker_fd)
    return data


def _child_argv() -> List[bytes]:
    argv = [multiprocessing.spawn.get_executable()]
    argv += subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    argv += ["-c", "from tether._child import main; main()"]
    return [os.fsencode(a) for a in argv]


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


def launch_spawn(
    fn: Callable[..., Any], args: Sequence[Any], ranks: Sequence[int], keep_fds: Sequence[int] = ()
) -> _native.Group:
    """Starts ``fn(rank, *args)`` for each rank in a fresh interpreter; the children inherit
    the standard streams, the fds the arguments pass and ``keep_fds``, under the same
    numbers. Also the pool's way of starting its workers."""
    popen = _SpawningPopen()
    prep = _dumps(_preparation_data(popen), popen)
    work = _dumps((fn, tuple(args)), popen)
    argv = _child_argv()
    passed = [*popen.fds, *keep_fds]
    group = _native.Group()
    group.launch([(argv, [], passed, _child.make_payload(i, prep, work)) for i in ranks])
    return group


def launch_forkserver(
    fn: Callable[..., Any],
    args: Sequence[Any],
    ranks: Sequence[int],
    preload: Optional[Sequence[str]],
    keep_fds: Sequence[int] = (),
) -> _native.Group:
    """Starts ``fn(rank, *args)`` for each rank as a fork of the zygote for ``preload``; the
    children inherit the standard streams, the fds the arguments pass and ``keep_fds``,
    under the same numbers. Also the pool's way of starting its workers."""
    from . import _zygote

    popen = _SpawningPopen()
    prep = _dumps(_preparation_data(popen), popen)
    work = _dumps((fn, tuple(args)), popen)
    passed = [0, 1, 2, *popen.fds, *keep_fds]
    pipes = [os.pipe() for _ in ranks]
    group = _native.Group()
    try:
        _zygote.get(preload).fork(
            ranks=ranks,
            fds=passed,
            targets=passed,
            report_fds=[w for _, w in pipes],
            prep=prep,
            work=work,
            on_pid=lambda n, pid: group.adopt(pid, pipes[n][0]),
        )
    except _zygote.ZygoteError as e:
        for pid in e.pids[len(group) :]:
            _kill_stray(pid)
        group.signal_all(signal.SIGKILL)
        group.wait(None, "all", 5.0)
        raise
    finally:
        for read_fd, write_fd in pipes:
            os.close(read_fd)
            os.close(write_fd)
    return group


def _kill_stray(pid: int) -> None:
    """Stops and reaps a child the zygote started for a request that then failed."""
    group = _native.Group()
    try:
        group.adopt(pid)
    except OSError:
        return
    group.signal_all(signal.SIGKILL)
    group.wait(None, "all", 5.0)


def _launch_fork(fn: Callable[..., Any], args: Sequence[Any], nprocs: int) -> _native.Group:
    group = _native.Group()
    parent = os.getpid()
    from_main = threading.current_thread() is threading.main_thread()
    try:
        for i in range(nprocs):
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _child.run_forked(fn, i, args, write_fd, parent, from_main)
            os.close(write_fd)
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass  # the child got there first, or has already exited
            try:
                group.adopt(pid, read_fd)
            finally:
                os.close(read_fd)
    except BaseException:
        group.signal_all(signal.SIGKILL)
        raise
    return group


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
    if start_method not in START_METHODS:
        raise ValueError(
            f"unknown start method {start_method!r}: tether supports "
            + ", ".join(repr(m) for m in START_METHODS)
        )
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 0:
        raise ValueError(f"nprocs must be a non-negative int, got {nprocs!r}")
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        raise RuntimeError(
            "tether.spawn was called while this process was still importing the main module "
            "of its parent. Start processes only under the usual guard in the main script:\n\n"
            "    if __name__ == '__main__':\n        ...\n"
        )
    if start_method == "forkserver":
        group = launch_forkserver(fn, args, range(nprocs), preload)
    elif start_method == "spawn":
        group = launch_spawn(fn, args, range(nprocs))
    else:
        group = _launch_fork(fn, args, nprocs)
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
