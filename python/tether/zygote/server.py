"""The zygote process (see ``zygote.client`` for the parent's handle on it): it imports the
preload once, and the modules of tether its parent has, leaving out a module whose import
starts a thread (it starts again without it), then serves fork requests with tether-core's
loop (``_native.zygote_serve``); in each child it forks, it installs the caller's
environment and a fresh random state and runs the payload."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import pickle
import sys
from typing import Dict, FrozenSet, Iterator, List, NoReturn, Optional, Sequence, Tuple

from tether import _native
from tether.spawn import bootstrap

#: What a parent runs to start a zygote: ``main`` serves, and returns the job in each child
#: it forks, which runs it from here (a child's stack holds no frame of the serving).
ENTRY = "from tether.zygote.server import main, run_job; run_job(main())"

#: Where a zygote that started again without some modules finds its configuration.
_CONFIG_ENV = "TETHER_ZYGOTE_CONFIG"


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _preload(modules: Sequence[str]) -> Tuple[List[Tuple[str, str]], List[str]]:
    """Imports each module; returns (module, error) for those that fail, and the modules
    whose import left a thread running (one that a throwaway fork, see ``_quiesce``, does
    not wind down): forking a process with another thread copies the locks that thread
    holds, held for ever in every child."""
    failures = []
    threaded = []
    for name in modules:
        before = _threads()
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - an import may even call sys.exit
            failures.append((name, f"{type(exc).__name__}: {exc}"))
        if _threads() > before:
            _quiesce()
            if _threads() > before:
                threaded.append(name)
    return failures, threaded


@contextlib.contextmanager
def _output_dropped() -> Iterator[None]:
    """Sends what is written on stdout and stderr meanwhile (a package that prints or warns
    at import) to /dev/null: the zygote never writes on the user's streams, and the parent,
    which imported the same packages, has shown it already."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        try:
            import ctypes

            ctypes.CDLL(None).fflush(None)  # what C code buffered in stdio
        except (OSError, AttributeError):
            pass

    flush()
    saved: Dict[int, Optional[int]] = {}
    for fd in (1, 2):
        try:
            saved[fd] = os.dup(fd)
        except OSError:
            saved[fd] = None  # closed: it stays closed afterwards
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
    finally:
        os.close(null)
    try:
        yield
    finally:
        flush()
        for fd, copy in saved.items():
            if copy is None:
                os.close(fd)
            else:
                os.dup2(copy, fd)
                os.close(copy)


def _start_again_without(config: Dict[str, object], fds: Sequence[int]) -> NoReturn:
    """Replaces this zygote (same pid, same fds ``fds``) by a fresh one whose preload leaves
    out the modules in ``config["left_out"]``; its threads do not survive the exec."""
    import base64

    for fd in fds:
        os.set_inheritable(fd, True)
    env = dict(os.environ)
    env[_CONFIG_ENV] = base64.b64encode(pickle.dumps(config)).decode()
    argv = bootstrap.python_argv(ENTRY)
    os.execve(argv[0], argv, env)


