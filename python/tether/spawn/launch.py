"""The one way tether starts Python children running ``fn(rank, *args)``, for every start
method, used by ``tether.spawn`` and by ``tether.Pool``. ``STARTERS`` is the table of start
methods (each a function that starts the children of one call): forks of the warm zygote
(``client``), fresh interpreters started by the warden (``tether.spawn.bootstrap``), copies of
the calling process.

The arguments are pickled by ``pickling`` standing in for multiprocessing's "spawning
popen", so that multiprocessing primitives and shared tensors name the fds the children
inherit."""

from __future__ import annotations

import errno
import multiprocessing.process
import multiprocessing.spawn
import os
import signal
import sys
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

from tether import _native
from tether.common import pickling

from . import bootstrap

_T = TypeVar("_T")


def check_start_method(method: str, who: str) -> None:
    """Raises ValueError naming ``who`` (e.g. "tether.Pool") for an unknown start method."""
    if method not in START_METHODS:
        raise ValueError(
            f"unknown start method {method!r}: {who} supports "
            + ", ".join(repr(m) for m in START_METHODS)
        )


def _preparation_data(popen: pickling.FdCollector) -> Dict[str, Any]:
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
        "tether_parent": (process.name, os.getpid()),
    }
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    main_path = getattr(main, "__file__", None)
    if spec_name is not None:
        data["init_main_from_name"] = spec_name
    elif main_path is not None and not pickling.main_without_file():
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


class Start(NamedTuple):
    """One call of ``start``: what each child runs, and how it is made (see ``start``)."""

    fn: Callable[..., Any]
    args: Sequence[Any]
    ranks: Sequence[int]
    preload: Optional[Sequence[str]]
    keep_fds: Sequence[int]
    close_in_child: Sequence[int]
    title: bootstrap.Title
    #: The job's id, given to every child (see ``bootstrap.enter_job``).
    job: Optional[str] = None


class Starter(NamedTuple):
    """A start method: how it starts the children of a ``Start``, what a child is (for the
    documentation), and whether a child is a fresh process (``spawn()`` takes only those;
    a pool that replaces its workers needs one, since a copy of this process would copy
    its threads)."""

    start: Callable[[Start], _native.Group]
    child: str
    fresh: bool


def start(
    fn: Callable[..., Any],
    args: Sequence[Any],
    ranks: Sequence[int],
    method: str,
    *,
    preload: Optional[Sequence[str]] = None,
    keep_fds: Sequence[int] = (),
    close_in_child: Sequence[int] = (),
    title: Optional[bootstrap.Title] = None,
    job: Optional[str] = None,
) -> _native.Group:
    """Starts ``fn(rank, *args)`` for each rank with ``method`` and returns the group that
    hands them to the warden (member n runs ``ranks[n]``). The children inherit the standard
    streams, the fds the arguments pass and ``keep_fds``, under the same numbers.
    ``preload`` chooses the zygote (forkserver); ``close_in_child`` are fds a fork child
    closes at once (a fork copies every fd of this process); ``title`` is what each child
    says it is in ``ps`` and ``/proc/PID/comm`` (two templates with ``{rank}``; by default
    a rank running the function); ``job`` names the job to every child (where
    ``tether.share``'s key form meets). On an error, no child of the call is left
    running and no fd made for it is left open."""
    check_start_method(method, "tether")
    title = title or rank_title(fn, method)
    start = Start(fn, args, ranks, preload, keep_fds, close_in_child, title, job)
    return STARTERS[method].start(start)


def _pickled(job: Start, stacks_channel: bool) -> Tuple[bytes, bytes, List[int]]:
    """The preparation data and the work of a fresh child, pickled, and the fds the
    children inherit. With ``stacks_channel`` the data carries the stacks channel (a spawn
    child is given it by the warden instead: TETHER_STACKS_FD)."""
    popen = pickling.FdCollector(inherit=True)
    data = _preparation_data(popen)
    data["tether_title"] = job.title
    if job.job is not None:
        data["tether_job"] = job.job
    if stacks_channel:
        channel = _native.stacks_fd()
        fd = popen.duplicate_for_child(channel.fd)
        data["tether_stacks_channel"] = _native.StacksChannel(fd, channel.inode)
    prep = pickling.dumps(data, popen)
    # A function (or arguments) of a __main__ without a file travels by value.
    work = pickling.dumps((job.fn, tuple(job.args)), popen)
    return prep, work, list(dict.fromkeys([*popen.fds, *job.keep_fds]))


