"""The one way tether starts Python children running ``fn(rank, *args)``, for every start
method, used by ``tether.spawn`` and by ``tether.Pool``:

- ``"forkserver"``: forks of the warm zygote (``_zygote``);
- ``"spawn"``: fresh interpreters started by the supervisor (``python -m tether._child``);
- ``"fork"``: copies of the calling process.

The arguments are pickled while an object stands in for multiprocessing's "spawning popen",
so that multiprocessing primitives and shared tensors name the fds the children inherit."""

from __future__ import annotations

import errno
import multiprocessing.process
import multiprocessing.spawn
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _channel, _child, _native

START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_START_METHOD = "forkserver"


def check_start_method(method: str, who: str) -> None:
    """Raises ValueError naming ``who`` (e.g. "tether.Pool") for an unknown start method."""
    if method not in START_METHODS:
        raise ValueError(
            f"unknown start method {method!r}: {who} supports "
            + ", ".join(repr(m) for m in START_METHODS)
        )


class _DupFd:
    """An fd passed to a child under the same number (multiprocessing's protocol)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


class _SpawningPopen:
    """Stands in for the "spawning popen" while the arguments are pickled (by tether's one
    pickler, ``_channel.dumps``), so that multiprocessing primitives and shared tensors can
    name the fds the child must inherit."""

    def __init__(self) -> None:
        self.fds: List[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def DupFd(self, fd: int) -> _DupFd:  # noqa: N802 (multiprocessing's name)
        return _DupFd(fd)


def _preparation_data(popen: _SpawningPopen) -> Dict[str, Any]:
    """What a spawn child needs to look like this process: paths, argv, working directory,
    authkey, and how to rebuild ``__main__`` (by module name or by path; a ``__main__``
    without a file is not rebuilt: what the child needs of it travels by value)."""
    process = multiprocessing.process.current_process()
    data: Dict[str, Any] = {
        "log_to_stderr": False,
        "authkey": bytes(process.authkey),
        "sys_path": list(sys.path),
        "sys_argv": list(sys.argv),
        "dir": _working_directory(),
        "orig_dir": _original_dir(),
    }
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    main_path = getattr(main, "__file__", None)
    if spec_name is not None:
        data["init_main_from_name"] = spec_name
    elif main_path is not None and not _channel.main_without_file():
        original = _original_dir()
        if not os.path.isabs(main_path) and original is not None:
            main_path = os.path.join(original, main_path)
        data["init_main_from_path"] = os.path.normpath(main_path)
    from multiprocessing import resource_tracker

    tracker_fd = getattr(resource_tracker._resource_tracker, "_fd", None)
    if tracker_fd is not None:
        data["tether_tracker_fd"] = popen.duplicate_for_child(tracker_fd)
    return data


def _working_directory() -> str:
    """This process's working directory, where a new child starts; one that no longer
    exists is an error that says so (``os.getcwd`` alone says "No such file or
    directory")."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            "the working directory of this process no longer exists (deleted, or its mount "
            "is gone): a 'spawn' or 'forkserver' child starts in it; change to a directory "
            "that exists ('fork' children share the deleted one)",
        ) from None


def _original_dir() -> Optional[str]:
    """The working directory the interpreter started in (multiprocessing records it)."""
    return getattr(multiprocessing.process, "ORIGINAL_DIR", None)


def python_argv(code: str) -> List[bytes]:
    """``python [the interpreter's flags] -c code`` for this interpreter, as bytes."""
    argv = [multiprocessing.spawn.get_executable()]
    # The interpreter's own flags (-B, -X, ...), as multiprocessing passes them on (private to
    # subprocess, not in its type stubs).
    argv += subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    argv += ["-c", code]
    return [os.fsencode(a) for a in argv]


