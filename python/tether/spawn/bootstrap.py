"""What runs in a child: the bootstrap of a ``"spawn"`` child (a fresh interpreter started by
the warden) and of a ``"fork"`` child, and the call of ``fn(i, *args)`` shared by both.

A spawn child reads its payload from the socket named by ``TETHER_PAYLOAD_FD``: a header
(rank, two lengths), the preparation data (what multiprocessing's spawn needs to rebuild
``__main__``, ``sys.path``, the working directory...) and the pickled ``(fn, args)``.
On an exception (``KeyboardInterrupt`` included) it writes a report to the pipe named by
``TETHER_REPORT_FD`` and exits 1.

Every child registers its stack dump handler first of all (``install_stacks``) on its
parent's stacks channel: named by ``TETHER_STACKS_FD`` for a spawn child, carried in the
preparation data for a zygote's child, known to a fork child (an fd, checked to be that
socket)."""

from __future__ import annotations

import functools
import multiprocessing.process
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import signal
import struct
import sys
import threading
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from tether import _native
from tether.common import reports

HEADER = struct.Struct("<IQQ")

#: The job this process is a rank of, when it is a child of ``tether.spawn`` (which names
#: each call's job: ``tether.share``'s key form meets the job's other ranks under it), and
#: its rank there; None otherwise. Not in the environment: a child's is its caller's, exactly.
job_id: Optional[str] = None
job_rank: Optional[int] = None


def enter_job(job: Optional[str], rank: int) -> None:
    """Makes this process rank ``rank`` of the job ``job`` (nothing without a job)."""
    global job_id, job_rank
    if job is not None:
        job_id, job_rank = job, rank


def exit_code(exc: SystemExit) -> int:
    """The exit status the interpreter would give ``exc``, printing its message if any."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream the user put there may raise anything
            pass  # the exit goes on


def run_rank(call: Callable[[], Any], report_fd: int) -> int:
    """Runs ``call``; returns the exit status, having written a report on an exception."""
    try:
        call()
    except SystemExit as exc:
        return exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - any exception is the rank's failure
        return _failed(exc, report_fd)
    return 0


def _failed(exc: BaseException, report_fd: int) -> int:
    """Reports the rank's failure ``exc``; its exit status."""
    # From here the process only reports and exits: a SIGTERM that tether sends to stop the
    # other ranks (another one failed first) must not cut the report short. It stays
    # pending and is dropped at the exit.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    # The parent stops this process as soon as the report is whole: flush first.
    _flush_stdio()
    reports.write(report_fd, exc)
    return 1


def _read_all(fd: int) -> bytes:
    chunks: List[bytes] = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _prepare(data: Dict[str, Any]) -> None:
    """Rebuilds the parent's ``__main__`` and paths as multiprocessing's spawn does. While
    the main module is imported, the process counts as bootstrapping, so an unguarded
    ``tether.spawn`` at the top of a script fails clearly instead of recursing."""
    tracker_fd = data.pop("tether_tracker_fd", None)
    if tracker_fd is not None:
        from multiprocessing import resource_tracker

        # The tracker's fd is private to multiprocessing (its spawn children set it so too).
        resource_tracker._resource_tracker._fd = tracker_fd  # type: ignore[attr-defined]
    process = multiprocessing.process.current_process()
    # multiprocessing's own "still bootstrapping" flag (private, not in its type stubs).
    process._inheriting = True  # type: ignore[attr-defined]
    try:
        multiprocessing.spawn.prepare(data)
    finally:
        process._inheriting = False  # type: ignore[attr-defined]


#: What a child says it is in ``ps`` and ``/proc/PID/comm``: two templates with ``{rank}``.
Title = Tuple[str, str]


def set_title(title: Optional[Title], rank: int) -> None:
    """Names this process after its role, e.g. ``tether rank 3: train [forkserver, parent
    123]`` in ``ps -o args`` and ``tether:r3:train`` in ``/proc/PID/comm``."""
    if title is None:
        return
    try:
        _native.set_title(title[0].format(rank=rank), title[1].format(rank=rank))
    except (OSError, ValueError):
        pass  # a name is a courtesy: never a reason to fail


def install_stacks(channel: Optional[_native.StacksChannel]) -> None:
    """Makes this process answer its parent's requests for its stacks through ``channel``
    (its parent's stacks channel; the fd is moved to a private close-on-exec number): every
    thread's stack, written by the interpreter in the main thread, or the main thread's by
    ``faulthandler`` when it cannot run Python (see ``tether_core::stacks``). Without it the
    process only cannot answer: never a reason to fail."""
    if channel is None:
        return
    try:
        _native.install_stack_handler(channel.fd, channel.inode)
    except Exception:  # noqa: BLE001 - a debugging aid must never stop a rank
        pass


def stacks_channel_from_env() -> Optional[_native.StacksChannel]:
    """The channel ``TETHER_STACKS_FD`` names (``FD:INODE``), taken out of the environment
    (so that this process's own children do not take an fd they do not hold)."""
    value = os.environ.pop(_native.STACKS_FD_ENV, None)
    fd, _, inode = (value or "").partition(":")
    try:
        return _native.StacksChannel(int(fd), int(inode))
    except ValueError:
        return None