def _start_forkserver(job: Start) -> _native.Group:
    """Forks of the zygote of ``job.preload``, in one request."""
    from tether.zygote import client

    prep, work, passed = _pickled(job, stacks_channel=True)
    group = _native.Group()
    shared = [_native.SharedFd(fd, fd) for fd in dict.fromkeys([0, 1, 2, *passed]) if _is_open(fd)]
    payload = bootstrap.make_payload(0, prep, work)
    client.get(job.preload).fork(group, job.ranks, shared, payload)
    return group


def new_job_id() -> str:
    """A new job's id: unique on this machine (this process's pid) and beyond (random)."""
    return f"{os.getpid()}-{os.urandom(8).hex()}"


def rank_title(fn: Callable[..., Any], method: str) -> bootstrap.Title:
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


def _start_spawn(job: Start) -> _native.Group:
    """Fresh interpreters, started by the warden in one call."""
    prep, work, passed = _pickled(job, stacks_channel=False)
    argv = bootstrap.python_argv("from tether.spawn.bootstrap import main; main()")
    group = _native.Group()
    # The title also rides as the last argument, so that ``ps`` names the rank while its
    # interpreter starts (the child renames itself once it runs; it ignores the argument).
    group.launch(
        [
            _native.LaunchSpec(
                [*argv, os.fsencode(job.title[0].format(rank=i))],
                keep_fds=passed,
                payload=bootstrap.make_payload(i, prep, work),
            )
            for i in job.ranks
        ]
    )
    return group


def _start_fork(job: Start) -> _native.Group:
    """Forks one child per rank, then hands them all to the warden in one call."""
    parent = os.getpid()
    from_main = threading.current_thread() is threading.main_thread()
    stacks_channel = _native.stacks_fd()
    children: List[_native.ForkedChild] = []
    try:
        for rank in job.ranks:
            child = _fork_one(job, rank, parent, from_main, stacks_channel)
            children.append(child)
    except BaseException:
        _stop_unadopted(children)
        raise
    group = _native.Group()
    group.adopt_all(children)  # takes the report fds; on an error, stops every child
    return group


def _fork_one(
    job: Start,
    rank: int,
    parent: int,
    from_main: bool,
    stacks_channel: _native.StacksChannel,
) -> _native.ForkedChild:
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
        for fd in job.close_in_child:
            try:
                os.close(fd)
            except OSError:
                pass
        bootstrap.run_forked(
            job.fn, rank, job.args, write_fd, parent, from_main, job.title, stacks_channel, job.job
        )
    os.close(write_fd)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # the child got there first, or has already exited
    return _native.ForkedChild(pid, read_fd)


def _start_error(exc: OSError, what: str) -> OSError:
    """``exc`` (of the same OSError subclass) saying what failed and which limit it hit."""
    if exc.errno is None:
        return exc
    hint = _native.limit_hint(exc.errno)
    return OSError(exc.errno, f"{what}: {exc.strerror}{hint}")


def _stop_unadopted(children: Sequence[_native.ForkedChild]) -> None:
    """Kills and reaps children forked before a start failed, and closes their pipes."""
    for child in children:
        if child.report_fd is not None:
            os.close(child.report_fd)
        try:
            os.kill(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
        except OSError:
            pass  # already reaped (SIGCHLD ignored)


#: The start methods, the one list of them: ``START_METHODS``, the tests' ``start_method``
#: fixture, the docstrings (``with_start_methods``) and the table of docs/spawn.md follow it.
STARTERS: Dict[str, Starter] = {
    "forkserver": Starter(_start_forkserver, "a fork of tether's warm zygote", fresh=True),
    "spawn": Starter(_start_spawn, "a fresh interpreter", fresh=True),
    "fork": Starter(_start_fork, "a copy of this process", fresh=False),
}
START_METHODS = tuple(STARTERS)
DEFAULT_START_METHOD = "forkserver"
FRESH_START_METHODS = tuple(name for name, starter in STARTERS.items() if starter.fresh)


def named(methods: Sequence[str], details: bool = False, quote: str = '"') -> str:
    """``"a" (the default: what a child is), "b" (...) or "c" (...)``: the start methods
    ``methods`` in words, with what each one's child is when ``details``."""
    words = []
    for name in methods:
        notes = ["the default"] if name == DEFAULT_START_METHOD else []
        notes += [STARTERS[name].child] if details else []
        words.append(f"{quote}{name}{quote}" + (f" ({': '.join(notes)})" if notes else ""))
    return " or ".join(filter(None, [", ".join(words[:-1]), words[-1]]))


def with_start_methods(obj: _T) -> _T:
    """``obj`` with ``{start_methods}`` in its docstring replaced by the start methods
    (each with what its child is) and ``{fresh_start_methods}`` by those of fresh
    processes."""
    doc = (obj.__doc__ or "").replace("{start_methods}", named(START_METHODS, details=True))
    obj.__doc__ = doc.replace("{fresh_start_methods}", named(FRESH_START_METHODS))
    return obj