def start(
    fn: Callable[..., Any],
    args: Sequence[Any],
    ranks: Sequence[int],
    method: str,
    *,
    preload: Optional[Sequence[str]] = None,
    keep_fds: Sequence[int] = (),
    close_in_child: Sequence[int] = (),
    title: Optional[_child.Title] = None,
) -> _native.Group:
    """Starts ``fn(rank, *args)`` for each rank with ``method`` and returns the group that
    supervises them (member n runs ``ranks[n]``). The children inherit the standard
    streams, the fds the arguments pass and ``keep_fds``, under the same numbers.
    ``preload`` chooses the zygote (forkserver); ``close_in_child`` are fds a fork child
    closes at once (a fork copies every fd of this process); ``title`` is what each child
    says it is in ``ps`` and ``/proc/PID/comm`` (two templates with ``{rank}``; by default
    a rank running the function). On an error, no child of the call is left running and
    no fd made for it is left open."""
    check_start_method(method, "tether")
    title = title or rank_title(fn, method)
    if method == "fork":
        return _start_fork(fn, args, ranks, close_in_child, title)
    popen = _SpawningPopen()
    data = _preparation_data(popen)
    data["tether_title"] = title
    if method == "forkserver":
        # A spawn child is given the stacks channel by the supervisor (TETHER_STACKS_FD).
        fd, inode = _native.stacks_fd()
        data["tether_stacks_channel"] = (popen.duplicate_for_child(fd), inode)
    prep = _channel.dumps(data, popen)
    # A function (or arguments) of a __main__ without a file travels by value.
    work = _channel.dumps((fn, tuple(args)), popen)
    passed = list(dict.fromkeys([*popen.fds, *keep_fds]))
    if method == "spawn":
        return _start_spawn(prep, work, ranks, passed, title[0])
    from . import _zygote

    group = _native.Group()
    shared = [(fd, fd) for fd in dict.fromkeys([0, 1, 2, *passed]) if _is_open(fd)]
    payload = _child.make_payload(0, prep, work)
    _zygote.get(preload).fork(group, ranks, shared, payload)
    return group


def rank_title(fn: Callable[..., Any], method: str) -> _child.Title:
    """``ps`` names of a rank running ``fn``."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return (
        f"tether rank {{rank}}: {name} [{method}, parent {os.getpid()}]",
        f"tether:r{{rank}}:{name}",
    )


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _start_spawn(
    prep: bytes, work: bytes, ranks: Sequence[int], passed: Sequence[int], title: str
) -> _native.Group:
    argv = python_argv("from tether._child import main; main()")
    group = _native.Group()
    # The title also rides as the last argument, so that ``ps`` names the rank while its
    # interpreter starts (the child renames itself once it runs; it ignores the argument).
    group.launch(
        [
            (
                [*argv, os.fsencode(title.format(rank=i))],
                [],
                passed,
                _child.make_payload(i, prep, work),
            )
            for i in ranks
        ]
    )
    return group


def _start_fork(
    fn: Callable[..., Any],
    args: Sequence[Any],
    ranks: Sequence[int],
    close_in_child: Sequence[int],
    title: _child.Title,
) -> _native.Group:
    """Forks one child per rank, then hands them all to the supervisor in one call."""
    parent = os.getpid()
    from_main = threading.current_thread() is threading.main_thread()
    stacks_channel = _native.stacks_fd()
    children: List[Tuple[int, int]] = []  # (pid, read end of its report pipe)
    try:
        for rank in ranks:
            child = _fork_one(
                fn, rank, args, close_in_child, parent, from_main, title, stacks_channel
            )
            children.append(child)
    except BaseException:
        _stop_unsupervised(children)
        raise
    group = _native.Group()
    group.adopt_all(children)  # takes the report fds; on an error, stops every child
    return group


def _fork_one(
    fn: Callable[..., Any],
    rank: int,
    args: Sequence[Any],
    close_in_child: Sequence[int],
    parent: int,
    from_main: bool,
    title: _child.Title,
    stacks_channel: Tuple[int, int],
) -> Tuple[int, int]:
    try:
        read_fd, write_fd = os.pipe()
    except OSError as exc:
        raise _start_error(exc, f"cannot make the report pipe of rank {rank}") from None
    try:
        pid = os.fork()
    except BaseException as exc:
        os.close(read_fd)
        os.close(write_fd)
        if isinstance(exc, OSError):
            raise _start_error(exc, f"cannot fork rank {rank}") from None
        raise
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_fd)
        for fd in close_in_child:
            try:
                os.close(fd)
            except OSError:
                pass
        _child.run_forked(fn, rank, args, write_fd, parent, from_main, title, stacks_channel)
    os.close(write_fd)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # the child got there first, or has already exited
    return pid, read_fd


def _start_error(exc: OSError, what: str) -> OSError:
    """``exc`` (of the same OSError subclass) saying what failed and which limit it hit."""
    if exc.errno is None:
        return exc
    hint = _native.limit_hint(exc.errno)
    return OSError(exc.errno, f"{what}: {exc.strerror}{hint}")


def _stop_unsupervised(children: Sequence[Tuple[int, int]]) -> None:
    """Kills and reaps children forked before a start failed, and closes their pipes."""
    for pid, read_fd in children:
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass  # already reaped (SIGCHLD ignored)