def _quiesce() -> None:
    """Lets libraries stop the threads their imports started. Children are made with a raw
    ``clone``, which runs no ``pthread_atfork`` handlers; a plain fork does, and libraries
    use them to wind down their thread pools (OpenBLAS, loaded with numpy, joins its
    workers). One throwaway fork leaves the zygote single-threaded."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def main() -> _native.Job:
    """Entry point of the zygote (``ENTRY``): returns only in a child, its job.
    An unexpected error goes to the zygote's report pipe (the parent shows it), never to
    the terminal."""
    report_fd = int(os.environ.pop("TETHER_REPORT_FD"))
    try:
        fds_value = os.environ.pop(_native.ZYGOTE_FDS_ENV)
        request_fd, notices_fd = map(int, fds_value.split(","))
        again = os.environ.pop(_CONFIG_ENV, None)
        if again is None:
            payload_fd = int(os.environ.pop("TETHER_PAYLOAD_FD"))
            config = pickle.loads(bootstrap._read_all(payload_fd))
            os.close(payload_fd)
        else:
            import base64

            config = pickle.loads(base64.b64decode(again))
        left_out: List[str] = config.setdefault("left_out", [])
        preload = [m for m in config["preload"] if m not in left_out]
        sys.path[:] = config["sys_path"]
        _name_zygote(preload)
        with _output_dropped():
            failures, threaded = _preload(preload)
            for name in config["own"]:
                # tether's own modules start no thread; one that cannot be imported here is
                # imported (or not) by each child that needs it, as without this.
                with contextlib.suppress(ImportError):
                    importlib.import_module(name)
        if threaded and len(left_out) < 3 * len(config["preload"]):
            # Start again without them: a thread cannot be stopped from outside, and a
            # zygote must fork from a single thread.
            config["left_out"] = left_out + threaded
            os.environ["TETHER_REPORT_FD"] = str(report_fd)
            os.environ[_native.ZYGOTE_FDS_ENV] = fds_value
            _start_again_without(config, [report_fd, request_fd, notices_fd])
        _quiesce()
        # What the zygote holds now is shared by every child, page for page, until written
        # to: keep the garbage collector from walking it (and copying every page it visits)
        # in each child.
        gc.freeze()
        threads = _threads()
        ready = pickle.dumps({"failures": failures, "threads": threads, "left_out": left_out})
        served = _native.zygote_serve(
            request_fd, notices_fd, os.getppid(), ready, config["reserve"]
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, not the terminal
        _report_and_exit(report_fd, exc)
    if isinstance(served, int):
        os._exit(served)
    return served


def preload_summary(preload: Sequence[str], shown: int = 6) -> str:
    """The preload list in a few words, installed packages (torch, numpy) first."""
    stdlib: FrozenSet[str] = getattr(sys, "stdlib_module_names", frozenset())
    names = sorted((m for m in preload if not m.startswith("_")), key=lambda m: (m in stdlib, m))
    hidden = len(preload) - min(shown, len(names))
    text = ", ".join(names[:shown])
    return (text + (f", +{hidden} more" if hidden else "")) or "nothing"


def _name_zygote(preload: Sequence[str]) -> None:
    title = f"tether zygote of pid {os.getppid()} (preload: {preload_summary(preload)})"
    try:
        _native.set_title(title, _native.ZYGOTE_COMM)
    except OSError:
        pass


def _report_and_exit(report_fd: int, exc: BaseException) -> NoReturn:
    from tether.common import reports

    try:
        reports.write(report_fd, exc)
    finally:
        os._exit(1)


def run_job(job: _native.Job) -> NoReturn:
    """In a new child: take the caller's environment and a fresh random state, then run the
    payload's function for the job's rank; never returns."""
    code = 1
    try:
        report_fd = job.take_report_fd()
        _take_environment(dict(job.env))
        bootstrap.reset_after_fork()
        _reseed()
        _, prep, work = bootstrap.split_payload(job.take_payload())
        code = bootstrap.run_payload(prep, work, job.rank, report_fd, job.error)
    finally:
        bootstrap.exit_forked(code)


def _take_environment(env: Dict[bytes, bytes]) -> None:
    """Makes this process's environment ``env``, touching only the variables that differ
    (each change is a libc call that scans the whole environment)."""
    current = os.environb
    for name in [name for name in current if name not in env]:
        del current[name]
    for name, value in env.items():
        if current.get(name) != value:
            current[name] = value


#: The seed torch gives its default generator in a new process, in builds that do not
#: draw one at random.
_TORCH_FIXED_SEED = 67280421310721


def _reseed() -> None:
    """A fresh process's random state. Python's ``random`` reseeds itself after a fork;
    numpy's global generator, if the zygote has loaded it, does not; torch's default
    generator starts as in a new process: from a fresh random seed, or from its fixed
    default seed in builds that use one (the zygote never draws from it, so that state is
    still untouched)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # else the child's first use imports and seeds it afresh
        numpy_random.seed()
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None and generator.initial_seed() != _TORCH_FIXED_SEED:
        generator.seed()