def run_payload(
    prep: bytes,
    work: bytes,
    rank: int,
    report_fd: int,
    setup_error: Optional[OSError] = None,
) -> int:
    """Rebuilds the parent's ``__main__`` from ``prep``, unpickles ``(fn, args)`` from ``work``
    and runs ``fn(rank, *args)``; returns the exit status (see ``run_rank``). A
    ``setup_error`` from setting the child up is reported instead. ``fn`` runs right under
    this frame: what its stack shows of tether is short (torch formats the whole stack each
    time a DataLoader worker seeds its generators)."""
    try:
        fn, args = _unpickle_payload(prep, work, rank, setup_error)
        fn(rank, *args)
    except SystemExit as exc:
        return exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - any exception is the rank's failure
        return _failed(exc, report_fd)
    return 0


def _unpickle_payload(
    prep: bytes, work: bytes, rank: int, setup_error: Optional[OSError]
) -> Tuple[Callable[..., Any], Tuple[Any, ...]]:
    if setup_error is not None:
        raise setup_error
    data = pickle.loads(prep)
    enter_job(data.pop("tether_job", None), rank)
    set_title(data.pop("tether_title", None), rank)
    install_stacks(data.pop("tether_stacks_channel", None))
    parent = data.pop("tether_parent", None)
    _prepare(data)
    if parent is not None:
        set_parent(*parent)
    fn, args = pickle.loads(work)
    return fn, args


def split_payload(payload: bytes) -> Tuple[int, bytes, bytes]:
    """The rank, preparation data and work of a payload made by ``make_payload``."""
    rank, prep_size, work_size = HEADER.unpack_from(payload)
    start = HEADER.size
    return (
        rank,
        payload[start : start + prep_size],
        payload[start + prep_size : start + prep_size + work_size],
    )


def python_argv(code: str) -> List[bytes]:
    """``python [the interpreter's flags] -c code`` for this interpreter, as bytes."""
    import subprocess  # only a parent starts an interpreter: a child's start-up skips it

    argv = [multiprocessing.spawn.get_executable()]
    # The interpreter's own flags (-B, -X, ...), as multiprocessing passes them on (private to
    # subprocess, not in its type stubs).
    argv += subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    argv += ["-c", code]
    return [os.fsencode(a) for a in argv]


def make_payload(rank: int, prep: bytes, work: bytes) -> bytes:
    return HEADER.pack(rank, len(prep), len(work)) + prep + work


def main() -> None:
    """Entry point of a spawn child: ``python -c 'from tether.spawn.bootstrap import main;
    main()'``."""
    install_stacks(stacks_channel_from_env())
    payload_fd = int(os.environ.pop("TETHER_PAYLOAD_FD"))
    report_fd = int(os.environ.pop("TETHER_REPORT_FD"))
    os.set_inheritable(report_fd, False)
    payload = _read_all(payload_fd)
    os.close(payload_fd)
    rank, prep, work = split_payload(payload)
    sys.exit(run_payload(prep, work, rank, report_fd))


def set_parent(name: str, pid: int) -> None:
    """What ``multiprocessing.parent_process()`` gives in this child, as in multiprocessing's
    own children once their main module is imported: the process that started it (its
    name and pid), alive until its pidfd says it exited. Left None where the pidfd cannot
    be had (that process is gone already)."""
    try:
        sentinel = os.pidfd_open(pid)
    except OSError:
        return
    # Private to multiprocessing (not in its type stubs); its children set it alike.
    process: Any = multiprocessing.process
    process._parent_process = process._ParentProcess(name, pid, sentinel)


def reset_after_fork() -> None:
    """What multiprocessing does in a process it forks: forget the parent's children and
    finalizers, and let queues, locks and loggers reset themselves. (These are private to
    multiprocessing and missing from its type stubs: its own Popen uses them alike.)"""
    multiprocessing.util._finalizer_registry.clear()  # type: ignore[attr-defined]
    multiprocessing.process._children = set()  # type: ignore[attr-defined]
    multiprocessing.util._run_after_forkers()  # type: ignore[attr-defined]


def exit_forked(code: int) -> NoReturn:
    """Ends a forked child as multiprocessing ends its fork and forkserver children: its
    finalizers run (queue feeder threads flush), non-daemon threads are joined, the standard
    streams flushed, then ``os._exit`` skips ``atexit`` handlers and the interpreter's slow
    teardown (most of a second with torch loaded)."""
    try:
        # What multiprocessing runs at a child's exit (private, not in the type stubs).
        multiprocessing.util._exit_function()  # type: ignore[attr-defined]
        threading._shutdown()  # type: ignore[attr-defined]
    finally:
        _flush_stdio()
        os._exit(code)


def run_forked(
    fn: Callable[..., Any],
    rank: int,
    args: Sequence[Any],
    report_fd: int,
    parent_pid: int,
    from_main_thread: bool,
    title: Optional[Title] = None,
    stacks_channel: Optional[_native.StacksChannel] = None,
    job: Optional[str] = None,
) -> NoReturn:
    """Entry point of a fork child, right after ``os.fork()``; never returns."""
    code = 1
    try:
        _native.setup_forked_child(parent_pid, from_main_thread)
        enter_job(job, rank)
        install_stacks(stacks_channel)
        set_title(title, rank)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        reset_after_fork()
        set_parent(multiprocessing.process.current_process().name, parent_pid)
        code = run_rank(functools.partial(fn, rank, *args), report_fd)
    finally:
        exit_forked(code)
